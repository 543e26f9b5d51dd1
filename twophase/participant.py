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
import importlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twophase.errors import InvalidRequest, ParticipantError, PrepareRefused
from twophase.names import validate_lineage, validate_name
from twophase.protocol import TxnKey

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "EMPTY_BRANCH",
    "BranchRef",
    "BranchStatus",
    "Descriptor",
    "Handle",
    "Participant",
    "ParticipantError",
    "PrepareRefused",
    "ReadBack",
    "is_empty_branch",
    "rebuild",
    "register_kind",
    "secret_env_name",
    "secrets_from_env",
]

Handle = Mapping[str, str]
"""What a YES vote carries: all a later process needs to commit or abort the branch."""

from twophase.protocol.recovery import BranchStatus  # noqa: E402 - the rule owns it

EMPTY_BRANCH: Handle = {"empty": "yes", "rows": "0"}
"""The handle voted for a branch with no rows. The task votes it without calling the
participant: nothing is written (no empty file, no empty database transaction, no Kafka
transaction), so committing or aborting it is nothing, and a recovery that finds this
handle in the coordinator's record has nothing to redo."""


def is_empty_branch(handle: Handle | None) -> bool:
    """True for a branch voted with :data:`EMPTY_BRANCH` (nothing was prepared)."""
    return handle is not None and handle.get("empty") == "yes"


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
        validate_lineage(self.lineage)
        validate_name("participant name", self.participant)
        for label, n in (
            ("checkpoint", self.batch_id),
            ("attempt", self.attempt),
            ("partition", self.partition),
        ):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise InvalidRequest(f"{label} must be a non-negative int, got {n!r}")

    @property
    def key(self) -> TxnKey:
        """The transaction this branch belongs to."""
        return TxnKey(self.sink, self.lineage, self.batch_id, self.attempt)

    @property
    def branch_id(self) -> str:
        return f"{self.participant}/{self.partition}"


@dataclass(frozen=True)
class ReadBack:
    """One column of a participant's output read the way a consumer reads it.

    The verifier (``twophase.testing.verify``) judges exactly-once from this alone, so it
    needs no knowledge of any system: each participant knows where its rows, its prepared
    leftovers and its litter live.
    """

    values: tuple[Any, ...]
    """The column's values, one per visible row (duplicates kept)."""
    prepared: int = 0
    """Prepared leftovers the system can list (e.g. ``pg_prepared_xacts``, staged files)."""
    temp: int = 0
    """Litter of a write killed midway: never visible, never prepared, reported only."""
    exact: bool = True
    """False when these values cannot prove exactly-once (``note`` says why)."""
    note: str = ""
    aborted: int = 0
    """Rows written and then discarded by an abort (expected after a kill; reported)."""
    open: int = 0
    """Transactions still open at the end of the output (Kafka): must be 0."""
    mismatch: int = 0
    """Rows on which a second reader (a Kafka ``read_committed`` consumer on a broker
    that hides aborted records) disagrees with ``values``: must be 0."""


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

    def redo(
        self,
        branch: BranchRef,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        voted: Handle | None,
    ) -> Handle:
        """Write a lost branch again under a COMMIT decision (only a participant whose
        prepare is not durable loses one); ``voted`` is the handle it voted YES with.

        Like :meth:`prepare`, but the participant must first make sure the branch was
        not committed after all (its marker, or whatever evidence ``voted`` points to):
        a redo of a committed branch writes it twice. The default is :meth:`prepare`,
        whose marker check is that guard.
        """
        return self.prepare(branch, schema, batches)

    @abc.abstractmethod
    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        """Make the prepared branch visible. Already committed is success."""

    @abc.abstractmethod
    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        """Discard the prepared branch. Already gone is success."""

    @abc.abstractmethod
    def status(self, branch: BranchRef) -> BranchStatus:
        """Read the branch's state from the system itself, not from memory."""

    def voted_status(self, branch: BranchRef, voted: Handle | None) -> BranchStatus:
        """:meth:`status` when the caller holds the handle the branch voted YES with
        (recovery, ``twophase resolve``). The default ignores it; a participant whose
        marker can lag behind its data (Kafka on tansu) uses it to look further."""
        return self.status(branch)

    @abc.abstractmethod
    def in_doubt(self, sink: str) -> list[BranchRef]:
        """Prepared leftovers of ``sink`` that can be found by name."""

    def partition_columns(self) -> tuple[str, ...] | None:
        """Columns whose equal values must land in one branch (an upsert key: two
        branches writing one key would race for its row and block each other while
        prepared), or None when any split of the batch will do. The driver hashes each
        batch by the columns every participant asks for (their intersection)."""
        return None

    def single_branch(self) -> bool:
        """True when the whole batch must be one branch (e.g. a PostgreSQL table replaced
        in ``complete`` mode: one transaction deletes the old rows and writes the new)."""
        return False

    def check_vote_window(self, vote_timeout: float) -> None:  # noqa: B027 - optional hook
        """Driver side, when the sink is built: refuse (``ValueError``) a participant whose
        prepared branch would not outlive the sink's vote window of ``vote_timeout``
        seconds (a Kafka transaction times out in the broker)."""

    def required_modules(self) -> tuple[str, ...]:
        """Modules the executors must import to run this participant, beyond the one it
        is defined in (checked by :mod:`twophase.preflight` before the first batch; name
        what it imports lazily, e.g. a client library loaded in :meth:`prepare`)."""
        return ()

    def read_back(self, column: str) -> ReadBack:
        """Read ``column`` of everything committed, as a consumer would, plus the prepared
        leftovers; used by the exactly-once verifier (tests, demo, chaos), never by the
        protocol."""
        raise NotImplementedError(
            f"{self.describe()} cannot be verified: {type(self).__name__} does not "
            "implement read_back(column)"
        )

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and producers."""

    def describe(self) -> str:
        return f"{self.kind} participant {self.name!r}"

    def descriptor(self) -> Descriptor | None:
        """How to rebuild this participant without the job: ``{"kind", "name", "target",
        "options"}`` with non-secret options only (the coordinator stores it at register,
        and ``twophase resolve`` rebuilds from it with :func:`rebuild`). ``None``: this
        participant cannot be rebuilt (resolve then needs it named by hand)."""
        return None

    @classmethod
    def from_descriptor(cls, descriptor: Descriptor, secrets: Mapping[str, str]) -> Participant:
        """The inverse of :meth:`descriptor`; ``secrets`` are the values the descriptor
        left out (a password), from :func:`secrets_from_env` or a file."""
        raise NotImplementedError(f"{cls.__name__} cannot be rebuilt from a descriptor")


Descriptor = dict[str, Any]
"""``{"kind": str, "name": str, "target": str, "options": {str: scalar}}``
(``twophase.wire.DescriptorOut``)."""

# kind -> "module:Class", imported only when a descriptor of that kind is rebuilt
_KINDS: dict[str, str] = {
    "postgres": "twophase.sinks.postgres:PostgresParticipant",
    "files": "twophase.sinks.files:StagedFileParticipant",
    "kafka": "twophase.sinks.kafka:KafkaParticipant",
}
SECRET_ENV_PREFIX = "TWOPHASE_SECRET_"  # noqa: S105 - a variable name prefix


def register_kind(kind: str, cls: type[Participant]) -> None:
    """Make descriptors of ``kind`` rebuildable by ``cls.from_descriptor`` in this process
    (for participants outside twophase; the built-in kinds are known already)."""
    validate_name("participant kind", kind)
    _KINDS[kind] = f"{cls.__module__}:{cls.__qualname__}"


def secret_env_name(participant: str, key: str) -> str:
    """``TWOPHASE_SECRET_<PARTICIPANT>_<KEY>``, upper case, other characters as ``_``."""
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", f"{participant}_{key}".upper())


def secrets_from_env(participant: str, keys: Iterable[str]) -> dict[str, str]:
    """The secrets a descriptor names, from ``TWOPHASE_SECRET_<PARTICIPANT>_<KEY>``."""
    out = {}
    for key in keys:
        value = os.environ.get(secret_env_name(participant, key))
        if value is not None:
            out[key] = value
    return out


def rebuild(descriptor: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> Participant:
    """A participant from its descriptor (as the coordinator recorded it) plus secrets
    (default: from the environment, see :func:`secrets_from_env`)."""
    kind, name = descriptor.get("kind"), descriptor.get("name")
    if not isinstance(kind, str) or not isinstance(name, str):
        raise InvalidRequest(f"descriptor {dict(descriptor)!r} has no kind or name")
    path = _KINDS.get(kind)
    if path is None:
        raise InvalidRequest(
            f"participant {name!r} is of kind {kind!r}, which this process cannot rebuild: "
            "call twophase.participant.register_kind(kind, cls) (or name the participant "
            "by hand, e.g. twophase resolve --job)"
        )
    module, _, qual = path.partition(":")
    cls = getattr(importlib.import_module(module), qual)
    if secrets is None:
        wanted = str(descriptor.get("options", {}).get("secrets") or "")
        secrets = secrets_from_env(name, [k for k in wanted.split(",") if k])
    try:
        part: Participant = cls.from_descriptor(dict(descriptor), secrets)
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(
            f"participant {name!r}: its recorded {kind} descriptor is incomplete or "
            f"malformed ({type(exc).__name__}: {exc}); register the sink again with this "
            "twophase version, or name the participant by hand"
        ) from None
    return part


def required_secret(name: str, secrets: Mapping[str, str], key: str) -> str:
    """A secret the rebuilt participant cannot do without, or a clear error naming where
    to put it."""
    if key not in secrets:
        raise InvalidRequest(
            f"participant {name!r} needs its secret {key!r}, which the coordinator never "
            f"stores: set {secret_env_name(name, key)} (or pass it in --secrets FILE.json)"
        )
    return secrets[key]
