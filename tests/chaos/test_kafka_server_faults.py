"""The Kafka broker crashes mid-batch and comes back: Apache Kafka SIGKILLed and restarted
on the same port and log folder while a Spark job writes Kafka and PostgreSQL.

Each case holds one Kafka task at a protocol step (a ``sleep`` failpoint; the once-dir
says when it got there), SIGKILLs the broker, checks that a Kafka call made while it is
down fails with an error naming the broker, restarts it, and lets the job run to its end
without a hand. Then Kafka is judged twice, from its partition logs (COMMIT/ABORT markers
replayed with Kafka's rule) and by a ``read_committed`` consumer, which must agree
exactly: 0 duplicates, 0 missing, 0 open transactions; PostgreSQL exactly once with
nothing prepared. Every committed Kafka branch must also read COMMITTED through
``voted_status`` (what recovery and ``twophase resolve`` ask).

On tansu, the suite's broker before, these cases needed the broker's stored transaction
outcomes to settle markers a kill had lost (docs/chaos.md "The lost marker"); Kafka
writes a decided transaction's markers itself after a restart, so nothing is settled
from outside the log here.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pyarrow as pa
import pytest

from tests.support.kafka import private_broker
from tests.support.kafka_job import BATCHES, ROWS, finished_run, judge, start_job, stop, wait_fired
from twophase.errors import ParticipantError
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.job import JobConfig, build_participants, write_input
from twophase.testing.kafka_evidence import evidence

pytestmark = pytest.mark.spark

DOWN_S = 8.0  # how long the broker stays down (the held task wakes up meanwhile)
HOLD_S = 3.0  # how long the failpoint holds the Kafka task at its step


__all__ = ["private_broker"]  # the fixture, imported for pytest


@pytest.fixture
def broker(private_broker: LocalKafka) -> LocalKafka:
    """An Apache Kafka broker of its own (this test kills it)."""
    return private_broker


def _config(tmp: Path, pg_dsn: str, bootstrap: str) -> JobConfig:
    tag = secrets.token_hex(3)
    return JobConfig(
        input_dir=str(tmp / "in"), checkpoint=str(tmp / "ckpt"),
        coordinator=f"sqlite:///{tmp / 'coord.db'}", sink=f"kdown_{tag}", partitions=2,
        vote_timeout=60.0, max_attempts=4, pg_dsn=pg_dsn, pg_table=f"kdown_{tag}",
        kafka_bootstrap=bootstrap, kafka_topic=f"kdown-{tag}",
        kafka_prepare="in_task",  # the held steps are the in-task path's
    )


def _probe_down(bootstrap: str, topic: str) -> str:
    """What a Kafka participant says while the broker is down."""
    probe = KafkaParticipant(topic=topic, config={"bootstrap.servers": bootstrap},
                             connect_timeout_s=2.0, prepare="in_task")
    with pytest.raises(ParticipantError) as err:
        probe.check(pa.schema([("id", pa.int64())]))
    probe.close()
    return str(err.value)


def test_a_cached_producer_that_lived_through_a_restart_is_not_reused(
    broker: LocalKafka,
) -> None:
    """With ``reuse_clients=True``, an idle cached producer that lived through a broker
    restart hangs in ``send_offsets_to_transaction`` past its timeout (librdkafka's
    cached coordinator, confluentinc/librdkafka#5456; seen as a 9-minute hang): the next
    batch must take a new producer, which it does because the cached one reported broker
    errors while idle. Bounded: the batch must finish within 60 s."""
    import pickle
    import threading

    from tests.support.kafka import create_topic
    from twophase.participant import BranchRef
    from twophase.sinks.kafka.participant import PRODUCERS

    bs, topic = broker.bootstrap, f"reuse-{secrets.token_hex(3)}"
    create_topic(bs, topic)
    kafka = KafkaParticipant(topic=topic, config={"bootstrap.servers": bs},
                             connect_timeout_s=10.0, reuse_clients=True, prepare="in_task")
    schema = pa.schema([("id", pa.int64())])
    used: list[object] = []

    def batch(n: int) -> None:
        own: KafkaParticipant = pickle.loads(pickle.dumps(kafka))
        ref = BranchRef("restart", "lin", n, 1, own.name, 0)
        rows = [pa.record_batch([pa.array(range(n * 10, n * 10 + 10), pa.int64())],
                                schema=schema)]
        handle = own.prepare(ref, schema, rows)
        used.append(own._prepared[ref].producer)
        own.commit(ref, handle)

    try:
        batch(0)
        assert len(PRODUCERS) >= 1  # the committed producer waits for the next batch
        assert broker.kill()
        time.sleep(DOWN_S)
        broker.restart()
        worker = threading.Thread(target=batch, args=(1,), daemon=True)
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the next batch hung on the producer cached before a restart"
        assert len(used) == 2 and used[1] is not used[0]
        back = kafka.read_back("id")
        assert sorted(back.values) == list(range(20)) and back.open == 0, back
    finally:
        PRODUCERS.close_all()
        kafka.close()


# The step at which the Kafka task of partition 0 is held while the broker dies:
# - after_prepare: its transaction is produced and open, the vote not sent;
# - before_commit: the COMMIT decision is known, the Kafka transaction still open;
# - after_commit: committed in Kafka (records, markers, offset marker), the ack not sent.
STEPS = [
    pytest.param("before_commit", False, id="before_commit"),
    pytest.param("after_prepare", False, id="after_prepare", marks=pytest.mark.slow),
    pytest.param("after_commit", False, id="after_commit", marks=pytest.mark.slow),
    # Producer reuse across the restart (reuse_clients=True): a cached producer that saw
    # a broker error is not reused (it hung in send_offsets_to_transaction before).
    pytest.param("before_commit", True, id="before_commit-reuse", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("point", "reuse"), STEPS)
def test_broker_killed_and_restarted_mid_batch(
    point: str, reuse: bool, tmp_path: Path, pg_dsn: str, broker: LocalKafka
) -> None:
    cfg = _config(tmp_path, pg_dsn, broker.bootstrap)
    cfg.kafka_reuse = reuse
    kafka = next(p for p in build_participants(cfg) if isinstance(p, KafkaParticipant))
    write_input(cfg.input_dir, BATCHES, ROWS)
    once = tmp_path / "once"
    log = tmp_path / "job.log"
    job = start_job(cfg, tmp_path, f"{point}@{kafka.name}/0=sleep({HOLD_S})*1", once)
    try:
        wait_fired(once, job, log)
        down_at = time.monotonic()
        assert broker.kill()
        message = _probe_down(broker.bootstrap, cfg.kafka_topic)
        assert f"cannot reach Kafka at {broker.bootstrap}" in message, message
        time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
        broker.restart()
        out, _ = job.communicate(timeout=900)
    finally:
        stop(job)
    lines = finished_run(job, out, log)

    def explain() -> str:
        """Why the verdict failed: the logs batch by batch, the coordinator, the job's
        own report (twophase/testing/kafka_evidence.py), the broker's log."""
        text = evidence(broker.bootstrap, cfg.kafka_topic, cfg.coordinator, cfg.sink)
        text += "\n== job\n" + "\n".join(json.dumps(x) for x in lines)
        text += "\n== job.log (Kafka lines)\n" + "\n".join(
            x for x in log.read_text(errors="replace").splitlines()
            if any(w in x for w in ("afka", "redo", "doubt", "ttempt", "rror")))[-6000:]
        text += "\n== broker\n" + broker.log_tail(6000)
        (tmp_path / "evidence.txt").write_text(text)
        return text

    judge(cfg, pg_dsn, explain)


def test_status_answers_on_a_fresh_and_on_a_restarted_broker(broker: LocalKafka) -> None:
    """A fresh broker creates its group-coordinator topic on the first offset read and a
    restarted one reloads it: meanwhile Kafka may answer NOT_COORDINATOR or
    COORDINATOR_LOAD_IN_PROGRESS, which librdkafka's ``committed()`` returns as is (seen
    once as a failed conformance check on the session's fresh broker). The participant
    asks again (bounded by ``connect_timeout_s``). A regression guard, not a
    reproduction: the race is timing-dependent and a bare ``committed()`` right after
    start or restart did not hit it in 6 tries here."""
    from tests.support.kafka import create_topic
    from twophase.participant import BranchRef, BranchStatus

    topic = f"fresh-{secrets.token_hex(3)}"
    create_topic(broker.bootstrap, topic)
    kafka = KafkaParticipant(topic=topic, config={"bootstrap.servers": broker.bootstrap},
                             connect_timeout_s=20.0, prepare="in_task")
    ref = BranchRef("fresh", "lin", 0, 0, kafka.name, 0)
    assert kafka.status(ref) is BranchStatus.ABSENT  # the first offset read of the broker
    schema = pa.schema([("id", pa.int64())])
    kafka.commit(ref, kafka.prepare(ref, schema, [pa.record_batch(
        [pa.array(range(5), pa.int64())], schema=schema)]))
    kafka.close()
    assert broker.kill()
    broker.restart()
    assert kafka.status(ref) is BranchStatus.COMMITTED  # read while the broker reloads
    back = kafka.read_back("id")
    assert sorted(back.values) == list(range(5)) and back.open == 0, back
    assert "a read_committed consumer agrees" in back.note, back.note
    kafka.close()


def test_the_topic_check_rides_out_a_broker_restart(broker: LocalKafka) -> None:
    """The driver's first-batch check reads the topic's configs after the metadata; a
    broker killed in between (a chaos run saw it: the query failed with ``_TRANSPORT``
    at its first batch) answers again after its restart, and the check waits for it
    within ``connect_timeout_s`` instead of failing the query."""
    import threading

    from twophase.sinks.kafka.admin import _admin, _configs

    topic = f"check-{secrets.token_hex(4)}"
    kafka = KafkaParticipant(topic=topic, config={"bootstrap.servers": broker.bootstrap},
                             connect_timeout_s=30.0)
    kafka.check(pa.schema([("id", pa.int64())]))  # creates the topic
    admin, _errors = _admin({"bootstrap.servers": broker.bootstrap})
    assert broker.kill()
    back = threading.Timer(3.0, broker.restart)
    back.start()
    try:
        began = time.monotonic()
        cfg = _configs("kafka", broker.bootstrap, admin, "TOPIC", topic, 30.0)
        waited = time.monotonic() - began
    finally:
        back.join(90)
    assert "max.message.bytes" in cfg, cfg
    assert 3.0 <= waited < 30.0, waited  # it waited for the restart, within its bound
