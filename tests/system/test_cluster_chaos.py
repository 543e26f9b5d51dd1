"""Issue 30's proof as users run it: the barrier-free sink on the multi-host cluster, elastic
and speculative, through at least 40 SIGKILLs.

A Spark standalone cluster of two worker hosts (network namespaces, 2 cores each: 4 task
slots), dynamic allocation on (shuffle tracking, 0..2 executors) and speculation on. One
driver process on the host side of the bridge runs two streaming queries in one
application: the sink's (200 partitions per batch into PostgreSQL + files + Apache Kafka
with its staged prepare + Iceberg on a SQL catalog) and a second, independent query (a
rate source written as Parquet). While input keeps arriving, the driver (its Python and
JVM), executor JVMs and the executors' Python workers are SIGKILLed at random moments,
one kill per committed batch at most, and a killed driver is started again from its
checkpoint. At the end: every id exactly once in every system, nothing left prepared, no
open Kafka transaction (the log judge and a read_committed consumer agree), exactly one
Iceberg snapshot per batch, and the second query went on committing batches.

Run: ``bash scripts/test.sh -m "cluster and slow" -k cluster_chaos`` (root: network
namespaces). ``TWOPHASE_CLUSTER_CHAOS_KILLS`` (default 40), ``..._SEED`` (0),
``..._MINUTES`` (a time budget for the kills, default 75) and ``..._JSON`` (where the
summary goes, besides stdout) change the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Driver
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.chaosprocs import kill
from twophase.testing.cluster import SparkStandalone, Worker
from twophase.testing.job import (
    JobConfig,
    build_participants,
    committed_batches,
    expected_ids,
    write_input,
)
from twophase.testing.localpg import LocalPostgres
from twophase.testing.verify import verify

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROWS = 400  # per batch: 200 partitions of 2 rows, so the load is tasks, not volume
PARTITIONS = 200
AHEAD = 3  # input files kept ahead of the committed batches
VICTIM_SHARES = {"driver": 0.2, "executor": 0.4, "python": 0.4}


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(f"TWOPHASE_CLUSTER_CHAOS_{name}", default))


def elastic_conf(spark: SparkStandalone) -> dict[str, str]:
    """What a user passes to spark-submit for an elastic, speculative cluster."""
    return {
        "spark.master": spark.master_url,
        "spark.driver.host": spark.host_address,
        "spark.executor.memory": "512m",
        "spark.executor.cores": "2",
        "spark.cores.max": "4",
        "spark.ui.enabled": "false",
        "spark.pyspark.python": sys.executable,
        "spark.sql.shuffle.partitions": "4",
        "spark.dynamicAllocation.enabled": "true",
        "spark.dynamicAllocation.shuffleTracking.enabled": "true",
        "spark.dynamicAllocation.minExecutors": "0",
        "spark.dynamicAllocation.maxExecutors": "2",
        "spark.dynamicAllocation.executorIdleTimeout": "30s",
        "spark.speculation": "true",
        "spark.speculation.multiplier": "1.3",
        "spark.speculation.quantile": "0.6",
        "spark.speculation.minTaskRuntime": "300ms",
        "spark.speculation.efficiency.enabled": "false",
        "spark.scheduler.minRegisteredResourcesRatio": "0",
        # a task may be hit by several kills in a run (a Python worker, then its executor)
        "spark.task.maxFailures": "8",
    }


@dataclass
class Kill:
    n: int
    victim: str
    where: str
    at: float  # seconds since the start
    batches_before: int  # committed batches when it landed
    recovery_s: float | None = None  # kill -> next committed batch


@dataclass
class Run:
    """What the chaos loop saw; the summary is built from it."""

    t0: float = field(default_factory=time.monotonic)
    kills: list[Kill] = field(default_factory=list)
    missed: Counter[str] = field(default_factory=Counter)
    commit_times: dict[int, float] = field(default_factory=dict)  # batch -> seconds
    side: list[tuple[float, int]] = field(default_factory=list)  # (seconds, side batches)
    drivers: list[dict[str, Any]] = field(default_factory=list)
    load: list[float] = field(default_factory=list)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _python_workers(w: Worker) -> list[int]:
    """Forked Python workers (children of a ``pyspark.daemon``), else the daemons."""
    daemons = set(w.python_pids())
    forked = [p for p in daemons if _ppid(p) in daemons]
    return forked or sorted(daemons)


class ClusterChaos:
    """The loop: feed input, kill, restart a dead driver, watch both queries."""

    def __init__(self, spark: SparkStandalone, cfg: JobConfig, cfg_path: Path, work: Path,
                 kills: int, seed: int, budget_s: float) -> None:
        self.spark, self.cfg, self.cfg_path, self.work = spark, cfg, cfg_path, work
        self.want, self.budget_s = kills, budget_s
        self.rng = random.Random(seed)  # reproducible chaos, not crypto
        plan = [v for v, share in VICTIM_SHARES.items() for _ in range(round(kills * share))]
        plan += ["python"] * (kills - len(plan))
        self.rng.shuffle(plan)
        self.plan = plan
        self.r = Run()
        self.written = 0
        self.driver: Driver | None = None
        self.batch_s: list[float] = [15.0]

    # ------------------------------------------------------------------ pieces
    def _feed(self) -> None:
        done = committed_batches(self.cfg.checkpoint)
        while self.written < done + AHEAD:
            write_input(self.cfg.input_dir, 1, ROWS, first=self.written)
            self.written += 1

    def _start_driver(self) -> None:
        n = len(self.r.drivers) + 1
        self.driver = Driver(["-m", "twophase.testing.job", str(self.cfg_path)],
                             self.work / f"driver-{n:03d}.log",
                             env={"SPARK_LOCAL_IP": self.spark.host_address})
        self.r.drivers.append({"n": n, "started": self.r.now(), "ended": None, "rc": None,
                               "side_at_start": self._side()})

    def _driver_ended(self, rc: int) -> None:
        info = self.r.drivers[-1]
        info.update(ended=self.r.now(), rc=rc, side_at_end=self._side())
        if rc not in (0, -signal.SIGKILL) and self.driver is not None:
            info["error"] = self.driver.tail(6)

    def _side(self) -> int:
        assert self.cfg.side_output is not None
        return committed_batches(Path(self.cfg.side_output) / "ckpt")

    def _watch(self) -> int:
        """Record new commits (their times), the second query's progress, the load."""
        done = committed_batches(self.cfg.checkpoint)
        t = self.r.now()
        for b in range(done):
            if b not in self.r.commit_times:
                self.r.commit_times[b] = t
                prev = [x for x in self.r.commit_times.values() if x < t]
                if prev:
                    self.batch_s.append(t - max(prev))
        self.r.side.append((t, self._side()))
        self.r.load.append(os.getloadavg()[0])
        return done

    def _kill(self, victim: str) -> str | None:
        """SIGKILL one process of the kind; where it was, or None if there was none."""
        assert self.driver is not None
        if victim == "driver":
            pid = self.driver.proc.pid
            self.driver.kill()
            self._driver_ended(-signal.SIGKILL)
            return f"driver pid {pid}"
        hosts = list(self.spark.workers)
        self.rng.shuffle(hosts)
        for w in hosts:
            pids = w.executor_pids() if victim == "executor" else _python_workers(w)
            if pids:
                pid = self.rng.choice(pids)
                if kill(pid):
                    return f"{victim} pid {pid} on {w.address}"
        return None

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self._feed()
        self._start_driver()
        next_kill: float | None = None
        try:
            while len(self.r.kills) < self.want and self.r.now() < self.budget_s:
                self._feed()
                assert self.driver is not None
                if self.driver.proc.poll() is not None:  # a driver that gave up: again
                    self._driver_ended(self.driver.wait(30))
                    self._start_driver()
                done = self._watch()
                last = self.r.kills[-1] if self.r.kills else None
                # at most one kill per committed batch: the next one waits for a commit
                # after the last kill, then a random moment within a batch's time
                if next_kill is None and (last is None or done > last.batches_before):
                    est = statistics.median(self.batch_s[-10:])
                    next_kill = self.r.now() + self.rng.uniform(0.0, est)
                if next_kill is not None and self.r.now() >= next_kill:
                    victim = self.plan[len(self.r.kills)]
                    where = self._kill(victim)
                    if where is None:
                        self.r.missed[victim] += 1
                        next_kill = self.r.now() + 1.0
                    else:
                        self.r.kills.append(Kill(len(self.r.kills) + 1, victim, where,
                                                 self.r.now(), done))
                        print(f"kill {len(self.r.kills)}/{self.want}: {where} at "
                              f"t={self.r.now():.0f}s after {done} batches", flush=True)
                        next_kill = None
                        if victim == "driver":
                            self._start_driver()
                time.sleep(0.25)
            self._finish()
        finally:
            if self.driver is not None and self.driver.proc.poll() is None:
                self.driver.kill()

    def _finish(self, timeout: float = 900.0) -> None:
        """Stop feeding, tell the driver how many batches there are, let it end them."""
        assert self.cfg.stream_stop is not None
        Path(self.cfg.stream_stop).write_text(str(self.written))  # input files, for the log
        deadline = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < deadline:
            self._watch()
            assert self.driver is not None
            rc = self.driver.proc.poll()
            if rc is not None:
                self._driver_ended(self.driver.wait(30))
                if rc == 0:
                    return
                restarts += 1
                if restarts > 3:
                    raise AssertionError(f"the driver failed {restarts} times at the end:\n"
                                         f"{self.driver.tail()}")
                self._start_driver()
            time.sleep(0.5)
        raise AssertionError(f"the stream did not end {timeout:.0f}s after the stop file")

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, Any]:
        times = sorted(self.r.commit_times.values())
        for k in self.r.kills:
            nxt = next((t for t in times if t > k.at), None)
            k.recovery_s = None if nxt is None else round(nxt - k.at, 3)
        rec = sorted(k.recovery_s for k in self.r.kills if k.recovery_s is not None)
        return {
            "kills": len(self.r.kills),
            "by_victim": dict(Counter(k.victim for k in self.r.kills)),
            "missed": dict(self.r.missed),
            "batches": committed_batches(self.cfg.checkpoint),  # the query's batches
            "input_files": self.written,  # a batch after a restart may read two
            "rows": self.written * ROWS,
            "partitions": PARTITIONS,
            "task_slots": 4,
            "driver_runs": len(self.r.drivers),
            "driver_failures": sum(1 for d in self.r.drivers
                                   if d["rc"] not in (0, -signal.SIGKILL, None)),
            "recovery_s": _stats(rec),
            "batch_s": _stats(sorted(self.batch_s[1:])),
            "side_batches": self.r.side[-1][1] if self.r.side else 0,
            "load_avg_1m": _stats(sorted(self.r.load)),
            "wall_s": self.r.now(),
            "kill_log": [asdict(k) for k in self.r.kills],
            "driver_log": self.r.drivers,
        }


def task_events(folder: Path) -> dict[str, Any]:
    """From Spark's event logs (every driver run's, a killed one's ``.inprogress`` too):
    tasks ended, speculative copies among them, and failures by reason."""
    ended = speculative = 0
    reasons: Counter[str] = Counter()
    for path in sorted(x for x in folder.rglob("*") if x.is_file()):
        with open(path, errors="replace") as f:
            for line in f:
                if '"SparkListenerTaskEnd"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    ended += 1
                    speculative += bool(ev.get("Task Info", {}).get("Speculative"))
                    reason = ev.get("Task End Reason", {}).get("Reason", "?")
                    if reason != "Success":
                        reasons[reason] += 1
    return {"tasks_ended": ended, "speculative": speculative, "failed": dict(reasons)}


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": round(statistics.median(xs), 2),
            "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2),
            "max": round(xs[-1], 2)}


@pytest.mark.timeout(3 * 3600)
def test_cluster_chaos_elastic_speculative_two_queries(tmp_path: Path) -> None:
    """>= 40 SIGKILLs of drivers, executor JVMs and Python workers on the elastic,
    speculative cluster: every id exactly once in PostgreSQL, files, Kafka and Iceberg,
    nothing prepared, one Iceberg snapshot per batch, the second query kept running."""
    kills = _env_int("KILLS", 40)
    work = tmp_path
    spark = SparkStandalone(workers=2, cores=2, memory="1g", base_dir=str(work))
    kafka: LocalKafka | None = None
    pg: LocalPostgres | None = None
    try:
        spark.start(timeout=240)
        # 200 branches a batch stay prepared until the driver commits them; speculative
        # copies and killed attempts add more until they are resolved
        pg = LocalPostgres(max_prepared_transactions=1000, fsync=False,
                           also_listen=spark.host_address, trust_network=spark.network)
        pg.start()
        kafka = LocalKafka(host=spark.host_address, base_dir=str(work))
        kafka.start(timeout=120)
        tag = secrets.token_hex(3)
        cfg = JobConfig(
            input_dir=str(work / "in"), checkpoint=str(work / "ckpt"),
            coordinator=f"sqlite:///{work / 'coord.db'}", sink=f"cchaos_{tag}",
            pg_dsn=pg.dsn_at(spark.host_address), pg_table=f"cchaos_{tag}",
            files_path=str(work / "files"),
            kafka_bootstrap=kafka.bootstrap, kafka_topic=f"cchaos-{tag}",
            kafka_prepare="staged",
            iceberg_table=f"chaos.orders_{tag}",
            iceberg_catalog={"type": "sql", "uri": f"sqlite:///{work / 'iceberg.db'}",
                             "warehouse": f"file://{work / 'iceberg'}"},
            partitions=PARTITIONS, max_attempts=5, vote_timeout=120.0,
            spark_conf=elastic_conf(spark),
            stream_stop=str(work / "stop"), side_output=str(work / "side"),
        )
        (work / "events").mkdir()
        cfg.spark_conf.update({"spark.eventLog.enabled": "true",
                               "spark.eventLog.dir": f"file://{work / 'events'}",
                               # plain JSON lines this test reads (Spark 4 compresses
                               # them with zstd by default)
                               "spark.eventLog.compress": "false",
                               "spark.eventLog.rolling.enabled": "false"})
        cfg_path = work / "job.json"
        cfg.dump(cfg_path)
        chaos = ClusterChaos(spark, cfg, cfg_path, work, kills, _env_int("SEED", 0),
                             60.0 * _env_int("MINUTES", 75))
        chaos.run()
        out = chaos.summary()
        out["tasks"] = task_events(work / "events")
        parts = build_participants(cfg)
        report = verify(parts, expected_ids(chaos.written, ROWS), sink=cfg.sink)
        for p in parts:
            p.close()
        out["verify"] = report.lines()
        out["systems"] = {s.kind: {"rows": s.rows, "duplicates": s.duplicates,
                                   "missing": s.missing, "prepared": s.prepared_leftovers,
                                   "open_transactions": s.open_transactions,
                                   "mismatch": s.mismatch, "aborted": s.aborted,
                                   "commits": s.commits, "extra_commits": s.extra_commits}
                          for s in report.systems}
        import psycopg

        with psycopg.connect(cfg.pg_dsn or "") as conn:
            out["pg_prepared_xacts"] = conn.execute(
                "select count(*) from pg_prepared_xacts").fetchone()[0]  # type: ignore[index]
        text = json.dumps(out, indent=1, default=str)
        print("cluster-chaos: " + json.dumps({k: v for k, v in out.items()
                                              if k not in ("kill_log", "driver_log")}))
        dest = os.environ.get("TWOPHASE_CLUSTER_CHAOS_JSON")
        (Path(dest) if dest else work / "cluster-chaos.json").write_text(text)

        assert report.ok, "\n".join(report.lines())
        assert out["pg_prepared_xacts"] == 0
        assert len(chaos.r.kills) >= kills, (
            f"only {len(chaos.r.kills)} of {kills} kills landed in the time budget")
        for victim in VICTIM_SHARES:
            assert out["by_victim"].get(victim, 0) >= min(3, kills // 5), out["by_victim"]
        kafka_sys = next(s for s in report.systems if s.kind == "kafka")
        assert kafka_sys.exact and kafka_sys.open_transactions == 0 and not kafka_sys.mismatch
        ice = next(s for s in report.systems if s.kind == "iceberg")
        # one snapshot per batch of the query (not per input file: after a driver restart
        # Spark may read two files in one batch)
        assert ice.commits == out["batches"] and ice.extra_commits == 0, (ice.commits,
                                                                          out["batches"])
        # the second query committed batches in every driver run that lived 30 s or more
        for d in chaos.r.drivers:
            if d["ended"] is not None and d["ended"] - d["started"] >= 30:
                assert d["side_at_end"] > d["side_at_start"], d
        assert out["side_batches"] >= 10, out["side_batches"]
        assert out["tasks"]["speculative"] > 0, out["tasks"]  # speculation did copy tasks
    finally:
        if kafka is not None:
            kafka.stop()
        if pg is not None:
            pg.stop()
        with contextlib.suppress(Exception):
            spark.stop()
