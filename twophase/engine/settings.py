"""A sink's options, checked once when it is built, the same way for both doors.

``TransactionalSink`` (the ``foreachBatch`` door, and the data source door's sinks
declared in code) and a sink the data source door builds from options alone check their
arguments here, so a refusal names the same bound and fix whichever door it came
through; the engine reads nothing else of a sink."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twophase.client.connection import check_coordinator
from twophase.engine.plan import fixed_split
from twophase.names import validate_lineage, validate_name
from twophase.options import MARKER_KEEP_BATCHES, VOTE_TIMEOUT, check_sink_options
from twophase.participant import Participant, check_durable

if TYPE_CHECKING:
    from twophase.engine.report import BatchReport

__all__ = ["SinkSettings"]


@dataclass(frozen=True)
class SinkSettings:
    """One sink's checked options (``TransactionalSink``'s docstring says what each does).

    ``split_columns`` and ``one_branch`` are derived: the participants' keys, or a
    participant that writes a batch as one branch, may fix the split (one branch: P is
    1, and ``partitions`` becomes 1)."""

    name: str
    participants: tuple[Participant, ...]
    coordinator: str
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    partitions: int | None = None
    max_attempts: int = 3
    backoff: float = 1.0
    vote_timeout: float = VOTE_TIMEOUT
    lineage: str | None = None
    on_batch: Callable[[BatchReport], None] | None = None
    coordinator_host: str | None = None
    coordinator_tls: tuple[str, str] | None = None
    retry_budget_s: float = 120.0
    preflight: bool = True
    marker_keep_batches: int = MARKER_KEEP_BATCHES
    split_columns: tuple[str, ...] = field(init=False, default=())
    one_branch: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        validate_name("sink name", self.name)
        parts = tuple(self.participants)
        check_sink_options(self.name, [p.name for p in parts], partitions=self.partitions,
                           max_attempts=self.max_attempts, backoff=self.backoff,
                           vote_timeout=self.vote_timeout,
                           retry_budget_s=self.retry_budget_s,
                           marker_keep_batches=self.marker_keep_batches)
        # the tasks prepare and end before the decision: each prepare must outlive them
        check_durable(self.name, parts)
        columns, single, partitions = fixed_split(self.name, parts, self.partitions)
        check_coordinator(self.coordinator)
        if self.lineage is not None:
            validate_lineage(self.lineage)
        for p in parts:
            # A prepared branch must outlive the vote window (a Kafka transaction times out).
            p.check_vote_window(self.vote_timeout)
        for attr, value in (("participants", parts), ("split_columns", columns),
                            ("one_branch", single), ("partitions", partitions),
                            ("retry_budget_s", float(self.retry_budget_s))):
            object.__setattr__(self, attr, value)
