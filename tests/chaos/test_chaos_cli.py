"""``twophase chaos`` end to end: a short run with real SIGKILLs of the driver, a Spark
Python worker and the coordinator daemon, real PostgreSQL, files and Kafka (Apache Kafka,
judged from its partition logs and a read_committed consumer, which must agree);
``twophase demo --kafka-bootstrap local``; the long run over all
three participants (``slow``); then bad options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.spark


def _chaos(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "twophase.cli", "chaos", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_short_chaos_run_passes_and_writes_report(tmp_path: Path, pg_dsn: str) -> None:
    out = tmp_path / "report.json"
    res = _chaos("--kills", "3", "--seed", "3", "--victims", "driver,worker,coordinator",
                 "--coordinator-mode", "daemon", "--batches", "2", "--rows-per-batch", "40",
                 "--pg-dsn", pg_dsn, "--kafka-local", "--workdir", str(tmp_path / "wd"),
                 "--json-out", str(out))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "exactly-once: PASSED" in res.stdout
    assert "kills by protocol step reached:" in res.stdout
    report = json.loads(out.read_text())
    for key in ("ok", "seed", "kills", "by_victim", "by_step", "by_victim_step", "missed",
                "runs", "recovery_seconds", "verify", "events", "batches", "rows",
                "duration_s", "coordinator_unsettled"):
        assert key in report, key
    assert report["ok"] is True
    assert report["kills"] == 3 and len(report["events"]) == 3
    assert sum(report["by_victim"].values()) == 3
    systems = {s["kind"]: s for s in report["verify"]["systems"]}
    assert set(systems) == {"postgres", "files", "kafka"}
    for s in systems.values():
        assert s["rows"] == report["rows"] == report["batches"] * 40
        assert (s["duplicates"], s["missing"], s["unexpected"], s["prepared_leftovers"],
                s["open_transactions"], s["mismatch"]) == (0, 0, 0, 0, 0, 0)
        assert s["exact"] and s["ok"]
    assert "judged from the partition logs" in systems["kafka"]["note"]
    assert "a read_committed consumer agrees" in systems["kafka"]["note"]
    assert "not judged" not in res.stdout
    assert report["recovery_seconds"]["n"] >= 1
    for ev in report["events"]:
        assert ev["victim"] in ("driver", "worker", "coordinator")
        assert ev["method"] in ("failpoint", "timer") and ev["step"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)


# Slow (132 s, a non-default producer mode): the default suite stays within CI's 45
# minutes; run it with `bash scripts/test.sh -m slow -k broker_with_producer_reuse`.
@pytest.mark.slow
def test_short_chaos_run_kills_the_broker_with_producer_reuse(tmp_path: Path,
                                                               pg_dsn: str) -> None:
    """Victim ``broker``: the Apache Kafka of ``--kafka-local`` is SIGKILLed at a random
    moment of a job and restarted after a short pause on its log; the Kafka participant
    keeps its producers across batches. Kafka is judged from the partition log and a
    read_committed consumer, which must agree (on tansu this case needed an xfail for
    records it lost: no more)."""
    out = tmp_path / "report.json"
    res = _chaos("--kills", "4", "--seed", "1", "--victims", "driver,worker,coordinator,broker",
                 "--coordinator-mode", "daemon", "--batches", "1", "--rows-per-batch", "40",
                 "--pg-dsn", pg_dsn, "--kafka-local", "--kafka-reuse", "--broker-down-max", "3",
                 "--workdir", str(tmp_path / "wd"), "--json-out", str(out))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "starting a private Apache Kafka broker" in res.stdout
    assert "exactly-once: PASSED" in res.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["kafka_reuse"] is True
    # every victim is killed once before any twice: 4 kills, one each
    assert report["by_victim"] == {"driver": 1, "worker": 1, "coordinator": 1, "broker": 1}
    down = report["broker_down_seconds"]
    assert down["n"] == report["by_victim"]["broker"] and 0 <= down["max"] <= 3, down
    assert "broker down per kill" in res.stdout
    for ev in report["events"]:
        if ev["victim"] == "broker":
            assert ev["method"] == "timer" and ev["where"].startswith("pid "), ev
    systems = {s["kind"]: s for s in report["verify"]["systems"]}
    assert set(systems) == {"postgres", "files", "kafka"}
    for s in systems.values():
        assert s["rows"] == report["rows"] == report["batches"] * 40 > 0
        assert (s["duplicates"], s["missing"], s["unexpected"], s["prepared_leftovers"],
                s["open_transactions"], s["mismatch"]) == (0, 0, 0, 0, 0, 0), s
    assert "judged from the partition logs" in systems["kafka"]["note"]
    assert "a read_committed consumer agrees" in systems["kafka"]["note"]
    assert report["coordinator_unsettled"] == 0


@pytest.mark.slow
def test_long_chaos_run_over_postgres_files_and_kafka(tmp_path: Path, pg_dsn: str) -> None:
    """The long run of docs/chaos.md: >= 100 kills of the driver, a worker and the
    coordinator, PostgreSQL + files + Kafka, all judged (about 45 minutes on a 2-core
    machine)."""
    out = tmp_path / "report.json"
    res = _chaos("--kills", "110", "--seed", "12", "--coordinator-mode", "daemon",
                 "--victims", "driver,worker,coordinator", "--batches", "4", "--rows-per-batch",
                 "200", "--max-kills-per-run", "12", "--pg-dsn", pg_dsn, "--kafka-local",
                 "--workdir", str(tmp_path / "wd"), "--json-out", str(out), "--quiet",
                 timeout=4 * 3600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["kills"] >= 100 and report["coordinator_unsettled"] == 0
    systems = {s["kind"]: s for s in report["verify"]["systems"]}
    assert set(systems) == {"postgres", "files", "kafka"}
    for s in systems.values():
        assert s["ok"] and s["exact"] and s["rows"] == report["rows"]


def test_same_seed_same_kill_plan(tmp_path: Path) -> None:
    """--seed makes the plan reproducible: victims and methods drawn in the same order."""
    from twophase.testing.chaos import ChaosOptions, _Chaos

    plans = []
    for i in range(2):
        c = _Chaos(ChaosOptions(workdir=tmp_path / f"w{i}", seed=11, files=True))
        plans.append([(c.rng.choice(("driver", "worker")), c._choose_failpoint("worker"))
                      for _ in range(5)])
    assert plans[0] == plans[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--victims", "coordinator"], "needs --coordinator-mode daemon"),
        (["--victims", "executor"], "unknown victim 'executor'"),
        (["--kills", "-1", "--no-postgres"], "--kills must be >= 0"),
        (["--no-postgres", "--no-files"], "no participant left"),
        (["--kafka-reuse"], "--kafka-reuse needs --kafka-local or --kafka-bootstrap"),
        (["--victims", "driver,broker"], "victim 'broker' needs --kafka-local"),
        (["--victims", "broker", "--kafka-bootstrap", "127.0.0.1:1"],
         "victim 'broker' needs --kafka-local"),
        (["--kafka-local", "--kafka-tansu"], "pass one of --kafka-bootstrap, --kafka-local"),
        (["--kafka-local", "--kafka-cluster", "3"], "pass one of --kafka-bootstrap"),
        (["--kafka-cluster", "2"], "--kafka-cluster needs 3 or more nodes"),
        (["--broker-down-max", "-1"], "--broker-down-max must be within 0..60 seconds"),
        (["--aim-endtxn", "-1"], "--aim-endtxn must be >= 0"),
    ],
)
def test_bad_options_are_clear_errors(tmp_path: Path, args: list[str], message: str) -> None:
    res = _chaos("--workdir", str(tmp_path / "wd"), "--no-postgres", *args, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr


def test_broker_victim_needs_a_broker_whose_log_survives(tmp_path: Path) -> None:
    """The runner refuses a broker victim it cannot restart with its log: none given, or a
    tansu on memory storage (a kill would lose every record: nothing left to judge)."""
    from twophase.testing.chaos import ChaosError, ChaosOptions, _Chaos
    from twophase.testing.localkafka import LocalTansu

    with pytest.raises(ChaosError, match="victim 'broker' needs --kafka-local"):
        _Chaos(ChaosOptions(workdir=tmp_path / "a", victims=("worker", "broker")))
    with pytest.raises(ChaosError, match=r"needs a tansu on s3:// storage"):
        _Chaos(ChaosOptions(workdir=tmp_path / "b", victims=("broker",), broker=LocalTansu()))


def test_job_with_used_input_is_refused(tmp_path: Path) -> None:
    from twophase.testing.job import JobConfig

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "old.parquet").write_bytes(b"x")
    cfg = JobConfig(input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ck"),
                    coordinator=f"sqlite:///{tmp_path / 'c.db'}", files_path=str(tmp_path / "o"))
    cfg.dump(tmp_path / "job.json")
    res = _chaos("--job", str(tmp_path / "job.json"), "--workdir", str(tmp_path / "wd"),
                 timeout=120)
    assert res.returncode == 2
    assert "is not empty" in res.stderr
