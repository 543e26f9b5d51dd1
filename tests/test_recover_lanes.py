"""The driver asks the branches of a recovered batch their state in lanes
(``twophase.engine.recover``): each branch by a participant no other thread uses, every
result in order, and a failure in a lane raised, not lost."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from twophase.engine import recover
from twophase.participant import BranchRef, BranchStatus, Handle, Participant
from twophase.sinks.files import StagedFileParticipant
from twophase.testing.conformance import SCHEMA, _prepare, make_branch


def _prepared(tmp_path: Path, n: int) -> tuple[StagedFileParticipant, list[recover._Item]]:
    part = StagedFileParticipant(str(tmp_path / "out"), name="files")
    part.check(SCHEMA)
    lineage = "lanes0000000000a"
    items: list[recover._Item] = []
    for p in range(n):
        ref = make_branch(part, lineage=lineage, partition=p)
        items.append((part, ref, _prepare(part, ref)))
    return part, items


def test_a_many_partition_finish_asks_every_branch_in_lanes(tmp_path: Path) -> None:
    part, items = _prepared(tmp_path, 3 * recover.BRANCHES_PER_LANE)
    used: Counter[int] = Counter()  # participant object -> branches it was asked about
    threads: dict[int, set[int]] = {}  # participant object -> threads that used it
    lock = threading.Lock()

    def status(p: Participant, ref: BranchRef, handle: Handle) -> BranchStatus:
        with lock:
            used[id(p)] += 1
            threads.setdefault(id(p), set()).add(threading.get_ident())
        return p.voted_status(ref, handle)

    statuses = recover._in_lanes(items, status)
    assert statuses == [BranchStatus.PREPARED] * len(items)
    # one lane per BRANCHES_PER_LANE branches, each with a participant of its own (the
    # first lane the sink's own), and no participant used by two threads
    assert sorted(used.values()) == [recover.BRANCHES_PER_LANE] * 3
    assert id(part) in used and all(len(t) == 1 for t in threads.values())
    recover._in_lanes(items, lambda p, r, h: p.commit(r, h))  # a lane's writes land too
    assert [part.status(ref) for _, ref, _ in items] == [BranchStatus.COMMITTED] * len(items)
    assert len(list((tmp_path / "out").glob("*.parquet"))) == len(items)


def test_a_failure_in_a_lane_is_raised(tmp_path: Path) -> None:
    part, items = _prepared(tmp_path, 2 * recover.BRANCHES_PER_LANE)
    broken = items[5][1]
    part.abort(broken, items[5][2])  # its staged file is gone: its commit must fail
    with pytest.raises(Exception, match="neither the staged nor the final file exists"):
        recover._in_lanes(items, lambda p, r, h: p.commit(r, h))
    assert part.status(items[0][1]) is BranchStatus.COMMITTED  # the other lane went on
