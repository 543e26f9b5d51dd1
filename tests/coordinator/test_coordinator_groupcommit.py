"""Group commit on SQLite: many requests, one transaction and one fsync, each judged alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, insert, select

from tests.support.store import decisions, new_sink
from twophase import protocol as p
from twophase.coordinator import schema as s
from twophase.coordinator.groupcommit import Job as _Job
from twophase.coordinator.store import Store
from twophase.errors import TransactionNotFound


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    st = Store(f"sqlite:///{tmp_path}/log.db")
    yield st
    st.close()



def _wait(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 10
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def in_one_group(st: Store, calls: list[Callable[[], Any]]) -> list[tuple[str, Any]]:
    """Run ``calls`` concurrently so that the writer takes all of them as one group.

    The test holds the store's write lock: the writer takes a first (plug) request and
    blocks; the calls queue up behind it; releasing the lock commits the plug alone and
    then every call together.
    """
    out: list[tuple[str, Any]] = [("none", None)] * len(calls)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            out[i] = ("ok", fn())
        except BaseException as exc:
            out[i] = ("err", exc)

    lock: Any = st.db.write_lock
    before = st.group_stats.largest
    lock.acquire()
    try:
        plug = _Job(lambda conn: (None, []))
        st.writes.enqueue(plug)  # queued before this returns: qsize 0 means the writer took it
        _wait(lambda: st.writes.queue.qsize() == 0, "the writer to take the plug")
        ts = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
        for t in ts:
            t.start()
        _wait(lambda: st.writes.queue.qsize() == len(calls), "the calls to queue up")
    finally:
        lock.release()
    for t in ts:
        t.join(30)
    assert plug.done.wait(30) and plug.error is None
    assert st.group_stats.largest >= max(before, len(calls)), st.group_stats
    return out



def test_conflicting_writes_in_one_group_make_one_decision(store: Store) -> None:
    sink = new_sink()
    epoch = store.register(sink).epoch
    res = store.begin(p.Begin(sink, "L", 0, epoch, ("a", "b"), 2, time.time()))
    assert res.txn is not None
    key = res.txn.key
    bids = list(res.txn.branches)
    now = time.time()
    calls: list[Callable[[], Any]] = []

    def yes(b: str) -> Callable[[], Any]:
        return lambda: store.apply(key, [p.Vote(b, epoch, True, now, {"h": b})])

    calls += [yes(b) for b in bids]  # every branch votes YES (would COMMIT) ...
    # ... while the writer abandons and one branch also votes NO (both would ABORT)
    calls.append(lambda: store.apply(key, [p.Abandon(epoch, "writer gave up", now)]))
    calls.append(lambda: store.apply(key, [p.Vote(bids[0], epoch, False, now,
                                                  reason="disk full")]))
    out = in_one_group(store, calls)
    final = store.get(key)
    assert final is not None and final.decision is not None
    assert decisions(store, key) == 1
    for kind, val in out:
        if kind == "ok":  # every answer that shows a decision shows the stored one
            assert val.decision in (None, final.decision)
        else:
            assert isinstance(val, p.ProtocolError), val
    assert sum(kind == "ok" for kind, _ in out) >= 1


def test_a_failing_request_does_not_fail_its_group(store: Store) -> None:
    keys = []
    for _ in range(3):  # three writers, one open transaction each
        sink = new_sink()
        epoch = store.register(sink).epoch
        r = store.begin(p.Begin(sink, "L", 0, epoch, ("a",), 1, time.time()))
        assert r.txn is not None
        keys.append(r.txn.key)
    bid = "a/0"
    now = time.time()

    def writes_then_fails(conn: Connection) -> tuple[None, list[Any]]:
        conn.execute(insert(s.meta).values(key="half-done", value="x"))
        raise RuntimeError("boom after a write")

    calls: list[Callable[[], Any]] = [
        lambda: store.apply(keys[0], [p.Vote(bid, epoch, True, now, {"h": "0"})]),
        lambda: store.apply(keys[1], [p.Vote(bid, epoch - 1, True, now, {"h": "1"})]),
        lambda: store.apply((sink, "L", 99, 1), [p.Vote(bid, epoch, True, now)]),
        lambda: store._write(writes_then_fails),
        lambda: store.apply(keys[2], [p.Vote(bid, epoch, True, now, {"h": "2"})]),
    ]
    out = in_one_group(store, calls)
    assert out[0][0] == "ok" and out[0][1].decision == p.Decision.COMMIT
    assert out[1][0] == "err" and isinstance(out[1][1], p.ProtocolError)
    assert out[1][1].code == "stale_epoch"
    assert out[2][0] == "err" and isinstance(out[2][1], TransactionNotFound)
    assert out[3][0] == "err" and "boom after a write" in str(out[3][1])
    assert out[4][0] == "ok" and out[4][1].decision == p.Decision.COMMIT
    # the failed request's own write was undone (its SAVEPOINT), the others are durable
    with store.read_engine.connect() as conn:
        assert conn.execute(select(s.meta).where(s.meta.c.key == "half-done")).first() is None
    store.close()
    again = Store(store.url)
    try:
        for k, want in ((keys[0], "COMMITTING"), (keys[1], "OPEN"), (keys[2], "COMMITTING")):
            t = again.get(k)
            assert t is not None and t.state.value == want, (k, t)
    finally:
        again.close()


def test_many_concurrent_rounds_all_complete(store: Store) -> None:
    """Threads running whole rounds share groups; every round ends COMMITTED."""
    errors: list[BaseException] = []

    def rounds() -> None:
        try:
            sink = new_sink()
            epoch = store.register(sink).epoch
            for ckpt in range(5):
                r = store.begin(p.Begin(sink, "L", ckpt, epoch, ("a", "b"), 2, time.time()))
                assert r.txn is not None
                k, bids = r.txn.key, list(r.txn.branches)
                now = time.time()
                t = store.apply(k, [p.Vote(b, epoch, True, now, {"h": b}) for b in bids])
                assert t.decision == p.Decision.COMMIT
                t = store.apply(k, [p.Ack(b, epoch, p.Decision.COMMIT, now) for b in bids])
                assert t.state == p.State.COMMITTED
            rec = store.sink(sink)
            assert rec is not None and rec.last_committed == 4
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=rounds) for _ in range(12)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert store.group_stats.jobs == 12 * (1 + 5 * 3)
    assert store.group_stats.groups < store.group_stats.jobs  # some requests shared a commit


def test_store_without_group_commit_still_works(tmp_path: Path) -> None:
    st = Store(f"sqlite:///{tmp_path}/plain.db", group_commit=False)
    try:
        sink = new_sink()
        epoch = st.register(sink).epoch
        r = st.begin(p.Begin(sink, "L", 0, epoch, ("a",), 1, time.time()))
        assert r.txn is not None
        t = st.apply(r.txn.key, [p.Vote("a/0", epoch, True, time.time(), {"h": "x"})])
        assert t.decision == p.Decision.COMMIT
        assert st.group_stats.groups == 0 and st.writes.thread is None
    finally:
        st.close()


def test_async_writes_share_groups_and_fail_alone(store: Store) -> None:
    """The service's event-loop path: no worker thread per request, same isolation."""
    import asyncio

    async def main() -> list[Any]:
        sinks = [new_sink() for _ in range(6)]
        epochs = await asyncio.gather(*(store.register_async(sk) for sk in sinks))
        begun = await asyncio.gather(*(
            store.begin_async(p.Begin(sk, "L", 0, e.epoch, ("a",), 1, time.time()))
            for sk, e in zip(sinks, epochs, strict=True)
        ))
        now = time.time()
        votes = []
        for i, (r, e) in enumerate(zip(begun, epochs, strict=True)):
            assert r.txn is not None
            epoch = e.epoch - 1 if i == 2 else e.epoch  # one stale writer
            votes.append(store.apply_async(r.txn.key, [p.Vote("a/0", epoch, True, now, {})]))
        return await asyncio.gather(*votes, return_exceptions=True)

    out = asyncio.run(main())
    assert isinstance(out[2], p.ProtocolError) and out[2].code == "stale_epoch"
    for i, t in enumerate(out):
        if i != 2:
            assert isinstance(t, p.Transaction) and t.decision == p.Decision.COMMIT, t
    assert store.group_stats.largest > 1  # gathered requests were committed together
