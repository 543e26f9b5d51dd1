"""No ceiling on branches per batch (issue 30 item 4): a batch of 10,000 branches runs
through the daemon's HTTP API as the driver runs it (begin, the votes and the acks in
bounded chunks, each answer carrying only its chunk's branches), on a SQLite store, and
ends COMMITTED with every branch voted and acknowledged. Before the row-per-branch store
and the chunked relay, votes past ~8,000 branches were refused (1 MiB body limit) and a
vote rewrote the whole transaction."""

from __future__ import annotations

from pathlib import Path

from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.engine.commit import ACK_CHUNK, send_acks
from twophase.engine.decide import decide
from twophase.protocol import Decision, State
from twophase.testing.servers import LocalDaemon

TOKEN = "ten-thousand-token"
P = 10_000


def test_a_batch_of_ten_thousand_branches_commits_through_http(tmp_path: Path) -> None:
    daemon = LocalDaemon(f"sqlite:///{tmp_path / 'tp.db'}", TOKEN, tmp_path / "d.log").start()
    client = CoordinatorClient(daemon.url, TOKEN)
    try:
        epoch = client.register("wide")
        begun = client.begin("wide", "lineage-1", 0, epoch, ["files"], P, 300.0)
        assert begun.txn is not None and begun.txn.partitions == P
        handle = {"participant": "files", "file": "x" * 40, "rows": "1000"}
        votes = [VoteIn(branch=f"files/{i}", yes=True, handle=handle,
                        digest="v2:" + "0" * 32, task=f"7/{i}") for i in range(P)]
        decided = decide(client, begun.txn, epoch, votes, "")
        assert decided.state == State.COMMITTING and len(decided.branches) == P
        assert all(st.vote == Decision.COMMIT for st in decided.branches.values())
        acks = [(b, Decision.COMMIT) for b in decided.branches]
        assert len(acks) > ACK_CHUNK  # the acks go in several bounded requests
        done = send_acks(client, decided.key, epoch, acks, into=decided)
        assert done is not None and done.state == State.COMMITTED
        stored = client.get(decided.key)  # the whole record, as the console reads it
        assert stored.state == State.COMMITTED and len(stored.branches) == P
        assert all(st.ack == Decision.COMMIT for st in stored.branches.values())
        assert stored.branches["files/9999"].handle == handle
    finally:
        client.close()
        daemon.stop()
