"""``clients.bounded``: a client call that ignores its own timeout (librdkafka's
``send_offsets_to_transaction``, issue 31) is given up on, the client marked stuck, and
the error names the cause; a call that returns or raises in time is passed through. The
in-task prepare sends its marker under the same bound as the staged copy
(``marker.add_marker``)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.sinks.kafka.test_kafka_participant import SCHEMA, batch, branch, make
from twophase.errors import ParticipantError
from twophase.participant import BranchStatus, PrepareRefused
from twophase.sinks.kafka.clients import bounded


class _Client:
    def __init__(self) -> None:
        self.release = threading.Event()

    def hang(self, _timeout: float) -> str:  # ignores its timeout, as librdkafka#5456
        self.release.wait(60)
        return "late"

    def fail(self, _timeout: float) -> None:
        raise ValueError("broker said no")


def test_a_call_past_its_timeout_is_given_up_and_named() -> None:
    client = _Client()
    began = time.monotonic()
    with pytest.raises(ParticipantError, match=r"kafka-t: branch 3: librdkafka's hang did "
                                               r"not return within 0\.3s .*#5456"):
        bounded(client, "hang", 0.1, "kafka-t: branch 3", 0.1, grace=0.2)
    assert time.monotonic() - began < 2.0
    assert getattr(client, "stuck", False)
    client.release.set()


def test_a_call_in_time_returns_or_raises_as_it_did() -> None:
    client = _Client()
    client.release.set()
    assert bounded(client, "hang", 1.0, "w", 1.0) == "late"
    assert not getattr(client, "stuck", False)
    with pytest.raises(ValueError, match="broker said no"):
        bounded(client, "fail", 1.0, "w", 1.0)


def test_the_in_task_marker_send_is_bounded_and_its_id_fenced(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer whose ``send_offsets_to_transaction`` adds the marker to its open
    transaction and then does not return (librdkafka#5456; the real hang needs a broker
    dying during the call, so it is made here): the in-task prepare votes NO within
    ``connect_timeout_s`` + the grace naming the cause, and fences the branch's id at
    once, so the open transaction no longer holds the marker group: the next prepare's
    stable marker read answers within its 2 s and the branch commits once."""
    import confluent_kafka

    release = threading.Event()

    class Hanging(confluent_kafka.Producer):  # type: ignore[misc]
        def send_offsets_to_transaction(self, *args: object) -> None:
            super().send_offsets_to_transaction(*args)
            release.wait(60)

    p = make(kafka_bootstrap, prepare="in_task", connect_timeout_s=2.0)
    b = branch(p)
    monkeypatch.setattr(confluent_kafka, "Producer", Hanging)
    began = time.monotonic()
    try:
        with pytest.raises(PrepareRefused, match=r"send_offsets_to_transaction did not return "
                                                 r"within 7s .*#5456.*transactional.id is fenced"):
            p.prepare(b, SCHEMA, [batch(0, 5)])
    finally:
        monkeypatch.undo()
        release.set()
    assert time.monotonic() - began < 15
    p.commit(b, p.prepare(b, SCHEMA, [batch(0, 5)]))
    assert p.status(b) is BranchStatus.COMMITTED
    assert sorted(p.read_back("id").values) == list(range(5))
