"""A partition leader (or a transaction coordinator) of a 3-broker Apache Kafka cluster
is SIGKILLed mid-commit while a Spark job writes Kafka and PostgreSQL.

The cluster (``twophase.testing.kafkacluster``): three KRaft nodes, each broker and
controller, each in its own network namespace on a bridge; every topic with 3 replicas
and ``min.insync.replicas=2``. The job (local Spark on the host side) is held with a
``sleep`` failpoint where its Kafka transaction is open:

- staged (the default prepare): ``mid_commit`` on the driver, inside the copy's
  transaction (records and the marker offset sent, ``commit_transaction`` not called);
- resumable: ``before_commit`` on the driver, where it sends ``EndTxn`` for the
  transaction the task produced and left open (the vote's id, producer id and epoch);
- in-task: ``before_commit`` in the task (its transaction produced and open).

Meanwhile the node that leads the target partition, or the one coordinating the open
copy transaction (found with ListTransactions), is SIGKILLed; the cluster elects another
and the job goes on without a hand (the node is restarted later, or only after the job).
Then Kafka is judged from its partition logs and by a ``read_committed`` consumer, which
must agree exactly, and PostgreSQL as a table: 0 duplicates, 0 missing, 0 open.

Slow (each case starts a Spark job, ~1 min) and needs root for the namespaces:
``bash scripts/test.sh -m slow -k leader_failover`` or
``pytest tests/chaos/test_kafka_leader_failover.py -m slow``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kafka_job import BATCHES, ROWS, finished_run, judge, start_job, stop, wait_fired
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.job import JobConfig, build_participants, write_input
from twophase.testing.kafka_evidence import evidence
from twophase.testing.kafkacluster import KafkaCluster

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.spark]

HOLD_S = 4.0  # the held commit wakes up with its leader dead, before it is fenced
DOWN_S = 10.0  # how long a node restarted during the job stays down


@pytest.fixture(scope="module")
def kafka3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """One 3-node cluster for the module (~10 s to start); each case restarts the node
    it killed and waits until every replica is back in sync."""
    with KafkaCluster(base_dir=str(tmp_path_factory.mktemp("kafka3"))) as cluster:
        yield cluster


CASES = [
    # (prepare, failpoint, victim, restart during the job)
    pytest.param("staged", "mid_commit", "leader", False, id="staged-leader"),
    pytest.param("staged", "mid_commit", "coordinator", True, id="staged-coordinator"),
    pytest.param("resumable", "before_commit", "leader", False, id="resumable-leader"),
    pytest.param("resumable", "before_commit", "coordinator", True,
                 id="resumable-coordinator"),
]


@pytest.mark.parametrize(("prepare", "point", "victim", "restart_during"), CASES)
def test_leader_killed_mid_commit(
    prepare: str, point: str, victim: str, restart_during: bool, tmp_path: Path,
    pg_dsn: str, kafka3: KafkaCluster,
) -> None:
    tag = secrets.token_hex(3)
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"kfail_{tag}",
        partitions=2, vote_timeout=60.0, max_attempts=4, pg_dsn=pg_dsn,
        pg_table=f"kfail_{tag}", kafka_bootstrap=kafka3.bootstrap,
        kafka_topic=f"kfail-{tag}", kafka_prepare=prepare,
    )
    kafka = next(p for p in build_participants(cfg) if isinstance(p, KafkaParticipant))
    kafka.close()
    write_input(cfg.input_dir, BATCHES, ROWS)
    once, log = tmp_path / "once", tmp_path / "job.log"
    job = start_job(cfg, tmp_path, f"{point}@{kafka.name}/0=sleep({HOLD_S})*1", once)
    killed = 0
    try:
        wait_fired(once, job, log)
        if victim == "leader":
            killed = kafka3.leader(cfg.kafka_topic, 0)
            why = f"leader of {cfg.kafka_topic}/0"
        else:
            open_now = kafka3.ongoing(f"twophase.{cfg.sink}.")
            assert open_now, "the held commit has no open transaction on the cluster"
            tid, killed = sorted(open_now.items())[0]
            why = f"coordinator of {tid}"
        down_at = time.monotonic()
        assert kafka3.kill(killed), why
        print(f"killed node {killed} ({why})")
        if restart_during:
            while job.poll() is None and time.monotonic() - down_at < DOWN_S:
                time.sleep(0.1)
            kafka3.restart(killed)
        out, _ = job.communicate(timeout=900)
    finally:
        stop(job)
    # the cluster really elected elsewhere: the dead node leads nothing of the topic now
    if victim == "leader" and not restart_during:
        assert kafka3.leader(cfg.kafka_topic, 0) != killed
    if not kafka3.nodes[killed].alive:
        kafka3.restart(killed)  # and every replica back in sync before the verdict
    kafka3.wait_in_sync()
    lines = finished_run(job, out, log)

    def explain() -> str:
        text = evidence(kafka3.bootstrap, cfg.kafka_topic, cfg.coordinator, cfg.sink)
        text += "\n== job\n" + "\n".join(json.dumps(x) for x in lines)
        text += "\n== job.log\n" + log.read_text(errors="replace")[-6000:]
        text += "\n== cluster\n" + kafka3.log_tail(3000)
        (tmp_path / "evidence.txt").write_text(text)
        return text

    judge(cfg, pg_dsn, explain)
