"""The kill matrix: every failpoint x participant kind x victim, with real Spark (a separate
driver process), real PostgreSQL, real files and Kafka over the wire.

Each case: fresh input, checkpoint, coordinator and target; run the job with a ``kill``
failpoint (once across processes, via the once-dir); check the right process died;
restart from the checkpoint (one more input batch) and run to the end; verify 0
duplicates, 0 missing, nothing left prepared. Kafka is judged from its partition logs
(COMMIT/ABORT markers replayed with Kafka's rule: 0 duplicates, 0 missing, 0 open
transactions) on the suite's Apache Kafka, and a read_committed consumer must agree with
the log exactly. Every committed Kafka branch must also show its committed-offset marker.

Kafka's hard moments (``test_kafka_hard_moment``): a worker killed after producing but
before voting, after the COMMIT decision but before the Kafka commit, twice (the second
kill lands *during the redo*: its transaction is produced, not committed); the zombie
producer alive while its replacement redoes is ``tests/chaos/test_kafka_chaos.py``.

The full matrix is ``slow`` (``bash scripts/test.sh -m slow -k matrix``); the default run
keeps a bounded subset covering the driver and worker victims and all three participant kinds
(the coordinator victim: the short chaos run in tests/chaos/test_chaos_cli.py).
"""

from __future__ import annotations

import itertools
import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.support.fault import prepared_gids
from tests.support.kafka import kafka_branches_committed
from tests.support.user import run_reference_job
from twophase import failpoints
from twophase.testing.chaos import PER_BRANCH_POINTS, TABLE_POINTS, VICTIMS, points_for
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.servers import LocalDaemon
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

KINDS = ("postgres", "files", "kafka", "kafka_resumable")
"""``kafka``: the staged prepare (tasks stage, the driver copies and commits);
``kafka_resumable``: ``prepare="resumable"``, the default (tasks leave their
transactions open, the driver ends them with ``EndTxn``: its driver points fall between
a vote and its ``EndTxn``)."""
BATCHES, ROWS = 3, 40
_n = itertools.count()


def _mode(victim: str) -> str:
    # Coordinator points kill the driver in embedded mode and the daemon in daemon mode.
    return "daemon" if victim == "coordinator" else "embedded"


def _all_cases() -> list[tuple[str, str, str]]:
    # every kind prepares in tasks and commits from the driver
    return [(v, p, k) for k in KINDS for v in VICTIMS
            for p in points_for(v, _mode(v), kafka_staged=k == "kafka")]


# Bounded subset for every run: all victims, all kinds, the decision on both sides.
# (Slow since the suite went to two workers, each covered in the default run:
# worker-after_prepare-postgres by tests/system/test_cluster.py's embedded-coordinator test
# (a Python worker SIGKILLed right after preparing its PostgreSQL branch, the retry finds
# it by name). docs/testing.md.)
FAST = {
    ("driver", "coordinator_before_decision", "postgres"),
    ("driver", "before_commit", "files"),
    # staged Kafka: the driver dies after copying a branch into the topic and committing
    # it, before the ack; the restart finds the marker and does not copy again
    ("driver", "after_commit", "kafka"),
    # resumable Kafka (the default): the driver dies after the COMMIT decision, before
    # any EndTxn; the restart commits every branch from its vote's handle
    ("driver", "after_decision", "kafka_resumable"),
    # resumable Kafka: a Python worker dies after writing its branch, before its vote;
    # the retry writes it on another pool id and the open transaction is aborted
    ("worker", "after_prepare", "kafka_resumable"),
    # the coordinator victim: tests/chaos/test_chaos_cli.py's short run kills the daemon,
    # tests/coordinator/test_coordinator_daemon.py kills it at the decision (its matrix
    # row, 2-3 minutes, is in the slow matrix to keep CI within 45 minutes)
}


def _params() -> list[Any]:
    out = []
    for case in _all_cases():
        marks = [] if case in FAST else [pytest.mark.slow]
        out.append(pytest.param(*case, marks=marks, id="-".join(case)))
    return out


def run_case(
    tmp: Path, victim: str, point: str, kind: str, *, pg_dsn: str,
    kafka: str | None = None, kills: int = 1,
) -> list[Any]:
    """Run one case (``kills`` hits of the failpoint, counted across processes); returns
    the verifier's system reports. ``reuse``: the Kafka participant's ``reuse_clients``
    (None: the job config's default)."""
    n = next(_n)
    tag = f"m{n}_{secrets.token_hex(3)}"
    store = f"sqlite:///{tmp / 'coord.db'}"
    cfg = JobConfig(
        input_dir=str(tmp / "in"), checkpoint=str(tmp / "ckpt"), coordinator=store,
        sink=f"mx_{tag}", partitions=2, vote_timeout=60.0, max_attempts=4,
        pg_dsn=pg_dsn if kind == "postgres" else None, pg_table=f"mx_{tag}",
        files_path=str(tmp / "out") if kind == "files" else None,
        kafka_bootstrap=kafka if kind.startswith("kafka") else None, kafka_topic=f"mx-{tag}",
        kafka_prepare="resumable" if kind == "kafka_resumable" else "staged",
        # a files-only job writes natively (Spark's writer, from the driver): a worker
        # victim needs the files written in the tasks, the Python path
        files_native=False if kind == "files" and victim == "worker" else None,
    )
    [participant] = build_participants(cfg)
    spec = f"{point}=kill*{kills}"
    if point in PER_BRANCH_POINTS:
        spec = f"{point}@{participant.name}/1=kill*{kills}"
    once = tmp / "once"
    fp_env = {failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)}
    daemon = None
    if victim == "coordinator":
        daemon = LocalDaemon(store, secrets.token_urlsafe(12), tmp / "daemon.log")
        daemon.start(spec, str(once))
        cfg.coordinator, cfg.token = daemon.url, daemon.token
    cfg_path = tmp / "job.json"
    cfg.dump(cfg_path)
    log = tmp / "job.log"
    write_input(cfg.input_dir, BATCHES, ROWS)
    try:
        first = run_reference_job(cfg_path, fp_env if victim != "coordinator" else {}, log,
                                  drop=())
        fired = failpoints.fired(str(once))
        assert len(fired) == kills, (fired, first.returncode, log.read_text()[-3000:])
        pid = int(fired[0].split("pid=")[1].split()[0])
        if victim == "driver":
            assert first.returncode == -9, log.read_text()[-3000:]
        elif victim == "worker":
            # A Python worker died, not the driver: the driver finished or gave up itself.
            assert first.returncode != -9, log.read_text()[-3000:]
            assert pid != 0
        else:
            assert daemon is not None and daemon.proc is not None
            assert daemon.proc.wait(60) == -9
            assert pid == daemon.proc.pid
            daemon.start()  # restart on the same port and store, without failpoints
        # Restart from the checkpoint with one more batch and run to the end.
        write_input(cfg.input_dir, 1, ROWS, first=BATCHES)
        second = run_reference_job(cfg_path, {}, log, drop=())
        assert second.returncode == 0, log.read_text()[-3000:]
        lines = [json.loads(x) for x in second.stdout.splitlines() if x.startswith("{")]
        assert lines[-1] == {"done": True}
    finally:
        if daemon is not None:
            daemon.stop()
    report = verify(build_participants(cfg), expected_ids(BATCHES + 1, ROWS), sink=cfg.sink)
    [system] = report.systems
    assert system.missing == 0 and system.unexpected == 0, report.lines()
    assert system.prepared_leftovers == 0, report.lines()
    assert system.duplicates == 0 and system.open_transactions == 0, report.lines()
    assert system.exact and system.mismatch == 0, report.lines()
    assert report.ok, report.lines()
    if kind == "postgres":
        assert prepared_gids(pg_dsn) == []
    if kind.startswith("kafka"):
        assert "a read_committed consumer agrees" in system.note, system.note
        assert kafka_branches_committed(cfg, store) >= 2 * (BATCHES + 1)
    return report.systems


@pytest.mark.parametrize(("victim", "point", "kind"), _params())
def test_matrix(tmp_path: Path, pg_dsn: str, request: pytest.FixtureRequest,
                victim: str, point: str, kind: str) -> None:
    kafka = request.getfixturevalue("kafka_bootstrap") if kind.startswith("kafka") else None
    run_case(tmp_path, victim, point, kind, pg_dsn=pg_dsn, kafka=kafka)


def test_matrix_covers_every_point_kind_and_victim() -> None:
    """The matrix is complete: every failpoint the code hits is killed in some victim.
    The Kafka broker is a victim without failpoints (no twophase code runs in it): it is
    killed by timer in ``twophase chaos`` and at held steps in
    ``tests/chaos/test_kafka_server_faults.py``."""
    cases = _all_cases()
    process_victims = set(VICTIMS) - {"broker"}
    assert points_for("broker", "daemon") == points_for("broker", "embedded") == ()
    # the batch-commit points fire only for a table participant (none of KINDS)
    # before_ack: the driver's step after its last after_commit, aimed by test_branch.py
    assert {p for _, p, _ in cases} == (set(failpoints.POINTS) - set(TABLE_POINTS)
                                        - {"before_ack"})
    assert {v for v, _, _ in cases} == process_victims
    assert {k for _, _, k in cases} == set(KINDS)
    assert set(cases) >= FAST
    # the default subset: driver kills of every kind and a worker kill (the coordinator
    # victim's default run is the short chaos run in tests/chaos/test_chaos_cli.py)
    assert {v for v, _, _ in FAST} == process_victims - {"coordinator"}
    assert {k for _, _, k in FAST} == set(KINDS)
