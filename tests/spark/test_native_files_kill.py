"""Exactly-once on the native data path when the driver dies: the reference job (its
own driver process, real Spark local[2]) writes a files-only sink, so Spark's Parquet
writer prepares every branch. The driver is SIGKILLed after Spark wrote an attempt's
folder (no vote sent: the folder is swept by name), before the driver's commit (COMMIT
decided, nothing renamed: the restart finishes it) and after the first branch's rename
(the rest are finished). Each run restarts from its checkpoint with one more batch; then
every id is in the folder once and nothing is left staged."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from tests.support.user import run_reference_job
from twophase import failpoints
from twophase.sinks.files import NATIVE_NAME, STAGING_DIR
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

ROWS = 40


KILLS = (
    # (failpoint, what the driver may leave in the staging folder, what it must)
    # Spark wrote the attempt's folder, no vote
    ("after_prepare=kill*1", {"write folder"}, {"write folder"}),
    # COMMIT decided, the killed branch not renamed (the driver's other commit lane may
    # have renamed its branch)
    ("before_commit=kill*1", {"staged"}, {"staged"}),
    # a branch renamed, none acknowledged (the restart's finish of the batch before, one
    # branch at a time, may meet the point on that batch's last branch)
    ("after_commit=kill*1", {"staged"}, set()),
)


def _left(staging: Path) -> set[str]:
    return {"write folder" if f.is_dir() and NATIVE_NAME.match(f.name) else "staged"
            for f in staging.iterdir()}


@pytest.mark.slow  # 92-168 s: CI time; the default suite reads the native path back
def test_driver_killed_on_the_native_path(tmp_path: Path) -> None:
    """One job killed three times in a row (a driver run each), then run to the end: the
    kills' restarts share their Spark start-ups, the test's whole cost."""
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"nk{secrets.token_hex(3)}",
        files_path=str(tmp_path / "out"), partitions=2, vote_timeout=60.0, max_attempts=4,
    )
    (files,) = build_participants(cfg)
    assert files.native_format() == "parquet"  # type: ignore[attr-defined]
    cfg_path, log = tmp_path / "job.json", tmp_path / "job.log"
    cfg.dump(cfg_path)
    write_input(cfg.input_dir, 1, ROWS)
    batches = 1
    for i, (spec, may, must) in enumerate(KILLS):
        once = tmp_path / f"once{i}"
        run = run_reference_job(cfg_path, {failpoints.ENV: spec,
                                           failpoints.ONCE_DIR_ENV: str(once)}, log)
        assert len(failpoints.fired(str(once))) == 1, log.read_text()[-3000:]
        assert run.returncode == -9, log.read_text()[-3000:]
        assert must <= _left(tmp_path / "out" / STAGING_DIR) <= may, spec
        write_input(cfg.input_dir, 1, ROWS, first=batches)
        batches += 1
    last = run_reference_job(cfg_path, {}, log)
    assert last.returncode == 0, log.read_text()[-3000:]
    assert [json.loads(x) for x in last.stdout.splitlines() if x.startswith("{")][-1] == \
        {"done": True}
    report = verify([files], expected_ids(batches, ROWS), sink=cfg.sink)
    assert report.ok, report.lines()
    assert files.in_doubt(cfg.sink) == []
    assert list((tmp_path / "out" / STAGING_DIR).iterdir()) == []
