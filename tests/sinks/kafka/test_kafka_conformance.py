"""The conformance suite (twophase/testing/conformance.py) against the Kafka participant.

Both prepares, resumable and staged, are durable (every check runs, the cross-process
ones too) but hold nothing this object can see while prepared: ``status``/``in_doubt``
see no prepared branch. The rows
a reader sees are the topic's committed records rebuilt from its partition logs (COMMIT and
ABORT markers, ``twophase.sinks.kafka.log``), and they must equal exactly what a
read_committed consumer sees, on the suite's Apache Kafka broker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.kafka import (
    create_topic,
    kafka_bootstrap,
    read_all,
    unique_topic,
)
from twophase.participant import Participant
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.log import read_log
from twophase.testing.conformance import (
    Harness,
    applicable_checks,
)

__all__ = ["kafka_bootstrap"]


class KafkaTarget:
    """A fresh topic; rows are its committed records, rebuilt from the partition logs
    (and equal to what a read_committed reader sees)."""

    def __init__(self, bootstrap: str, cross_check: bool, prepare: str = "resumable") -> None:
        self.bootstrap = bootstrap
        self.cross_check = cross_check
        self.prepare = prepare
        self.topic = unique_topic("conf")
        create_topic(bootstrap, self.topic)

    def participant(self) -> Participant:
        return KafkaParticipant(self.topic, {"bootstrap.servers": self.bootstrap},
                                connect_timeout_s=10, prepare=self.prepare)

    def rows(self) -> list[dict[str, Any]]:
        log = read_log({"bootstrap.servers": self.bootstrap}, self.topic)
        rows = [json.loads(v) for v in log.committed if v]
        if self.cross_check:
            seen = sorted(map(_key, (json.loads(m.value())
                                     for m in read_all(self.bootstrap, self.topic,
                                                       idle_s=1.0))))
            if not log.open_transactions:
                assert seen == sorted(map(_key, rows)), (
                    "read_committed consumer and partition log disagree")
            else:  # the consumer stops at the first open transaction (the LSO)
                left = sorted(map(_key, rows))
                for row in seen:
                    assert row in left, f"read_committed consumer saw {row} the log " \
                                        "does not hold committed (or saw it twice)"
                    left.remove(row)
        return rows

    def close(self) -> None:
        pass


def _key(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True)


STAGED = Harness(id="x", new_target=lambda: None,  # type: ignore[arg-type,return-value]
                 durable=True, status_sees_prepared=False, in_doubt_finds_prepared=False)


@pytest.mark.real_kafka
@pytest.mark.parametrize("check", applicable_checks(STAGED), ids=lambda c: c.__name__)
def test_conformance_staged(check: Callable[[Harness], None], kafka_bootstrap: str) -> None:
    """The staged prepare (durable: the cross-process checks run, the commit from a
    pickled clone too); status and in_doubt see no prepared branch (nothing is held),
    so the commit of a branch found by name without its handle does not apply."""
    check(Harness(id="kafka-staged",
                  new_target=lambda: KafkaTarget(kafka_bootstrap, True, "staged"),
                  durable=True, status_sees_prepared=False, in_doubt_finds_prepared=False))


@pytest.mark.real_kafka
@pytest.mark.parametrize("check", applicable_checks(STAGED), ids=lambda c: c.__name__)
def test_conformance_resumable(check: Callable[[Harness], None], kafka_bootstrap: str) -> None:
    """The resumable prepare (durable: the task's transaction is left open and committed
    from the handle alone by any process, the pickled clone's commit too); ``status``
    without the vote's handle sees no prepared branch (the pool id is in the handle)."""
    check(Harness(id="kafka-resumable",
                  new_target=lambda: KafkaTarget(kafka_bootstrap, True, "resumable"),
                  durable=True, status_sees_prepared=False, in_doubt_finds_prepared=False))
