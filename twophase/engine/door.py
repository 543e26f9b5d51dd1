"""The data source door's steps over the batch engine (``format("twophase")``).

A task begins the attempt (:mod:`twophase.protocol.door`), then runs the foreachBatch
door's own ``prepare`` step for its partition (``twophase.engine.task.run_partition``), and
hands its votes back as Spark's commit message. The driver's ``commit(messages,
batchId)`` sends them and decides (``twophase.engine.decide``), then applies the decision
(``twophase.engine.commit.Committer``); ``abort`` abandons the attempt and aborts what its
tasks prepared. A sink declared by options alone becomes its ``DoorSpec`` here
(``spec_from_options``). Nothing here imports Spark: the door's Spark classes live in
:mod:`twophase.doors.datasource`."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.engine.commit import Committer
from twophase.engine.decide import decide, votes_of
from twophase.engine.plan import INPUT_SPLIT, PREPARE, BatchPlan, descriptors
from twophase.engine.settings import SinkSettings
from twophase.engine.task import _shared_client, run_partition
from twophase.errors import BatchFailed, InvalidRequest
from twophase.extras import missing_extra
from twophase.names import validate_name
from twophase.options import VOTE_TIMEOUT
from twophase.participant import EMPTY_BRANCH, Participant, check_durable, rebuild
from twophase.protocol import BeginKind, Decision, State, TxnKey, branch_id
from twophase.protocol.door import (
    TaskAction,
    TaskAnswer,
    check_partition,
    commit_case,
    task_action,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.engine.batch import BatchEngine
    from twophase.spark.session import SparkApp

__all__ = ["DoorSpec", "Message", "abort_batch", "adopt_zone", "commit_batch",
           "prepare_partition", "spec_for", "spec_from_options", "spec_of_engine"]

Message = tuple[TaskAnswer, dict[str, Any] | None]
"""A task's commit message: its begin's answer and its outcome (votes) when it wrote."""


@dataclass(frozen=True)
class DoorSpec:
    """One sink as the door's tasks and committer need it (pickled with the writer)."""

    name: str
    participants: tuple[Participant, ...]
    coordinator_url: str
    epoch: int
    partitions: int  # the branches per participant each attempt is begun with
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    ca_pem: str | None = field(default=None, repr=False)
    vote_timeout: float = VOTE_TIMEOUT
    retry_budget: float = 120.0
    lineage: str | None = None  # default: the streaming query's id (per checkpoint)
    # the time zone the options name; None: the session's (spark.sql.session.timeZone),
    # which the tasks read from the Arrow batches Spark hands them
    tz: str | None = None

    def __post_init__(self) -> None:
        check_durable(self.name, self.participants)

    def client(self) -> CoordinatorClient:
        return _shared_client(self.coordinator_url, self.token, self.retry_budget,
                              self.ca_pem, self.token_file)


_SECRET_OPTIONS = ("token", "password", "secret")
_N = TypeVar("_N", int, float)


def spec_for(opts: dict[str, str], registered: Mapping[str, DoorSpec]) -> DoorSpec:
    """The sink the data source's options name (lower-cased keys): one ``registered`` in
    code by ``sink``, else one declared by options alone. A secret in the options is
    refused: Spark logs them and shows them in its UI."""
    for k in opts:
        if any(s in k for s in _SECRET_OPTIONS) and k not in ("token_env", "token_file"):
            raise InvalidRequest(
                f"option {k!r}: secrets never go in options (Spark logs them and shows "
                "them in its UI); name an environment variable (token_env) or a file "
                "(token_file), and participants' secrets in TWOPHASE_SECRET_* variables")
    if "sink" in opts and not ({"participants", "config"} & opts.keys()):
        found = registered.get(opts["sink"])
        if found is None:
            raise InvalidRequest(
                f"no twophase sink named {opts['sink']!r} is registered in this "
                f"application (registered: {sorted(registered) or 'none'}); call "
                "twophase.register(spark, sink) first, or declare it by options")
        return found
    return spec_from_options(opts)


def spec_of_engine(engine: BatchEngine, app: SparkApp, shuffle_partitions: int) -> DoorSpec:
    """A sink declared in code, as its tasks and committer need it: this starts its
    coordinator connection (an embedded coordinator listens in this process) and takes
    its writer epoch, which fences every earlier run's writer. The bound on partitions
    is the sink's ``partitions``, else Spark's ``spark.sql.shuffle.partitions``."""
    client, epoch = engine.start(app)
    conn, s = engine.conn, engine.sink
    assert conn is not None
    return DoorSpec(s.name, s.participants, conn.url, epoch,
                    s.partitions or shuffle_partitions, client.token, conn.token_file,
                    conn.ca_pem, s.vote_timeout, s.retry_budget_s, s.lineage)


def spec_from_options(opts: dict[str, str]) -> DoorSpec:
    """A sink declared by options (or a JSON ``config`` file holding the same keys): a
    new writer epoch from the coordinator daemon for each planning of a batch."""
    if "config" in opts:
        opts = {**{k.lower(): (v if isinstance(v, str) else json.dumps(v)) for k, v in
                   json.loads(Path(opts["config"]).read_text()).items()}, **opts}
    missing = [k for k in ("sink", "participants", "coordinator") if k not in opts]
    if missing:
        raise InvalidRequest(
            f"the twophase data source needs option(s) {missing}: .option('sink', NAME) "
            "for a sink registered with twophase.register(spark, sink), or 'sink', "
            "'participants' (JSON descriptors) and 'coordinator' (a daemon URL)")
    url = opts["coordinator"]
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"option coordinator={url!r}: a sink declared by options needs a coordinator "
            "daemon (http(s)://host:port); an embedded coordinator needs the sink in code: "
            "twophase.register(spark, TransactionalSink(..., coordinator=...))")
    name = validate_name("sink name", opts["sink"])
    try:
        parts = tuple(rebuild(d) for d in json.loads(opts["participants"]))
    except ImportError as exc:  # Spark runs the data source in its own Python processes
        raise InvalidRequest(
            f"the twophase data source runs in {sys.executable}, which cannot import a "
            f"participant's module ({missing_extra(exc) or exc}); set spark.pyspark.python "
            "(or PYSPARK_PYTHON) to an interpreter that has twophase with the "
            "participants' extras before the session starts") from exc
    env = opts.get("token_env")
    token = os.environ.get(env) if env else None
    if env and token is None:
        raise InvalidRequest(f"option token_env={env!r}: that variable is not set on the "
                             "driver")
    vote_timeout = _number(opts, "vote_timeout", float)
    checked = SinkSettings(  # the same checks and defaults as a sink declared in code
        name, parts, url, token=token, token_file=opts.get("token_file"),
        partitions=_number(opts, "partitions", int), lineage=opts.get("lineage"),
        vote_timeout=VOTE_TIMEOUT if vote_timeout is None else vote_timeout)
    with CoordinatorClient(url, token, token_file=checked.token_file) as client:
        epoch = client.register(name, descriptors(parts))
    return DoorSpec(name, parts, url, epoch, checked.partitions or 200, token,
                    checked.token_file, None, checked.vote_timeout, lineage=checked.lineage,
                    tz=opts.get("timezone"))


def _number(opts: dict[str, str], key: str, kind: Callable[[str], _N]) -> _N | None:
    """Option ``key`` as a number (None when it is not given), refused naming it."""
    if key not in opts:
        return None
    try:
        return kind(opts[key])
    except ValueError:
        raise InvalidRequest(f"option {key}={opts[key]!r} is not a number: give "
                             f"{'a whole number' if kind is int else 'a number'}, or leave it "
                             "out for the default") from None


def adopt_zone(spec: DoorSpec, expected: pa.Schema, got: pa.Schema) -> pa.Schema:
    """The schema a task prepares with: ``expected`` (planned on the driver) in the zone
    of Spark's batches (``got``: the session's), unless the sink names another zone,
    which is refused naming both. A difference besides zones is left to the
    participants' own checks."""
    from twophase.spark.compat import in_zone, zone_of

    zone = zone_of(got)
    if zone is None or got == expected or in_zone(got, "UTC") != in_zone(expected, "UTC"):
        return expected
    if spec.tz is not None and spec.tz != zone:
        raise InvalidRequest(
            f"sink {spec.name!r}: option timezone={spec.tz!r}, but the session's time zone "
            f"(spark.sql.session.timeZone, which Spark's batches carry) is {zone!r}; "
            f"leave the option out (the sink then takes the session's zone) or set "
            f"timezone={zone!r}")
    return in_zone(expected, zone)


def prepare_partition(spec: DoorSpec, batch_id: int, query_id: str | None, partition: int,
                      task: str, schema: pa.Schema,
                      batches: Iterable[pa.RecordBatch]) -> Message:
    """One task: begin (or join) the batch's attempt, then prepare this partition's
    branches as the foreachBatch door's tasks do; a replay writes nothing."""
    check_partition(spec.name, partition, spec.partitions)
    lineage = spec.lineage or query_id
    if not lineage:
        raise BatchFailed(f"sink {spec.name!r}: the task found no streaming query id; "
                          "the twophase data source writes streams only (writeStream)")
    client = spec.client()
    res = client.begin(spec.name, lineage, batch_id, spec.epoch,
                       [p.name for p in spec.participants], spec.partitions,
                       spec.vote_timeout)
    key = res.txn.key if res.txn is not None else TxnKey(spec.name, lineage, batch_id, 0)
    answer = TaskAnswer(key, res.kind, spec.epoch, partition)
    if task_action(res.kind) != TaskAction.PREPARE or res.txn is None:
        for _ in batches:  # Spark's plan runs to its end (a stateful query's state commits)
            pass
        return answer, None
    plan = BatchPlan(
        key=key, epoch=spec.epoch, partitions=res.txn.partitions, mode=PREPARE,
        coordinator_url=spec.coordinator_url, token=spec.token,
        participants=spec.participants, ca_pem=spec.ca_pem, split=INPUT_SPLIT,
        retry_budget=spec.retry_budget, token_file=spec.token_file,
        ack_earlier=tuple(t.attempt for t in res.recover if t.attempt != key.attempt),
    )
    out = run_partition(plan, partition, schema, batches, client, task=task)
    return answer, out.as_dict()


_COMMITTERS: dict[tuple[str, str], Committer] = {}
_LOCK = threading.Lock()


def _committer(spec: DoorSpec) -> Committer:
    """One committer per sink in this process (Spark reuses the driver's Python worker
    for the next batch's commit: its lanes' connections are kept)."""
    with _LOCK:
        found = _COMMITTERS.get((spec.name, spec.coordinator_url))
        if found is None:
            found = _COMMITTERS[(spec.name, spec.coordinator_url)] = Committer(
                spec.participants)
        return found


def _unused(spec: DoorSpec, used: int) -> list[VoteIn]:
    """Empty YES votes for the bound's branches past Spark's partitions."""
    return [VoteIn(branch=branch_id(p.name, i), yes=True, handle=dict(EMPTY_BRANCH))
            for p in spec.participants for i in range(used, spec.partitions)]


def commit_batch(spec: DoorSpec, messages: Sequence[Message | None], batch_id: int) -> None:
    """The driver's ``commit``: decide the attempt every task joined and apply the
    decision; return only when the coordinator shows it COMMITTED, else raise (the query
    stops; a restart replays the batch under a new attempt)."""
    door = commit_case([m[0] if m else None for m in messages], batch_id)
    if door.kind == BeginKind.COMMITTED:
        return
    client = spec.client()
    committer = _committer(spec)
    if door.kind == BeginKind.NEW:
        votes = votes_of(m[1] for m in messages if m and m[1]) + _unused(spec, len(messages))
        txn = decide(client, door.key, door.epoch, votes, "")  # the votes' answer: the record
    else:
        txn = client.get(door.key)
    final, error = committer.apply(client, door.epoch, txn)
    if final.state == State.COMMITTED:
        committer.prune(spec.name, door.key.lineage, batch_id)
        return
    if final.decision == Decision.ABORT:
        committer.sweep(final)
    raise BatchFailed(
        f"sink {spec.name!r} batch {batch_id} attempt {door.key.attempt} ended "
        f"{final.state.value}: {final.reason or error or 'branches left unacknowledged'}; "
        "restart the query to replay the batch")


def abort_batch(spec: DoorSpec, messages: Sequence[Message | None], batch_id: int) -> None:
    """The driver's ``abort`` (a task failed): send the votes the others returned, abandon
    the attempt (ABORT) and abort what they prepared. A failed task's leftovers are found
    by name by the next attempt's tasks (the recovery rule) or ``twophase resolve``."""
    known = [m for m in messages if m is not None and m[0].kind == BeginKind.NEW]
    if not known:
        return  # nothing begun here, or a replay: the next begin settles it
    client = spec.client()
    committer = _committer(spec)
    for key, epoch in {(a.key, a.epoch) for a, _ in known}:
        votes = votes_of(o for a, o in known if a.key == key and o)
        txn = decide(client, key, epoch, votes, f"a task of batch {batch_id} failed")
        final, _ = committer.apply(client, epoch, txn)
        if final.decision == Decision.ABORT:
            committer.sweep(final)
