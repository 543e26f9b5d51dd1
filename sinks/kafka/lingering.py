"""Open Kafka transactions a crash left behind, found and aborted through the brokers.

Why: a Kafka branch's transaction lives in its producer; when the process dies between
prepare and commit, the transaction stays open on the broker until
``transaction.timeout.ms`` (600 s by default here), and every ``read_committed`` consumer
of its partitions stops at the last stable offset until then. The next batch's
``init_transactions`` on the same transactional.id aborts it, but a sink that is not
restarted (or a partition no later batch writes) leaves it stalling readers. This finds
the sink's open transactions with the AdminClient (ListTransactions and
DescribeTransactions, Kafka 3.0+, through kafka-python: librdkafka's client has no such
call) and aborts them the way Kafka itself would, by fencing the transactional.id
(``init_transactions``): the broker writes the ABORT markers.

Aborting is always safe under the protocol: a Kafka prepare is not durable, so a branch
whose transaction was open is redone under a COMMIT decision, never committed by another
process (that would need KIP-939).

At sink start (the driver, before its first batch) the same cleanup runs, sparing what
the coordinator holds as COMMIT-decided and not yet acknowledged (:func:`committing_ids`):
such a transaction may belong to a task of another run that is committing it now, and
aborting it would only force a redo (docs/decisions.md, "lingering transactions at start").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from twophase.errors import ParticipantError
from twophase.participant import BranchRef, SinkDecisions
from twophase.protocol import parse_branch_id

COMMIT_LANE = "commit."
"""What follows ``twophase.<sink>.<participant>.`` in a staged copy's transactional id
(``p`` and the branch's partition follow, :func:`.lanes.copy_id`)."""

__all__ = ["COMMIT_LANE", "OpenTransaction", "admin_client", "committing_ids",
           "list_open_transactions"]


def committing_ids(decisions: SinkDecisions, sink: str, participant: str,
                   transactional_id: Callable[[BranchRef], str]) -> set[str]:
    """The transactional ids of ``participant``'s branches that the coordinator holds in
    a COMMIT-decided batch of ``sink`` not yet acknowledged: the ones a starting sink
    must not abort."""
    out: set[str] = set()
    for txn in decisions.committing(sink):
        for bid, st in txn.branches.items():
            name, partition = parse_branch_id(bid)
            if name == participant and st.ack is None:
                out.add(transactional_id(BranchRef(*txn.key, name, partition)))
                voted = (st.handle or {}).get("transactional_id")
                if voted:  # a resumable branch's pool id is in its vote
                    out.add(str(voted))
    return out

# librdkafka setting -> kafka-python argument: the connection and security settings a
# participant's config may carry
_KAFKA_PYTHON = {
    "security.protocol": "security_protocol",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
}


@dataclass(frozen=True)
class OpenTransaction:
    """A transaction still open (``Ongoing``) on its coordinator."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    age_s: float  # since the broker began it
    partitions: tuple[str, ...]  # "topic-partition", sorted


def _numbered(rest: str) -> bool:
    """``N`` (a branch id of the in-task prepare, retired in 0.4), ``commit.pN`` (a
    staged copy of partition N's branch), ``commit.N`` (a staged copy lane of releases before the
    per-branch copy ids,
    still cleared) or ``wN.K`` (a resumable prepare's pool id: partition N, slot K)."""
    lane = rest[len(COMMIT_LANE):] if rest.startswith(COMMIT_LANE) else None
    part, _, slot = rest.removeprefix("w").partition(".")
    return rest.isdigit() or (lane is not None and lane.removeprefix("p").isdigit()) or (
        rest.startswith("w") and part.isdigit() and slot.isdigit())


def admin_client(who: str, config: Mapping[str, object], timeout: float) -> Any:
    """A kafka-python admin client with the participant's connection settings."""
    from kafka.admin import KafkaAdminClient

    bootstrap = str(config["bootstrap.servers"])
    kwargs: dict[str, Any] = {
        "bootstrap_servers": bootstrap.split(","),
        "request_timeout_ms": int(timeout * 1000),
        "bootstrap_timeout_ms": int(timeout * 1000),  # 30 s by default
        "client_id": "twophase-lingering",
    }
    kwargs.update({_KAFKA_PYTHON[k]: v for k, v in config.items() if k in _KAFKA_PYTHON})
    try:
        return KafkaAdminClient(**kwargs)
    except Exception as exc:
        raise ParticipantError(f"{who}: cannot reach Kafka at {bootstrap} to list open "
                               f"transactions: {type(exc).__name__}: {exc}") from exc


def list_open_transactions(
    who: str, config: Mapping[str, object], prefix: str, timeout: float,
    admin: Any | None = None,
) -> list[OpenTransaction]:
    """Every ``Ongoing`` transaction whose transactional.id is ``prefix`` followed by a
    partition number (a branch of the in-task prepare, retired in 0.4) or by ``commit.``
    and a lane number (a staged copy's, :mod:`~twophase.sinks.kafka.staged`), oldest first.
    ``admin``: a client of
    :func:`admin_client` kept by the caller (else one is made and closed here)."""
    bootstrap = str(config["bootstrap.servers"])
    own = admin is None
    if admin is None:
        admin = admin_client(who, config, timeout)
    try:
        listed = admin.list_transactions(state_filters=["Ongoing"])
        ids = sorted(t.transactional_id for per_broker in listed.values() for t in per_broker
                     if t.transactional_id.startswith(prefix)
                     and _numbered(t.transactional_id[len(prefix):]))
        described: dict[str, Any] = {}
        for tid in ids:  # one by one: one that ended meanwhile is not found, the rest are
            try:
                described.update(admin.describe_transactions([tid]))
            except Exception as exc:
                if type(exc).__name__ != "TransactionalIdNotFoundError":
                    raise
    except Exception as exc:
        raise ParticipantError(
            f"{who}: cannot list open transactions at {bootstrap}: {type(exc).__name__}: "
            f"{exc} (the principal needs Describe on the cluster and on the transactional "
            "ids twophase.<sink>.*)") from exc
    finally:
        if own:
            admin.close()
    now_ms = time.time() * 1000
    out = [
        OpenTransaction(
            tid, int(d.producer_id), int(d.producer_epoch),
            max(0.0, (now_ms - d.transaction_start_time_ms) / 1000),
            tuple(sorted(f"{tp.topic}-{tp.partition}" for tp in d.topic_partitions)))
        for tid, d in described.items() if getattr(d.state, "value", d.state) == "Ongoing"
    ]
    return sorted(out, key=lambda t: -t.age_s)
