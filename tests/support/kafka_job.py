"""The reference job run against Kafka brokers a test kills (tests/chaos/
test_kafka_server_faults.py, test_kafka_leader_failover.py): started with a failpoint
holding one Kafka task, waited on until it is held, its run's assertions, and the
verdict on both systems. One copy, so the two suites judge a run alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.fault import prepared_gids
from tests.support.kafka import kafka_branches_committed
from twophase import failpoints
from twophase.testing.job import JobConfig, build_participants, expected_ids
from twophase.testing.verify import verify

BATCHES, ROWS = 3, 60


def start_job(cfg: JobConfig, tmp: Path, spec: str, once: Path) -> subprocess.Popen[str]:
    """The job as a child process with failpoint ``spec``; stderr to ``tmp/job.log``."""
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


def wait_fired(once: Path, job: subprocess.Popen[str], log: Path) -> None:
    """Until the failpoint holds its task (the job dying first fails with its log)."""
    deadline = time.monotonic() + 600
    while not failpoints.fired(str(once)):
        assert job.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the failpoint was never reached"
        time.sleep(0.05)


def stop(job: subprocess.Popen[str]) -> None:
    """Kill a job a failed test left running."""
    if job.poll() is None:
        job.kill()
        job.wait()


def finished_run(job: subprocess.Popen[str], out: str, log: Path) -> list[dict[str, Any]]:
    """The job's JSON lines, asserted: it exited 0, said done, and committed every batch
    in order."""
    assert job.returncode == 0, log.read_text()[-4000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines[-1] == {"done": True}, lines
    assert [x["batch"] for x in lines[:-1] if x["outcome"] == "committed"] == \
        list(range(BATCHES)), lines
    return lines


def judge(cfg: JobConfig, pg_dsn: str, explain: Callable[[], str]) -> None:
    """Both systems through the verifier: PostgreSQL read as a table, Kafka rebuilt from
    its partition logs and read by a ``read_committed`` consumer, which must agree."""
    parts = build_participants(cfg)
    report = verify(parts, expected_ids(BATCHES, ROWS), sink=cfg.sink)
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
    assert "a read_committed consumer agrees" in kafka.note, kafka.note
    assert prepared_gids(pg_dsn) == []
    assert kafka_branches_committed(cfg, cfg.coordinator) >= 2 * BATCHES
    for p in parts:
        p.close()
