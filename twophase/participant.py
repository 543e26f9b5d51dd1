"""The contract every participant (one external system) fulfils.

Rows arrive as Arrow record batches. Spark's ``mapInArrow`` hands each task its
partition as Arrow batches without building a Python object per row, pyarrow writes
Parquet from them directly, and Postgres COPY and Kafka JSON are built column-wise from
them; Spark ``Row`` objects would cost a Python object per row and per value before any
participant even started (see ARCHITECTURE.md, "Why Arrow").

A participant object is built on the driver (it must pickle: it is shipped to the
executors) and opened lazily where it is used. Every method other than :meth:`prepare`
may run in a different process from the one that prepared: that is what a crash
recovery is.
"""

from __future__ import annotations

import abc
import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "BranchRef",
    "BranchStatus",
    "Handle",
    "Participant",
    "ParticipantError",
    "PrepareRefused",
    "validate_name",
]

Handle = Mapping[str, str]
"""What a YES vote carries: all a later process needs to commit or abort the branch."""

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
LINEAGE_RE: Final = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_LINEAGE_RE: Final = LINEAGE_RE


def validate_name(kind: str, value: str, pattern: re.Pattern[str] = _NAME_RE) -> str:
    """Names reach SQL identifiers, file names and Kafka group ids: allow a safe alphabet."""
    if not isinstance(value, str) or not pattern.match(value) or value in (".", ".."):
        raise ValueError(
            f"invalid {kind} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
        )
    return value


class BranchStatus(str, enum.Enum):
    COMMITTED = "COMMITTED"
    PREPARED = "PREPARED"
    ABSENT = "ABSENT"


@dataclass(frozen=True, order=True)
class BranchRef:
    """Which branch: the transaction key plus (participant, partition).

    The idempotency marker is keyed without ``attempt`` (a branch's data lands once per
    checkpoint whatever the attempt); prepared leftovers are named with it, so a later
    attempt can tell its own from an earlier one's.
    """

    sink: str
    lineage: str
    batch_id: int
    attempt: int
    participant: str
    partition: int

    def __post_init__(self) -> None:
        validate_name("sink name", self.sink)
        validate_name("lineage", self.lineage, _LINEAGE_RE)
        validate_name("participant name", self.participant)
        for label, n in (
            ("checkpoint", self.batch_id),
            ("attempt", self.attempt),
            ("partition", self.partition),
        ):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"{label} must be a non-negative int, got {n!r}")

    @property
    def branch_id(self) -> str:
        return f"{self.participant}/{self.partition}"


class ParticipantError(Exception):
    """A participant failed; the message names the participant and the cause."""


class PrepareRefused(ParticipantError):
    """Prepare failed for a reason the data or the target explains: vote NO with it.

    Raised after the participant has undone whatever it had written for the branch.
    """


class Participant(abc.ABC):
    """One external system. Subclasses set ``kind`` and ``durable_prepare``."""

    kind: str = "participant"
    durable_prepare: bool = True

    def __init__(self, name: str) -> None:
        self.name = validate_name("participant name", name)

    def check(self, schema: pa.Schema) -> None:  # noqa: B027 - optional hook
        """Driver side, before the first batch: verify the target (create the table,
        compare columns, read server settings) so a misfit fails before any write."""

    @abc.abstractmethod
    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        """Write the rows and the idempotency marker, durable but invisible.

        Returns the handle to vote YES with. Raises :class:`PrepareRefused` (vote NO)
        after undoing its own partial work.
        """

    @abc.abstractmethod
    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        """Make the prepared branch visible. Already committed is success."""

    @abc.abstractmethod
    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        """Discard the prepared branch. Already gone is success."""

    @abc.abstractmethod
    def status(self, branch: BranchRef) -> BranchStatus:
        """Read the branch's state from the system itself, not from memory."""

    @abc.abstractmethod
    def in_doubt(self, sink: str) -> list[BranchRef]:
        """Prepared leftovers of ``sink`` that can be found by name."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and producers."""

    def describe(self) -> str:
        return f"{self.kind} participant {self.name!r}"
