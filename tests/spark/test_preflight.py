"""The executors' check without Spark: what it probes for and how it words a finding."""

from __future__ import annotations

from pathlib import Path

from twophase.sinks.files import StagedFileParticipant
from twophase.spark.preflight import (
    HostReport,
    PreflightReport,
    _mismatch,
    after_unreachable,
    modules_to_check,
)


class _Lazy(StagedFileParticipant):
    def required_modules(self) -> tuple[str, ...]:
        return ("some_client_lib",)


def test_modules_checked_are_the_base_each_participants_own_and_what_it_names(
    tmp_path: Path,
) -> None:
    parts = [StagedFileParticipant(path=str(tmp_path / "a")),
             _Lazy(path=str(tmp_path / "b"), name="lazy")]
    assert modules_to_check(parts) == (
        "twophase", "pyarrow", "twophase.sinks.files", __name__, "some_client_lib",
    )


def test_versions_twophase_exact_others_same_major() -> None:
    assert _mismatch("twophase", "0.1.0", "0.1.0") is None
    assert "install the same version" in (_mismatch("twophase", "0.1.0", "0.2.0") or "")
    assert _mismatch("pyarrow", "26.0.1", "26.1.0") is None
    assert "install a 26.x release" in (_mismatch("pyarrow", "26.0.1", "19.0.0") or "")
    assert _mismatch("psycopg", "", "3.2") is None  # unknown on one side: not judged


def test_the_message_names_host_interpreter_problem_and_fix() -> None:
    report = PreflightReport(
        [HostReport("h1", "/usr/bin/python3", "3.11.2", 2, {},
                    ["cannot import pyarrow: ModuleNotFoundError: No module named 'pyarrow'"]),
         HostReport("h2", "/venv/bin/python", "3.11.7", 2)],
        "/venv/bin/python",
    )
    assert not report.ok
    msg = report.message("orders")
    assert "sink 'orders'" in msg and "before anything was written" in msg
    assert "on host h1, interpreter /usr/bin/python3 (Python 3.11.2, 2 task(s))" in msg
    assert "h2" not in msg  # only where something is wrong
    assert "PYSPARK_PYTHON" in msg and "spark.pyspark.python" in msg
    assert "(this driver runs /venv/bin/python)" in msg and "--archives" in msg


def test_an_unreachable_coordinator_is_probed_again_once_the_driver_reaches_it() -> None:
    """A daemon restarting between the executors' probe and the driver's check (found by
    a 100-kill chaos run: the driver reached it, the first probe had not, and the sink
    failed at once): the executors are probed once more before their network is blamed;
    a coordinator the driver cannot reach either is waited for (an outage)."""
    assert after_unreachable(driver_reaches=False, rechecked=False) == "wait"
    assert after_unreachable(driver_reaches=False, rechecked=True) == "wait"
    assert after_unreachable(driver_reaches=True, rechecked=False) == "again"
    assert after_unreachable(driver_reaches=True, rechecked=True) == "report"
