"""TransactionalSink under Spark Connect: a local Connect server (pyspark's own
``SparkConnectServer``, started here with ``spark-submit``) and a client script, run as a
user runs it, whose ``foreachBatch`` therefore runs in a Python process on the server.
The sink needs ``lineage=`` there (the server-side process cannot see the query id), and
says so at construction when it is missing (docs/cluster.md, "Spark Connect platforms").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from twophase.testing.cluster import spark_home
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.servers import free_port
from twophase.testing.verify import verify

CLIENT = r'''
import json, sys, time
from pathlib import Path
from pyspark.sql import SparkSession
from twophase import TransactionalSink
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.job import EVENT_DDL

url, cfg = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
spark = SparkSession.builder.remote(url).getOrCreate()
parts = [PostgresParticipant(dsn=cfg["pg_dsn"], table=cfg["pg_table"]),
         StagedFileParticipant(path=cfg["files_path"])]
try:
    TransactionalSink("orders", parts, coordinator=cfg["coordinator"])
    print(json.dumps({"construct": "accepted"}), flush=True)
except ValueError as exc:
    print(json.dumps({"construct": str(exc)}), flush=True)
sink = TransactionalSink("orders", parts, coordinator=cfg["coordinator"],
                         lineage="connect-orders", partitions=2)
for attempt in range(3):
    try:
        q = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
             .parquet(cfg["input_dir"]).writeStream.foreachBatch(sink)
             .option("checkpointLocation", cfg["checkpoint"])
             .trigger(availableNow=True).start())
        break
    except Exception as exc:  # Spark's fixed 10 s for the server's Python to connect back
        if "connect back" not in str(exc) or attempt == 2:
            raise
        print(json.dumps({"start_retry": attempt}), flush=True)
        time.sleep(2)
q.awaitTermination()
print(json.dumps({"done": True, "batches": q.lastProgress["batchId"] + 1}), flush=True)
'''


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server (local[2]) on loopback; its URL."""
    home = spark_home()
    port = free_port()
    log = tmp_path_factory.mktemp("connect") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(SPARK_HOME=str(home), PYSPARK_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(home / "bin" / "spark-submit"),
             "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
             "--master", "local[2]", "--driver-memory", "1g",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.shuffle.partitions=2",
             "--conf", f"spark.pyspark.python={sys.executable}"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "Spark Connect server did not start"
                time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_sink_under_spark_connect_exactly_once_and_lineage_required(
    connect_server: str, tmp_path: Path, pg_dsn: str
) -> None:
    batches, rows = 3, 40
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", pg_dsn=pg_dsn,
        pg_table="orders_connect", files_path=str(tmp_path / "files"),
    )
    write_input(cfg.input_dir, batches, rows)
    cfg.dump(tmp_path / "cfg.json")
    (tmp_path / "client.py").write_text(CLIENT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    res = subprocess.run(
        [sys.executable, str(tmp_path / "client.py"), connect_server,
         str(tmp_path / "cfg.json")],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert res.returncode == 0, res.stderr[-3000:]
    construct = lines[0]["construct"]
    assert "Spark Connect" in construct and "lineage=" in construct, construct
    assert lines[-1] == {"done": True, "batches": batches}
    report = verify(build_participants(cfg), expected_ids(batches, rows), sink=cfg.sink)
    assert report.ok, report.lines()


DOOR_CLIENT = r'''
import json, sys, time
from pathlib import Path
from pyspark.sql import SparkSession
import twophase
from twophase import TransactionalSink
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.job import EVENT_DDL

url, cfg = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
spark = SparkSession.builder.remote(url).getOrCreate()


def parts(suffix):
    return [PostgresParticipant(dsn=cfg["pg_dsn"], table=cfg["pg_table"] + suffix),
            StagedFileParticipant(path=cfg["files_path"] + suffix)]


def start(writer, ckpt):
    for attempt in range(3):
        try:
            stream = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
                      .parquet(cfg["input_dir"]))
            q = (writer(stream.writeStream).option("checkpointLocation", ckpt)
                 .trigger(availableNow=True).start())
            q.awaitTermination()
            return q.lastProgress["batchId"] + 1
        except Exception as exc:  # Spark's fixed 10 s for the server's Python to connect back
            if "connect back" not in str(exc) or attempt == 2:
                raise
            time.sleep(2)


# the data source door: the sink in code, its embedded coordinator in this client
door = TransactionalSink("door", parts("_door"), coordinator=cfg["coordinator"],
                         lineage="connect-door", partitions=4)
twophase.register(spark, door)
n = start(lambda w: w.format("twophase").option("sink", "door"), cfg["checkpoint"] + "_door")
print(json.dumps({"door": n}), flush=True)
# foreachBatch with 4.3's cloned batch session turned off (the old behaviour)
spark.conf.set("spark.sql.connect.streaming.foreachBatch.useClonedSession", "false")
fb = TransactionalSink("fb", parts("_fb"), coordinator=cfg["coordinator"] + "_fb",
                       lineage="connect-fb", partitions=2)
n = start(lambda w: w.foreachBatch(fb), cfg["checkpoint"] + "_fb")
print(json.dumps({"foreachBatch": n}), flush=True)
'''


@pytest.mark.slow  # two more streaming queries on the Connect server (~1 min)
def test_data_source_door_and_foreach_batch_uncloned_under_spark_connect(
    connect_server: str, tmp_path: Path, pg_dsn: str
) -> None:
    batches, rows = 3, 40
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", pg_dsn=pg_dsn,
        pg_table="orders_connect2", files_path=str(tmp_path / "files"),
    )
    write_input(cfg.input_dir, batches, rows)
    cfg.dump(tmp_path / "cfg.json")
    (tmp_path / "client.py").write_text(DOOR_CLIENT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    res = subprocess.run(
        [sys.executable, str(tmp_path / "client.py"), connect_server,
         str(tmp_path / "cfg.json")],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert res.returncode == 0, res.stderr[-3000:]
    assert lines == [{"door": batches}, {"foreachBatch": batches}]
    for suffix, sink in (("_door", "door"), ("_fb", "fb")):
        from twophase.sinks.files import StagedFileParticipant
        from twophase.sinks.postgres import PostgresParticipant

        parts = [PostgresParticipant(dsn=pg_dsn, table="orders_connect2" + suffix),
                 StagedFileParticipant(path=str(tmp_path / "files") + suffix)]
        report = verify(parts, expected_ids(batches, rows), sink=sink)
        assert report.ok, (suffix, report.lines())
