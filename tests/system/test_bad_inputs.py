"""The bad-input catalogue (docs/bad-inputs.md): each bad input a user can give the sink,
a participant, the CLI, the configuration or the HTTP API, with the clear error it gets.

Every case names its cause (the offending value or field) and its fix (the rule, the
range, or what to pass instead); nothing is half-done. The ids here are the catalogue's
rows; a test keeps the two in step.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.pg import fresh_pg_db
from twophase import TransactionalSink, failpoints
from twophase.client import wire
from twophase.client.api import CoordinatorClient
from twophase.coordinator.background import parse_duration
from twophase.errors import InvalidRequest
from twophase.sinks.files import StagedFileParticipant as FilesParticipant
from twophase.sinks.kafka.participant import KafkaParticipant
from twophase.sinks.postgres.participant import PostgresParticipant
from twophase.testing.servers import LocalDaemon, free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "bad-input-token-0123456789"
KAFKA = {"bootstrap.servers": "127.0.0.1:9"}


def _files(tmp: str = "/tmp/twophase-bad-inputs") -> FilesParticipant:
    return FilesParticipant(tmp, name="files-out")


def _sink(**kw: Any) -> Callable[[], object]:
    args: dict[str, Any] = {"name": "orders", "participants": [_files()],
                            "coordinator": "sqlite:///x.db"}
    args.update(kw)
    return lambda: TransactionalSink(**args)


# (id, what raises, the message must match: cause ... fix)
API_CASES: list[tuple[str, Callable[[], object], str]] = [
    # the sink
    ("sink-name", _sink(name="my orders"), r"invalid sink name 'my orders'.*use 1-64"),
    ("sink-no-participants", _sink(participants=[]), r"at least one participant"),
    ("sink-duplicate-participants", _sink(participants=[_files(), _files()]),
     r"must be unique.*pass name="),
    ("sink-too-many-participants",
     _sink(participants=[FilesParticipant("/tmp/x", name=f"f{i}") for i in range(65)]),
     r"at most 64 participants, got 65: split"),
    ("sink-partitions", _sink(partitions=0), r"partitions must be an int from 1 to 100000, got 0"),
    ("sink-partitions-huge", _sink(partitions=10**6), r"partitions .* to 100000, got 1000000"),
    ("sink-max-attempts", _sink(max_attempts=0), r"max_attempts must be an int from 1"),
    ("sink-vote-timeout-nan", _sink(vote_timeout=float("nan")),
     r"vote_timeout must be a number .* from 0.001 to 604800, got nan"),
    ("sink-vote-timeout-8-days", _sink(vote_timeout=8 * 86400.0),
     r"vote_timeout .* to 604800, got 691200"),
    ("sink-backoff", _sink(backoff=-1), r"backoff must be a number of seconds .* got -1"),
    ("sink-marker-keep-batches", _sink(marker_keep_batches=10),
     r"marker_keep_batches must be an int of at least 100 .* got 10: pass at least the "
     r"query's spark.sql.streaming.minBatchesToRetain"),
    ("sink-lineage", _sink(lineage="a_b"), r"invalid lineage 'a_b'.*A-Z a-z 0-9 -"),
    ("sink-coordinator-url", _sink(coordinator="ftp://host"),
     r"coordinator='ftp://host' is not understood: use 'http://host:port'"),
    # participants
    ("files-empty-path", lambda: FilesParticipant(""), r"path must be a non-empty"),
    ("files-nul-path", lambda: FilesParticipant("/tmp/a\x00b"), r"must not contain NUL"),
    ("files-format", lambda: FilesParticipant("/tmp/x", format="csv"),
     r"format must be 'parquet' or 'jsonl', got 'csv'"),
    ("participant-name", lambda: FilesParticipant("/tmp/x", name="a/b"),
     r"invalid participant name 'a/b'.*use 1-64"),
    ("postgres-table", lambda: PostgresParticipant("postgresql://h/db", "t; drop table x"),
     r"invalid table name 't; drop table x'.*use a letter"),
    ("postgres-schema", lambda: PostgresParticipant("postgresql://h/db", "t", schema="1x"),
     r"invalid schema name '1x'"),
    ("postgres-empty-dsn", lambda: PostgresParticipant("", "t"), r"dsn must be a non-empty"),
    ("postgres-bad-dsn", lambda: PostgresParticipant("host = = x", "t"), r"invalid dsn"),
    ("postgres-timeout", lambda: PostgresParticipant("postgresql://h/db", "t",
                                                      connect_timeout=0),
     r"connect_timeout must be > 0"),
    ("kafka-topic", lambda: KafkaParticipant("my topic", KAFKA),
     r"invalid Kafka topic name 'my topic'.*use 1-249"),
    ("kafka-no-brokers", lambda: KafkaParticipant("t", {}),
     r"must name the brokers: \{'bootstrap.servers'"),
    ("kafka-idempotence-off",
     lambda: KafkaParticipant("t", {**KAFKA, "enable.idempotence": "false"}),
     r"enable.idempotence=false is refused: transactions need idempotence"),
    ("kafka-acks", lambda: KafkaParticipant("t", {**KAFKA, "acks": "1"}),
     r"acks='1' is refused: transactions need acks=all"),
    ("kafka-transactional-id", lambda: KafkaParticipant("t", {**KAFKA,
                                                              "transactional.id": "x"}),
     r"'transactional.id' may not be set"),
    ("kafka-txn-timeout", lambda: KafkaParticipant("t", KAFKA, transaction_timeout_ms=10),
     r"transaction_timeout_ms must be an int >= 1000, got 10"),
    # configuration
    ("failpoints-syntax", lambda: failpoints.parse("after_prepare=explode"),
     r"cannot parse 'after_prepare=explode'; expected POINT"),
    ("failpoints-unknown", lambda: failpoints.parse("after_lunch=kill"),
     r"unknown failpoint 'after_lunch'; known: before_begin"),
    ("duration", lambda: parse_duration("3 weeks"), r"cannot read duration '3 weeks'; use e.g."),
]


@pytest.mark.parametrize(("make", "pattern"), [pytest.param(m, p, id=i) for i, m, p in API_CASES])
def test_api_bad_input(make: Callable[[], object], pattern: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        make()
    assert re.search(pattern, str(exc.value)), str(exc.value)


# the CLI, run as a user runs it: exit code 2 (or 1) and one line naming cause and fix
CLI_CASES: list[tuple[str, list[str], int, str]] = [
    ("cli-serve-no-token", ["serve", "--store", "sqlite:///{tmp}/a.db"], 2,
     r"no token: pass --token or set TWOPHASE_TOKEN"),
    ("cli-serve-port", ["serve", "--store", "sqlite:///{tmp}/a.db", "--token", TOKEN,
                        "--port", "70000"], 2, r"'70000' is not a TCP port: use 0-65535"),
    ("cli-serve-store-url", ["serve", "--store", "mysql://h/db", "--token", TOKEN], 2,
     r"unsupported store URL 'mysql://h/db': use sqlite:///"),
    ("cli-serve-retention", ["serve", "--store", "sqlite:///{tmp}/a.db", "--token", TOKEN,
                             "--retention", "3w"], 2, r"cannot read duration '3w'"),
    ("cli-serve-store-down", ["serve", "--store", "postgresql://u@127.0.0.1:{port}/db",
                              "--token", TOKEN, "--store-wait", "1s"], 1,
     r"store not reachable after waiting 1s: .*start the database or check --store"),
    ("cli-unknown-command", ["frobnicate"], 2, r"invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize(("argv", "rc", "pattern"),
                         [pytest.param(a, r, p, id=i) for i, a, r, p in CLI_CASES])
def test_cli_bad_input(argv: list[str], rc: int, pattern: str, tmp_path: Path) -> None:
    args = [a.format(tmp=tmp_path, port=free_port()) for a in argv]
    out = subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == rc, out.stderr
    assert re.search(pattern, out.stderr), out.stderr
    assert "Traceback" not in out.stderr


# HTTP: a real daemon on a PostgreSQL store (whose columns are the narrower ones)
@pytest.fixture(scope="module")
def daemon(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    store = fresh_pg_db(pg_dsn, "tp_badin")
    d = LocalDaemon(store, TOKEN, tmp_path_factory.mktemp("badin") / "d.log").start()
    try:
        yield d
    finally:
        d.stop()


BIG = wire.MAX_INT
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _txn(d: LocalDaemon, checkpoint: int = 0) -> tuple[str, int]:
    sink = f"s{uuid.uuid4().hex[:8]}"
    c = CoordinatorClient(d.url, TOKEN)
    epoch = c.register(sink)
    c.begin(sink, "lin", checkpoint, epoch, ["pg"], 1)
    return sink, epoch


def _begin(epoch: int = 1, **kw: Any) -> dict[str, Any]:
    return {"lineage": "lin", "checkpoint": 0, "epoch": epoch, "participants": ["pg"],
            "partitions": 1, **kw}


# (id, method, path (format: sink, epoch), json body or raw bytes, status, message pattern)
HTTP_CASES: list[tuple[str, str, str, Any, int, str]] = [
    ("http-checkpoint-too-big", "GET", f"/v1/txns/{{sink}}/lin/{BIG + 1}/1", None, 422,
     r"path.checkpoint: Input should be less than or equal to 9223372036854775807"),
    ("http-attempt-too-big", "GET", f"/v1/txns/{{sink}}/lin/0/{10**30}/decision?timeout=0",
     None, 422, r"path.attempt: Input should be less than or equal to"),
    ("http-checkpoint-negative", "POST", "/v1/txns/{sink}/lin/-1/1/abandon",
     {"epoch": 1, "reason": "x"}, 422, r"path.checkpoint: Input should be greater than"),
    ("http-epoch-too-big", "POST", "/v1/sinks/{sink}/begin", _begin(epoch=2**62 + 1), 422,
     r"body.epoch: Input should be less than or equal to 4611686018427387904"),
    ("http-participant-name", "POST", "/v1/sinks/{sink}/begin",
     _begin(participants=["p\u0000g"]), 422, r"invalid participant name 'p\\x00g': use 1-64"),
    ("http-branch-id", "POST", "/v1/txns/{sink}/lin/0/1/votes",
     {"epoch": 1, "votes": [{"branch": "pg", "yes": True}]}, 422,
     r"invalid branch id 'pg': use PARTICIPANT/PARTITION"),
    ("http-reason-nul", "POST", "/v1/txns/{sink}/lin/0/1/abandon",
     {"epoch": 1, "reason": "a\u0000b"}, 422,
     r"body.reason: Value error, text must not contain NUL .*: remove or escape"),
    ("http-reason-too-long", "POST", "/v1/txns/{sink}/lin/0/1/abandon",
     {"epoch": 1, "reason": "x" * 5000}, 422, r"body.reason: String should have at most 4096"),
    ("http-handle-too-many-keys", "POST", "/v1/txns/{sink}/lin/0/1/votes",
     {"epoch": 1, "votes": [{"branch": "pg/0", "yes": True,
                             "handle": {str(i): "v" for i in range(33)}}]}, 422,
     r"body.votes.0.handle: Dictionary should have at most 32 items"),
    ("http-string-for-int", "POST", "/v1/sinks/{sink}/begin", _begin(epoch="1"), 422,
     r"body.epoch: Input should be a valid integer"),
    ("http-unknown-field", "POST", "/v1/sinks/{sink}/begin", _begin(colour="red"), 422,
     r"body.colour: Extra inputs are not permitted"),
    ("http-malformed-json", "POST", "/v1/sinks/{sink}/begin", b'{"lineage": ', 400,
     r"request body is not valid JSON"),
    ("http-body-too-large", "POST", "/v1/sinks/{sink}/begin", b"x" * ((1 << 20) + 1), 413,
     r"request body is larger than 1048576 bytes"),
    ("http-timeout-nan", "GET", "/v1/txns/{sink}/lin/0/1/decision?timeout=nan", None, 422,
     r"query.timeout"),
    ("http-limit", "GET", f"/v1/txns?limit={10**20}", None, 422,
     r"query.limit: Input should be less than or equal to 10000"),
    ("http-no-token", "POST", "/v1/sinks/{sink}/register", None, 401,
     r"missing bearer token: send 'Authorization: Bearer <token>'"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "pattern"),
                         [pytest.param(*c[1:], id=c[0]) for c in HTTP_CASES])
def test_http_bad_input(daemon: LocalDaemon, method: str, path: str, body: Any, status: int,
                        pattern: str) -> None:
    sink, _ = _txn(daemon)
    headers = {} if status == 401 else dict(AUTH)
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw["content"] = body
        headers["Content-Type"] = "application/json"
    elif body is not None:
        kw["json"] = body
    before = httpx.get(f"{daemon.url}/v1/txns/{sink}/lin/0/1", headers=AUTH).json()
    r = httpx.request(method, daemon.url + path.format(sink=sink), headers=headers,
                      timeout=30, **kw)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "message"}
    assert re.search(pattern, r.json()["message"]), r.json()["message"]
    after = httpx.get(f"{daemon.url}/v1/txns/{sink}/lin/0/1", headers=AUTH).json()
    assert after == before  # refused: nothing changed


def test_http_largest_values_are_stored(daemon: LocalDaemon) -> None:
    """The bounds are real: the largest batch id and epoch the API accepts fit the store
    (PostgreSQL BIGINT), and the sink can register again after the largest epoch."""
    sink = f"s{uuid.uuid4().hex[:8]}"
    c = CoordinatorClient(daemon.url, TOKEN)
    res = c.begin(sink, "lin", BIG, wire.MAX_EPOCH, ["pg"], 1)
    assert res.txn is not None and res.txn.batch_id == BIG
    assert c.register(sink) == wire.MAX_EPOCH + 1
    assert c.get((sink, "lin", BIG, 1)) is not None


def test_long_no_vote_reason_is_clipped_not_refused(daemon: LocalDaemon) -> None:
    """A NO vote whose reason is a huge exception message (with a NUL in it) still lands:
    the client clips it to what the service accepts."""
    sink, epoch = _txn(daemon)
    c = CoordinatorClient(daemon.url, TOKEN)
    t = c.vote((sink, "lin", 0, 1), epoch,
               [wire.VoteIn("pg/0", False, reason="boom\x00" + "x" * 100_000)])
    assert t.state.value == "ABORTED"
    reason = t.branches["pg/0"].reason or ""
    assert reason.startswith("boom\\x00x") and reason.endswith("...[clipped]")
    assert len(reason) <= wire.MAX_TEXT and "\x00" not in reason


def test_catalogue_lists_every_case() -> None:
    doc = (ROOT / "docs" / "bad-inputs.md").read_text()
    ids = [c[0] for c in API_CASES] + [c[0] for c in CLI_CASES] + [c[0] for c in HTTP_CASES]
    missing = [i for i in ids if f"`{i}`" not in doc]
    assert not missing, f"docs/bad-inputs.md does not list {missing}"
    assert len(ids) >= 25
