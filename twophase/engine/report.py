"""What a batch reports (the protocol's "report" step): ``BatchReport`` and its phases,
the tasks' result schema, the default log line's handler, and the sentence a failed
batch is raised with (the participant's or Spark's own cause first)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from twophase.errors import BatchFailed, TwophaseError, headline

if TYPE_CHECKING:
    from twophase.protocol import Transaction

__all__ = ["BATCH_PHASES", "DRIVER_PHASES", "REPORT_SCHEMA", "TASK_PHASES", "BatchReport",
           "Laps", "batch_phases", "default_logging", "failure", "log_batch",
           "progress_listener", "report_struct", "short_error", "summary"]

log = logging.getLogger("twophase.sink")

REPORT_SCHEMA = (
    "partition long, rows long, recovered long, redone long, "
    "prepare_s double, task_s double, "
    "error string, redone_handles string, votes string"
)


@dataclass
class BatchReport:
    """What happened to one micro-batch (shown by the demo, kept in ``sink.history``)."""

    batch_id: int
    outcome: str  # "committed", "replay", "recovered"
    attempts: int
    rows: int = 0  # the batch's rows (every partition's), as each participant wrote them
    partitions: int = 0
    recovered: int = 0
    redone: int = 0
    seconds: float = 0.0
    # seconds per phase, measured: the driver's (frame_s: the job's DataFrame; split_s:
    # its planning and its split read; setup_s: coordinator, preflight, checks;
    # begin_s; plan_s; job_s: the Spark job, or the driver's votes for an empty
    # relation; decide_s: the tasks' votes sent; driver_commit_s: the decision applied from
    # the driver; driver_s: the rest) and the tasks' (prepare_s, task_s:
    # the slowest task's), so job_s - task_s is Spark's own share of the job
    phases: dict[str, float] = field(default_factory=dict)
    split: str = ""  # "input" (as Spark read it), "hash", or "none" (empty: no job ran)
    sink: str = ""
    txn: str = ""  # sink/lineage/batch/attempt of the deciding attempt ("" for a replay)
    decision: str = ""  # COMMIT for a committed batch; "" for a replay
    # the batch's three protocol phases, the tasks' and the driver's work together
    # (BATCH_PHASES says which measured phases each sums): what the log line shows
    prepare_s: float = 0.0
    wait_s: float = 0.0
    commit_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (a streaming listener's event, a log record's fields)."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}



TASK_PHASES: Final = ("prepare_s", "task_s")
DRIVER_PHASES: Final = ("frame_s", "split_s", "setup_s", "begin_s", "plan_s",
                          "job_s", "decide_s", "driver_commit_s")


BATCH_PHASES: Final = {
    # the tasks' prepare (the slowest task's)
    "prepare_s": ("prepare_s",),
    # votes to decision: the driver sending the tasks' votes, the coordinator deciding
    "wait_s": ("decide_s",),
    # the decision applied by the driver, a finish's too (Kafka's EndTxn or copy,
    # COMMIT PREPARED, the renames, a table's one commit per batch), and its acks
    "commit_s": ("driver_commit_s",),
}
"""Each of ``BatchReport``'s protocol phases as the sum of the measured ``phases``: no
task waits or commits, the driver does, and a phase shown from the tasks alone would
read 0 ms while the driver spent seconds in it."""


def batch_phases(report: BatchReport) -> None:
    """Set ``report``'s ``prepare_s``, ``wait_s`` and ``commit_s`` from its ``phases``."""
    for name, parts in BATCH_PHASES.items():
        setattr(report, name, sum(report.phases.get(k, 0.0) for k in parts))


class Laps:
    """The driver's time per phase of one batch, measured (``BatchReport.phases``): each
    lap adds the time since the previous one to its phase, so a batch that begins again
    sums its attempts."""

    def __init__(self, started: float) -> None:
        self._last = started
        self.taken: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.taken[phase] = self.taken.get(phase, 0.0) + now - self._last
        self._last = now


def report_struct() -> Any:
    """``REPORT_SCHEMA`` as a StructType built here: a DDL string is parsed by the JVM
    on every batch (a py4j round trip, ~1-7 ms)."""
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    kinds = {"string": StringType(), "double": DoubleType(), "long": LongType()}
    return StructType([StructField(name, kinds[kind])
                       for name, kind in (f.strip().split() for f in REPORT_SCHEMA.split(","))])


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr for the ``twophase`` loggers while the application configured no logging of
    its own (then its handlers get the records and this one stays quiet)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


_SHOWN = ("twophase.sink", "twophase.preflight")  # INFO by default: a line per batch


def default_logging(json_logs: bool = False) -> None:
    """A job that never configured ``logging`` still shows a line per batch and every
    warning: a stderr handler on the ``twophase`` logger, and INFO for the sink's own
    loggers unless the application set their level (an embedded coordinator's INFO lines
    stay off). ``json_logs``: one JSON object per line on stderr, as the daemon logs."""
    if json_logs:
        from twophase.logs import setup_logging

        setup_logging("info")
        return
    top = logging.getLogger("twophase")
    if top.handlers:  # ours already, or the application's (e.g. json_logs)
        return
    handler = _DefaultHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    top.addHandler(handler)
    for name in _SHOWN:
        lg = logging.getLogger(name)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.INFO)


def short_error(exc: BaseException) -> str:
    """The first meaningful line of a (possibly huge) Spark/Py4J error: a participant's
    cause-and-fix sentence (:func:`~twophase.errors.headline`) wherever it is, else the
    Python error a task raised, else the JVM's own exception line (Py4J's first line,
    "An error occurred while calling o280.collectToPython.", says nothing), else the
    first line."""
    text = str(exc)
    found = headline(text)
    if found:
        return found[:2000]
    for marker in ("ModuleNotFoundError:", "ImportError:", "InvalidRequest:",
                   "BatchFailed:", "PrepareRefused:", "ParticipantError:", "Error:"):
        idx = text.find(marker)
        if idx >= 0:
            line = text[idx:].splitlines()[0]
            return line[:500]
    jvm = _JVM_CAUSE.search(text)
    if jvm is not None:
        return f"{jvm.group(1)}: {jvm.group(2).strip()}"[:500]
    return (text.splitlines() or [type(exc).__name__])[0][:500]


# A JVM exception line as Py4J prints it: ": org.apache.spark.SparkException: why".
_JVM_CAUSE: Final = re.compile(
    r"^(?::\s*)?(?:[a-z_$][\w$]*\.)+([A-Z][\w$]*(?:Exception|Error)):\s*(.+)$", re.MULTILINE)


def failure(sink: str, batch_id: int, exc: TwophaseError) -> tuple[str, TwophaseError]:
    """The sentence a failed batch is reported with, and the error to raise: the same
    class, its first line that sentence, the original message (attempts, other hosts)
    below it. The participant's cause and fix come first, wherever the task put them."""
    text = str(exc)
    cause = headline(text)
    if cause is None:
        cause = text.splitlines()[0] if text.strip() else type(exc).__name__
        for prefix in (f"sink {sink!r} batch {batch_id}: ", f"sink {sink!r}: "):
            cause = cause.removeprefix(prefix)
    first = f"sink {sink} batch {batch_id} failed: {cause}"
    lines = text.splitlines() or [""]
    rest = text if lines[0] != cause and headline(text) else "\n".join(lines[1:])
    message = first + ("\n" + rest if rest.strip() else "")
    try:
        failed = type(exc)(message)
    except TypeError:  # a class of its own with another constructor
        failed = BatchFailed(message)
    return first, failed


def summary(sink: str, batch_id: int, txn: Transaction,
            outcomes: Sequence[Mapping[str, Any]], recovered: bool) -> BatchReport:
    """The report of a batch that ended with ``txn`` (``recovered``: it finished an
    earlier run's COMMIT), from the tasks' outcomes (the slowest task's phases)."""
    phases = {k: max((float(o[k]) for o in outcomes), default=0.0) for k in TASK_PHASES}
    return BatchReport(
        batch_id=batch_id,
        outcome="recovered" if recovered else "committed",
        attempts=txn.attempt,
        rows=sum(int(o["rows"]) for o in outcomes),
        partitions=txn.partitions,
        recovered=sum(int(o["recovered"]) for o in outcomes),
        redone=sum(int(o["redone"]) for o in outcomes),
        phases=phases,
        sink=sink,
        txn="/".join(str(x) for x in txn.key),
        decision=txn.decision.value if txn.decision is not None else "",
    )


def log_batch(r: BatchReport, participants: Sequence[str]) -> None:
    """One INFO line per committed batch; a WARNING when recovery had work to do."""
    where = f"sink {r.sink} batch {r.batch_id}"
    if r.outcome == "replay":
        log.warning("%s replayed: already committed by an earlier run, nothing written",
                    where, extra={"twophase_batch": r.as_dict()})
        return
    log.info(
        "%s %s: %d rows, %d participants (%s) x %d partitions, attempt %d; "
        "prepare %.0f ms, wait %.0f ms, commit %.0f ms, total %.0f ms",
        where, r.outcome, r.rows, len(participants), ", ".join(participants),
        r.partitions, r.attempts, r.prepare_s * 1000, r.wait_s * 1000, r.commit_s * 1000,
        r.seconds * 1000,
        extra={"twophase_batch": r.as_dict()},  # the report as data, for JSON logs
    )
    if r.outcome == "recovered" or r.recovered or r.redone:
        log.warning(
            "%s recovered from an earlier run: %s; %d branch(es) of aborted attempts "
            "rolled back, %d lost branch(es) written again", where,
            "finished its committed attempt" if r.outcome == "recovered"
            else f"committed at attempt {r.attempts}", r.recovered, r.redone,
        )


def progress_listener(
    report_of: Callable[[int], BatchReport | None],
    callback: Callable[[Any, BatchReport | None], None],
) -> Any:
    """A ``StreamingQueryListener`` calling ``callback(progress, report_of(batchId))``
    for every query progress (``TransactionalSink.progress_listener``)."""
    from pyspark.sql.streaming.listener import StreamingQueryListener

    class _Listener(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            callback(progress, report_of(int(progress.batchId)))

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    return _Listener()
