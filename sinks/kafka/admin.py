"""Driver-side checks of a Kafka target, before the first batch: columns, brokers, topic.

A misfit (unreachable cluster, a transaction timeout over the broker's maximum, a missing
topic that cannot be created, a key or value column of the wrong type) fails here with a
message naming the fix, not in the middle of a batch on an executor.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from twophase.errors import Failure, ParticipantError, TargetProblem, classify
from twophase.sinks.kafka.config import DEFAULT_TRANSACTION_MAX_TIMEOUT_MS, common_config
from twophase.sinks.kafka.errors import FENCED, TRANSIENT, describe_error, kafka_error

__all__ = ["check_columns", "check_topic", "list_metadata", "probe_topic",
           "probe_transactional_write", "security_refusal"]


def _admin(config: Mapping[str, object]) -> tuple[Any, list[str]]:
    """An AdminClient that keeps what librdkafka reports to its ``error_cb``: a failed
    TLS handshake or SASL sign-in surfaces only there (the request itself fails with a
    bare ``_TRANSPORT``)."""
    from confluent_kafka.admin import AdminClient

    errors: list[str] = []
    settings: dict[str, Any] = {**config, "error_cb": lambda err: errors.append(err.str())}
    admin = AdminClient(settings)
    return admin, errors


def list_metadata(admin: Any, errors: list[str], timeout: float,
                  topic: str | None = None) -> Any:
    """``admin.list_topics`` within ``timeout``, asked in short rounds so that a TLS or
    SASL refusal (which librdkafka retries until the timeout) ends the wait at once."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return admin.list_topics(topic=topic, timeout=max(0.1, min(2.0, left)))
        except Exception:
            if time.monotonic() >= deadline or security_refusal(errors, admin) is not None:
                raise


def security_refusal(errors: list[str], client: Any = None) -> tuple[str, str] | None:
    """(cause, fix) when librdkafka's errors show a TLS or SASL refusal, else None.
    ``client``: polled first, so the errors it has queued reach ``error_cb``."""
    if client is not None:
        with contextlib.suppress(Exception):
            client.poll(0)
    for text in reversed(errors):
        low = text.lower()
        if "sasl authentication" in low or "authentication failed" in low:
            return (f"SASL authentication failed ({text.strip()[:300]})",
                    "check sasl.username and sasl.password (and sasl.mechanism) in config=: "
                    "the broker must hold this principal's credentials for that mechanism")
        if "certificate verify failed" in low or "ssl handshake failed" in low:
            return (f"TLS: the broker's certificate does not verify ({text.strip()[:300]})",
                    "set ssl.ca.location in config= to the CA that signed the broker's "
                    "certificate, and name the brokers by a host the certificate lists")
    return None


def check_columns(who: str, schema: pa.Schema, key: str | None, value: str | None) -> None:
    """The key column must be string, binary or integer; the value column string or binary."""
    names = schema.names
    for label, col in (("key", key), ("value", value)):
        if col is None:
            continue
        if col not in names:
            raise ParticipantError(
                f"{who}: {label} column {col!r} is not in the schema {names}"
            )
        typ = schema.field(col).type
        usable = pat.is_string(typ) or pat.is_large_string(typ) or pat.is_binary(typ) or (
            pat.is_large_binary(typ)
        )
        if label == "key":
            usable = usable or pat.is_integer(typ)
        if not usable:
            kinds = "string, binary or integer" if label == "key" else "string or binary"
            raise ParticipantError(
                f"{who}: {label} column {col!r} has type {typ}; it must be {kinds}"
            )


def check_topic(
    who: str,
    config: Mapping[str, object],
    topic: str,
    *,
    transaction_timeout_ms: int,
    timeout: float,
) -> int | None:
    """Reach the brokers, compare the transaction timeout with the broker's maximum, make
    sure the topic exists (creating it if the broker allows). Returns the topic's (or the
    broker's) message size limit, None when the broker reports none.

    ``config`` holds only connection settings (:func:`~.config.common_config`).
    """
    bootstrap = str(config["bootstrap.servers"])
    admin, errors = _admin(config)
    try:
        md = list_metadata(admin, errors, timeout)
    except Exception as exc:
        refused = security_refusal(errors, admin)
        if refused is not None:
            raise TargetProblem(who, f"Kafka at {bootstrap} refused: {refused[0]}",
                                refused[1], kind=Failure.AUTHENTICATION) from None
        raise ParticipantError(
            f"{who}: cannot reach Kafka at {bootstrap} within "
            f"{timeout:g}s: {describe_error(exc)}"
        ) from exc
    broker_cfg = _broker_config(who, bootstrap, admin, md, timeout)
    _check_timeout(who, transaction_timeout_ms, broker_cfg)
    topic_md = md.topics.get(topic)
    if topic_md is None or topic_md.error is not None:
        _create_topic(who, bootstrap, admin, topic, broker_cfg, timeout)
    topic_cfg = _configs(who, bootstrap, admin, "TOPIC", topic, timeout)
    limit = topic_cfg.get("max.message.bytes") or broker_cfg.get("message.max.bytes")
    return int(limit) if limit is not None else None


_KAFKA_FIXES = {
    Failure.AUTHENTICATION: "check the security settings in config= (sasl.*, ssl.*) and "
    "the principal's credentials",
    Failure.AUTHORIZATION: "grant the principal Describe and Write on the topic and "
    "Write/Describe on transactional ids (ACLs on the cluster)",
    Failure.MISSING: "create the topic, or fix topic=",
    Failure.CONFIGURATION: "fix the setting named above in config=",
}


def probe_topic(who: str, config: Mapping[str, object], topic: str, *, timeout: float) -> None:
    """The brokers answer with these settings; an existing topic has partitions and is
    not refused to this principal. Raises :class:`TargetProblem` for a permanent refusal,
    :class:`ParticipantError` for brokers that do not answer."""
    import socket

    bootstrap = str(config["bootstrap.servers"])
    host = socket.gethostname()
    admin, errors = _admin(config)
    try:
        md = list_metadata(admin, errors, timeout, topic)
    except Exception as exc:
        refused = security_refusal(errors, admin)
        if refused is not None:
            raise TargetProblem(who, f"Kafka at {bootstrap} refused: {refused[0]}",
                                refused[1], host=host, kind=Failure.AUTHENTICATION) from None
        kind = classify(exc)
        if kind.permanent:
            raise TargetProblem(who, f"Kafka at {bootstrap} refused: {describe_error(exc)}",
                                _KAFKA_FIXES[kind], host=host, kind=kind) from None
        raise ParticipantError(
            f"{who}: cannot reach Kafka at {bootstrap} from host {host} within "
            f"{timeout:g}s: {describe_error(exc)}"
        ) from None
    found = md.topics.get(topic)
    if found is None or found.error is None:
        if found is not None and not found.partitions:
            raise TargetProblem(who, f"topic {topic!r} at {bootstrap} has no partitions",
                                "recreate the topic with at least one partition",
                                host=host, kind=Failure.CONFIGURATION)
        return
    name = found.error.name()
    if name in ("UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC", "LEADER_NOT_AVAILABLE"):
        return  # created by check() on the driver (or by the broker on first use)
    from confluent_kafka import KafkaException

    kind = classify(KafkaException(found.error))
    if kind.permanent:
        raise TargetProblem(who, f"topic {topic!r} at {bootstrap}: {name}: {found.error.str()}",
                            _KAFKA_FIXES[kind], host=host, kind=kind)


def unstable_records(config: Mapping[str, object], topic: str, *, timeout: float
                     ) -> dict[str, int]:
    """Per partition of ``topic`` (``topic-N``): records past its last stable offset (the
    high watermark minus the offset a ``read_committed`` reader stops at). Above 0 only
    while a transaction writing the partition is open: readers wait behind it."""
    from confluent_kafka import IsolationLevel, TopicPartition
    from confluent_kafka import admin as kadmin

    AdminClient, OffsetSpec = kadmin.AdminClient, kadmin.OffsetSpec  # type: ignore[attr-defined]

    admin = AdminClient(dict(config))  # type: ignore[arg-type]
    md = admin.list_topics(topic=topic, timeout=timeout)
    found = md.topics.get(topic)
    if found is None or found.error is not None:
        return {}
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    specs = {TopicPartition(topic, n): latest for n in found.partitions}
    ends = {}
    for level in (IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED):
        futures = admin.list_offsets(specs, isolation_level=level, request_timeout=timeout)
        ends[level] = {tp.partition: f.result().offset for tp, f in futures.items()}
    high, stable = ends[IsolationLevel.READ_UNCOMMITTED], ends[IsolationLevel.READ_COMMITTED]
    return {f"{topic}-{n}": max(0, high[n] - stable[n]) for n in sorted(high)}


def _transient(exc: BaseException) -> bool:
    """A broker restarting or a leader moving: asked again shortly, it answers."""
    err = kafka_error(exc)
    return err is not None and not err.fatal() and (
        err.retriable() or err.name() in TRANSIENT)


def _configs(
    who: str, bootstrap: str, admin: Any, kind: str, resource: str, timeout: float
) -> dict[str, str]:
    """A resource's configs; empty when the broker reports none (tansu). A transient
    error (the broker that answered the metadata restarting) is asked again within
    ``timeout``, as the commits ride out a broker restart: a query must not fail at its
    first batch's check for what a second later would have answered."""
    import tenacity
    from confluent_kafka.admin import _config, _resource

    res = _config.ConfigResource(getattr(_resource.ResourceType, kind), resource)

    def ask() -> Any:
        [future] = admin.describe_configs([res], request_timeout=timeout).values()
        return future.result(timeout=timeout)

    try:
        entries = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_transient),
            stop=tenacity.stop_after_delay(timeout),
            wait=tenacity.wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        )(ask)
    except Exception as exc:
        raise ParticipantError(
            f"{who}: cannot read {kind.lower()} {resource!r} configs at "
            f"{bootstrap}: {describe_error(exc)}"
        ) from exc
    return {n: e.value for n, e in entries.items() if e.value is not None}


def _check_timeout(who: str, transaction_timeout_ms: int, broker_cfg: Mapping[str, str]) -> None:
    """The transaction timeout within the broker's maximum, or an error naming both."""
    max_timeout = int(
        broker_cfg.get("transaction.max.timeout.ms", DEFAULT_TRANSACTION_MAX_TIMEOUT_MS)
    )
    if transaction_timeout_ms > max_timeout:
        raise ParticipantError(
            f"{who}: transaction_timeout_ms={transaction_timeout_ms} "
            f"exceeds the broker's transaction.max.timeout.ms={max_timeout}; lower it or "
            "raise the broker setting"
        )


def _timeout_refused(who: str, producer_config: Mapping[str, object], timeout: float) -> None:
    """The broker refused the producer's transaction timeout (``INVALID_TRANSACTION_TIMEOUT``
    at ``init_transactions``): raise :func:`_check_timeout`'s error, with the broker's
    maximum read from its configs, rather than the broker's bare words."""
    config = common_config(producer_config)
    bootstrap = str(config["bootstrap.servers"])
    admin, errors = _admin(config)
    md = list_metadata(admin, errors, timeout)
    _check_timeout(who, int(str(producer_config["transaction.timeout.ms"])),
                   _broker_config(who, bootstrap, admin, md, timeout))


def _broker_config(
    who: str, bootstrap: str, admin: Any, md: Any, timeout: float
) -> dict[str, str]:
    if not md.brokers:
        raise ParticipantError(f"{who}: {bootstrap} lists no brokers")
    broker_id = md.controller_id if md.controller_id in md.brokers else min(md.brokers)
    return _configs(who, bootstrap, admin, "BROKER", str(broker_id), timeout)


def _create_topic(
    who: str,
    bootstrap: str,
    admin: Any,
    topic: str,
    broker_cfg: Mapping[str, str],
    timeout: float,
) -> None:
    from confluent_kafka.cimpl import NewTopic

    if broker_cfg.get("auto.create.topics.enable", "true").lower() != "true":
        raise ParticipantError(
            f"{who}: topic {topic!r} does not exist at {bootstrap} "
            "and the broker does not auto-create topics; create it first"
        )
    try:
        [future] = admin.create_topics([NewTopic(topic)], request_timeout=timeout).values()
        future.result(timeout=timeout)
    except Exception as exc:
        err = kafka_error(exc)
        if err is not None and err.name() == "TOPIC_ALREADY_EXISTS":
            return
        raise ParticipantError(
            f"{who}: topic {topic!r} does not exist at {bootstrap} "
            f"and could not be created: {describe_error(exc)}"
        ) from exc


def _missing_topic_ops(admin: Any, topic: str, needs: tuple[str, ...],
                       timeout: float) -> list[str]:
    """The operations of ``needs`` this principal may not do on ``topic``, from the
    broker's own answer (DescribeTopics' authorized operations); [] when the broker does
    not say (no authorizer, or a broker without the field)."""
    from confluent_kafka import TopicCollection

    try:
        [future] = admin.describe_topics(TopicCollection([topic]),
                                         include_authorized_operations=True,
                                         request_timeout=timeout).values()
        allowed = future.result(timeout=timeout).authorized_operations
    except Exception:
        return []  # a missing topic (check() creates it) or no answer: the write says
    if not allowed:
        return []
    names = {getattr(op, "name", str(op)) for op in allowed}
    if "ALL" in names:
        return []
    return [op for op in needs if op not in names]


_PROBE_RACES = FENCED | {"CONCURRENT_TRANSACTIONS"}
"""Executors probing at once share the probe's transactional.id: one fences another."""


def probe_transactional_write(
    who: str, producer_config: Mapping[str, object], topics: Mapping[str, tuple[str, ...]],
    acl_hint: str, *, timeout: float,
) -> None:
    """This principal may write transactionally: ``init_transactions`` on the probe's
    transactional.id (the broker checks Write on it), and the topics allow the operations
    named in ``topics`` (topic -> operations). Writes no record. A refusal is a
    :class:`TargetProblem` naming the missing ACL; ``acl_hint`` is the kafka-acls
    command line that grants it."""
    import socket

    from confluent_kafka import Producer

    bootstrap = str(producer_config["bootstrap.servers"])
    host = socket.gethostname()
    tid = str(producer_config["transactional.id"])
    errors: list[str] = []
    producer = Producer({**producer_config, "error_cb": lambda e: errors.append(e.str())})
    try:
        producer.init_transactions(timeout)
    except Exception as exc:
        err = kafka_error(exc)
        refused = security_refusal(errors, producer)
        if refused is not None:
            raise TargetProblem(who, f"Kafka at {bootstrap} refused: {refused[0]}",
                                refused[1], host=host, kind=Failure.AUTHENTICATION) from None
        if err is not None and "AUTHORIZATION" in err.name():
            raise TargetProblem(
                who, f"Kafka at {bootstrap} refused a transactional write: {err.name()} on "
                f"transactional.id {tid!r}",
                "grant the principal Write and Describe on the transactional ids by prefix "
                f"(kafka-acls.sh --add {acl_hint})", host=host,
                kind=Failure.AUTHORIZATION) from None
        if err is not None and err.name() == "INVALID_TRANSACTION_TIMEOUT":
            _timeout_refused(who, producer_config, timeout)  # names both numbers
        # another process probing the same id at once: the broker accepted it
        if err is None or err.name() not in _PROBE_RACES:
            raise ParticipantError(
                f"{who}: cannot initialise the probe's transactional.id {tid!r} at "
                f"{bootstrap} within {timeout:g}s: {describe_error(exc)}") from None
    finally:
        with warnings.catch_warnings():  # a refused producer's close warns of its abort
            warnings.simplefilter("ignore", RuntimeWarning)
            producer.close()
    admin, _ = _admin(common_config(producer_config))
    for topic, needs in topics.items():
        missing = _missing_topic_ops(admin, topic, needs, timeout)
        if missing:
            raise TargetProblem(
                who, f"Kafka at {bootstrap} does not allow this principal "
                f"{', '.join(missing)} on topic {topic!r}",
                "grant it: " + "; ".join(
                    f"kafka-acls.sh --add --allow-principal User:<you> --operation "
                    f"{op.title()} --topic {topic}" for op in missing),
                host=host, kind=Failure.AUTHORIZATION)
