"""Helpers of the fault tests (servers and networks that fail): one batch driven the way
TransactionalSink drives it, with the task's real code, in this process."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import psycopg
import pyarrow as pa

from twophase import failpoints
from twophase.client.api import CoordinatorClient
from twophase.engine.commit import Committer
from twophase.engine.decide import decide, votes_of
from twophase.engine.plan import PREPARE, BatchPlan, redone_handles
from twophase.engine.task import run_partition
from twophase.errors import TwophaseError
from twophase.participant import Participant
from twophase.protocol import BeginKind, StepKind, next_step

TOKEN = "server-faults-token"
SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.string())])


def rows_for(batch_id: int, n: int, payload: int = 10) -> pa.RecordBatch:
    ids = [batch_id * 1_000_000 + i for i in range(n)]
    return pa.record_batch({"id": ids, "payload": ["x" * payload] * n}, schema=SCHEMA)


def write_batch(client: CoordinatorClient, url: str, sink: str, epoch: int, batch_id: int,
                 parts: tuple[Participant, ...], rows: pa.RecordBatch,
                 max_attempts: int = 10, errors: list[str] | None = None) -> str:
    """What TransactionalSink does for one batch (begin, the task, decide, commit, the
    coordinator's record decides what next), with one partition run by run_partition in
    this process. Returns the final state; task and commit errors are collected in
    ``errors``."""
    aborted = finishing = 0
    committer = Committer(parts)
    try:
        for _ in range(50):
            state = _one_round(client, url, sink, epoch, batch_id, parts, rows, committer,
                               max_attempts, errors, aborted, finishing)
            if isinstance(state, str):
                return state
            aborted, finishing = state
    finally:
        committer.close()
    raise AssertionError("no end after 50 rounds")


def _one_round(client: CoordinatorClient, url: str, sink: str, epoch: int, batch_id: int,
               parts: tuple[Participant, ...], rows: pa.RecordBatch, committer: Committer,
               max_attempts: int, errors: list[str] | None, aborted: int,
               finishing: int) -> str | tuple[int, int]:
    """One begin and what follows it: the final state, or the counters to begin again."""
    res = client.begin(sink, "lin", batch_id, epoch, [p.name for p in parts], 1, 60.0)
    if res.kind == BeginKind.COMMITTED:
        return "COMMITTED"
    txn = res.txn
    assert txn is not None
    plan = BatchPlan(
        key=txn.key, epoch=epoch, partitions=1,
        mode="finish" if res.kind == BeginKind.IN_DOUBT else PREPARE,
        coordinator_url=url, token=TOKEN, participants=parts,
        handles={b: dict(s.handle) for b, s in txn.branches.items() if s.handle},
        ack_earlier=tuple(t.attempt for t in res.recover if t.attempt != txn.attempt),
    )
    job_error, outcomes = "", list[dict[str, object]]()
    try:
        out = run_partition(plan, 0, SCHEMA, [rows])
        outcomes.append(out.as_dict())
        if out.error and errors is not None:
            errors.append(out.error)  # a NO vote, with its reason
    except (TwophaseError, psycopg.Error, OSError) as exc:
        job_error = f"{type(exc).__name__}: {exc}"
        if errors is not None:
            errors.append(job_error)
    # as BatchEngine.run: the driver sends the votes (a finish's record is decided
    # already) and applies the decision, a finish's redone branches from their new handles
    final = decide(client, txn, epoch, votes_of(outcomes), job_error)
    if plan.mode == PREPARE or not job_error:
        final, commit_error = committer.apply(client, epoch, final, redone_handles(outcomes))
        if commit_error and errors is not None:
            errors.append(commit_error)
        job_error = job_error or commit_error
    rule = partial(next_step, max_attempts=max_attempts, backoff=0.2, job_error=job_error)
    step = rule(final, aborted=aborted, finishing=finishing)
    if step.kind == StepKind.ABANDON:
        final = client.abandon(final.key, epoch, step.reason)
        step = rule(final, aborted=aborted, finishing=finishing, abandoned=True)
    if step.kind == StepKind.RETURN:
        return final.state.value
    if step.kind == StepKind.GIVE_UP:
        if final.decision is not None and final.decision.value == "ABORT":
            committer.sweep(final)
        return f"GAVE_UP: {step.reason}"
    time.sleep(max(step.delay, 0.5))
    return step.aborted, step.finishing


def wait_fired(once_dir: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not failpoints.fired(str(once_dir)):
        assert time.monotonic() < deadline, "the failpoint was never reached"
        time.sleep(0.05)


def table_ids(dsn: str, table: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [r[0] for r in c.execute(f'SELECT id FROM "{table}" ORDER BY id')]


def prepared_gids(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts")]


