"""The driver finishes an attempt a restart found in doubt (COMMIT decided, not every
branch acknowledged), with no Spark task: the protocol's commit step for a recovery.

Every participant of a barrier-free sink prepares durably, so a branch under COMMIT is
committed from its vote's handle, by name, and needs none of its rows: PostgreSQL's
``COMMIT PREPARED``, a rename, a multipart completion, a staged Kafka branch's copy, a
table's adoption. Only a branch whose prepared state is gone (ABSENT: a staged Kafka
branch whose records left with the staging topic's retention, or a branch never voted)
must be written again from the replayed rows, and a redo is the tasks' ``finish``
(``twophase.finish``, digest-checked). So :func:`finish_on_driver` first asks every
branch's state; when one needs its rows it changes nothing but earlier attempts'
leftovers and returns None, and the caller runs the tasks' finish as before.

Before this, the finish of a sink of Python participants ran a Spark job over the whole
batch to commit what the driver could commit alone (issue 30: the right shape is the
driver's, as Spark's DataSource V2 committer and the native path do). The batch still
runs through Spark's ``noop`` sink (``run_through``): a stateful query commits its state
stores only when the batch's plan runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from twophase.batchplan import BatchPlan, BranchOutcome
from twophase.finish import apply_decision, settle_earlier
from twophase.participant import Handle, Participant, is_empty_branch
from twophase.plan import run_through
from twophase.protocol import Decision, RecoveryAction, branch_id, recovery_action
from twophase.wire import acks_body

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client import CoordinatorClient
    from twophase.participant import BranchRef

__all__ = ["finish_on_driver", "settle_all_earlier"]

log = logging.getLogger("twophase.sink")


def settle_all_earlier(participants: Sequence[Participant], plan: BatchPlan,
                       client: CoordinatorClient) -> int:
    """The recovery rule for earlier attempts, every partition, from the driver (what
    each task does for its own partition): abort what they left PREPARED and acknowledge
    the attempts still waiting. Returns how many branches were aborted."""
    recovered = 0
    for attempt in range(1, plan.key.attempt):
        acks = []
        for p in range(plan.partitions):
            mine, aborted = settle_earlier(plan, participants, p, attempt)
            acks += mine
            recovered += aborted
        if attempt in plan.ack_earlier:
            client.ack(plan.key._replace(attempt=attempt), plan.epoch, acks, brief=True)
    return recovered


def finish_on_driver(participants: Sequence[Participant], df: DataFrame, plan: BatchPlan,
                     client: CoordinatorClient) -> list[dict[str, Any]] | None:
    """COMMIT is decided (``plan.mode`` finish): commit every prepared branch by name
    and hand back the acks as one outcome, which the driver relays. None, having changed
    nothing but earlier attempts' leftovers, when a branch needs its rows again (see the
    module docstring). A table's branches (``commit_scope`` BATCH) are left to the
    driver's batch commit, as the tasks' finish leaves them."""
    t0 = time.perf_counter()
    recovered = settle_all_earlier(participants, plan, client)
    acks: list[tuple[str, Decision]] = []
    todo: list[tuple[Participant, BranchRef, Handle]] = []
    rows = 0
    for part in participants:
        for p in range(plan.partitions):
            ref, bid = plan.ref(part, p), branch_id(part.name, p)
            voted = plan.handles.get(bid)
            if voted is None:
                return None
            if is_empty_branch(voted):
                acks.append((bid, Decision.COMMIT))
                continue
            action = recovery_action(Decision.COMMIT, part.voted_status(ref, voted),
                                     part.commit_scope)
            if action == RecoveryAction.COMMIT:
                todo.append((part, ref, voted))
            elif action == RecoveryAction.COMMIT_BATCH:
                continue  # a table's: the driver commits the batch and acknowledges
            elif action != RecoveryAction.NOTHING:
                log.info("sink %s batch %d: %s partition %d needs its rows again (%s): "
                         "the batch is finished by Spark tasks", plan.key.sink,
                         plan.key.batch_id, part.describe(), p, action.value)
                return None
            acks.append((bid, Decision.COMMIT))
            rows = max(rows, int(voted.get("rows", "0")))
    run_through(df)  # a stateful query commits its state only when the batch runs
    for part, ref, voted in todo:
        apply_decision(part, ref, voted, Decision.COMMIT)
    took = time.perf_counter() - t0
    log.info("sink %s batch %d: finished from the driver: %d branch(es) committed, %d "
             "already, in %.0f ms", plan.key.sink, plan.key.batch_id, len(todo),
             len(acks) - len(todo), took * 1000)
    out = BranchOutcome(partition=0, rows=rows, recovered=recovered, commit_s=took,
                        task_s=took, decision=Decision.COMMIT.value,
                        acks=json.dumps(acks_body(plan.epoch, acks, {})["acks"]))
    return [out.as_dict()]
