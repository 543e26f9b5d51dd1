"""The executors' check when a probe task's Python worker is killed under it (an OOM
killer, a node going away; a 100-kill chaos run found it): probed again, and only a
crash every time is reported, with Spark's own words."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle

from twophase.errors import EnvironmentProblem
from twophase.sinks.files import StagedFileParticipant
from twophase.spark.preflight import CRASH_RETRIES, WORKER_CRASHED, check_executors

pytestmark = pytest.mark.spark


class _KilledUnderProbe(StagedFileParticipant):
    """Its executor-side probe SIGKILLs its own Python worker the first ``crashes``
    times, counted in files (one per kill, made atomically across workers)."""

    def __init__(self, path: str, counter: str, crashes: int) -> None:
        super().__init__(path)
        self.counter, self.crashes = counter, crashes

    def probe(self) -> None:
        for i in range(self.crashes):
            try:
                os.close(os.open(os.path.join(self.counter, f"kill-{i}"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def coordinator() -> Iterator[str]:
    """Something listening where the probe looks for the coordinator."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.fixture(autouse=True)
def _by_value() -> Iterator[None]:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_a_worker_killed_under_the_probe_is_probed_again(
    spark: Any, tmp_path: Path, coordinator: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # the Arrow probe's job takes 1-2 kills (2 tasks), the RDD probe's at least one more
    p = _KilledUnderProbe(str(tmp_path / "out"), str(tmp_path), crashes=3)
    with caplog.at_level(logging.WARNING, logger="twophase"):
        report = check_executors(spark.sparkContext, "crashy", [p], coordinator,
                                 session=spark)
    assert report.ok
    assert len(list(tmp_path.glob("kill-*"))) == 3
    assert any("Python worker crashed" in r.getMessage() and "probing again"
               in r.getMessage() for r in caplog.records), caplog.text


def test_a_worker_that_crashes_every_time_is_reported_with_sparks_words(
    spark: Any, tmp_path: Path, coordinator: str,
) -> None:
    p = _KilledUnderProbe(str(tmp_path / "out"), str(tmp_path), crashes=100)
    with pytest.raises(EnvironmentProblem) as err:
        check_executors(spark.sparkContext, "crashy", [p], coordinator, session=spark)
    msg = str(err.value)
    assert "could not run a probe task" in msg and WORKER_CRASHED in msg, msg
    kills = len(list(tmp_path.glob("kill-*")))
    assert 1 + CRASH_RETRIES + 1 <= kills <= 2 + 2 * (CRASH_RETRIES + 1), kills
