"""The data source door's steps (twophase/engine/door.py) without Spark: real PostgreSQL,
real files, a real embedded coordinator; the tasks run in threads at once, as Spark's
would, so their begins race (the first creates the attempt, the others join it)."""

from __future__ import annotations

import itertools
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from twophase.client.connection import connect
from twophase.engine.door import DoorSpec, Message, abort_batch, commit_batch, prepare_partition
from twophase.errors import BatchFailed, IllegalTransition, InvalidRequest
from twophase.participant import Participant
from twophase.protocol import BeginKind, State
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.verify import verify

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])
_n = itertools.count()


def _rows(batch: int, partition: int, n: int = 5) -> list[pa.RecordBatch]:
    ids = [batch * 10_000 + partition * 100 + i for i in range(n)]
    return [pa.RecordBatch.from_pydict({"id": ids, "label": [f"x{i}" for i in ids]},
                                       schema=SCHEMA)]


@pytest.fixture
def spec(tmp_path: Path, pg_dsn: str) -> Any:
    k = next(_n)
    parts: list[Participant] = [PostgresParticipant(dsn=pg_dsn, table=f"door_steps_{k}"),
                                StagedFileParticipant(path=str(tmp_path / "out"))]
    for p in parts:
        p.check(SCHEMA)
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    client = conn.client()
    epoch = client.register(f"steps{k}")
    yield DoorSpec(f"steps{k}", tuple(parts), conn.url, epoch, 6, conn.token)
    conn.close()


def _tasks(spec: DoorSpec, batch: int, partitions: int) -> list[Message]:
    def one(p: int) -> Message:  # each task its own copy of the sink, as Spark unpickles
        mine = pickle.loads(pickle.dumps(spec))
        return prepare_partition(mine, batch, "q-1", p, f"1/{p}", SCHEMA, iter(_rows(batch, p)))

    with ThreadPoolExecutor(partitions) as pool:
        return list(pool.map(one, range(partitions)))


def _ids(spec: DoorSpec) -> list[int]:
    pg = spec.participants[0]
    with psycopg.connect(pg.dsn) as conn:  # type: ignore[attr-defined]
        return sorted(r[0] for r in conn.execute(f"SELECT id FROM {pg.table}").fetchall())  # type: ignore[attr-defined]


def test_racing_tasks_join_one_attempt_and_the_driver_commits_it(spec: DoorSpec) -> None:
    msgs = _tasks(spec, 0, 4)
    assert {m[0].key for m in msgs} == {msgs[0][0].key}  # four begins, one attempt
    assert msgs[0][0].key.attempt == 1 and all(m[0].kind == BeginKind.NEW for m in msgs)
    commit_batch(spec, msgs, 0)
    want = sorted(i for p in range(4) for i in _rows(0, p)[0].column("id").to_pylist())
    assert _ids(spec) == want
    assert verify(list(spec.participants), want, sink=spec.name).ok
    # a replay of the committed batch: the tasks write nothing, the commit does nothing
    again = _tasks(spec, 0, 4)
    assert all(m[0].kind == BeginKind.COMMITTED and m[1] is None for m in again)
    commit_batch(spec, again, 0)
    assert _ids(spec) == want


def test_a_failed_task_aborts_the_batch_and_leaves_nothing(spec: DoorSpec) -> None:
    msgs: list[Message | None] = list(_tasks(spec, 1, 3))
    msgs[1] = None  # its task failed for good: Spark calls abort
    with pytest.raises(IllegalTransition, match="a task failed"):
        commit_batch(spec, msgs, 1)
    abort_batch(spec, msgs, 1)
    client = spec.client()
    first = msgs[0]
    assert first is not None
    assert client.get(first[0].key).state in (State.ABORTED, State.ABORTING)
    assert _ids(spec) == []
    assert all(p.in_doubt(spec.name) == [] for p in spec.participants)
    # the restarted query (a newer writer) writes the batch as attempt 2
    newer = DoorSpec(spec.name, spec.participants, spec.coordinator_url,
                     client.register(spec.name), spec.partitions, spec.token)
    again = _tasks(newer, 1, 3)
    assert again[0][0].key.attempt == 2
    commit_batch(newer, again, 1)
    assert len(_ids(spec)) == 15


def test_a_partition_past_the_bound_is_refused(spec: DoorSpec) -> None:
    with pytest.raises(InvalidRequest, match="partitions"):
        prepare_partition(spec, 2, "q-1", 6, "1/6", SCHEMA, iter(()))


def test_a_stale_writers_commit_fails_without_touching_the_newer(spec: DoorSpec) -> None:
    msgs = _tasks(spec, 3, 2)
    client = spec.client()
    newer = DoorSpec(spec.name, spec.participants, spec.coordinator_url,
                     client.register(spec.name), spec.partitions, spec.token)
    taken = _tasks(newer, 3, 2)  # the newer run takes the undecided attempt over
    assert taken[0][0].key.attempt == 2
    with pytest.raises(BatchFailed):
        commit_batch(spec, msgs, 3)  # the zombie's attempt was aborted by the take-over
    commit_batch(newer, taken, 3)
    assert len(_ids(spec)) == 10


def test_the_tasks_take_the_sessions_zone_and_refuse_another_named_one() -> None:
    """Spark's batches carry the session's zone: a sink that names none prepares in it
    (a session on Etc/UTC against a plan made in UTC, nested timestamps too); one that
    names another zone is refused with both zones and the fix."""
    from twophase.engine.door import adopt_zone

    def schema(tz: str) -> pa.Schema:
        ts = pa.timestamp("us", tz=tz)
        return pa.schema([("id", pa.int64()), ("ts", ts), ("at", pa.list_(pa.struct(
            [("when", ts)])))])

    plan, spark = schema("UTC"), schema("Etc/UTC")
    free = DoorSpec("zones", (), "http://127.0.0.1:1", 1, 1)
    assert adopt_zone(free, plan, spark) == spark
    assert adopt_zone(free, plan, plan) == plan
    assert adopt_zone(free, SCHEMA, SCHEMA) == SCHEMA  # no timestamp at all
    other = pa.schema([("id", pa.string())])  # not a zone difference: the checks' business
    assert adopt_zone(free, plan, other) == plan
    named = DoorSpec("zones", (), "http://127.0.0.1:1", 1, 1, tz="UTC")
    assert adopt_zone(named, plan, plan) == plan
    with pytest.raises(InvalidRequest) as err:
        adopt_zone(named, plan, spark)
    assert str(err.value) == (
        "sink 'zones': option timezone='UTC', but the session's time zone "
        "(spark.sql.session.timeZone, which Spark's batches carry) is 'Etc/UTC'; leave the "
        "option out (the sink then takes the session's zone) or set timezone='Etc/UTC'")



def test_a_sink_declared_by_options_is_checked_as_one_declared_in_code(tmp_path: Path) -> None:
    """The options door builds the same ``SinkSettings`` as ``TransactionalSink``: each
    bad option is refused naming it and its fix, before any coordinator is asked (the
    URL below answers nobody), and a secret or an unknown sink name is refused too."""
    import json

    from twophase.engine.door import spec_for
    from twophase.participant import descriptor_of
    from twophase.sinks.kafka import KafkaParticipant

    files = StagedFileParticipant(path=str(tmp_path / "out"))
    kafka = KafkaParticipant("orders", {"bootstrap.servers": "127.0.0.1:9"},
                             transaction_timeout_ms=120_000, prepare="resumable")
    base = {"sink": "opts", "coordinator": "http://127.0.0.1:1",
            "participants": json.dumps([descriptor_of(files)])}
    cases = [
        ({"partitions": "eight"}, "option partitions='eight' is not a number: give a whole "
                                  "number, or leave it out for the default"),
        ({"vote_timeout": "soon"}, "option vote_timeout='soon' is not a number"),
        ({"partitions": "0"}, "partitions"),
        ({"lineage": "../up"}, "lineage"),
        ({"participants": json.dumps([descriptor_of(files), descriptor_of(kafka)]),
          "vote_timeout": "300"}, "transaction_timeout_ms=120000 must exceed the sink's "
                                  "vote window"),
        ({"password": "x"}, "option 'password': secrets never go in options"),
    ]
    for extra, refusal in cases:
        with pytest.raises(InvalidRequest) as err:
            spec_for({**base, **extra}, {})
        assert refusal in str(err.value), (extra, str(err.value))
    with pytest.raises(InvalidRequest, match=r"no twophase sink named 'other' is registered "
                                             r"in this application \(registered: none\)"):
        spec_for({"sink": "other"}, {})
