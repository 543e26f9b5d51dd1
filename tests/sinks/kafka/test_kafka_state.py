"""The Kafka participant's own state handling, without a broker.

Real ``KafkaError`` objects and real (unconnected) librdkafka producers, no broker mocks:
commit-error classification, config and topic validation, names and handle contents,
pickling, size limits and the "commit never turns into an abort" rule.
"""

from __future__ import annotations

import pickle
import re
import string

import pyarrow as pa
import pytest
from confluent_kafka import KafkaError
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.participant import BranchRef, ParticipantError
from twophase.sinks.kafka import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KafkaParticipant,
    classify_commit_error,
    validate_config,
    validate_topic,
)
from twophase.sinks.kafka.config import RECONNECT_BACKOFF_MS
from twophase.testing.servers import free_port

CODES = sorted(
    {getattr(KafkaError, n) for n in dir(KafkaError) if n.isupper() or n.startswith("_")
     if isinstance(getattr(KafkaError, n), int)}
)
LEGAL = string.ascii_letters + string.digits + "._-"


def _closed() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def part(**kw: object) -> KafkaParticipant:
    return KafkaParticipant("orders", {"bootstrap.servers": _closed()}, **kw)  # type: ignore[arg-type]


def ref(p: KafkaParticipant, batch_id: int = 3, attempt: int = 0, partition: int = 2,
        lineage: str = "lin-1", sink: str = "orders") -> BranchRef:
    return BranchRef(sink, lineage, batch_id, attempt, p.name, partition)


# -- commit error classification ---------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(code=st.sampled_from(CODES), fatal=st.booleans(), retriable=st.booleans(),
       abortable=st.booleans())
def test_commit_errors_are_retried_or_reported_never_aborted(
    code: int, fatal: bool, retriable: bool, abortable: bool
) -> None:
    err = KafkaError(code, "x", fatal=fatal, retriable=retriable, txn_requires_abort=abortable)
    action = classify_commit_error(err)
    assert action in ("retry", "fatal")  # there is no "abort" outcome at all
    if fatal or abortable:
        assert action == "fatal"
    elif retriable:
        assert action == "retry"


@pytest.mark.parametrize("name", ["_TIMED_OUT", "REQUEST_TIMED_OUT", "_TRANSPORT",
                                  "COORDINATOR_NOT_AVAILABLE", "NOT_COORDINATOR",
                                  "CONCURRENT_TRANSACTIONS", "COORDINATOR_LOAD_IN_PROGRESS"])
def test_ambiguous_errors_retry_even_without_the_flag(name: str) -> None:
    assert classify_commit_error(KafkaError(getattr(KafkaError, name))) == "retry"


@pytest.mark.parametrize("name", ["PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH",
                                  "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", "_STATE"])
def test_fenced_and_state_errors_are_fatal(name: str) -> None:
    fatal = name != "_STATE"
    assert classify_commit_error(KafkaError(getattr(KafkaError, name), fatal=fatal)) == "fatal"


# -- topics, config, names ---------------------------------------------------------------


@given(st.text(alphabet=LEGAL, min_size=1, max_size=249).filter(lambda t: t not in (".", "..")))
def test_legal_topics_accepted(topic: str) -> None:
    assert validate_topic(topic) == topic


@given(st.text(min_size=0, max_size=300).filter(
    lambda t: not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", t) or t in (".", "..")))
def test_other_topics_refused(topic: str) -> None:
    with pytest.raises(ValueError, match="invalid Kafka topic name"):
        validate_topic(topic)


@pytest.mark.parametrize(("cfg", "match"), [
    ({"bootstrap.servers": "h:1", "transactional.id": "x"}, "'transactional.id' may not be set"),
    ({"bootstrap.servers": "h:1", "enable.idempotence": "false"}, "enable.idempotence=false"),
    ({"bootstrap.servers": "h:1", "enable.idempotence": False}, "enable.idempotence=false"),
    ({"bootstrap.servers": "h:1", "acks": "1"}, "acks='1' is refused"),
    ({"bootstrap.servers": "h:1", "transaction.timeout.ms": "5"}, "transaction_timeout_ms="),
    ({"bootstrap.servers": "h:1", "isolation.level": "read_committed"}, "consumer setting"),
    ({}, "must name the brokers"),
    ({"bootstrap.servers": "  "}, "must name the brokers"),
])
def test_config_that_breaks_the_protocol_is_refused(cfg: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_config(cfg)


def test_config_not_a_mapping() -> None:
    with pytest.raises(TypeError, match="mapping"):
        validate_config([("bootstrap.servers", "h:1")])  # type: ignore[arg-type]


def test_producer_config_enforces_the_protocol_and_keeps_security() -> None:
    p = KafkaParticipant("orders", {"bootstrap.servers": "h:1", "security.protocol": "SASL_SSL",
                                    "sasl.mechanism": "PLAIN", "linger.ms": "20",
                                    "enable.idempotence": "true", "acks": "all"},
                         transaction_timeout_ms=30_000)
    cfg = p.producer_config("twophase.s.p.0")
    assert cfg["transactional.id"] == "twophase.s.p.0"
    assert cfg["enable.idempotence"] is True and cfg["acks"] == "all"
    assert cfg["transaction.timeout.ms"] == 30_000
    assert cfg["security.protocol"] == "SASL_SSL" and cfg["linger.ms"] == "20"
    assert cfg["reconnect.backoff.ms"] == RECONNECT_BACKOFF_MS  # connects sooner
    own = KafkaParticipant("orders", {"bootstrap.servers": "h:1", "reconnect.backoff.ms": "250"})
    assert own.producer_config("t")["reconnect.backoff.ms"] == "250"  # the user's wins
    common = p._common_config()
    assert common == {"bootstrap.servers": "h:1", "security.protocol": "SASL_SSL",
                      "sasl.mechanism": "PLAIN"}


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="longer than 64 characters: pass name="):
        KafkaParticipant("t" * 60, {"bootstrap.servers": "h:1"})
    assert KafkaParticipant("t" * 60, {"bootstrap.servers": "h:1"}, name="short").name == "short"
    with pytest.raises(ValueError, match="invalid participant name"):
        KafkaParticipant("t", {"bootstrap.servers": "h:1"}, name="bad name")
    with pytest.raises(ValueError, match="transaction_timeout_ms"):
        KafkaParticipant("t", {"bootstrap.servers": "h:1"}, transaction_timeout_ms=10)
    with pytest.raises(ValueError, match="key must be a column name"):
        KafkaParticipant("t", {"bootstrap.servers": "h:1"}, key="")
    p = KafkaParticipant("orders", {"bootstrap.servers": "h:1"})
    assert (p.name, p.kind, p.prepare_mode) == ("kafka-orders", "kafka", "resumable")


@given(batch_id=st.integers(0, 10**12), attempt=st.integers(0, 1000),
       partition=st.integers(0, 10_000))
def test_names_and_handle(batch_id: int, attempt: int, partition: int) -> None:
    p = KafkaParticipant("orders", {"bootstrap.servers": "h:1"})
    b = ref(p, batch_id, attempt, partition)
    tid = p.transactional_id(b)
    # Stable per sink and partition: every checkpoint, attempt and lineage shares it.
    assert tid == f"twophase.orders.kafka-orders.{partition}"
    assert tid == p.transactional_id(ref(p, batch_id + 1, attempt + 1, partition, "other"))
    # The marker group is per lineage: a new checkpoint location starts a new group.
    assert p.marker_group(b) == f"twophase.orders.lin-1.kafka-orders.{partition}"
    assert p.marker_group(b) != p.marker_group(ref(p, batch_id, attempt, partition, "lin-2"))
    h = p._handle(b, 17, already=False)
    assert h == {"transactional_id": tid, "marker_group": p.marker_group(b),
                 "marker_offset": str(batch_id + 1), "topic": "orders", "rows": "17",
                 "already_committed": "no"}
    assert all(isinstance(v, str) for v in h.values())


def test_branch_of_another_participant_is_refused() -> None:
    p = part()
    other = BranchRef("orders", "lin-1", 0, 0, "someone-else", 0)
    with pytest.raises(ParticipantError, match="belongs to participant 'someone-else'"):
        p.status(other)


def test_pickling_keeps_the_settings() -> None:
    p = part()
    q: KafkaParticipant = pickle.loads(pickle.dumps(p))
    assert q.config == p.config and q.topic == "orders" and q.prepare_mode == "resumable"
    assert q.in_doubt("orders") == []


def test_message_size_limit() -> None:
    p = part()
    assert p.max_message_bytes() == DEFAULT_MAX_MESSAGE_BYTES
    p.broker_max_message_bytes = 500_000
    assert p.max_message_bytes() == 500_000
    q = KafkaParticipant("t", {"bootstrap.servers": "h:1", "message.max.bytes": "1000"})
    q.broker_max_message_bytes = 500_000
    assert q.max_message_bytes() == 1000


@pytest.mark.parametrize(("key", "value", "match"), [
    ("k", None, None), ("n", None, None), (None, "v", None), (None, "b", None),
    ("f", None, "key column 'f' has type double; it must be string, binary or integer"),
    (None, "n", "value column 'n' has type int64; it must be string or binary"),
    ("missing", None, "key column 'missing' is not in the schema"),
])
def test_key_value_columns(key: str | None, value: str | None, match: str | None) -> None:
    schema = pa.schema([("k", pa.string()), ("n", pa.int64()), ("f", pa.float64()),
                        ("v", pa.large_string()), ("b", pa.binary())])
    p = part(key=key, value=value)
    if match is None:
        p._check_columns(schema)
    else:
        with pytest.raises(ParticipantError, match=re.escape(match)):
            p._check_columns(schema)

