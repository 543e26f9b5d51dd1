"""A broker that refuses the resume: tansu (0.6, the Kafka-API broker the dev extra
ships) answers produce, transactions and the topic check, but closes the connection on
``DescribeTransactions``, without which no process can learn a task's producer id and
epoch. The default (resumable) prepare is refused at the sink's first check, before
anything is written, with the cause and the fix; the staged prepare, which needs no
resume, passes the same check."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from tests.support.kafka import create_topic
from twophase.participant import ParticipantError
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.localkafka import LocalTansu

SCHEMA = pa.schema([("id", pa.int64())])


def test_a_broker_without_describe_transactions_is_refused_naming_staged(
    tmp_path: Path,
) -> None:
    with LocalTansu(base_dir=str(tmp_path)) as broker:
        create_topic(broker.bootstrap, "resume", partitions=1)
        config = {"bootstrap.servers": broker.bootstrap}
        default = KafkaParticipant("resume", config, connect_timeout_s=10.0)
        assert default.prepare_mode == "resumable"
        with pytest.raises(ParticipantError) as refused:
            default.check(SCHEMA)
        message = str(refused.value)
        assert f"Kafka at {broker.bootstrap} answered the topic check but not " \
            "DescribeTransactions" in message, message
        assert "the broker closed the connection" in message, message
        assert 'prepare="staged"' in message and "Apache Kafka 3.0" in message, message
        staged = KafkaParticipant("resume", config, connect_timeout_s=10.0,
                                  prepare="staged")
        staged.check(SCHEMA)  # the staged prepare needs no resume
