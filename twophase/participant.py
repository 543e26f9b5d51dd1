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

The contract, in three parts (docs/writing-a-participant.md):

- **required**, what the protocol cannot do without: :meth:`Participant.prepare`,
  :meth:`~Participant.commit`, :meth:`~Participant.abort`, :meth:`~Participant.status`,
  :meth:`~Participant.in_doubt`. A participant that commits once per batch (a table:
  :class:`BatchParticipant`) implements :meth:`~BatchParticipant.commit_batch` in place
  of ``commit``;
- **optional protocol hooks** with safe defaults (``check``, ``probe``, ``redo``,
  ``voted_status``, ``partition_columns``, ``single_branch``, ``check_vote_window``,
  ``required_modules``, ``close``, ``describe``, ``prune_markers``,
  ``end_other_attempts``, ``open_on_target``, ``clear_left_open``);
- **optional operator interfaces**, separate classes a participant may also inherit:
  :class:`Rebuildable` (``twophase resolve`` and the console rebuild it from the
  coordinator's record) and :class:`Verifiable` (the exactly-once verifier reads its
  output back).
"""

from __future__ import annotations

import abc
import importlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from twophase.errors import InvalidRequest, ParticipantError, PrepareRefused, ProtocolError
from twophase.names import validate_lineage, validate_name
from twophase.protocol import Transaction, TxnKey

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "EMPTY_BRANCH",
    "ENTRY_POINT_GROUP",
    "BatchParticipant",
    "BranchRef",
    "BranchStatus",
    "CommitScope",
    "Descriptor",
    "Handle",
    "LeftOpen",
    "Participant",
    "ParticipantError",
    "PrepareRefused",
    "ReadBack",
    "Rebuildable",
    "SinkDecisions",
    "SparkWritten",
    "TargetBacklog",
    "Verifiable",
    "check_durable",
    "descriptor_of",
    "is_empty_branch",
    "known_kinds",
    "native_eligible",
    "read_back_of",
    "rebuild",
    "register_kind",
    "secret_env_name",
    "secrets_from_env",
]

Handle = Mapping[str, str]
"""What a YES vote carries: all a later process needs to commit or abort the branch."""

from twophase.protocol.recovery import BranchStatus, CommitScope  # noqa: E402 - the rule owns them

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
    commits: int | None = None
    """Table commits (snapshots, log versions) made by twophase, when the system keeps
    them (Iceberg, Delta); None where there is no such thing."""
    extra_commits: int = 0
    """Commits of a batch beyond its first (one snapshot per micro-batch is the rule of a
    once-per-batch participant): must be 0."""


@dataclass(frozen=True)
class LeftOpen:
    """What a crash left open on a target that its readers wait behind (a Kafka
    transaction), as a starting sink's clean-up reports it after aborting it."""

    name: str
    """The target's own name for it (a Kafka ``transactional.id``)."""
    age_s: float
    holds: tuple[str, ...]
    """What its readers were stalled on (``topic-N``)."""


class SinkDecisions(Protocol):
    """What the start-up clean-up may ask the coordinator: a sink's COMMIT-decided,
    unfinished transactions (:meth:`twophase.client.api.CoordinatorClient.committing`, a
    route the jobs' data token may call)."""

    def committing(self, sink: str) -> list[Transaction]: ...


@dataclass(frozen=True)
class TargetBacklog:
    """What a target holds open for a sink now, that its readers wait behind (a Kafka
    transaction left open by a crash stalls every ``read_committed`` reader of its
    partitions): shown by the coordinator's console and ``/metrics``."""

    open_transactions: int
    oldest_open_age_s: float
    unstable: Mapping[str, int]
    """Per target partition (``topic-N``): records past its last stable offset, which
    committed readers cannot read yet."""


class Participant(abc.ABC):
    """One external system. Subclasses set ``kind``. A prepared branch must survive the
    process that prepared it (the Spark task ends before the decision): a participant
    that declares ``durable_prepare = False`` is refused (``check_durable``).

    Five methods are required; everything else has a default that is right for a
    participant that needs nothing special.
    """

    kind: str = "participant"
    commit_scope: ClassVar[CommitScope] = CommitScope.BRANCH

    def __init__(self, name: str) -> None:
        self.name = validate_name("participant name", name)

    # ------------------------------------------------------------------ required
    @abc.abstractmethod
    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        """Write the rows and the idempotency marker, durable but invisible.

        Returns the handle to vote YES with. Raises :class:`PrepareRefused` (vote NO)
        after undoing its own partial work. A branch whose marker shows it committed
        already writes nothing and returns a handle all the same.
        """

    @abc.abstractmethod
    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        """Make the prepared branch visible. Already committed is success; ``handle`` is
        None when recovery found the branch by name and holds no vote."""

    @abc.abstractmethod
    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        """Discard the prepared branch. Already gone is success."""

    @abc.abstractmethod
    def status(self, branch: BranchRef) -> BranchStatus:
        """Read the branch's state from the system itself, never from memory."""

    @abc.abstractmethod
    def in_doubt(self, sink: str) -> list[BranchRef]:
        """Prepared leftovers of ``sink`` that can be found by name."""

    # ------------------------------------------------------------------ optional
    def check(self, schema: pa.Schema) -> None:  # noqa: B027 - optional hook
        """Driver side, before the first batch: verify the target (create the table,
        compare columns, read server settings) so a misfit fails before any write."""

    def probe(self) -> None:  # noqa: B027 - optional hook
        """Before the first batch, on the driver and on every executor (the preflight
        job): can this process reach the target and write there? Raise
        :class:`~twophase.errors.TargetProblem` (cause and fix) when not; write nothing
        that stays (a probe file is removed again)."""

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

    def voted_status(self, branch: BranchRef, voted: Handle | None) -> BranchStatus:
        """:meth:`status` when the caller holds the handle the branch voted YES with
        (recovery, ``twophase resolve``). The default ignores it; a participant whose
        marker can lag behind its data (Kafka on tansu) uses it to look further."""
        return self.status(branch)

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
        is defined in (checked by :mod:`twophase.spark.preflight` before the first batch; name
        what it imports lazily, e.g. a client library loaded in :meth:`prepare`)."""
        return ()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and producers."""

    def prune_markers(self, sink: str, lineage: str, below: int) -> int:
        """Delete this participant's idempotency markers of ``sink``'s ``lineage`` for
        batches below ``below``; returns how many. The driver calls it in the background
        with its committed batch minus a kept window (``twophase.engine.commit``), so markers do
        not grow by P rows per batch forever: no recovery asks about those batches (Spark
        replays only batches its checkpoint still retains). Default: nothing to prune."""
        return 0

    def end_other_attempts(self, key: TxnKey, kept: Mapping[int, Handle]) -> int:
        """On the driver, once a decision is applied to every branch of ``key``'s batch:
        end what other attempts of its branches left open on the target (a retried or
        speculative task whose vote was not recorded, or that died before voting) and
        readers wait behind, sparing the recorded votes' handles ``kept`` (by partition).
        Returns how many were ended. Default: nothing is left open that readers wait for."""
        return 0

    def open_on_target(self, sink: str) -> TargetBacklog | None:
        """What ``sink``'s writers hold open on the target now, any process's (the
        coordinator polls it for its console and ``/metrics``). Default None: this kind
        of target holds nothing open that readers wait behind."""
        return None

    def clear_left_open(self, sink: str, decisions: SinkDecisions) -> list[LeftOpen]:
        """Once per sink start, on the driver before the first batch: abort what a crash
        left open on the target for ``sink`` (readers wait behind it until a timeout),
        sparing what ``decisions`` holds as COMMIT-decided, and say what was aborted.
        Default: nothing is ever left open (a prepared branch waits for its decision)."""
        return []

    def describe(self) -> str:
        return f"{self.kind} participant {self.name!r}"

    # ------------------------------------------------------------------ batch scope
    def commit_batch(self, key: TxnKey, handles: Mapping[int, Handle]) -> None:
        """Commit every branch of one attempt at once (``commit_scope`` BATCH only)."""
        raise ProtocolError(
            f"{self.describe()} commits each branch itself (commit_scope 'branch'): "
            "commit_batch is for participants that commit once per batch"
        )


class BatchParticipant(Participant):
    """A participant that commits once per micro-batch, from the driver (a lakehouse
    table: one snapshot or log entry per batch, not one per branch).

    Its branches prepare in parallel in the tasks (data files written, referenced by
    nothing) and vote with handles naming those files. After COMMIT the driver calls
    :meth:`commit_batch` once with every non-empty branch's handle; the table's own
    marker of the batch (a snapshot property, Delta's app transaction) makes a second
    call a no-op. :meth:`status` of a branch is read from the table: COMMITTED when the
    batch's marker names this branch's attempt; PREPARED when the attempt's files exist
    but that attempt's commit is not in the table; ABSENT otherwise. ``abort`` deletes
    the attempt's files of that branch; ``in_doubt`` lists branches whose files exist
    unreferenced, so ``twophase resolve`` sweeps what nobody will commit.
    """

    commit_scope: ClassVar[CommitScope] = CommitScope.BATCH

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        raise ProtocolError(
            f"{self.describe()} commits once per batch: a branch alone is never "
            "committed (the batch's marker would then hide the other branches); the "
            "driver and twophase resolve call commit_batch with every branch's handle"
        )

    @abc.abstractmethod
    def commit_batch(self, key: TxnKey, handles: Mapping[int, Handle]) -> None:
        """Apply one commit with every branch's files; ``handles`` maps partition ->
        the handle that branch voted with (empty branches left out; possibly none at
        all, then the batch's marker is still written so status reads COMMITTED).
        Idempotent through the table's marker of (sink, lineage, batch): a batch
        already committed by this attempt is success. A commit that loses an optimistic
        race with another writer retries; it is never applied twice."""


class Rebuildable(abc.ABC):
    """Optional: a participant ``twophase resolve``, the console and the chaos runner can
    rebuild without the job, from what the coordinator recorded at register."""

    @abc.abstractmethod
    def descriptor(self) -> Descriptor | None:
        """How to rebuild this participant without the job: ``{"kind", "name", "target",
        "options"}`` with non-secret options only (the coordinator stores it at register,
        and ``twophase resolve`` rebuilds from it with :func:`rebuild`). ``None``: this
        object cannot be rebuilt (resolve then needs it named by hand)."""

    @classmethod
    @abc.abstractmethod
    def from_descriptor(cls, descriptor: Descriptor, secrets: Mapping[str, str]) -> Participant:
        """The inverse of :meth:`descriptor`; ``secrets`` are the values the descriptor
        left out (a password), from :func:`secrets_from_env` or a file."""


class Verifiable(abc.ABC):
    """Optional: a participant whose output the exactly-once verifier can read back
    (tests, ``twophase demo``, ``twophase chaos``); never used by the protocol."""

    @abc.abstractmethod
    def read_back(self, column: str) -> ReadBack:
        """Read ``column`` of everything committed, as a consumer would, plus the prepared
        leftovers."""


class SparkWritten(abc.ABC):
    """Optional: a participant whose prepared branch is data files can take files that
    Spark's own writer wrote (the native data path, docs/decisions.md 2026-11-26): no row
    crosses into Python. The driver writes the attempt's rows with ``df.write`` in
    :meth:`native_format` into :meth:`native_location`, one Spark task per branch
    partition, then :meth:`adopt` turns those files into the attempt's prepared branches
    under the names ``prepare`` would have given them, so ``commit``, ``abort``,
    ``status`` and ``in_doubt`` stay as they are. While Spark writes, the location is
    this attempt's own and named by it: ``status`` reads a branch of an attempt whose
    location still exists as PREPARED and ``abort`` deletes the location, so the sweeps
    find a write killed midway by name."""

    @abc.abstractmethod
    def native_format(self) -> str | None:
        """Spark's data source name for this participant as configured (``"parquet"``),
        or None when its rows must go through :meth:`Participant.prepare` (a format
        Spark does not write the same way, or the user's override)."""

    def native_preferred(self) -> bool:
        """True when the user asked for the native path even in a sink with Python
        participants (the batch is then persisted once for both); by default such a
        sink keeps every participant on the Python path."""
        return False

    def native_options(self) -> Mapping[str, str]:
        """Writer options of the native write (compression, ...) beyond twophase's own."""
        return {}

    def native_partition_by(self) -> Sequence[str]:
        """Columns the native write partitions by (``df.write.partitionBy``: Hive-style
        ``col=value/`` folders, the columns left out of the files); none by default."""
        return ()

    def native_columns(self) -> Mapping[str, str]:
        """Hidden columns the native write adds before it partitions (name -> Spark SQL
        expression), for a table whose files keep the partition's source columns (Iceberg:
        its partition transforms); none by default."""
        return {}

    @abc.abstractmethod
    def native_location(self, key: TxnKey) -> str:
        """Where Spark writes attempt ``key``'s files (a path or URI Spark can write)."""

    @abc.abstractmethod
    def adopt(self, key: TxnKey, partitions: int) -> dict[int, Handle]:
        """Make what Spark wrote into :meth:`native_location` the prepared branches of
        ``key`` (durably, as ``prepare`` would have left them) and remove the location.
        Returns partition -> the handle to vote YES with, for every partition of
        ``range(partitions)`` that has rows; the others are empty branches. A branch whose
        marker shows it committed already keeps nothing and gets a handle all the same."""


def native_eligible(participant: Participant) -> bool:
    """True when ``participant`` takes files Spark wrote (:class:`SparkWritten`, and its
    configuration allows it)."""
    return isinstance(participant, SparkWritten) and participant.native_format() is not None


def check_durable(sink: str, participants: Iterable[Participant]) -> None:
    """Refuse a participant whose prepared branch dies with its task's process
    (``durable_prepare = False``): the tasks end before the decision, and the barrier
    stage that kept such tasks alive until it was retired in 0.4."""
    bad = [p.describe() for p in participants if getattr(p, "durable_prepare", True) is False]
    if bad:
        raise InvalidRequest(
            f"sink {sink!r}: {', '.join(bad)} declares durable_prepare = False (its prepared "
            "branch lives only in its Spark task), which twophase no longer runs: since 0.4 "
            "the tasks end before the decision and the driver commits. Make its prepare "
            "durable (a prepared transaction in the target, a staged file, a transaction "
            "the driver can resume) and drop durable_prepare (docs/writing-a-participant.md)")


def descriptor_of(participant: Participant) -> Descriptor | None:
    """The participant's descriptor, or None when it is not :class:`Rebuildable`."""
    return participant.descriptor() if isinstance(participant, Rebuildable) else None


def read_back_of(participant: Participant, column: str) -> ReadBack:
    """:meth:`Verifiable.read_back`, or a clear refusal for a participant without it."""
    if not isinstance(participant, Verifiable):
        raise NotImplementedError(
            f"{participant.describe()} cannot be verified: {type(participant).__name__} "
            "does not implement read_back(column) (inherit twophase.participant.Verifiable)"
        )
    return participant.read_back(column)


Descriptor = dict[str, Any]
"""``{"kind": str, "name": str, "target": str, "options": {str: scalar}}``
(``twophase.client.wire.DescriptorOut``)."""

ENTRY_POINT_GROUP = "twophase.participants"
"""Installed packages register ``kind = "module:Class"`` here (pyproject.toml's
``[project.entry-points."twophase.participants"]``); :func:`rebuild` finds them."""

# kind -> "module:Class", imported only when a descriptor of that kind is rebuilt
_KINDS: dict[str, str] = {}
SECRET_ENV_PREFIX = "TWOPHASE_SECRET_"  # noqa: S105 - a variable name prefix


def register_kind(kind: str, cls: type[Participant]) -> None:
    """Make descriptors of ``kind`` rebuildable by ``cls.from_descriptor`` in this process
    (installed packages use the ``twophase.participants`` entry point instead)."""
    validate_name("participant kind", kind)
    _KINDS[kind] = f"{cls.__module__}:{cls.__qualname__}"


def known_kinds() -> dict[str, str]:
    """Every kind this process can rebuild: kind -> ``module:Class``. Entry points
    (twophase's own kinds among them) first, then :func:`register_kind` calls."""
    from importlib.metadata import entry_points

    kinds = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    kinds.update(_BUILT_IN)  # an uninstalled checkout (PYTHONPATH) still knows its own
    kinds.update(_KINDS)
    return kinds


_BUILT_IN = {
    "postgres": "twophase.sinks.postgres:PostgresParticipant",
    "files": "twophase.sinks.files:StagedFileParticipant",
    "kafka": "twophase.sinks.kafka:KafkaParticipant",
    "iceberg": "twophase.sinks.iceberg:IcebergParticipant",
}


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
    path = known_kinds().get(kind)
    if path is None:
        raise InvalidRequest(
            f"participant {name!r} is of kind {kind!r}, which this process cannot rebuild: "
            f"install the package that provides it (it registers the kind under the "
            f"{ENTRY_POINT_GROUP!r} entry-point group), or call "
            "twophase.participant.register_kind(kind, cls), or name the participant by "
            "hand (twophase resolve --participant, --pg-dsn, --files-path, --kafka-bootstrap)"
        )
    module, _, qual = path.partition(":")
    cls = getattr(importlib.import_module(module), qual)
    if not (isinstance(cls, type) and issubclass(cls, Rebuildable)):
        raise InvalidRequest(
            f"participant {name!r}: kind {kind!r} names {path}, which is not a "
            "twophase.participant.Rebuildable participant class"
        )
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
