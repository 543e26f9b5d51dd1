"""The driver's next step after an attempt: return, finish, abandon, retry or give up.

``TransactionalSink`` runs an attempt, reads the transaction back from the coordinator,
and asks :func:`next_step` what to do; the driver only performs the I/O. The counts of
aborts and finishing tries so far travel in and out of the function, so the rule (and
its bounds and backoff) is testable without Spark or a coordinator.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from twophase.protocol.records import Decision, State, Transaction

__all__ = ["Step", "StepKind", "next_step", "permanent"]

MAX_DELAY = 30.0  # seconds: the backoff's cap

# Causes that running the batch again cannot heal: the same interpreter misses the same
# module, the same configuration is refused again. Matched in the abort reason / job
# error text, as they arrive from executors (class names survive Spark's wrapping).
_PERMANENT = re.compile(
    r"\b(ModuleNotFoundError|ImportError|InvalidRequest|EnvironmentProblem|TargetProblem"
    r"|PYTHON_VERSION_MISMATCH|Cannot run program)\b"
)


def permanent(reason: str) -> bool:
    """True when ``reason`` (an abort reason or Spark job error) names a cause a retry
    cannot heal: a missing module, a refused configuration, a wrong interpreter."""
    return bool(_PERMANENT.search(reason))


class StepKind(str, enum.Enum):
    RETURN = "return"  # COMMITTED: foreachBatch returns and Spark records the batch
    FINISH = "finish"  # COMMIT decided, acks missing: begin again (in doubt) and finish it
    ABANDON = "abandon"  # undecided after the job: tell the coordinator (reason), then ask again
    RETRY = "retry"  # ABORT: a new attempt after ``delay``
    GIVE_UP = "give_up"  # raise BatchFailed(reason)


@dataclass(frozen=True)
class Step:
    kind: StepKind
    delay: float = 0.0  # seconds to sleep before the next begin
    reason: str = ""  # abandon/abort reason, or the BatchFailed message for GIVE_UP
    warning: str = ""  # what the driver logs, if anything
    aborted: int = 0  # aborted attempts, counting this one
    finishing: int = 0  # tries to finish a COMMIT decision, counting this one


def next_step(
    final: Transaction,
    *,
    aborted: int,
    finishing: int,
    max_attempts: int,
    backoff: float,
    job_error: str,
    abandoned: bool = False,
) -> Step:
    """What the driver does with ``final``, the attempt as the coordinator shows it after
    the Spark job (``abandoned``: the coordinator's answer to the driver's abandon)."""
    where = f"sink {final.sink!r} batch {final.batch_id}"
    if abandoned and final.decision == Decision.COMMIT:
        # The last vote won the race with abandon: finish the commit (not a retry).
        return Step(StepKind.FINISH, reason="the last vote won the race with abandon",
                    aborted=aborted, finishing=finishing)
    if final.state == State.COMMITTED:
        return Step(StepKind.RETURN, aborted=aborted, finishing=finishing)
    if final.decision == Decision.COMMIT:
        # Decided but not every branch acknowledged (a task died after the decision):
        # finish it under the same decision, it is not an abort.
        finishing += 1
        if finishing > max_attempts:
            return Step(
                StepKind.GIVE_UP,
                reason=f"{where}: COMMIT was decided for attempt {final.attempt} but branches "
                f"{final.pending_acks()} could not be committed after {finishing} tries: "
                f"{job_error}",
                aborted=aborted, finishing=finishing,
            )
        return Step(
            StepKind.FINISH, delay=_delay(backoff, finishing), reason=job_error,
            warning=f"sink {final.sink} batch {final.batch_id}: finishing committed attempt "
            f"{final.attempt}: {job_error}",
            aborted=aborted, finishing=finishing,
        )
    if final.decision is None and not abandoned:
        return Step(StepKind.ABANDON, reason=f"Spark job failed: {job_error or 'unknown'}",
                    aborted=aborted, finishing=finishing)
    reason = final.reason or job_error or "aborted"
    aborted += 1
    warning = (
        f"sink {final.sink} batch {final.batch_id} attempt {final.attempt} aborted: {reason}"
    )
    if permanent(reason) or permanent(job_error):
        return Step(
            StepKind.GIVE_UP,
            reason=f"{where}: attempt {final.attempt} aborted by a cause a retry cannot "
            f"heal, not retried: {reason}",
            warning=warning, aborted=aborted, finishing=finishing,
        )
    if aborted >= max_attempts:
        return Step(
            StepKind.GIVE_UP,
            reason=f"{where}: aborted {aborted} time(s), last attempt {final.attempt}: {reason}",
            warning=warning, aborted=aborted, finishing=finishing,
        )
    return Step(StepKind.RETRY, delay=_delay(backoff, aborted), reason=reason, warning=warning,
                aborted=aborted, finishing=finishing)


def _delay(backoff: float, n: int) -> float:
    """Exponential backoff for the n-th try (n >= 1), capped."""
    return min(backoff * 2.0 ** (n - 1), MAX_DELAY)
