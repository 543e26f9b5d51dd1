"""The abandon race through a real daemon: the Spark job fails after the last vote was
recorded (COMMIT decided), and the driver's ``abandon`` must answer that COMMIT so the
driver finishes the commit, instead of HTTP 409 ``illegal_transition`` failing the query.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from twophase import protocol as p
from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.testing.servers import LocalDaemon

TOKEN = "race-token-1-0123456789"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[str]:
    """``twophase serve`` on a fresh SQLite log; always stopped."""
    server = LocalDaemon(f"sqlite:///{tmp_path}/tp.db", TOKEN, tmp_path / "daemon.log")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_abandon_after_the_last_vote_answers_commit(daemon: str) -> None:
    with CoordinatorClient(daemon, TOKEN) as client:
        epoch = client.register("orders")
        res = client.begin("orders", "lin-race", 0, epoch, ["pg"], 2)
        assert res.kind == p.BeginKind.NEW and res.txn is not None
        key = res.txn.key
        # both tasks voted YES (the last vote decided COMMIT) ... then the job failed
        voted = client.vote(key, epoch, [VoteIn(branch="pg/0", yes=True, handle={"gid": "a"}),
                                         VoteIn(branch="pg/1", yes=True, handle={"gid": "b"})])
        assert voted.decision == p.Decision.COMMIT
        # ... so the driver abandons, and learns the COMMIT instead of a 409
        answer = client.abandon(key, epoch, "Spark job failed: executor lost")
        assert answer.decision == p.Decision.COMMIT and answer.state == p.State.COMMITTING
        assert answer.reason is None  # the abandon reason is not recorded on a COMMIT
        step = p.next_step(answer, aborted=0, finishing=0, max_attempts=3, backoff=1.0,
                           job_error="executor lost", abandoned=True)
        assert step.kind == p.StepKind.FINISH and step.delay == 0
        # the driver begins again: in doubt, finish under the same decision
        again = client.begin("orders", "lin-race", 0, epoch, ["pg"], 2)
        assert again.kind == p.BeginKind.IN_DOUBT and again.txn is not None
        assert again.txn.key == key
        done = client.ack(key, epoch, [("pg/0", p.Decision.COMMIT), ("pg/1", p.Decision.COMMIT)])
        assert done.state == p.State.COMMITTED
        # abandon of a finished COMMIT is answered unchanged too ...
        assert client.abandon(key, epoch, "late").state == p.State.COMMITTED
        newer = client.register("orders")  # and for a newer writer
        assert client.abandon(key, newer, "took over").state == p.State.COMMITTED
        # ... but the epoch is still checked: a writer older than the attempt's is refused
        assert epoch == 1
        with pytest.raises(p.StaleEpoch):
            client.abandon(key, epoch - 1, "zombie")
        assert client.get(key).state == p.State.COMMITTED


def test_next_step_after_abandon_answered_commit_is_finish() -> None:
    """The driver's rule for the race, without a daemon."""
    req = p.Begin("orders", "lin-race", 0, 1, ("pg",), 2, now=0.0)
    res = p.begin(None, (), req)
    assert res.txn is not None
    txn = res.txn
    for b in txn.branches:
        txn = p.handle(txn, p.Vote(branch=b, epoch=1, yes=True, now=1.0))
    answer = p.handle(txn, p.Abandon(epoch=1, reason="Spark job failed: boom", now=2.0))
    assert answer is txn and answer.decision == p.Decision.COMMIT
    step = p.next_step(answer, aborted=0, finishing=0, max_attempts=3, backoff=1.0,
                       job_error="boom", abandoned=True)
    assert step.kind == p.StepKind.FINISH
    assert (step.aborted, step.finishing) == (0, 0)  # neither an abort nor a finishing try
