"""The batch's Spark job (the protocol's "prepare" step, run from the driver): one task
per partition runs ``twophase.engine.task.run_partition`` over its rows; the job's result is
one ``BranchOutcome`` row per task: ordinary tasks, each ending with its votes (every
participant's prepare outlives its task).

The job's DataFrame is planned once per batch before the attempt is known
(``frame``): the batch's part of the plan reaches the tasks as a job property
(``PLAN_PROPERTY``), the fixed part (participants, coordinator, token: never in a
property, which Spark's event log records) inside the task's function.

Participants that take files Spark wrote prepare on the native data path instead
(``twophase.engine.native``): Spark's own writer, no row through Python; the Python job then
runs only for the others, over the same split batch (persisted when both read it)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twophase.engine.native import NativePrepare, split_native
from twophase.engine.plan import (
    EMPTY_SPLIT,
    FINISH,
    INPUT_SPLIT,
    PLAN_PROPERTY,
    PREPARE,
    BatchPlan,
    plan_from_property,
    plan_property,
    split_of,
)
from twophase.engine.recover import finish_from_votes, vote_empty
from twophase.engine.report import REPORT_SCHEMA, report_struct, short_error
from twophase.engine.task import run_partition
from twophase.protocol import BeginKind, TxnKey
from twophase.spark.compat import ArrowMap

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client.api import CoordinatorClient
    from twophase.participant import Participant
    from twophase.protocol import Transaction
    from twophase.spark.session import SparkBatch

__all__ = ["PrepareJob"]


class PrepareJob:
    """Builds and launches each batch's job for one sink. ``template`` (the plan's fixed
    part) is set once the driver has connected and registered its epoch."""

    def __init__(self, participants: Sequence[Participant], split_columns: Sequence[str],
                 one_branch: bool) -> None:
        self.participants = tuple(participants)
        self.split_columns = tuple(split_columns)
        self.one_branch = one_branch
        self.template: BatchPlan | None = None
        # the native data path's participants, and the Python job's of a new attempt
        self.native, self.python = split_native(self.participants)
        self._native = NativePrepare(self.native) if self.native else None
        # the persist policy (None): persist when two consumers read the split batch;
        # False recomputes it per consumer (bench/persist.py measures what that costs)
        self.persist: bool | None = None
        self._python: BatchPlan | None = None  # the template of the Python job beside it
        self._checked_schema: Any = None
        # the task's function per template, pickled once: (template, Arrow schema, map)
        self._maps: dict[int, tuple[BatchPlan, Any, ArrowMap]] = {}

    def fixed_part(self, *, epoch: int, coordinator_url: str, token: str | None,
                   ca_pem: str | None, retry_budget: float,
                   token_file: str | None = None) -> None:
        """What every batch's plan shares (``plan`` fills in the batch)."""
        self.template = BatchPlan(
            key=TxnKey("", "", 0, 0), epoch=epoch, partitions=0, mode=PREPARE,
            coordinator_url=coordinator_url, token=token, participants=self.participants,
            ca_pem=ca_pem,
            retry_budget=retry_budget, token_file=token_file,
        )
        self._python = dataclasses.replace(self.template, participants=self.python)

    def forget(self) -> None:
        """The sink closed: no template, no function kept for the next batches."""
        self.template = self._python = None
        self._maps.clear()

    def _renew_token(self, token: str | None) -> None:
        """The driver's client re-read a rotated token: the next tasks carry it."""
        if self.template is not None and self.template.token != token:
            self.template = dataclasses.replace(self.template, token=token)
            self._python = dataclasses.replace(self.template, participants=self.python)

    def check(self, schema: Any) -> None:
        """Each participant checks its target against the batch's Arrow ``schema`` once,
        before writing."""
        if self._checked_schema is schema:
            return
        if self._checked_schema is not None and self._checked_schema.equals(schema):
            return
        for p in self.participants:
            p.check(schema)
        self._checked_schema = schema

    def _mapped(self, df: DataFrame, base: BatchPlan, batch_schema: Any) -> DataFrame:
        """``df`` mapped by the task over ``base`` (reading its batch from the job
        property), with the task's function pickled once while ``base`` and the schema
        stay (``ArrowMap``): a new token, epoch or schema makes a new one."""
        kept = self._maps.get(id(base))
        if kept is None or kept[0] is not base or not kept[1].equals(batch_schema):
            kept = (base, batch_schema, ArrowMap(self._task(None, batch_schema, base),
                                                 report_struct()))
            self._maps = {k: v for k, v in self._maps.items()
                          if v[0] is self.template or v[0] is self._python}
            self._maps[id(base)] = kept
        mapped: DataFrame = kept[2](df)
        return mapped

    def plan(self, kind: BeginKind, txn: Transaction, recover: tuple[Transaction, ...],
             n_in: int | None, token: str | None) -> BatchPlan:
        """The plan of this attempt: its mode, and for a finish the votes to honour.
        ``token``: the driver's client's, as its begin left it (a rotated token file is
        re-read on a refusal): this attempt's tasks and the next batches' carry it."""
        self._renew_token(token)
        assert self.template is not None
        handles = {b: dict(s.handle) for b, s in txn.branches.items() if s.handle}
        digests = {b: s.digest for b, s in txn.branches.items() if s.digest}
        # Spark's own split only where it has txn.partitions tasks; a finish redoes lost
        # branches, so it must split as the votes did (they say how).
        split = INPUT_SPLIT if n_in == txn.partitions else "hash"
        if n_in == 0 and kind == BeginKind.NEW:
            split = EMPTY_SPLIT  # no partition to run a task on: the driver votes
        if kind == BeginKind.IN_DOUBT and any(split_of(h) != split for h in handles.values()):
            split = "hash"  # cannot split as voted: a branch needing a redo refuses it
        return dataclasses.replace(
            self.template,
            key=txn.key,
            partitions=txn.partitions,
            mode=FINISH if kind == BeginKind.IN_DOUBT else PREPARE,
            handles=handles,
            digests=digests,
            acked=tuple(b for b, s in txn.branches.items() if s.ack is not None),
            ack_earlier=tuple(t.attempt for t in recover if t.attempt != txn.attempt),
            split=split,
        )

    def frame(self, df: DataFrame, spark: SparkBatch) -> DataFrame | None:
        """``df`` mapped by the sink's task, the plan left to the job property, when this
        batch may run on Spark's own split; None before the sink connected, under
        Spark Connect (no local properties) and when the sink always shuffles."""
        if (self.template is None or self.split_columns or self.one_branch
                or spark.jvm is None or self.native):
            return None  # the native path splits the batch itself (``launch``)
        return self._mapped(df, self.template, spark.schema)

    def _split(self, df: DataFrame, plan: BatchPlan) -> DataFrame:
        """The batch in the plan's partitions."""
        cols = list(self.split_columns or df.columns)
        if plan.split == INPUT_SPLIT and not self.split_columns and not self.one_branch:
            return df  # Spark's split is the same on replay: no shuffle
        if cols:
            return df.repartition(plan.partitions, *cols)
        return df.repartition(plan.partitions)

    def launch(self, df: DataFrame, plan: BatchPlan, spark: SparkBatch,
               direct: DataFrame | None = None,
               client: CoordinatorClient | None = None) -> tuple[list[dict[str, Any]], str]:
        """One task per partition; returns the tasks' outcomes and the job's error.
        ``direct`` (``frame``) is run as planned when the plan keeps Spark's split. A new
        attempt of a sink with native participants writes theirs with Spark's writer
        (``client`` settles earlier attempts) and runs the Python job for the rest. A
        finish runs tasks only when a branch needs its rows again (``finish_from_votes``):
        they redo it, and the driver commits every branch either way."""
        if plan.mode == FINISH and client is not None:
            finished = finish_from_votes(self.participants, df, plan, client)
            if finished is not None:  # else a branch needs its rows: the tasks' redo
                return finished, ""
        if plan.split == EMPTY_SPLIT and client is not None:
            return vote_empty(self.participants, plan, client), ""
        if self._native is None or plan.mode != PREPARE or client is None:
            return self._run_python(df, plan, spark, direct, None)
        from pyspark import StorageLevel

        split = self._split(df, plan)
        persisted = (len(self.native) + bool(self.python) > 1  # the persist policy
                     if self.persist is None else self.persist)
        if persisted:
            split = split.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            outcomes: list[dict[str, Any]] = []
            error = ""
            if self.python:
                assert self._python is not None
                outcomes, error = self._run_python(split, plan, spark, None, self._python)
            if not error:
                native, error = self._native.run(split, plan, client,
                                                 count_rows=not self.python)
                outcomes += native
            return outcomes, error
        finally:
            if persisted:
                split.unpersist()

    def _run_python(self, df: DataFrame, plan: BatchPlan, spark: SparkBatch,
                    direct: DataFrame | None, template: BatchPlan | None
                    ) -> tuple[list[dict[str, Any]], str]:
        """The Python job (``template``: its participants, default the sink's)."""
        sc, batch_schema = spark.jvm, spark.schema
        if sc is None:  # Spark Connect: no job property, the plan in the function
            fixed = plan if template is None else dataclasses.replace(
                plan, participants=self.python)
            job = (df if template is not None else self._split(df, plan)).mapInArrow(
                self._task(fixed, batch_schema), report_struct())
        elif template is not None:  # the Python participants beside native ones, split
            job = self._mapped(df, template, batch_schema)
        elif plan.split == INPUT_SPLIT and direct is not None:
            job = direct
        else:
            assert self.template is not None
            job = self._mapped(self._split(df, plan), self.template, batch_schema)
        if sc is not None:
            sc.setLocalProperty(PLAN_PROPERTY, plan_property(plan))
        try:
            rows = job.collect()
        except Exception as exc:  # the job failed: the coordinator's record decides what next
            return [], short_error(exc)
        finally:
            if sc is not None:
                sc.setLocalProperty(PLAN_PROPERTY, None)
        return [r.asDict() for r in rows], ""

    def _task(self, fixed: BatchPlan | None, batch_schema: Any,
              base: BatchPlan | None = None) -> Callable[[Any], Any]:
        """The task's function. With ``fixed`` it runs that plan; without, it reads the
        batch's plan from the job property over ``base`` (default: the template)."""
        import pyarrow as pa

        template = fixed or base or self.template
        assert template is not None
        report_schema = pa.schema(
            [(name, pa.string() if kind == "string" else pa.float64() if kind == "double"
              else pa.int64())
             for name, kind in (f.strip().split() for f in REPORT_SCHEMA.split(","))]
        )

        def task(batches: Any) -> Any:
            from pyspark import TaskContext

            entered = time.perf_counter()
            ctx = TaskContext.get()
            assert ctx is not None, "a Spark task always has its context"
            partition = ctx.partitionId()
            # unique in the application: a retried or speculative copy has its own
            attempt = f"{ctx.stageId()}/{ctx.taskAttemptId()}"
            plan = template if fixed is not None else plan_from_property(
                template, ctx.getLocalProperty(PLAN_PROPERTY))
            it = iter(batches)
            first = next(it, None)
            before = time.perf_counter() - entered  # Spark's first rows: the task's too
            if first is None:
                out = run_partition(plan, partition, batch_schema, iter(()), task=attempt)
            else:  # the rows stream on to the participants, never held here
                out = run_partition(plan, partition, first.schema,
                                    itertools.chain([first], it), task=attempt)
            out.task_s += before
            out.prepare_s += before
            yield pa.RecordBatch.from_pylist([out.as_dict()], schema=report_schema)

        return task
