"""``writeStream.format("twophase")`` on an elastic cluster: the suite's standalone
cluster (two workers in network namespaces), dynamic allocation from 0 to 2 executors,
speculation on, 48 partitions a batch on 4 task slots, into PostgreSQL + files. A
stalled task of each run is copied by speculation (both copies begin, join the same
attempt and prepare the same branch; Spark hands the driver's ``commit`` one message per
partition): every id exactly once, nothing left prepared or staged."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from tests.support.cluster import (
    ELASTIC,
    Cluster,
    Driver,
    assert_exactly_once_with_a_copy,
    executor_failpoints,
)
from twophase.sinks.files import StagedFileParticipant
from twophase.testing.job import expected_ids, write_input

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # a cluster start and minutes of run

ROWS = 40

DOOR_ELASTIC = r"""
import json, sys
from pathlib import Path
from pyspark.sql import SparkSession
import twophase
from twophase import TransactionalSink
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.job import EVENT_DDL

cfg = json.loads(Path(sys.argv[1]).read_text())
builder = SparkSession.builder.appName("twophase-door-elastic")
for k, v in cfg["conf"].items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
sink = TransactionalSink("orders", [PostgresParticipant(dsn=cfg["pg_dsn"], table=cfg["table"]),
                                    StagedFileParticipant(path=cfg["files"])],
                         coordinator=cfg["coordinator"], partitions=cfg["partitions"])
twophase.register(spark, sink)
q = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1).parquet(cfg["input"])
     .repartition(cfg["partitions"]).writeStream.format("twophase").option("sink", "orders")
     .option("checkpointLocation", cfg["ckpt"]).trigger(availableNow=True).start())
try:
    q.awaitTermination()
    out = {"error": None, "batches": len([p for p in q.recentProgress if p["numInputRows"]])}
except Exception as exc:
    out = {"error": str(exc)}
sink.close()
spark.stop()
print(json.dumps(out), flush=True)
"""


def test_door_under_dynamic_allocation_and_speculation(cluster: Cluster, tmp_path: Path) -> None:
    batches, partitions = 3, 48
    write_input(tmp_path / "in", batches, ROWS)
    table = "door_el_" + secrets.token_hex(4)
    # partition 7's first task stalls after preparing its files branch: Spark copies it
    # (the copy may wait for dynamic allocation's second executor, hence the long stall,
    # which costs nothing once the copy wins: Spark kills the stalled attempt)
    once = tmp_path / "once"
    files_name = StagedFileParticipant(path=str(tmp_path / "files")).name
    spec = (f"before_prepare@{files_name}/7=sleep(0.01)*1000;"
            f"after_prepare@{files_name}/7=sleep(90)*1")
    conf = cluster.spark_conf(**executor_failpoints(spec, once), **ELASTIC)
    cfg = {"pg_dsn": cluster.pg_dsn, "table": table, "files": str(tmp_path / "files"),
           "coordinator": f"sqlite:///{tmp_path / 'coord.db'}", "input": str(tmp_path / "in"),
           "ckpt": str(tmp_path / "ckpt"), "conf": conf, "partitions": partitions}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "door_elastic.py").write_text(DOOR_ELASTIC)
    driver = Driver([str(tmp_path / "door_elastic.py"), str(tmp_path / "cfg.json")],
                    tmp_path / "driver.log", env={"SPARK_LOCAL_IP": cluster.host})
    assert driver.wait(400) == 0, driver.tail()
    [out] = driver.lines
    assert out["error"] is None, (out["error"][-3000:], driver.tail())
    copies = assert_exactly_once_with_a_copy(cluster, table, tmp_path / "files", once,
                                             expected_ids(batches, ROWS), batches)
    print(json.dumps({"door_elastic": {"batches": batches, "partitions": partitions,
                                       "slots": 4, "prepares_of_partition_7": copies}}))
