"""What the service accepts: strict request bodies with their bounds, and path parameters.

Strict: ``"5"`` is not an int and unknown fields are refused. The client builds these
bodies with :mod:`twophase.client.wire` (``begin_body``, ``votes_body``, ...), whose TypedDicts
name the same fields; a test keeps the two in step. What the service answers is
documented with wire's TypedDicts directly (``wire.TxnOut``, ``wire.BeginOut``, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Path
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    field_validator,
)

from twophase.client import wire
from twophase.client.wire import MAX_EPOCH, MAX_INT, MAX_TEXT
from twophase.names import BRANCH_PATTERN, LINEAGE_PATTERN, NAME_PATTERN, validate_name

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


# Every integer is bounded (the store's columns are 64-bit), every string has a pattern
# or a length, and free text has no NUL (PostgreSQL refuses it): a bad request is a 422,
# never a 5xx from the database.
def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters (PostgreSQL cannot store "
                         "them): remove or escape them (twophase.client.wire.clip_text does)")
    return value


_NO_NUL = AfterValidator(_no_nul)
_NO_NUL_SCHEMA = {"type": "string", "pattern": r"^[^\x00]*$"}
# /register adds one to the epoch it stores: a begin may store any epoch up to MAX_EPOCH
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]
Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT), _NO_NUL,
                 WithJsonSchema({**_NO_NUL_SCHEMA, "minLength": 1, "maxLength": MAX_TEXT})]
HandleKey = Annotated[str, StringConstraints(min_length=1, max_length=128), _NO_NUL,
                      WithJsonSchema({**_NO_NUL_SCHEMA, "minLength": 1, "maxLength": 128})]
HandleValue = Annotated[str, StringConstraints(max_length=MAX_TEXT), _NO_NUL,
                        WithJsonSchema({**_NO_NUL_SCHEMA, "maxLength": MAX_TEXT})]


def _branch(value: str) -> str:
    if not _BRANCH_RE.match(value):
        raise ValueError(f"invalid branch id {value!r}: use PARTICIPANT/PARTITION, "
                         "e.g. 'postgres-orders/3' (a participant name, '/', the partition)")
    return value


_BRANCH_RE = re.compile(BRANCH_PATTERN)
# the named check gives the clear message; the schema still documents the pattern
Name = Annotated[str, AfterValidator(lambda v: validate_name("participant name", v)),
                 WithJsonSchema({"type": "string", "pattern": NAME_PATTERN})]
Branch = Annotated[str, AfterValidator(_branch),
                   WithJsonSchema({"type": "string", "pattern": BRANCH_PATTERN})]


class BeginIn(_Strict):
    lineage: str = Field(pattern=LINEAGE_PATTERN, description="identity of the Spark checkpoint")
    checkpoint: int = Field(ge=0, le=MAX_INT, description="Spark's micro-batch id (batch_id)")
    epoch: Epoch = Field(description="writer epoch from /register")
    participants: list[Name] = Field(min_length=1, max_length=64)
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
    branch: Branch = Field(description="participant/partition")
    yes: bool
    handle: dict[HandleKey, HandleValue] | None = Field(default=None, max_length=32)
    reason: Text | None = None
    digest: str | None = Field(default=None, max_length=128, pattern=r"^[0-9a-z:]+$",
                               description="content digest of the rows voted on")
    task: str | None = Field(default=None, max_length=128, pattern=r"^[0-9A-Za-z.:/_-]+$",
                             description="the Spark task attempt voting: the first vote "
                             "of a branch wins, another attempt's is not recorded")
    metrics: BranchMetricsIn | None = None


class VotesIn(_Strict):
    epoch: Epoch
    votes: list[VoteItem] = Field(min_length=1, max_length=10_000)
    brief: bool = Field(default=False, description="answer without the branches "
                        "(state and decision only)")
    touched: bool = Field(default=False, description="answer with only the branches "
                          "voted on in this request (and the transaction's state and "
                          "decision): a driver that keeps the record itself merges them")


class AckItem(_Strict):
    branch: Branch
    outcome: wire.DecisionName
    metrics: BranchMetricsIn | None = None


class AcksIn(_Strict):
    epoch: Epoch
    acks: list[AckItem] = Field(min_length=1, max_length=10_000)
    brief: bool = Field(default=False, description="answer without the branches "
                        "(state and decision only)")
    touched: bool = Field(default=False, description="answer with only the branches "
                          "acknowledged in this request (and the transaction's state and "
                          "decision)")


class AbandonIn(_Strict):
    epoch: Epoch
    reason: Text


class ForceAckIn(_Strict):
    branch: Branch
    outcome: wire.DecisionName
    reason: Text | None = Field(default=None, description="why, for the log and the history")


class DescriptorIn(_Strict):
    """A participant's descriptor; secrets are never sent (see Participant.descriptor)."""

    kind: str = Field(pattern=NAME_PATTERN)
    name: str = Field(pattern=NAME_PATTERN)
    target: Annotated[str, StringConstraints(max_length=1024), _NO_NUL]
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
            if "\x00" in k or (isinstance(x, str) and "\x00" in x):
                raise ValueError(f"option {k[:40]!r} contains a NUL character: remove it")
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_INT:
                raise ValueError(f"option {k[:40]!r} is out of the 64-bit range")
        return v


class RegisterIn(_Strict):
    participants: list[DescriptorIn] = Field(max_length=64)


class AbortIn(_Strict):
    reason: Text


class ResolveIn(_Strict):
    dry_run: bool = Field(default=False, description="only report what would be done")


SinkName = Annotated[str, Path(pattern=NAME_PATTERN, description="sink name",
                               examples=["orders"])]
Lineage = Annotated[str, Path(pattern=LINEAGE_PATTERN, examples=["lin"])]
Checkpoint = Annotated[int, Path(ge=0, le=MAX_INT, examples=[0])]
Attempt = Annotated[int, Path(ge=1, le=MAX_INT, examples=[1])]

# the refusals a route may answer with, for the OpenAPI document
ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": wire.ErrorOut} for c in (400, 401, 404, 409, 413, 422, 503)
}
