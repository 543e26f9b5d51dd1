"""``clients.bounded``: a client call that ignores its own timeout (librdkafka's
``send_offsets_to_transaction``, issue 31) is given up on, the client marked stuck, and
the error names the cause; a call that returns or raises in time is passed through."""

from __future__ import annotations

import threading
import time

import pytest

from twophase.errors import ParticipantError
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

