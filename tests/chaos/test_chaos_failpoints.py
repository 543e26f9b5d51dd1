"""Failpoints for chaos: the once-dir makes ``*N`` count across processes (a retried Spark
task runs in a new Python worker), ``kill`` really SIGKILLs, and chaos' victim/point map
covers every point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from twophase import failpoints
from twophase.testing.chaos import TABLE_POINTS, VICTIMS, points_for


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    failpoints.reload("", "")


def _child(spec: str, once: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


HIT = ("from twophase import failpoints\n"
       "failpoints.hit('after_prepare', 'postgres-orders', 1)\n"
       "print('survived')\n")


def test_once_dir_counts_across_processes(tmp_path: Path) -> None:
    once = tmp_path / "once"
    spec = "after_prepare@postgres-orders/1=kill*2"
    results = [_child(spec, once, HIT) for _ in range(4)]
    assert [r.returncode for r in results] == [-signal.SIGKILL, -signal.SIGKILL, 0, 0]
    assert results[2].stdout.strip() == "survived"
    fired = failpoints.fired(str(once))
    assert len(fired) == 2
    assert all(f.startswith("after_prepare@postgres-orders/1 pid=") for f in fired)


def test_without_once_dir_count_is_per_process(tmp_path: Path) -> None:
    env = {**os.environ, failpoints.ENV: "after_prepare=kill*1"}
    env.pop(failpoints.ONCE_DIR_ENV, None)
    rcs = [subprocess.run([sys.executable, "-c", HIT], env=env, capture_output=True,
                          timeout=60, check=False).returncode for _ in range(2)]
    assert rcs == [-signal.SIGKILL, -signal.SIGKILL]


def test_once_dir_in_process_and_non_matching_hits(tmp_path: Path) -> None:
    once = tmp_path / "once"
    failpoints.reload("before_commit@files-out/0=raise*1;before_ack=raise", str(once))
    failpoints.hit("before_commit", "files-out", 1)  # other partition: no claim
    failpoints.hit("before_commit", "postgres-x", 0)  # other participant
    assert failpoints.fired(str(once)) == []
    with pytest.raises(failpoints.FailpointHit, match="before_commit@files-out/0"):
        failpoints.hit("before_commit", "files-out", 0)
    failpoints.hit("before_commit", "files-out", 0)  # the one firing is taken
    assert len(failpoints.fired(str(once))) == 1
    # an entry without *N is not counted and never touches the folder
    with pytest.raises(failpoints.FailpointHit, match="before_ack/3"):
        failpoints.hit("before_ack", None, 3)
    assert len(os.listdir(once)) == 1


def test_victim_points_cover_every_point() -> None:
    covered = {p for v in VICTIMS for mode in ("embedded", "daemon")
               for p in points_for(v, mode, tables=True)}
    covered |= set(points_for("driver", "embedded", kafka_staged=True))
    # before_ack (the driver, between its last after_commit and its acks: the state an
    # after_commit kill of the last branch leaves) is no draw's; tests/spark/
    # test_branch.py's test_a_driver_killed_before_its_acks_after_a_redo_... aims at it
    assert covered == set(failpoints.POINTS) - {"before_ack"}
    # the tasks only prepare; the driver commits
    assert points_for("worker", "embedded") == ("before_prepare", "after_prepare")
    assert {"before_commit", "after_commit"} <= set(points_for("driver", "embedded"))
    assert not set(TABLE_POINTS) & set(points_for("driver", "embedded"))  # tables only
    assert points_for("coordinator", "embedded") == ()
    with pytest.raises(ValueError, match="unknown victim"):
        points_for("executor", "embedded")


def _kafka_chaos(tmp_path: Path, prepare: str, aim: int) -> object:
    from twophase.testing.chaos import ChaosOptions, _Chaos

    return _Chaos(ChaosOptions(workdir=tmp_path / f"{prepare}-{aim}", seed=3, files=True,
                               kafka_bootstrap="127.0.0.1:9", kafka_prepare=prepare,
                               aim_endtxn=aim))


def test_aim_endtxn_draws_only_points_between_a_kafka_vote_and_its_endtxn(
    tmp_path: Path
) -> None:
    """``--aim-endtxn``: until N such kills landed, the driver's failpoints (embedded: the
    coordinator's too) are drawn where a written-once Kafka branch is voted and open,
    and each counts; a before_commit of another participant does not count."""
    from twophase.testing.chaos import ENDTXN_POINTS, _Chaos

    c = _kafka_chaos(tmp_path, "resumable", aim=2)
    assert isinstance(c, _Chaos)
    kafka = c.kafka_once[0]
    specs = {c._choose_failpoint("driver") or "" for _ in range(40)}
    assert specs and all(c._in_endtxn_window(s) for s in specs), specs
    points = {s.split("=")[0].split("@")[0] for s in specs}
    assert points <= set(ENDTXN_POINTS) and "before_commit" in points
    assert all(f"@{kafka}/" in s for s in specs if s.startswith("before_commit"))
    assert not c._in_endtxn_window("before_commit@files/0=kill*1")
    assert not c._in_endtxn_window("after_commit@" + kafka + "/0=kill*1")


def test_without_aim_points_are_drawn_evenly_and_mid_commit_is_staged_only(
    tmp_path: Path
) -> None:
    from twophase.testing.chaos import _Chaos

    c = _kafka_chaos(tmp_path, "resumable", aim=0)
    assert isinstance(c, _Chaos)
    specs = {c._choose_failpoint("driver") or "" for _ in range(200)}
    points = {s.split("=")[0].split("@")[0] for s in specs}
    assert {"before_begin", "before_return", "after_commit"} <= points
    assert "mid_commit" not in points  # a resumable branch never hits it: a wasted kill
    staged = _kafka_chaos(tmp_path, "staged", aim=0)
    assert isinstance(staged, _Chaos)
    assert staged.kafka_once == [] and staged.kafka_staged
    assert not staged._in_endtxn_window("after_decision=kill*1")


def test_while_aiming_each_run_takes_one_kill_then_the_usual_count(tmp_path: Path) -> None:
    """A failpoint is drawn only as a driver run starts, so with ``--aim-endtxn`` a run
    ends after each kill until N window kills landed (a 100-kill run with 12 kills per
    run drew 7 and 9); then ``--max-kills-per-run`` applies again."""
    from twophase.testing.chaos import KillEvent, _Chaos

    c = _kafka_chaos(tmp_path, "resumable", aim=1)
    assert isinstance(c, _Chaos)
    assert c._aiming() and c._run_ends(1) and not c._run_ends(0)
    c.events.append(KillEvent(1, 1, "driver", "failpoint", "after_decision", "x", 1.0,
                              endtxn=True))
    assert not c._aiming()
    assert not c._run_ends(1) and c._run_ends(c.o.max_kills_per_run)
    staged = _kafka_chaos(tmp_path, "staged", aim=5)  # nothing to aim at: never aiming
    assert isinstance(staged, _Chaos) and not staged._aiming()
