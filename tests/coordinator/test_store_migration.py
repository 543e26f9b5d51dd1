"""A store made by 0.2's schema (version 3: a transaction's branches as one JSON column)
is migrated at start to a row per branch, and its in-doubt transactions are finished."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import inspect

from tests.support.old_store import old_store
from tests.support.pg import fresh_pg_db
from twophase import protocol as p
from twophase.coordinator.store import Store
from twophase.errors import SchemaMismatch


@pytest.fixture(params=["sqlite", "postgresql"])
def old_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/old.db"
    else:
        url = fresh_pg_db(request.getfixturevalue("pg_dsn"), "tp_migrate")
    old_store(url)
    return url


def test_a_version_3_store_is_migrated_and_its_in_doubt_transactions_finish(
    old_url: str,
) -> None:
    with pytest.raises(SchemaMismatch, match="start this version's coordinator on it once"):
        Store(old_url, create=False)  # a read-only tool never migrates
    st = Store(old_url)
    try:
        key_a, key_b = p.TxnKey("a", "L", 0, 1), p.TxnKey("b", "L", 0, 1)
        a = st.get(key_a)
        assert a is not None and a.state == p.State.COMMITTING and a.version == 7
        assert list(a.branches) == ["pg/0", "pg/1", "files/0"]
        assert a.branches["pg/0"] == p.BranchState(
            vote=p.Decision.COMMIT, handle={"gid": "g0"}, ack=p.Decision.COMMIT, digest="d0")
        assert a.branches["pg/1"] == p.BranchState(vote=p.Decision.COMMIT, handle={"gid": "g1"})
        assert a.branches["files/0"].task == "0.1" and a.pending_acks() == ["pg/1", "files/0"]
        # the sink's next writer is told to finish it, then does
        epoch = st.register("a").epoch
        res = st.begin(p.Begin("a", "L", 0, epoch, ("pg", "files"), 2, time.time()))
        assert res.kind == p.BeginKind.IN_DOUBT and res.txn == a
        done = st.apply(key_a, [p.Ack(b, epoch, p.Decision.COMMIT, time.time())
                                for b in a.pending_acks()])
        assert done.state == p.State.COMMITTED
        sink_a = st.sink("a")
        assert sink_a is not None and sink_a.last_committed == 0
        # the undecided one takes its last vote, is decided and finished
        b = st.apply(key_b, [p.Vote("pg/1", 3, True, time.time(), {"gid": "h1"})])
        assert b.state == p.State.COMMITTING and b.branches["pg/0"].handle == {"gid": "h0"}
        b = st.apply(key_b, [p.Ack(x, 3, p.Decision.COMMIT, time.time()) for x in b.branches])
        assert b.state == p.State.COMMITTED
    finally:
        st.close()
    st = Store(old_url, create=False)  # migrated once: a read-only tool opens it now
    try:
        got = st.get(key_b)
        assert got is not None and got == b
        assert st.history(key_b)[-1]["state"] == "COMMITTED"
        cols = {c["name"] for c in inspect(st.engine).get_columns("twophase_txns")}
        assert "branches" not in cols
    finally:
        st.close()
