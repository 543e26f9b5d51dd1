"""What one task does for one partition of one micro-batch: its branches' share of 2PC.

This runs on a Spark executor (inside ``mapInArrow``), but nothing here imports Spark:
tests drive it directly with real participants and a real coordinator. One task owns
the branches ``(participant, p)`` of every participant for its partition ``p``:

1. settle what earlier attempts of this checkpoint left prepared (recovery rule);
2. ``prepare`` (a new attempt, ``twophase.engine.feed.prepare_partition``): prepare
   every branch and end, the votes going back with the job's result; the driver sends
   them (``twophase.engine.decide``) and applies the decision
   (``twophase.engine.commit``). Every participant's prepare outlives the task
   (``Participant`` refuses one that does not), so no task waits for the decision;
   ``finish`` (``twophase.engine.finish.redo_lost``): COMMIT is already decided, so
   write again what is lost (Kafka) and hand the new handles back; the driver commits
   every branch, as for a new attempt. No task commits or acknowledges anything.

A vote names the Spark task attempt that cast it (``run_partition``'s ``task``): when
Spark runs a task again (its executor died, or a speculative copy) the first vote of the
branch is the one that counts (the protocol's vote table).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from twophase.engine.feed import prepare_partition
from twophase.engine.finish import redo_lost, settle_earlier
from twophase.engine.plan import FINISH, BatchPlan, BranchOutcome

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.client.api import CoordinatorClient

__all__ = ["run_partition"]


def _settle_earlier(
    plan: BatchPlan, partition: int, client: CoordinatorClient, out: BranchOutcome
) -> None:
    """The recovery rule for earlier attempts' branches of this partition
    (:func:`~twophase.engine.finish.settle_earlier`), acknowledged to the attempts still
    waiting."""
    for attempt in range(1, plan.key.attempt):
        acks, aborted = settle_earlier(plan, plan.participants, partition, attempt)
        out.recovered += aborted
        if attempt in plan.ack_earlier:  # the answer is not read: brief
            client.ack(plan.key._replace(attempt=attempt), plan.epoch, acks, brief=True)


def run_partition(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    client: CoordinatorClient | None = None,
    task: str | None = None,
) -> BranchOutcome:
    """Run this partition's branches of one attempt to the end (see module docstring);
    ``task`` names the Spark task attempt running it (its votes carry it).

    A new attempt streams the partition's rows into every participant as Spark hands
    them over (``twophase.engine.feed``); only a finish, which may redo a lost branch
    and must check the replay's digest first, holds them.
    """
    started = time.perf_counter()
    cl = client or _shared_client(plan.coordinator_url, plan.token, plan.retry_budget,
                                  plan.ca_pem, plan.token_file)
    out = BranchOutcome(partition=partition)
    try:
        _settle_earlier(plan, partition, cl, out)
        if plan.mode == FINISH:
            rows = list(batches)  # a redo is rare and must check the replay first
            out.rows = sum(b.num_rows for b in rows)
            redo_lost(plan, partition, schema, rows, out)
        else:
            prepare_partition(plan, partition, schema, iter(batches), out, task)
    finally:
        for part in plan.participants:
            part.close()
        out.task_s = time.perf_counter() - started
    return out


_CLIENTS: dict[tuple[str, str | None, float, str | None, str | None], CoordinatorClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _shared_client(
    url: str, token: str | None, retry_budget: float, ca_pem: str | None,
    token_file: str | None = None,
) -> CoordinatorClient:
    """One client per coordinator in this process: Spark reuses its Python workers across
    tasks and batches, so a task finds the connection pool of the one before it instead
    of building a client and opening connections (the client is thread-safe)."""
    from twophase.client.api import CoordinatorClient, pinned

    key = (url, token, retry_budget, ca_pem, token_file)
    with _CLIENTS_LOCK:
        cl = _CLIENTS.get(key)
        if cl is None:
            # the token file only where this host has it (a mounted secret); else the
            # plan's token alone, which the driver renews each batch
            usable = token_file if token_file and os.path.isfile(token_file) else None
            cl = _CLIENTS[key] = CoordinatorClient(
                url, token, token_file=usable, verify=pinned(ca_pem),
                retry_budget=retry_budget)
        return cl
