"""What travels between the driver and its tasks: the plan a task runs (``BatchPlan``,
pickled into the task's function, its batch part in a job property) and the outcome it
returns (``BranchOutcome``, one row of the job's result), with the driver's readers of
those outcomes, and the rule that fixes how every batch of a sink is split. Nothing here
runs a protocol step."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from twophase.errors import InvalidRequest
from twophase.participant import (
    BranchRef,
    Handle,
    Participant,
    ParticipantError,
    descriptor_of,
)
from twophase.protocol import TxnKey

__all__ = ["EMPTY_SPLIT", "FINISH", "INPUT_SPLIT", "PLAN_PROPERTY", "PREPARE", "BatchPlan",
           "BranchOutcome", "descriptors", "fixed_split", "plan_from_property", "plan_property",
           "redone_handles", "split_of", "split_rule"]

PREPARE: Final = "prepare"
"""The plan's mode when every participant's prepare is durable: tasks prepare and hand
their votes back with the job's result; the driver sends them and commits (no task waits
for the decision, no barrier stage)."""

FINISH: Final = "finish"
"""The plan's mode when a restart found the attempt in doubt with COMMIT decided: tasks
only write again what was lost and hand the new handles back; the driver commits."""

INPUT_SPLIT = "input"
"""The batch's partitions as Spark read them (the other split is "hash", of every column)."""

EMPTY_SPLIT: Final = "none"
"""A new attempt of a batch Spark planned with no partition at all (an empty relation):
no Spark job runs, the driver votes every branch empty (``twophase.engine.recover``)."""


def split_of(handle: Mapping[str, str]) -> str:
    """How the partition behind a vote was split (votes from before this was recorded
    were all split by hash)."""
    return handle.get("split", "hash")


@dataclass(frozen=True)
class BatchPlan:
    """Everything a task needs, shipped from the driver (must pickle)."""

    key: TxnKey  # the attempt this task runs
    epoch: int
    partitions: int
    mode: str  # PREPARE a new attempt, or FINISH one whose decision is COMMIT
    coordinator_url: str
    token: str | None = field(repr=False)  # never in logs or Spark's task descriptions
    participants: tuple[Participant, ...]
    handles: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # finish mode
    digests: Mapping[str, str] = field(default_factory=dict)  # finish mode: voted digests
    acked: tuple[str, ...] = ()  # finish mode: branches acknowledged already (force-ack)
    ack_earlier: tuple[int, ...] = ()  # earlier attempts still waiting for abort acks
    ca_pem: str | None = field(default=None, repr=False)  # an embedded coordinator's TLS cert
    split: str = "hash"  # how the driver split the batch: "hash", INPUT_SPLIT or EMPTY_SPLIT
    retry_budget: float = 120.0  # seconds a coordinator may stay unreachable (sink option)
    token_file: str | None = None  # re-read after a 401 where readable (a rotated token)

    def ref(
        self, participant: Participant, partition: int, attempt: int | None = None
    ) -> BranchRef:
        key = self.key if attempt is None else self.key._replace(attempt=attempt)
        return BranchRef(*key, participant=participant.name, partition=partition)


@dataclass
class BranchOutcome:
    """What a task reports back to the driver (one per partition)."""

    partition: int
    rows: int = 0
    recovered: int = 0  # leftovers of earlier attempts aborted
    redone: int = 0  # lost branches written again under a COMMIT decision
    prepare_s: float = 0.0  # first row asked of Spark -> every participant prepared
    task_s: float = 0.0  # the whole of run_partition: the job's time minus this is Spark's
    error: str = ""
    redone_handles: str = ""  # finish mode: {branch id: handle} of branches redone (JSON)
    votes: str = ""  # prepare mode: this task's votes as the wire's vote bodies (JSON list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


PLAN_PROPERTY: Final = "twophase.batch.plan"  # the Spark job's local property: see below


def plan_property(plan: BatchPlan) -> str:
    """The batch's part of ``plan`` as JSON, for ``PLAN_PROPERTY``: the driver plans the
    job's DataFrame once, before it knows the batch's attempt, so the task reads the
    attempt from the job. Only what names the batch: participants, coordinator and token
    stay in the task's function (Spark's event log records job properties)."""
    return json.dumps({
        "key": list(plan.key), "epoch": plan.epoch, "partitions": plan.partitions,
        "mode": plan.mode, "handles": plan.handles, "digests": plan.digests,
        "acked": list(plan.acked), "ack_earlier": list(plan.ack_earlier), "split": plan.split,
    })


def plan_from_property(template: BatchPlan, value: str | None) -> BatchPlan:
    """``template`` (the sink's fixed part) with the batch read from ``plan_property``."""
    if not value:
        raise ParticipantError(
            f"the task found no {PLAN_PROPERTY} property on its job: the sink's job was "
            "started without it (a twophase bug: please report it)")
    d = json.loads(value)
    return replace(template, key=TxnKey(*d["key"]), epoch=d["epoch"],
                   partitions=d["partitions"], mode=d["mode"], handles=d["handles"],
                   digests=d["digests"], acked=tuple(d["acked"]),
                   ack_earlier=tuple(d["ack_earlier"]),
                   split=d["split"])


def redone_handles(outcomes: Iterable[Mapping[str, Any]]) -> dict[str, Handle]:
    """The handles of the branches a finish's tasks redid (branch id -> handle): the
    driver commits those instead of the lost ones the coordinator recorded."""
    out: dict[str, Handle] = {}
    for o in outcomes:
        out.update(json.loads(o.get("redone_handles") or "{}"))
    return out


def split_rule(participants: Sequence[Participant]) -> tuple[tuple[str, ...], bool]:
    """How every batch is split: (hash columns, one partition only).

    No column asked for: hash by every column (stable, so a replay splits alike).
    Participants asking for key columns get the columns all of them share (the first
    one's order): equal keys of each then meet in one branch. Nothing shared, or a
    participant that needs the whole batch, means a single partition."""
    single = any(p.single_branch() for p in participants)
    asks = [tuple(c) for p in participants if (c := p.partition_columns()) is not None]
    if single or not asks:
        return (), single
    shared = [c for c in asks[0] if all(c in a for a in asks[1:])]
    return tuple(shared), not shared


def fixed_split(
    sink: str, participants: Sequence[Participant], partitions: int | None
) -> tuple[tuple[str, ...], bool, int | None]:
    """``split_rule`` with the sink's ``partitions=``: (hash columns, one branch only,
    partitions). One branch only refuses any other partition count, saying why."""
    columns, single = split_rule(participants)
    if not single:
        return columns, False, partitions
    if partitions not in (None, 1):
        whole = [p.describe() for p in participants if p.single_branch()]
        why = (", ".join(whole) + " writes each batch as one branch" if whole else
               "the participants' key columns (partition_columns) share no column, "
               "so only one branch keeps every key in one place")
        raise InvalidRequest(
            f"sink {sink!r}: partitions={partitions} but {why}; leave partitions unset (or 1)"
        )
    return columns, True, 1


def descriptors(parts: Sequence[Participant]) -> Any:
    """What the coordinator records so ``twophase resolve`` can rebuild the participants."""
    return [d for d in map(descriptor_of, parts) if d]
