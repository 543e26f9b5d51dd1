"""The in-task prepare retired in 0.4: refused at construction naming the replacement;
a 0.3 descriptor that names it is rebuilt in the default mode (``twophase resolve``),
and a 0.3 in-task vote is told apart from the current modes' (docs/decisions.md)."""

from __future__ import annotations

import re

import pytest

from twophase.errors import InvalidRequest
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.legacy import is_in_task

REFUSAL = ('prepare="in_task" was retired in 0.4: use "resumable" (the default: the '
           "task's own transaction, committed by the driver, no barrier stage) or \"staged\"")


def test_the_in_task_prepare_is_refused_naming_the_replacement() -> None:
    with pytest.raises(InvalidRequest, match=f"^{re.escape(REFUSAL)}$"):
        KafkaParticipant("orders", {"bootstrap.servers": "127.0.0.1:1"}, prepare="in_task")
    with pytest.raises(InvalidRequest, match=r"prepare must be one of \('resumable', "
                                             r"'staged'\), got 'gang'"):
        KafkaParticipant("orders", {"bootstrap.servers": "127.0.0.1:1"}, prepare="gang")


@pytest.mark.parametrize("recorded", ["in_task", None])
def test_a_0_3_descriptor_is_rebuilt_in_the_default_mode(recorded: str | None) -> None:
    p = KafkaParticipant("orders", {"bootstrap.servers": "127.0.0.1:1"}, prepare="staged")
    d = p.descriptor()
    options = {k: v for k, v in d["options"].items() if k != "prepare"}
    if recorded is not None:
        options["prepare"] = recorded
    q = KafkaParticipant.from_descriptor({**d, "options": options}, {})
    assert q.prepare_mode == "resumable"
    assert KafkaParticipant.from_descriptor(d, {}).prepare_mode == "staged"


def test_a_0_3_in_task_vote_is_told_apart() -> None:
    tid = {"transactional_id": "twophase.s.kafka-orders.0", "marker_offset": "4"}
    assert is_in_task(tid)
    assert not is_in_task({**tid, "prepare": "resumable"})
    assert not is_in_task({**tid, "prepare": "staged"})
    assert not is_in_task(None) and not is_in_task({"rows": "0"})


def test_the_chaos_cli_refuses_it_naming_the_replacement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from twophase.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["chaos", "--kafka-prepare", "in_task"])
    assert REFUSAL in capsys.readouterr().err
    args = build_parser().parse_args(["chaos", "--kafka-prepare", "staged"])
    assert args.kafka_prepare == "staged"
