"""The conformance suite (tests/conformance.py) against the Kafka participant.

Kafka prepare is not durable, so the cross-process checks do not apply (``durable=False``),
and ``status``/``in_doubt`` cannot see another object's open transaction. Two runs:

- tansu (always): only the checks whose reads never meet an open or aborted transaction,
  because tansu does not hide those records from read_committed readers;
- a real broker (``real_kafka``, whenever ``KAFKA_BOOTSTRAP_SERVERS`` is set): every
  non-durable check except the pickled-clone commit, which a non-durable participant
  answers with "must be redone" by design (see docs/kafka.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.conformance import (
    Harness,
    applicable_checks,
    check_commit_is_idempotent,
    check_empty_branch_commits,
    check_new_lineage_is_not_skipped,
    check_participant_pickles_before_and_after_use,
    check_redo_never_applies_twice,
)
from tests.kafka_support import (
    create_topic,
    read_all,
    real_kafka_bootstrap,
    tansu_bootstrap,
    unique_topic,
)
from twophase.participant import Participant
from twophase.sinks.kafka import KafkaParticipant

__all__ = ["real_kafka_bootstrap", "tansu_bootstrap"]


class KafkaTarget:
    """A fresh topic; rows are what a read_committed reader sees."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.topic = unique_topic("conf")
        create_topic(bootstrap, self.topic)

    def participant(self) -> Participant:
        return KafkaParticipant(self.topic, {"bootstrap.servers": self.bootstrap},
                                connect_timeout_s=10)

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(m.value()) for m in read_all(self.bootstrap, self.topic, idle_s=1.0)]

    def close(self) -> None:
        pass


def _harness(bootstrap: str, id: str) -> Harness:
    return Harness(id=id, new_target=lambda: KafkaTarget(bootstrap), durable=False,
                   status_sees_prepared=True, in_doubt_finds_prepared=False)


TANSU_SAFE: tuple[Callable[[Harness], None], ...] = (
    check_commit_is_idempotent,
    check_redo_never_applies_twice,
    check_new_lineage_is_not_skipped,
    check_empty_branch_commits,
)

REAL_BROKER_CHECKS = [c for c in applicable_checks(Harness("x", lambda: None,  # type: ignore[arg-type,return-value]
                                                           durable=False))
                      if c is not check_participant_pickles_before_and_after_use]


@pytest.mark.parametrize("check", TANSU_SAFE, ids=lambda c: c.__name__)
def test_conformance_on_tansu(check: Callable[[Harness], None], tansu_bootstrap: str) -> None:
    check(_harness(tansu_bootstrap, "kafka-tansu"))


@pytest.mark.real_kafka  # deselected by tests/conftest.py unless KAFKA_BOOTSTRAP_SERVERS is set
@pytest.mark.parametrize("check", REAL_BROKER_CHECKS, ids=lambda c: c.__name__)
def test_conformance_on_real_broker(check: Callable[[Harness], None],
                                    real_kafka_bootstrap: str) -> None:
    check(_harness(real_kafka_bootstrap, "kafka"))
