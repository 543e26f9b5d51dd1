"""What the service accepts: strict request bodies with their bounds, and path parameters.

Strict: ``"5"`` is not an int and unknown fields are refused. The client builds these
bodies with :mod:`twophase.wire` (``begin_body``, ``votes_body``, ...), whose TypedDicts
name the same fields; a test keeps the two in step. What the service answers is
documented with wire's TypedDicts directly (``wire.TxnOut``, ``wire.BeginOut``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field, field_validator

from twophase import wire
from twophase.names import LINEAGE_PATTERN, NAME_PATTERN

__all__ = [
    "ERRORS",
    "AbandonIn",
    "AbortIn",
    "AckItem",
    "AcksIn",
    "Attempt",
    "BeginIn",
    "BranchMetricsIn",
    "Checkpoint",
    "DescriptorIn",
    "ForceAckIn",
    "Lineage",
    "RegisterIn",
    "ResolveIn",
    "SinkName",
    "VoteItem",
    "VotesIn",
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class BeginIn(_Strict):
    lineage: str = Field(pattern=LINEAGE_PATTERN, description="identity of the Spark checkpoint")
    checkpoint: int = Field(ge=0, description="Spark's micro-batch id (batch_id)")
    epoch: int = Field(ge=0, description="writer epoch from /register")
    participants: list[str] = Field(min_length=1, max_length=64)
    partitions: int = Field(ge=1, le=100_000)
    vote_timeout: float = Field(default=300.0, gt=0, le=7 * 86400)


_SECONDS = Field(default=None, ge=0, le=7 * 86400)


class BranchMetricsIn(_Strict):
    """What the executor measured for one branch (observed, never decided on)."""

    prepare_s: float | None = _SECONDS
    wait_s: float | None = _SECONDS
    commit_s: float | None = _SECONDS
    rows: int | None = Field(default=None, ge=0, le=10**12)


class VoteItem(_Strict):
    branch: str = Field(max_length=96, description="participant/partition")
    yes: bool
    handle: dict[str, str] | None = None
    reason: str | None = Field(default=None, max_length=4096)
    metrics: BranchMetricsIn | None = None


class VotesIn(_Strict):
    epoch: int = Field(ge=0)
    votes: list[VoteItem] = Field(min_length=1)


class AckItem(_Strict):
    branch: str = Field(max_length=96)
    outcome: wire.DecisionName
    metrics: BranchMetricsIn | None = None


class AcksIn(_Strict):
    epoch: int = Field(ge=0)
    acks: list[AckItem] = Field(min_length=1)


class AbandonIn(_Strict):
    epoch: int = Field(ge=0)
    reason: str = Field(min_length=1, max_length=4096)


class ForceAckIn(_Strict):
    branch: str = Field(max_length=96)
    outcome: wire.DecisionName
    reason: str | None = Field(default=None, min_length=1, max_length=4096,
                               description="why, for the log and the history")


class DescriptorIn(_Strict):
    """A participant's descriptor; secrets are never sent (see Participant.descriptor)."""

    kind: str = Field(pattern=NAME_PATTERN)
    name: str = Field(pattern=NAME_PATTERN)
    target: str = Field(max_length=1024)
    options: dict[str, str | int | float | bool | None] = Field(max_length=64)

    @field_validator("options")
    @classmethod
    def _bounded(
        cls, v: dict[str, str | int | float | bool | None]
    ) -> dict[str, str | int | float | bool | None]:
        for k, x in v.items():
            if not 0 < len(k) <= 128:
                raise ValueError(f"option name {k[:40]!r} must be 1-128 characters")
            if isinstance(x, str) and len(x) > 4096:
                raise ValueError(f"option {k!r} is longer than 4096 characters")
        return v


class RegisterIn(_Strict):
    participants: list[DescriptorIn] = Field(max_length=64)


class AbortIn(_Strict):
    reason: str = Field(min_length=1, max_length=4096)


class ResolveIn(_Strict):
    dry_run: bool = Field(default=False, description="only report what would be done")


SinkName = Annotated[str, Path(pattern=NAME_PATTERN, description="sink name")]
Lineage = Annotated[str, Path(pattern=LINEAGE_PATTERN)]
Checkpoint = Annotated[int, Path(ge=0)]
Attempt = Annotated[int, Path(ge=1)]

# the refusals a route may answer with, for the OpenAPI document
ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": wire.ErrorOut} for c in (400, 401, 404, 409, 413, 422, 503)
}
