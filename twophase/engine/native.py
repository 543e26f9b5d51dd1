"""The native data path: Spark's own writer prepares the branches of participants that
take files Spark wrote (``twophase.participant.SparkWritten``), so none of their rows
crosses into Python; twophase only commits them (docs/decisions.md, 2026-11-26).

Per attempt, on the driver, in place of those participants' share of the prepare job:

1. settle what earlier attempts left (the tasks' recovery rule, here: abort by name,
   acknowledge the attempts waiting for it);
2. ``df.write.format(fmt).save(participant.native_location(key))``: one Spark task per
   branch partition (the batch split as the Python path splits it), timestamps as
   Parquet ``TIMESTAMP_MICROS`` (what pyarrow writes, not Spark's default INT96), one
   file per task (and partition value: ``native_partition_by``, over the participant's
   derived ``native_columns`` when it has some);
3. ``participant.adopt(key, P)``: the files become the staged branches, by name;
4. the votes go back as the Python tasks' do (one outcome per partition), and the driver
   decides and commits as for any other batch.

A driver killed during 2 or 3 leaves the attempt's write folder, named by the attempt:
``status`` reads it as PREPARED, so the next attempt's settle step, the give-up sweep and
``twophase resolve`` abort it. A finish (a restart found COMMIT decided) commits the
staged branches from their votes' handles on the driver, as for any sink
(``twophase.engine.commit``, once ``twophase.engine.recover`` found none lost).

Which path (``split_native``): automatic, native for every participant when all of them
take Spark's files; beside Python participants only for those that ask
(``native_preferred``), because there the rows cross into Python anyway and the Python
path was measured faster (``bench/persist.py``: native beside PostgreSQL at 0.45-0.80
of the Python path's rows/s, 10k-1M rows per batch). Persist policy: with one consumer
(the Python job alone, or one native write) nothing is cached; with more, the split
batch is persisted (``MEMORY_AND_DISK``) for the attempt and unpersisted after it, so
every participant gets the same rows from one computation (recomputing was measured
faster on a plain file read, but a plan with ``rand()`` or ``uuid()`` would hand each
consumer other rows); ``PrepareJob.persist`` overrides it for the bench
(docs/decisions.md, 2026-11-26, "the persist policy measured").
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from twophase import failpoints
from twophase.client.wire import VoteIn, votes_body
from twophase.engine.plan import BatchPlan, BranchOutcome
from twophase.engine.recover import settle_all_earlier
from twophase.engine.report import short_error
from twophase.participant import (
    EMPTY_BRANCH,
    Handle,
    Participant,
    SparkWritten,
    native_eligible,
)
from twophase.protocol import branch_id

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client.api import CoordinatorClient

__all__ = ["TIMESTAMP_CONF", "NativePrepare", "split_native"]

TIMESTAMP_CONF: Final = "spark.sql.parquet.outputTimestampType"
"""Set to ``TIMESTAMP_MICROS`` during a native write (restored after): Spark's default,
INT96, is deprecated in Parquet and read by pyarrow as nanoseconds; pyarrow's files, the
Python path's, hold microseconds with the UTC flag, and so do these."""

_WRITE_OPTIONS: Final = {
    "compression": "snappy",  # pyarrow's default, the Python path's
    "maxRecordsPerFile": "0",  # one file per task (and partition value)
    # no _SUCCESS file in the write folder (a Hadoop option passed through the writer)
    "mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
}


def split_native(participants: Sequence[Participant]
                 ) -> tuple[tuple[Participant, ...], tuple[Participant, ...]]:
    """(native, Python) participants of a sink. Automatic: every participant goes native
    when all of them take files Spark wrote (the batch is then read by Spark's writers
    alone); in a sink with Python participants too, only those that ask for it
    (``native_preferred``: the batch is then persisted for both), since the rows reach
    Python anyway and a second job over them was measured slower."""
    native = tuple(p for p in participants if native_eligible(p))
    if len(native) < len(participants):
        native = tuple(p for p in native if isinstance(p, SparkWritten)
                       and p.native_preferred())
    return native, tuple(p for p in participants if p not in native)


@contextmanager
def _micros(spark: Any) -> Iterator[None]:
    conf = spark.conf
    before = conf.get(TIMESTAMP_CONF, None)
    conf.set(TIMESTAMP_CONF, "TIMESTAMP_MICROS")
    try:
        yield
    finally:
        if before is None:
            conf.unset(TIMESTAMP_CONF)
        else:
            conf.set(TIMESTAMP_CONF, before)


class NativePrepare:
    """The native participants' prepare of one attempt, from the driver."""

    def __init__(self, participants: Sequence[Participant]) -> None:
        self.participants = tuple(participants)

    def run(self, split: DataFrame, plan: BatchPlan, client: CoordinatorClient,
            *, count_rows: bool = True) -> tuple[list[dict[str, Any]], str]:
        """Write, adopt and hand back the votes as one outcome per partition (rows
        counted when ``count_rows``: no Python job counts them). Returns the outcomes and
        the write's error ("" when none; the votes are then missing and the driver
        abandons the attempt)."""
        t0 = time.perf_counter()
        recovered = settle_all_earlier(self.participants, plan, client)
        handles: dict[str, dict[int, Handle]] = {}
        try:
            with _micros(split.sparkSession):
                for part in self.participants:
                    assert isinstance(part, SparkWritten)
                    fmt = part.native_format()
                    assert fmt is not None
                    failpoints.hit("before_prepare", part.name)
                    extra = part.native_columns()  # derived columns to partition by
                    frame = split.selectExpr("*", *(f"{e} AS `{n}`" for n, e in extra.items())
                                             ) if extra else split
                    writer = (frame.write.mode("overwrite").format(fmt)
                              .options(**{**_WRITE_OPTIONS, **part.native_options()}))
                    by = list(part.native_partition_by())
                    if by:  # Hive-style folders: one file per task and value
                        writer = writer.partitionBy(*by)
                    writer.save(part.native_location(plan.key))
                    # written, not adopted: a kill here leaves the write folder
                    failpoints.hit("after_prepare", part.name)
            for part in self.participants:
                assert isinstance(part, SparkWritten)
                handles[part.name] = part.adopt(plan.key, plan.partitions)
        except Exception as exc:  # the coordinator's record decides what comes next
            return [], short_error(exc)
        took = time.perf_counter() - t0
        outcomes = []
        for p in range(plan.partitions):
            out = BranchOutcome(partition=p, prepare_s=took, task_s=took,
                                recovered=recovered if p == 0 else 0)
            votes = []
            for part in self.participants:
                handle = handles[part.name].get(p, EMPTY_BRANCH)
                rows = int(handle.get("rows", "0"))
                if count_rows:
                    out.rows = max(out.rows, rows)
                votes.append(VoteIn(branch=branch_id(part.name, p), yes=True,
                                    handle={**handle, "split": plan.split},
                                    metrics={"prepare_s": took, "rows": rows}))
            out.votes = json.dumps(votes_body(plan.epoch, votes)["votes"])
            outcomes.append(out.as_dict())
        return outcomes, ""
