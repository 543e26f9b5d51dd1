"""The stage-retry hole of the in-task path (issue 30, item 5), tried with real Spark and
Apache Kafka: a sink with an in-task participant runs each batch as a barrier stage; one
of its tasks fails after COMMIT is decided, before it commits, and the input is not
deterministic (a column says whether the stage ran this partition before).

Read from the code, Spark would run the stage again, and each task would commit what it
had just written although the decision was taken on other rows. Run, Spark refuses:
the batch's job ends in a barrier *ResultStage*, which Spark never re-runs ("Could not
recover from a failed barrier ResultStage"); the job fails, and the driver's finish redoes
the lost branch in a new job only after checking its rows against the vote's digest
(``twophase.engine.finish.check_redo``). The topic holds the voted rows exactly once. The task's
own guard for a re-run stage (``check_recorded``) is tested directly in
tests/spark/test_branch.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

ROWS = 40

JOB = textwrap.dedent('''
    import json, pathlib, sys
    from pyspark import TaskContext
    from pyspark.sql import SparkSession, functions as F, types as T
    from twophase import TransactionalSink
    from twophase.sinks.kafka import KafkaParticipant

    bootstrap, topic, store, name, rows = sys.argv[1:6]
    spark = (SparkSession.builder.master("local[2]")
             .config("spark.ui.enabled", "false")
             .config("spark.default.parallelism", "2")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())

    seen = pathlib.Path(sys.argv[6])

    @F.udf(T.IntegerType())
    def rerun(i):
        """1 when this stage already ran this partition (a stage re-run), else 0."""
        ctx = TaskContext.get()
        mine = f"{ctx.stageId()}-{ctx.partitionId()}-{ctx.taskAttemptId()}"
        (seen / mine).touch()
        return int(any(p.name != mine
                       for p in seen.glob(f"{ctx.stageId()}-{ctx.partitionId()}-*")))

    df = spark.createDataFrame([(i,) for i in range(int(rows))], "id int")
    df = df.withColumn("rerun", rerun("id"))
    sink = TransactionalSink(
        name, [KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, name="kout",
                                prepare="in_task")],
        f"sqlite:///{store}", lineage="stageretry1", backoff=0.1, vote_timeout=60.0)
    try:
        sink(df, 0)
        print(json.dumps({"outcomes": [r.outcome for r in sink.history],
                          "split": [r.split for r in sink.history]}))
    finally:
        sink.close()
        spark.stop()
''')


@pytest.mark.timeout(600)
def test_a_stage_run_again_after_commit_commits_only_the_voted_rows(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    from tests.support.kafka import create_topic, read_all
    from twophase.sinks.kafka.log import read_log

    sink = f"stageretry{os.getpid()}"
    topic = f"stage-retry-{os.getpid()}"
    create_topic(kafka_bootstrap, topic)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    once = tmp_path / "once"
    once.mkdir()
    seen = tmp_path / "seen"
    seen.mkdir()
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = sys.executable  # the UDF's workers too (a user's setting)
    # partition 0's task fails after COMMIT is decided, before it commits; a re-run of
    # the stage would differ from the voted rows (rerun = 1)
    env["TWOPHASE_FAILPOINTS"] = "before_commit@kout/0=raise*1"
    env["TWOPHASE_FAILPOINTS_ONCE_DIR"] = str(once)
    done = subprocess.run(
        [sys.executable, str(script), kafka_bootstrap, topic, str(tmp_path / "coord.db"),
         sink, str(ROWS), str(seen)],
        env=env, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert list(once.iterdir()), "the failpoint never fired: the stage was not re-run"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["split"] == ["input"], report  # the replay re-runs the UDF's stage
    # Spark did not run the barrier stage again; the driver finished the attempt
    assert "Could not recover from a failed barrier ResultStage" in done.stderr
    assert report["outcomes"] == ["recovered"], report
    # Judges: the partition log and a read_committed consumer agree, and hold exactly
    # the voted rows (the stage's first run), each once.
    log = read_log({"bootstrap.servers": kafka_bootstrap}, topic)
    committed = [json.loads(v) for p in log.partitions for v in p.committed]
    assert not any(p.open for p in log.partitions)
    stable = [json.loads(m.value()) for m in read_all(kafka_bootstrap, topic, expect=ROWS)]
    assert sorted(r["id"] for r in committed) == list(range(ROWS))
    assert sorted(r["id"] for r in stable) == list(range(ROWS))
    assert {r["rerun"] for r in stable} == {0}, "a re-run stage's rows became visible"
