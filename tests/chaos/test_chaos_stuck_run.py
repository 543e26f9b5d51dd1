"""A chaos job run that never ends (issue 31: a driver stalled in its commit) is a
finding reported with the run's log tail, and the chaos run fails cleanly with a
ChaosError; it used to crash on an uncaught ``subprocess.TimeoutExpired``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from twophase.testing.chaos import ChaosError, ChaosOptions, _Chaos
from twophase.testing.chaosprocs import JobRun


def test_a_run_that_never_finishes_fails_with_its_log_tail(tmp_path: Path) -> None:
    chaos = _Chaos(ChaosOptions(workdir=tmp_path / "work", kills=0, run_timeout=1.0))
    log = tmp_path / "run-0001.log"
    log.write_text("batch 31 committed\nsink s batch 32: commit still running after 30s\n")
    job = JobRun.__new__(JobRun)  # a real process that hangs, as the stuck driver did
    job.number, job.started, job.ended, job.log, job._lines = 1, time.monotonic(), None, \
        log, chaos.lines
    job.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True)
    job._reader = threading.Thread(target=job._read, daemon=True)
    job._reader.start()
    chaos.runs.append({"run": 1, "returncode": None, "seconds": None})
    with pytest.raises(ChaosError, match=r"(?s)run 1 did not finish within 1s .*"
                                         r"batch 32: commit still running"):
        chaos._finish_run(job)
    assert job.proc.returncode == -signal.SIGKILL  # killed, not left behind
    assert chaos.runs[0]["error"] == "did not finish within 1s"
