"""A slow commit in the driver is never silent (issue 31: a 10-minute wait inside
librdkafka with nothing in the log): the Committer logs, while it lasts, which branch
is still being applied and where its thread waits."""

from __future__ import annotations

import logging

import pytest

from tests.protocol.test_participant_contract import _Bare
from twophase import failpoints
from twophase.engine.commit import Committer
from twophase.participant import BranchRef
from twophase.protocol import Decision


def test_a_slow_commit_is_logged_with_where_it_waits(caplog: pytest.LogCaptureFixture) -> None:
    part = _Bare("bare")
    committer = Committer([part])
    committer.slow_commit_s = 0.4
    refs = [BranchRef("orders", "lin", 7, 1, "bare", i) for i in range(2)]
    failpoints.reload("before_commit@bare/1=sleep(1.5)")
    try:
        with caplog.at_level(logging.WARNING, logger="twophase.sink"):
            done, error = committer._apply_all([(part, r, {}) for r in refs], Decision.COMMIT)
    finally:
        failpoints.reload("")
        committer.close()
    assert sorted(done) == sorted(r.branch_id for r in refs) and error == ""
    slow = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert slow, caplog.text
    assert all("sink orders batch 7: " in m and "partition 1: commit" in m for m in slow)
    assert "waiting in hit (failpoints.py:" in slow[0] and "_apply_lane (commit.py:" in slow[0]
    assert len(slow) <= 4  # again each slow_commit_s, not at every look
