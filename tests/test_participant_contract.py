"""The participant contract's optional hooks: defaults and what the verifier relies on."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pytest

from twophase.participant import BranchRef, BranchStatus, Handle, Participant, ReadBack
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.verify import verify


class _Bare(Participant):
    kind = "bare"

    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        return {}

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        pass

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        pass

    def status(self, branch: BranchRef) -> BranchStatus:
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        return []


class _Isolated(_Bare):
    def read_back(self, column: str) -> ReadBack:
        return ReadBack((1, 1, 2), isolation_dependent=True)


def test_defaults_no_vote_window_rule_and_no_reader() -> None:
    p = _Bare("bare")
    p.check_vote_window(10**9)  # no rule by default
    with pytest.raises(NotImplementedError, match="does not implement read_back"):
        verify([p], [1])


def test_isolation_dependent_figures_are_judged_only_when_asked() -> None:
    judged = verify([_Isolated("iso")], [1, 2])
    assert not judged.ok and judged.systems[0].exact and judged.systems[0].duplicates == 1
    unjudged = verify([_Isolated("iso")], [1, 2], judge_kafka=False)
    [s] = unjudged.systems
    assert unjudged.ok and not s.exact and "tansu" in s.note


def test_kafka_vote_window() -> None:
    kafka = KafkaParticipant("t", {"bootstrap.servers": "127.0.0.1:1"},
                             transaction_timeout_ms=400_000)
    kafka.check_vote_window(300)
    with pytest.raises(ValueError, match=r"transaction_timeout_ms=400000 must exceed the "
                       r"sink's vote window \(vote_timeout 340s \+ 60s\)"):
        kafka.check_vote_window(340)
