"""The decision log: SQLite and a real PostgreSQL, CAS between replicas, background work."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pg import fresh_pg_db
from tests.support.store import decisions, new_sink
from twophase import protocol as p
from twophase.coordinator.background import Background, Settings, parse_duration
from twophase.coordinator.db import StoreMissing
from twophase.coordinator.store import Store, normalize_url
from twophase.errors import SchemaMismatch, TransactionNotFound


@pytest.fixture(scope="module")
def pg_url(pg_dsn: str) -> str:
    return fresh_pg_db(pg_dsn, "tp_store")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/log.db"
    else:
        url = request.getfixturevalue("pg_url")
    st = Store(url)
    yield st
    st.close()


def _begin(st: Store, sink: str, ckpt: int, epoch: int, parts: int = 2,
           timeout: float = 300.0, lineage: str = "L") -> p.BeginResult:
    return st.begin(p.Begin(sink, lineage, ckpt, epoch, ("pg", "files"), parts, time.time(),
                            vote_timeout=timeout))




def test_commit_round_and_replay(store: Store) -> None:
    sink = new_sink()
    epoch = store.register(sink).epoch
    res = _begin(store, sink, 0, epoch)
    assert res.kind == p.BeginKind.NEW and res.txn is not None
    key = res.txn.key
    branches = list(res.txn.branches)
    t = store.apply(key, [p.Vote(b, epoch, True, time.time(), {"gid": b}) for b in branches])
    assert t.state == p.State.COMMITTING
    again = store.get(key)
    assert again == t and again.branches["pg/0"].handle == {"gid": "pg/0"}
    t = store.apply(key, [p.Ack(b, epoch, p.Decision.COMMIT, time.time()) for b in branches])
    assert t.state == p.State.COMMITTED
    rec = store.sink(sink)
    assert rec is not None and rec.last_committed == 0
    assert _begin(store, sink, 0, epoch).kind == p.BeginKind.COMMITTED
    assert decisions(store, key) == 1
    kinds = [e["kind"] for e in store.history(key)]
    assert kinds[0] == "begin" and kinds.count("vote") == 4 and kinds.count("ack") == 4


def test_no_vote_aborts_and_refusals_change_nothing(store: Store) -> None:
    sink = new_sink()
    epoch = store.register(sink).epoch
    res = _begin(store, sink, 7, epoch)
    assert res.txn is not None
    key = res.txn.key
    store.apply(key, [p.Vote("pg/0", epoch, True, time.time(), {"gid": "x"})])
    t = store.apply(key, [p.Vote("files/1", epoch, False, time.time(), reason="disk full")])
    assert t.state == p.State.ABORTING and "disk full" in (t.reason or "")
    before = store.get(key)
    with pytest.raises(p.IllegalTransition):
        store.apply(key, [p.Ack("pg/0", epoch, p.Decision.COMMIT, time.time())])
    with pytest.raises(p.UnknownBranch):
        store.apply(key, [p.Vote("kafka/0", epoch, True, time.time())])
    assert store.get(key) == before
    with pytest.raises(TransactionNotFound):
        store.apply((sink, "L", 99, 1), [p.Expire(time.time())])
    t = store.apply(key, [p.Ack("pg/0", epoch, p.Decision.ABORT, time.time())])
    assert t.state == p.State.ABORTED
    # the next begin of the same checkpoint is a new attempt with the same partitions
    nxt = _begin(store, sink, 7, epoch, parts=5)
    assert nxt.kind == p.BeginKind.NEW and nxt.txn is not None
    assert nxt.txn.attempt == 2 and nxt.txn.partitions == 2


def test_stale_epoch_is_refused(store: Store) -> None:
    sink = new_sink()
    old = store.register(sink).epoch
    res = _begin(store, sink, 0, old)
    assert res.txn is not None
    new = store.register(sink).epoch
    assert new == old + 1
    with pytest.raises(p.StaleEpoch):
        _begin(store, sink, 0, old)
    taken = _begin(store, sink, 0, new)  # the new writer abandons the old attempt
    assert taken.txn is not None and taken.txn.attempt == 2
    assert store.get(res.txn.key).state == p.State.ABORTED  # type: ignore[union-attr]
    with pytest.raises(p.StaleEpoch):
        store.apply(taken.txn.key, [p.Vote("pg/0", old, True, time.time())])


def test_deadline_alert_and_retention(store: Store) -> None:
    sink = new_sink()
    epoch = store.register(sink).epoch
    bg = Background(store, Settings(retention=100.0, alert_after=50.0, purge_every=0.0))
    now = time.time()
    slow = _begin(store, sink, 5, epoch, timeout=10.0).txn  # above last_committed: kept
    assert slow is not None
    store.apply(slow.key, [p.Vote("pg/0", epoch, True, now)])
    bg.tick(now + 5)
    assert store.get(slow.key).state == p.State.PREPARING  # type: ignore[union-attr]
    bg.tick(now + 11)
    expired = store.get(slow.key)
    assert expired is not None and expired.state == p.State.ABORTING
    assert "no vote from" in (expired.reason or "")
    # committed but never acknowledged: flagged, never given up
    stuck = _begin(store, sink, 1, epoch).txn
    assert stuck is not None
    store.apply(stuck.key, [p.Vote(b, epoch, True, now) for b in stuck.branches])
    assert bg.tick(now + 20)["alerts"] == 0
    assert bg.tick(now + 60)["alerts"] >= 1
    flagged = {r.txn.key for r in store.list(sink=sink, alert=True)}
    assert stuck.key in flagged and store.stats(now + 60)["alerts"] >= 1
    done = store.apply(stuck.key, [p.Ack(b, epoch, p.Decision.COMMIT, now + 61)
                                   for b in stuck.branches])
    assert done.state == p.State.COMMITTED
    assert stuck.key not in {r.txn.key for r in store.list(sink=sink, alert=True)}
    # retention: the committed checkpoint goes; the aborted, never-committed one stays
    store.apply(slow.key, [p.Ack("pg/0", epoch, p.Decision.ABORT, now + 62)])
    bg.tick(now + 62 + 50)
    assert store.get(stuck.key) is not None  # younger than retention
    purged = bg.tick(time.time() + 1000)["purged"]
    assert purged >= 1
    assert store.get(stuck.key) is None and store.history(stuck.key) == []
    assert store.get(slow.key) is not None
    assert _begin(store, sink, 1, epoch).kind == p.BeginKind.COMMITTED  # from the sink row


def test_schema_version_is_checked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/v.db"
    Store(url).close()
    st = Store(url)  # same version: fine
    with st.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE twophase_meta SET value='999' WHERE key='schema_version'")
    st.close()
    with pytest.raises(SchemaMismatch, match="schema version 999"):
        Store(url)
    (tmp_path / "empty.db").touch()  # a SQLite file of something else: no schema in it
    with pytest.raises(SchemaMismatch, match="no twophase schema"):
        Store(f"sqlite:///{tmp_path}/empty.db", create=False)


def test_a_missing_sqlite_file_is_refused_unless_creation_was_asked_for(tmp_path: Path) -> None:
    """``create=False`` (the operators' commands, ``twophase force``/``resolve`` on a store
    URL) names the path and the fix, and leaves neither a file nor a folder behind."""
    missing = tmp_path / "typo" / "tp.db"
    with pytest.raises(StoreMissing) as err:
        Store(f"sqlite:///{missing}", create=False)
    assert f"no SQLite store at {missing}: the file does not exist" in str(err.value)
    assert "never creates one" in str(err.value) and "twophase serve" in str(err.value)
    assert not (tmp_path / "typo").exists()
    with pytest.raises(StoreMissing, match="it is a folder"):
        Store(f"sqlite:///{tmp_path}", create=False)
    Store(f"sqlite:///{missing}").close()  # asked for: created
    assert missing.is_file()


def test_urls() -> None:
    assert normalize_url("postgresql://u@h:1/d") == "postgresql+psycopg://u@h:1/d"
    assert normalize_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"
    with pytest.raises(ValueError, match="in-memory"):
        normalize_url("sqlite:///:memory:")
    with pytest.raises(ValueError, match="unsupported store URL"):
        normalize_url("mysql://x")


def test_replicas_race_one_decision_each(pg_url: str) -> None:
    """Two stores (two replicas) on one PostgreSQL database, voters racing on both."""
    a, b = Store(pg_url), Store(pg_url)
    decided: dict[tuple[str, str, int, int], int] = {}
    lock = threading.Lock()

    def count(before: p.Transaction | None, after: p.Transaction) -> None:
        if after.decision is not None and (before is None or before.decision is None):
            with lock:
                decided[after.key] = decided.get(after.key, 0) + 1

    a.on_change = b.on_change = count
    sink = new_sink()
    epoch = a.register(sink).epoch
    txns = []
    for ckpt in range(12):
        res = _begin(a if ckpt % 2 else b, sink, ckpt, epoch, parts=4)
        assert res.txn is not None
        txns.append(res.txn)
    jobs = []
    for i, t in enumerate(txns):
        for j, bid in enumerate(t.branches):
            yes = not (i % 3 == 0 and j == 5)  # every third transaction gets one NO
            jobs.append((a if (i + j) % 2 else b, t.key, bid, yes))
    errors: list[BaseException] = []

    def run(chunk: list[tuple[Store, tuple[str, str, int, int], str, bool]]) -> None:
        try:
            for st, key, bid, yes in chunk:
                st.apply(key, [p.Vote(bid, epoch, yes, time.time(), reason="no")])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(jobs[k::8],)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for i, t in enumerate(txns):
        final = a.get(t.key)
        assert final is not None
        if i % 3 == 0:  # ABORTED when the NO came before every YES (no ack pending)
            assert final.state in (p.State.ABORTING, p.State.ABORTED), (i, final.state)
            assert final.decision == p.Decision.ABORT
        else:
            assert final.state == p.State.COMMITTING, (i, final.state, final.reason)
        assert decided.get(t.key) == 1
        assert decisions(a, t.key) == 1
    a.close()
    b.close()


def test_parse_duration() -> None:
    assert parse_duration("3d") == 3 * 86400
    assert parse_duration("90") == 90
    with pytest.raises(ValueError, match="cannot read duration"):
        parse_duration("soon")


def test_retention_keeps_up_with_a_fast_sink(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full purge is followed by another at the next round, not a minute later: with
    10 a round (1,000 in the daemon), 25 finished transactions are gone after three rounds
    one second apart, although purge_every is 60 s."""
    from twophase.coordinator import background

    monkeypatch.setattr(background, "PURGE_BATCH", 10)
    PURGE_BATCH = background.PURGE_BATCH
    sink = new_sink()
    epoch = store.register(sink).epoch
    now = time.time()
    n = 2 * PURGE_BATCH + PURGE_BATCH // 2
    for batch in range(n):
        txn = _begin(store, sink, batch, epoch).txn
        assert txn is not None
        events: list[p.Event] = [p.Vote(b, epoch, True, now) for b in txn.branches]
        events += [p.Ack(b, epoch, p.Decision.COMMIT, now) for b in txn.branches]
        store.apply(txn.key, events)
    bg = Background(store, Settings(retention=10.0, purge_every=60.0))
    later = now + 100
    assert [bg.tick(later + i)["purged"] for i in range(4)] == [
        PURGE_BATCH, PURGE_BATCH, PURGE_BATCH // 2, 0]
    assert store.list(sink=sink) == []


def test_two_stores_on_one_log_never_answer_from_a_stale_decoded_record(
    store: Store,
) -> None:
    """Each store keeps its last durable records decoded (``sql.Rows``); a replica that
    wrote in between (another daemon on the same log) changes the row's version, so the
    other store reads the row again instead of answering from what it kept, and a refused
    change (a vote that contradicts itself) keeps nothing of its own."""
    other = Store(store.url)
    try:
        sink = new_sink()
        epoch = store.register(sink).epoch
        res = _begin(store, sink, 0, epoch, parts=2)
        assert res.txn is not None
        key = res.txn.key
        store.apply(key, [p.Vote("pg/0", epoch, True, time.time(), {"gid": "a"})])
        assert store.get(key).branches["pg/0"].vote == p.Decision.COMMIT  # type: ignore[union-attr]
        other.apply(key, [p.Vote("pg/1", epoch, True, time.time(), {"gid": "b"})])
        with pytest.raises(Exception, match="vote"):
            store.apply(key, [p.Vote("pg/0", epoch, False, time.time(), reason="no")])
        t = store.apply(key, [p.Vote(b, epoch, True, time.time(), {"gid": b})
                              for b in ("files/0", "files/1")])
        assert t.decision == p.Decision.COMMIT
        assert t.branches["pg/1"].handle == {"gid": "b"}  # the other store's vote, read
        assert t.branches["pg/0"].vote == p.Decision.COMMIT  # the refusal changed nothing
        assert other.get(key) == t
    finally:
        other.close()


def test_listing_indexes_are_added_to_a_store_made_before_them(tmp_path: Path) -> None:
    """The console's and /metrics' queries (newest transactions of a sink, the alert
    count) have indexes; a version 3 store made before they existed gets them when a
    coordinator starts on it, and SQLite's planner uses them."""
    import sqlite3

    db = tmp_path / "log.db"
    Store(f"sqlite:///{db}").close()
    names = ("twophase_txns_created", "twophase_txns_sink_created", "twophase_txns_alert")
    with sqlite3.connect(db) as conn:
        for n in names:
            conn.execute(f"DROP INDEX {n}")
    Store(f"sqlite:///{db}").close()
    with sqlite3.connect(db) as conn:
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert set(names) <= have
        plan = " ".join(str(r) for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM twophase_txns WHERE sink = 'x' "
            "ORDER BY created DESC LIMIT 50"))
        assert "twophase_txns_sink_created" in plan, plan
        plan = " ".join(str(r) for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT count(*) FROM twophase_txns WHERE alert = 1"))
        assert "twophase_txns_alert" in plan, plan


def test_the_listing_reads_a_page_with_its_branches_in_one_query(store: Store) -> None:
    """The console's and the API's listing: one statement per page (the transactions
    joined with their branch rows), not one per transaction; each listed record equals
    the one read alone (every branch, in order, with its vote and ack), newest first,
    under each filter; SQLite's planner joins through the branches' primary key."""
    from sqlalchemy import event

    sink = new_sink()
    epoch = store.register(sink).epoch
    keys = []
    for ckpt in range(4):  # committed, committing (one partition), preparing, open
        res = _begin(store, sink, ckpt, epoch, parts=1 if ckpt == 1 else 3)
        assert res.txn is not None
        key, bids = res.txn.key, list(res.txn.branches)
        keys.append(key)
        if ckpt <= 2:
            votes = bids if ckpt < 2 else bids[:2]
            store.apply(key, [p.Vote(b, epoch, True, time.time(), {"gid": b}, task="t")
                              for b in votes])
        if ckpt == 0:
            store.apply(key, [p.Ack(b, epoch, p.Decision.COMMIT, time.time()) for b in bids])
        time.sleep(0.002)  # distinct creation times: the newest-first order is the truth
    statements: list[tuple[str, object]] = []

    def seen(conn: object, cursor: object, statement: str, params: object,
             *rest: object) -> None:
        if "twophase_" in statement:
            statements.append((statement, params))

    engine = store.db.read_engine
    event.listen(engine, "before_cursor_execute", seen)
    try:
        listed = store.list(sink=sink)
        committed = store.list(sink=sink, state="COMMITTED")
        top = store.list(sink=sink, limit=2)
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert len(statements) == 3, statements  # one per page, however many transactions
    assert [r.txn.key for r in listed] == keys[::-1]
    for row in listed:
        alone = store.get(row.txn.key)
        assert row.txn == alone and list(row.txn.branches) == list(alone.branches)
    assert [len(r.txn.branches) for r in listed] == [6, 6, 2, 6]
    assert [r.txn.state for r in listed] == [p.State.OPEN, p.State.PREPARING,
                                             p.State.COMMITTING, p.State.COMMITTED]
    assert [r.txn.key for r in committed] == [keys[0]] and committed[0].txn == listed[-1].txn
    assert [r.txn for r in top] == [r.txn for r in listed[:2]]
    if store.db.is_sqlite:
        sql, params = statements[0]
        with store.db.read() as conn:
            plan = " ".join(str(r) for r in conn.exec_driver_sql(
                "EXPLAIN QUERY PLAN " + sql, params))  # type: ignore[arg-type]
        assert "SEARCH twophase_branches" in plan, plan
