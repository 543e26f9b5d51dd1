"""The error catalogue (issue 26): a failing job says what is wrong before it writes.

Each case runs as a user runs a job: a job script in a plain interpreter (no
``PYSPARK_PYTHON``, nothing twophase-internal in the environment; tests/support/user.py),
the public API, a rate source into PostgreSQL and Parquet under a local[2] master. For
each it asserts the one ERROR line the sink logs, ``sink S batch N failed: <participant>:
<cause>. Fix: <fix>``, that this line comes before Spark's wall of frames, that the raised
error's first line is the same sentence, and that nothing became visible and nothing
stayed prepared. The classification every participant shares (twophase.errors.classify)
and the earlier bad-input catalogue (docs/bad-inputs.md) run here too, the latter's API
rows in a user's interpreter.
"""

from __future__ import annotations

import errno
import json
import re
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.support.user import user_env
from twophase.errors import Failure, TargetProblem, classify, headline
from twophase.names import LINEAGE_RULE

HOST = socket.gethostname()

JOB = '''
import logging, sys
from pyspark.sql import SparkSession
from twophase import TransactionalSink
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant

spark = (SparkSession.builder.master("local[2]").appName("catalogue")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
{prelude}
participants = {participants}
sink = TransactionalSink("cat", participants, coordinator="sqlite:///{tmp}/coord.db",
                         max_attempts=3, backoff=0.1)
df = (spark.readStream.format("rate").option("rowsPerSecond", 20).load()
      .selectExpr({columns}))
query = (df.writeStream.foreachBatch(sink).option("checkpointLocation", "{tmp}/chk")
         .trigger(processingTime="1 second").start())
{finish}
query.stop()
print("JOB DONE")
'''

FAIL = "query.processAllAvailable()  # a rate source never runs dry: returns only by failing"
ROWS = """
import time
while not any(r.rows for r in sink.history):  # until a batch with rows is committed
    if query.exception() is not None:
        raise query.exception()
    time.sleep(0.5)
"""

PLAIN = '"value AS id"'
NESTED = ('"value AS id", "named_struct(\'colour\', \'red\', \'size\', value) AS attrs", '
          '"map(\'n\', value) AS labels", "array(value, value + 1) AS scores", '
          '"array(named_struct(\'x\', value)) AS points"')


def _run_job(tmp: Path, participants: str, *, columns: str = PLAIN, prelude: str = "",
             finish: str = FAIL) -> subprocess.CompletedProcess[str]:
    job = tmp / "job.py"
    job.write_text(JOB.format(prelude=textwrap.dedent(prelude), participants=participants,
                              tmp=tmp, columns=columns, finish=finish))
    return subprocess.run([sys.executable, str(job)], env=user_env(), cwd=tmp,
                          capture_output=True, text=True, timeout=400, check=False)


def _failed_with(out: subprocess.CompletedProcess[str], error: str, sentence: str) -> str:
    """The job failed; its one ERROR line is ``sentence`` (a regex), logged before any
    frame of Spark's, and the raised ``error``'s first line is the same sentence."""
    assert out.returncode != 0, out.stdout[-2000:]
    assert "JOB DONE" not in out.stdout
    err = out.stderr
    lines = re.findall(r"^.*ERROR twophase\.sink: (.*)$", err, re.M)
    assert len(lines) == 1, err[-6000:]
    line = lines[0]
    assert re.fullmatch(f"sink cat batch [0-9]+ failed: {sentence}", line), line
    logged = err.index(line)
    wall = [err.find(w) for w in ("Traceback", "ForeachBatchUserFuncException",
                                  "StreamingQueryException", "py4j") if w in err]
    assert wall and logged < min(wall), err[-6000:]
    assert f"twophase.errors.{error}: {line}" in err, err[-6000:]
    return line


def _table_rows(pg_dsn: str, table: str) -> int | None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (None,):
            return None
        row = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
        return int(row[0]) if row else 0


def _nothing_prepared(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        gids = conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
                            ("%cat%",)).fetchall()
    assert gids == []


def _no_files(folder: Path) -> None:
    """No visible file and nothing staged (prepared) in a files participant's folder."""
    if folder.exists():
        assert [p.name for p in folder.rglob("*") if p.is_file()] == []


# --------------------------------------------------------------------------- the jobs


@pytest.mark.spark
def test_a_folder_that_cannot_be_created_is_named_with_its_fix(
        tmp_path: Path, pg_dsn: str) -> None:
    table = f"cat_{uuid.uuid4().hex[:10]}"
    out = _run_job(tmp_path, f'[PostgresParticipant("{pg_dsn}", "{table}"), '
                             'StagedFileParticipant(path="/proc/forbidden/out")]')
    _failed_with(
        out, "TargetProblem",
        re.escape("files participant 'files-out' (parquet in /proc/forbidden/out): cannot "
                  "create the folder /proc/forbidden/out/_twophase_staging: No such file or "
                  f"directory (on host {HOST}). Fix: pass a path this user can create and "
                  "write on the driver and on every executor") + ".*")
    assert "FileNotFoundError" not in out.stderr  # no raw chain
    assert _table_rows(pg_dsn, table) is None  # checked before anything was created
    _nothing_prepared(pg_dsn)


@pytest.mark.spark
def test_a_role_that_does_not_exist_is_refused_at_once(tmp_path: Path, pg_dsn: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    params["user"] = "nobody"
    bad = make_conninfo(**params)
    parquet = tmp_path / "lake"
    started = time.monotonic()
    out = _run_job(tmp_path, f'[PostgresParticipant("{bad}", "cat_role"), '
                             f'StagedFileParticipant(path="{parquet}")]')
    _failed_with(
        out, "TargetProblem",
        r"postgres participant 'postgres-cat_role' \(public\.cat_role at [^)]+\): cannot "
        r'connect: authentication: role "nobody" does not exist \(on host [^)]+\)\. Fix: check '
        r"the user and password in dsn= .*")
    assert "tries" not in out.stderr and "unreachable" not in out.stderr
    assert time.monotonic() - started < 300
    _no_files(parquet / "_twophase_staging")
    assert not any(parquet.glob("*.parquet"))


@pytest.mark.spark
def test_nested_columns_reach_postgres_as_jsonb_and_arrays_and_parquet_as_they_are(
        tmp_path: Path, pg_dsn: str) -> None:
    table = f"cat_{uuid.uuid4().hex[:10]}"
    parquet = tmp_path / "lake"
    out = _run_job(tmp_path, f'[PostgresParticipant("{pg_dsn}", "{table}"), '
                             f'StagedFileParticipant(path="{parquet}")]', columns=NESTED,
                   finish=ROWS)
    assert out.returncode == 0 and "JOB DONE" in out.stdout, out.stderr[-6000:]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        types = dict(conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = %s::regclass AND attnum > 0", (table,)).fetchall())
        rows = conn.execute(f'SELECT id, attrs, labels, scores, points FROM "{table}" '
                            "ORDER BY id LIMIT 1").fetchall()
    assert types == {"id": "bigint", "attrs": "jsonb", "labels": "jsonb",
                     "scores": "bigint[]", "points": "jsonb"}
    (i, attrs, labels, scores, points), = rows
    assert attrs == {"colour": "red", "size": i} and labels == {"n": i}
    assert scores == [i, i + 1] and points == [{"x": i}]
    schema = pq.read_schema(sorted(parquet.glob("*.parquet"))[0])
    assert str(schema.field("attrs").type).startswith("struct<colour: string")
    assert str(schema.field("labels").type).startswith("map<string, int64")
    assert str(schema.field("scores").type).startswith("list<")


@pytest.mark.spark
def test_nested_refuse_names_the_column_and_the_other_policy(
        tmp_path: Path, pg_dsn: str) -> None:
    table = f"cat_{uuid.uuid4().hex[:10]}"
    parquet = tmp_path / "lake"
    out = _run_job(tmp_path, f'[PostgresParticipant("{pg_dsn}", "{table}", nested="refuse"), '
                             f'StagedFileParticipant(path="{parquet}")]', columns=NESTED)
    _failed_with(out, "ParticipantError",
                 r"postgres participant .*: column 'attrs' has the nested Arrow type struct.* "
                 r"nested='refuse' refuses nested columns: .* or pass nested='json' .*")
    assert _table_rows(pg_dsn, table) is None
    _nothing_prepared(pg_dsn)
    assert not any(parquet.glob("*.parquet"))


TASK_SIDE = '''
from twophase.errors import TargetProblem

class Refusing(StagedFileParticipant):
    """Its target takes the probe but refuses the rows, on the executors."""

    def prepare(self, branch, schema, batches):
        raise TargetProblem(self.describe(), "the store refused the rows",
                            "ask the store's owner for write access")
'''


@pytest.mark.spark
def test_a_task_side_cause_leads_the_sentence_and_is_not_retried(
        tmp_path: Path, pg_dsn: str) -> None:
    table = f"cat_{uuid.uuid4().hex[:10]}"
    refusing, lake = tmp_path / "refusing", tmp_path / "lake"
    out = _run_job(tmp_path, f'[PostgresParticipant("{pg_dsn}", "{table}"), '
                             f'StagedFileParticipant(path="{lake}"), '
                             f'Refusing(path="{refusing}", name="refusing")]',
                   prelude=TASK_SIDE)
    line = _failed_with(
        out, "BatchFailed",
        re.escape(f"files participant 'refusing' (parquet in {refusing}): the store refused "
                  "the rows. Fix: ask the store's owner for write access."))
    assert headline(line) is not None
    assert "attempt 1 aborted by a cause a retry cannot heal, not retried" in out.stderr
    assert "attempt 2" not in out.stderr
    assert _table_rows(pg_dsn, table) == 0  # created by check, no row visible
    _nothing_prepared(pg_dsn)
    _no_files(lake)  # aborted: nothing staged, nothing visible
    _no_files(refusing)


# --------------------------------------------------------------------------- classify


class _Fake(Exception):
    """A client library's error as classify reads it: attributes, not classes."""

    def __init__(self, text: str = "", **attrs: Any) -> None:
        super().__init__(text)
        self.__dict__.update(attrs)


class _PgOperational(_Fake):
    pass


_PgOperational.__module__ = "psycopg"
_PgOperational.__name__ = "OperationalError"


class KafkaException(_Fake):  # librdkafka's class name, with a KafkaError in args[0]
    pass


class _KafkaError:
    def __init__(self, name: str, retriable: bool = False) -> None:
        self._name, self._retriable = name, retriable

    def name(self) -> str:
        return self._name

    def retriable(self) -> bool:
        return self._retriable


@pytest.mark.parametrize(("exc", "kind"), [
    (FileNotFoundError(errno.ENOENT, "x"), Failure.MISSING),
    (PermissionError(errno.EACCES, "x"), Failure.AUTHORIZATION),
    (OSError(errno.EROFS, "x"), Failure.AUTHORIZATION),
    (ConnectionRefusedError(errno.ECONNREFUSED, "x"), Failure.TRANSIENT),
    (ConnectionResetError(errno.ECONNRESET, "x"), Failure.TRANSIENT),
    (TimeoutError("x"), Failure.TRANSIENT),
    (_Fake(sqlstate="28P01"), Failure.AUTHENTICATION),
    (_Fake(sqlstate="42501"), Failure.AUTHORIZATION),
    (_Fake(sqlstate="3D000"), Failure.MISSING),
    (_Fake(sqlstate="42P01"), Failure.MISSING),
    (_Fake(sqlstate="08006"), Failure.TRANSIENT),
    (_Fake(sqlstate="57P01"), Failure.TRANSIENT),
    (_Fake(sqlstate="40001"), Failure.TRANSIENT),
    (_PgOperational('connection failed: ... FATAL:  role "nobody" does not exist'),
     Failure.AUTHENTICATION),
    (_PgOperational("connection failed: ... FATAL:  password authentication failed for user"),
     Failure.AUTHENTICATION),
    (_PgOperational('FATAL:  database "nodb" does not exist'), Failure.MISSING),
    (_PgOperational("FATAL:  permission denied for database x"), Failure.AUTHORIZATION),
    (_PgOperational("FATAL:  the database system is starting up"), Failure.TRANSIENT),
    (_PgOperational("connection failed: Connection refused"), Failure.TRANSIENT),
    (KafkaException(_KafkaError("TOPIC_AUTHORIZATION_FAILED")), Failure.AUTHORIZATION),
    (KafkaException(_KafkaError("SASL_AUTHENTICATION_FAILED")), Failure.AUTHENTICATION),
    (KafkaException(_KafkaError("UNKNOWN_TOPIC_OR_PART")), Failure.MISSING),
    (KafkaException(_KafkaError("_TRANSPORT", retriable=True)), Failure.TRANSIENT),
    (_Fake(response={"Error": {"Code": "AccessDenied"}}), Failure.AUTHORIZATION),
    (_Fake(response={"Error": {"Code": "InvalidAccessKeyId"}}), Failure.AUTHENTICATION),
    (_Fake(response={"Error": {"Code": "NoSuchBucket"}}), Failure.MISSING),
    (_Fake(response={"Error": {"Code": "SlowDown"}}), Failure.UNKNOWN),
    (ValueError("x"), Failure.UNKNOWN),
])
def test_one_place_classifies_every_participants_errors(exc: BaseException,
                                                         kind: Failure) -> None:
    assert classify(exc) is kind
    assert kind.permanent == (kind not in (Failure.TRANSIENT, Failure.UNKNOWN))


def test_classify_follows_the_cause() -> None:
    try:
        try:
            raise PermissionError(errno.EACCES, "denied")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert classify(outer) is Failure.AUTHORIZATION


def test_the_real_server_refusing_a_role_is_permanent(pg_dsn: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    params["user"] = "nobody"
    with pytest.raises(psycopg.OperationalError) as info:
        psycopg.connect(make_conninfo(**params), connect_timeout=5)
    assert classify(info.value) is Failure.AUTHENTICATION


def test_a_target_problem_is_one_sentence_and_survives_pickling() -> None:
    import pickle

    p = TargetProblem("kafka participant 'k' (topic 't')", "topic 't' has no partitions",
                      "recreate it", host="h1", kind=Failure.CONFIGURATION)
    assert str(p) == ("kafka participant 'k' (topic 't'): topic 't' has no partitions "
                      "(on host h1). Fix: recreate it.")
    assert str(pickle.loads(pickle.dumps(p))) == str(p)
    assert headline(f"pg/0 voted NO: TargetProblem: {p}\nmore") == str(p)


def test_the_lineage_rule_is_stated_once() -> None:
    """The Spark Connect message listed ``_ .`` as allowed; the rule is names.py's."""
    from twophase.doors import foreachbatch as driver
    from twophase.names import LINEAGE_PATTERN, validate_lineage

    assert LINEAGE_PATTERN == r"^[A-Za-z0-9-]{1,64}$" and LINEAGE_RULE.endswith("A-Z a-z 0-9 -")
    source = Path(driver.__file__).read_text()
    assert "A-Z a-z 0-9 - _ ." not in source and "LINEAGE_RULE" in source
    with pytest.raises(ValueError, match=re.escape(f"use {LINEAGE_RULE}")):
        validate_lineage("a_b")


# --------------------------------------------------------------------------- bad inputs

# The API rows of docs/bad-inputs.md as a job script writes them (the CLI and HTTP rows
# already run as a user does in tests/system/test_bad_inputs.py: a real process, a real daemon).
USER_CASES = {
    "sink-name": 'TransactionalSink("my orders", [F("/tmp/x")], coordinator="sqlite:///x.db")',
    "sink-no-participants": 'TransactionalSink("o", [], coordinator="sqlite:///x.db")',
    "sink-duplicate-participants": 'TransactionalSink("o", [F("/tmp/x", name="f"), '
                                   'F("/tmp/y", name="f")], coordinator="sqlite:///x.db")',
    "sink-partitions": 'TransactionalSink("o", [F("/tmp/x")], coordinator="sqlite:///x.db", '
                       'partitions=0)',
    "sink-max-attempts": 'TransactionalSink("o", [F("/tmp/x")], '
                         'coordinator="sqlite:///x.db", max_attempts=0)',
    "sink-vote-timeout-nan": 'TransactionalSink("o", [F("/tmp/x")], '
                             'coordinator="sqlite:///x.db", vote_timeout=float("nan"))',
    "sink-backoff": 'TransactionalSink("o", [F("/tmp/x")], coordinator="sqlite:///x.db", '
                    'backoff=-1)',
    "sink-lineage": 'TransactionalSink("o", [F("/tmp/x")], coordinator="sqlite:///x.db", '
                    'lineage="a_b")',
    "sink-coordinator-url": 'TransactionalSink("o", [F("/tmp/x")], coordinator="ftp://host")',
    "files-empty-path": 'F("")',
    "files-nul-path": 'F("/tmp/a\\x00b")',
    "files-format": 'F("/tmp/x", format="csv")',
    "participant-name": 'F("/tmp/x", name="a/b")',
    "postgres-table": 'P("postgresql://h/db", "t; drop table x")',
    "postgres-schema": 'P("postgresql://h/db", "t", schema="1x")',
    "postgres-empty-dsn": 'P("", "t")',
    "postgres-bad-dsn": 'P("host = = x", "t")',
    "postgres-timeout": 'P("postgresql://h/db", "t", connect_timeout=0)',
    "kafka-topic": 'K("my topic", {"bootstrap.servers": "127.0.0.1:9"})',
    "kafka-no-brokers": 'K("t", {})',
    "kafka-acks": 'K("t", {"bootstrap.servers": "127.0.0.1:9", "acks": "1"})',
    "kafka-txn-timeout": 'K("t", {"bootstrap.servers": "127.0.0.1:9"}, '
                         'transaction_timeout_ms=10)',
}

USER_SCRIPT = '''
import json
from twophase import TransactionalSink
from twophase.sinks.files import StagedFileParticipant as F
from twophase.sinks.kafka import KafkaParticipant as K
from twophase.sinks.postgres import PostgresParticipant as P
out = {}
for case, expr in json.loads(CASES).items():
    try:
        eval(expr)
        out[case] = None
    except Exception as exc:
        out[case] = [type(exc).__name__, str(exc).splitlines()[0]]
print(json.dumps(out))
'''


def test_the_bad_input_catalogue_as_a_user_meets_it(tmp_path: Path) -> None:
    from tests.system.test_bad_inputs import API_CASES

    expected = {case: pattern for case, _, pattern in API_CASES}
    script = tmp_path / "job.py"
    script.write_text(f"CASES = {json.dumps(json.dumps(USER_CASES))}\n{USER_SCRIPT}")
    out = subprocess.run([sys.executable, str(script)], env=user_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for case in USER_CASES:
        assert got[case] is not None, f"{case}: accepted"
        cls, first = got[case]
        assert cls == "InvalidRequest", (case, cls, first)
        assert re.search(expected[case], first), (case, first)
    assert not list(tmp_path.glob("*.db"))  # nothing was created by a refused constructor


# --------------------------------------------------------------------------- the probes


def _executor_only_refusal(path: str, driver_pid: int) -> Any:
    from twophase.sinks.files import StagedFileParticipant

    class ExecutorsRefused(StagedFileParticipant):
        def probe(self) -> None:
            import os

            if os.getpid() != driver_pid:
                raise TargetProblem(self.describe(), "this host may not write there",
                                    "mount the folder on every executor",
                                    host=socket.gethostname(), kind=Failure.AUTHORIZATION)

    # as if defined in a job script: shipped by value, not imported by the executors
    ExecutorsRefused.__module__ = "__main__"
    return ExecutorsRefused(path=path, name="lake")


@pytest.mark.spark
def test_the_executors_probe_each_target_in_the_preflight_job(spark: Any,
                                                              tmp_path: Path) -> None:
    import os

    from twophase.spark.preflight import check_executors
    from twophase.testing.servers import free_port

    part = _executor_only_refusal(str(tmp_path / "out"), os.getpid())
    part.probe()  # the driver may write there
    with socket.create_server(("127.0.0.1", free_port())) as srv:  # a coordinator's port
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(TargetProblem) as err:
            check_executors(spark.sparkContext, "probed", [part], url)
    first = str(err.value).splitlines()[0]
    assert first == (f"files participant 'lake' (parquet in {tmp_path / 'out'}): this host "
                     f"may not write there (on host {HOST}). Fix: mount the folder on every "
                     "executor.")
    assert not any((tmp_path / "out").rglob("*.parquet"))


def test_a_role_without_privileges_is_named_with_the_grants(pg_dsn: str) -> None:
    from twophase.sinks.postgres import PostgresParticipant

    role, schema = f"r{uuid.uuid4().hex[:8]}", f"s{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    params = conninfo_to_dict(pg_dsn)
    params["user"] = role
    p = PostgresParticipant(make_conninfo(**params), "orders", schema=schema)
    with pytest.raises(TargetProblem) as err:
        p.probe()
    assert str(err.value) == (
        f"postgres participant 'postgres-orders' ({schema}.orders at {p._where}): role "
        f"'{role}' lacks CREATE on schema {schema} (to create {schema}.orders); CREATE on "
        f"schema {schema} (to create {schema}.twophase_markers) (on host {HOST}). Fix: "
        f"GRANT CREATE ON SCHEMA {schema} TO {role} (as the owner).")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {schema}.orders (id bigint)")
        admin.execute(f"GRANT SELECT ON {schema}.orders TO {role}")
        admin.execute(f"GRANT CREATE ON SCHEMA {schema} TO {role}")
    with pytest.raises(TargetProblem, match=re.escape(
            f"lacks INSERT, UPDATE, DELETE on {schema}.orders (on host {HOST}). Fix: GRANT "
            f"INSERT, UPDATE, DELETE ON {schema}.orders TO {role} (as the owner).")):
        p.probe()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"GRANT INSERT, UPDATE, DELETE ON {schema}.orders TO {role}")
    p.probe()  # all granted: the probe passes
    p.close()


def test_the_kafka_probe_against_a_real_broker(kafka_bootstrap: str) -> None:
    """Brokers answering: a missing topic is left to check() (it creates it), an existing
    one passes; brokers not answering are a transient ParticipantError naming the host."""
    import pyarrow as pa

    from twophase.participant import ParticipantError
    from twophase.sinks.kafka import KafkaParticipant
    from twophase.testing.servers import free_port

    topic = f"probe-{uuid.uuid4().hex[:8]}"
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap})
    p.probe()  # the topic does not exist yet
    p.check(pa.schema([("value", pa.string())]))  # creates it
    p.probe()
    p.close()
    down = KafkaParticipant(topic, {"bootstrap.servers": f"127.0.0.1:{free_port()}"},
                            connect_timeout_s=2)
    with pytest.raises(ParticipantError) as err:
        down.probe()
    assert not isinstance(err.value, TargetProblem)
    assert "cannot reach Kafka at 127.0.0.1:" in str(err.value) and HOST in str(err.value)
    down.close()
