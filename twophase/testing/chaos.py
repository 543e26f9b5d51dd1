"""The chaos runner behind ``twophase chaos``: kill, restart, run to the end, verify.

It runs the reference job (``python -m twophase.testing.job``) as a separate driver process and,
in daemon mode, the coordinator as a ``twophase serve`` process, then SIGKILLs one of
three victims again and again, each time at a moment drawn from ``random.Random(seed)``:

- ``driver``: the job process (its JVM and Python workers die with it);
- ``worker``: one Spark Python worker of the job (the driver lives on and retries);
- ``coordinator``: the daemon (restarted at once on the same port and store);
- ``broker``: the Kafka broker chaos started (Apache Kafka, ``--kafka-local``; or a tansu
  on S3 storage), restarted after a short random pause on the same port and log; always a
  timer kill while a job runs. Kafka is judged from the partition logs and a
  read_committed consumer (on tansu: its stored outcomes settle lost markers).

A kill is either a failpoint (the protocol step is known: ``after_prepare``, ...) or a
timer that fires after a random delay (the step is read from the coordinator: the state
of the newest transaction right after the kill). After every driver kill the job is
restarted from its checkpoint; each job run gets new input batches. When the requested
number of kills has landed the job runs once more to the end, then every system is
verified (duplicates, missing ids, leftovers still prepared) and a report is written.
Everything here is plain process orchestration: no Spark in this process.
"""

from __future__ import annotations

import json
import random
import secrets
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twophase import failpoints
from twophase.errors import InvalidRequest
from twophase.participant import Verifiable
from twophase.protocol import CommitScope
from twophase.testing.chaosplan import (
    COORDINATOR_POINTS,
    DRIVER_POINTS,
    ENDTXN_POINTS,
    KAFKA_COPY_POINTS,
    PER_BRANCH_POINTS,
    TABLE_POINTS,
    VICTIMS,
    ChaosError,
    ChaosOptions,
    KillEvent,
    points_for,
)
from twophase.testing.chaosprocs import JobRun, kill, python_workers
from twophase.testing.chaosreport import redacted, render, summary
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.servers import LocalDaemon, clean_env

if TYPE_CHECKING:
    from twophase.testing.kafkacluster import KafkaCluster
    from twophase.testing.verify import VerifyReport

__all__ = [
    "COORDINATOR_POINTS",
    "DRIVER_POINTS",
    "ENDTXN_POINTS",
    "PER_BRANCH_POINTS",
    "TABLE_POINTS",
    "VICTIMS",
    "ChaosError",
    "ChaosOptions",
    "points_for",
    "python_workers",
    "render",
    "run_chaos",
]

# --------------------------------------------------------------------------- the run


class _Chaos:
    def __init__(self, opts: ChaosOptions) -> None:
        opts.validate()
        self.o = opts
        self.rng = random.Random(opts.seed)  # noqa: S311 - reproducible chaos, not crypto
        self.work = opts.workdir
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, int, dict[str, Any]]] = []
        self.events: list[KillEvent] = []
        self.missed: Counter[str] = Counter()
        self.runs: list[dict[str, Any]] = []
        self.total_batches = 0
        self.daemon: LocalDaemon | None = None
        self._daemon_spec = ""
        self.cfg = self._config()
        self.cfg_path = self.work / "job.json"
        self.cfg.dump(self.cfg_path)
        try:
            built = build_participants(self.cfg)
        except InvalidRequest as exc:  # a kind nobody registered, a malformed descriptor
            raise ChaosError(str(exc)) from None
        blind = [p.describe() for p in built if not isinstance(p, Verifiable)]
        if blind:
            raise ChaosError(
                f"chaos cannot count the rows of {', '.join(blind)}: its class does not "
                "implement read_back(column); inherit twophase.participant.Verifiable "
                "(docs/writing-a-participant.md) so the verifier can read its output")
        self.participant_names = [p.name for p in built]
        self.tables = any(p.commit_scope == CommitScope.BATCH for p in built)
        from twophase.sinks.kafka import KafkaParticipant

        kafka = [p for p in built if isinstance(p, KafkaParticipant)]
        self.kafka_staged = [p.name for p in kafka if p.prepare_mode == "staged"]
        # Written once (resumable): open from the vote until EndTxn.
        self.kafka_once = [p.name for p in kafka if p.prepare_mode != "staged"]
        self.kafka_prepare = kafka[0].prepare_mode if kafka else None  # as run
        self.batch_seconds: list[float] = [3.0]
        self.broker_down: list[float] = []
        self.broker_targets: list[str] = []  # a cluster's kills: what the node led
        self._down_node = 0

    # ------------------------------------------------------------------ setup
    def _config(self) -> JobConfig:
        o = self.o
        tag = secrets.token_hex(4)
        if o.job is not None:
            cfg = replace(o.job)
            if Path(cfg.input_dir).exists() and any(Path(cfg.input_dir).iterdir()):
                raise ChaosError(f"the job's input_dir {cfg.input_dir} is not empty: chaos "
                                 "writes the input itself (ids it can check); use a fresh one")
            if Path(cfg.checkpoint).exists() and any(Path(cfg.checkpoint).iterdir()):
                raise ChaosError(f"the job's checkpoint {cfg.checkpoint} is not empty; "
                                 "use a fresh checkpoint location")
            store = cfg.coordinator
        else:
            store = f"sqlite:///{self.work / 'coordinator.db'}"
            cfg = JobConfig(
                input_dir=str(self.work / "input"),
                checkpoint=str(self.work / "checkpoint"),
                coordinator=store,
                sink=f"chaos_{tag}",
                pg_dsn=o.pg_dsn,
                pg_table=f"chaos_{tag}",
                files_path=(o.files_path or str(self.work / "files")) if o.files else None,
                files_options=o.files_options if o.files else None,
                kafka_bootstrap=o.kafka_bootstrap,
                kafka_topic=f"chaos-{tag}",
                kafka_reuse=o.kafka_reuse,
                kafka_config_file=o.kafka_config_file,
                sql_urls=[o.sql_url] if o.sql_url else None,
                sql_table=f"chaos_{tag}",
                delta_path=o.delta_path,
                iceberg_table=f"chaos.orders_{tag}" if o.iceberg_local else None,
                iceberg_catalog={
                    "type": "sql", "uri": f"sqlite:///{self.work / 'iceberg-catalog.db'}",
                    "warehouse": f"file://{self.work / 'iceberg'}",
                } if o.iceberg_local else None,
                participants=[dict(d) for d in o.participants] or None,
                partitions=o.partitions,
                max_attempts=5,
                vote_timeout=60.0,
            )
            if o.kafka_prepare is not None:  # else the participant's default
                cfg.kafka_prepare = o.kafka_prepare
        if o.coordinator_mode == "daemon":
            if store.startswith(("http://", "https://")):
                if "coordinator" in o.victims:
                    raise ChaosError("the job's coordinator is a daemon chaos did not start; "
                                     "it cannot be a victim (give a store URL instead)")
                self.store_url = store
            else:
                token = secrets.token_urlsafe(16)
                self.daemon = LocalDaemon(store, token, self.work / "logs" / "coordinator.log")
                cfg.coordinator, cfg.token = self.daemon.url, token
                self.store_url = store
        else:
            if store.startswith(("http://", "https://")):
                raise ChaosError("--coordinator-mode embedded needs a store URL in the job "
                                 "(sqlite:///... or postgresql://...), not a daemon URL")
            self.store_url = store
        return cfg

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def _step_state(self) -> str:
        """The newest transaction of the sink as ``STATE`` (``none`` before the first)."""
        try:
            from twophase.coordinator.listing import fetch

            txns = fetch(self.store_url, sink=self.cfg.sink, limit=1, token=self.cfg.token)
        except Exception as exc:  # the store may be mid-write or the daemon down
            return f"unknown ({type(exc).__name__})"
        return str(txns[0]["state"]) if txns else "none"

    # ------------------------------------------------------------------ kills
    def _choose_victim(self) -> str:
        """At random, but every victim first: until each has had a kill that landed, the
        draw is among those still without one (a short run still hits them all)."""
        landed = {ev.victim for ev in self.events}
        pending = [v for v in self.o.victims if v not in landed]
        if pending and self.o.kills - len(self.events) >= len(pending):
            return self.rng.choice(pending)
        return self.rng.choice(self.o.victims)

    def _aiming(self) -> bool:
        """``--aim-endtxn`` not met yet (a written-once Kafka participant in the job)."""
        return bool(self.kafka_once) and sum(ev.endtxn for ev in self.events) < self.o.aim_endtxn

    def _run_ends(self, kills_in_run: int) -> bool:
        """Whether the current driver run is left to finish before the next kill: after
        ``--max-kills-per-run`` kills, and while aiming after each one, since a failpoint
        is drawn only when a run starts."""
        return kills_in_run >= (1 if self._aiming() else self.o.max_kills_per_run)

    def _choose_failpoint(self, victim: str) -> str | None:
        points = points_for(victim, self.o.coordinator_mode, self.tables,
                            kafka_staged=bool(self.kafka_staged))
        if not points:
            return None
        aim = self._aiming() and any(p in ENDTXN_POINTS for p in points)
        if aim:
            points = tuple(p for p in points if p in ENDTXN_POINTS)
        point = self.rng.choice(points)
        if point in PER_BRANCH_POINTS:
            who = self.rng.choice(self.kafka_staged if point in KAFKA_COPY_POINTS
                                  else self.kafka_once if aim else self.participant_names)
            part = self.rng.randrange(self.cfg.partitions or 1)
            return f"{point}@{who}/{part}=kill*1"
        return f"{point}=kill*1"

    def _in_endtxn_window(self, spec: str) -> bool:
        """A failpoint kill that leaves a written-once Kafka branch voted with its
        transaction open (``EndTxn`` not sent): the coordinator's points, or
        ``before_commit`` of that Kafka branch."""
        point, _, who = spec.split("=")[0].partition("@")
        if not self.kafka_once or point not in ENDTXN_POINTS:
            return False
        return point != "before_commit" or who.split("/")[0] in self.kafka_once

    def _start_run(self, spec: str, victim: str) -> tuple[JobRun, Path]:
        first = self.total_batches
        write_input(self.cfg.input_dir, self.o.batches, self.o.rows_per_batch, first=first)
        self.total_batches += self.o.batches
        number = len(self.runs) + 1
        once = self.work / "once" / f"run-{number:04d}"
        extra: dict[str, str] = {}
        if spec and victim in ("driver", "worker"):
            extra = {failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)}
        if self.daemon is not None:
            want = spec if victim == "coordinator" else ""
            if want or self._daemon_spec or not self.daemon.alive:
                self.daemon.stop()
                self.daemon.start(want, str(once))
                self._daemon_spec = want
        job = JobRun(number, self.cfg_path, clean_env(**extra),
                      self.work / "logs" / f"run-{number:04d}.log", self.lines)
        self.runs.append({"run": number, "failpoints": spec, "batches": [first,
                          self.total_batches - 1], "returncode": None, "seconds": None})
        self.o.log(f"run {number}: batches {first}..{self.total_batches - 1}"
                   + (f", failpoint {spec} ({victim})" if spec else ""))
        return job, once

    def _finish_run(self, job: JobRun) -> int:
        try:
            rc = job.wait(self.o.run_timeout)
        except subprocess.TimeoutExpired:
            # A job that never ends is a finding (a stuck driver), not a crash of chaos:
            # its log tail says where it waited; the run fails with it.
            tail = job.tail(40)
            job.kill_tree()
            info = self.runs[job.number - 1]
            info["returncode"] = job.proc.returncode
            info["seconds"] = round((job.ended or time.monotonic()) - job.started, 3)
            info["error"] = f"did not finish within {self.o.run_timeout:.0f}s"
            raise ChaosError(
                f"run {job.number} did not finish within {self.o.run_timeout:.0f}s (killed): "
                f"the job is stuck, a defect to find from its log {job.log}, which ends:\n"
                f"{tail}") from None
        info = self.runs[job.number - 1]
        info["returncode"] = rc
        info["seconds"] = round((job.ended or time.monotonic()) - job.started, 3)
        if rc not in (0, -signal.SIGKILL):
            info["error"] = job.tail(8)
            self.o.log(f"run {job.number}: exited with {rc} (restarting): "
                       f"{job.tail(1)[:200]}")
        for _, run, line in self.lines:
            if run == job.number and "seconds" in line:
                self.batch_seconds.append(float(line["seconds"]))
        return rc

    def _wait_for_failpoint(self, victim: str, job: JobRun, once: Path) -> str | None:
        """Block until the failpoint fired (returns where) or the job ended without it."""
        deadline = time.monotonic() + self.o.run_timeout
        while time.monotonic() < deadline:
            ended = not job.alive  # read before the once-dir: a firing then is seen below
            fired = failpoints.fired(str(once))
            if victim == "driver" and ended:
                job.wait(30)
                return fired[0] if fired and job.proc.returncode == -signal.SIGKILL else None
            if victim == "coordinator":
                assert self.daemon is not None
                if not self.daemon.alive:
                    return (failpoints.fired(str(once)) or ["daemon killed"])[0]
            if victim == "worker" and fired:
                return fired[0]
            if victim != "driver" and ended:
                return None
            time.sleep(0.05)
        raise ChaosError(f"run {job.number} neither fired its failpoint nor ended within "
                         f"{self.o.run_timeout:.0f}s")

    def _timer_kill(self, victim: str, job: JobRun, fresh: bool) -> str | None:
        """Sleep a random delay, then SIGKILL the victim; returns the pid killed."""
        est = statistics.median(self.batch_seconds)
        if fresh:
            # Anchor at the first Python worker (the first batch's tasks): the JVM start
            # before it is the same every time and says nothing about the protocol.
            while job.alive and not python_workers(job.proc.pid):
                time.sleep(0.1)
            delay = self.rng.uniform(0.0, est * self.o.batches)
        else:
            delay = self.rng.uniform(0.0, 2.0 * est)
        end = time.monotonic() + delay
        while job.alive and time.monotonic() < end:
            time.sleep(0.05)
        if not job.alive:
            return None
        if victim == "driver":
            pid = job.proc.pid
            job.kill_tree()
            return f"pid {pid}"
        if victim == "worker":
            give_up = time.monotonic() + max(5.0, 2 * est)
            while job.alive and time.monotonic() < give_up:
                workers = python_workers(job.proc.pid)
                if workers:
                    pid = self.rng.choice(workers)
                    if kill(pid):
                        return f"pid {pid}"
                time.sleep(0.1)
            return None
        if victim == "broker":
            broker = self.o.broker
            assert broker is not None
            from twophase.testing.kafkacluster import KafkaCluster

            if isinstance(broker, KafkaCluster):  # the node leading what is written
                return self._kill_leader(broker)
            pid = broker.proc.pid if broker.proc else 0
            return f"pid {pid}" if broker.kill() else None
        assert self.daemon is not None
        pid = self.daemon.proc.pid if self.daemon.proc else 0
        return f"pid {pid}" if self.daemon.kill() else None

    def _kill_leader(self, cluster: KafkaCluster) -> str | None:
        from twophase.sinks.kafka.staged import default_staging_topic

        topics = [self.cfg.kafka_topic, default_staging_topic(self.cfg.kafka_topic)]
        node, why = cluster.pick_leader(self.rng, topics, f"twophase.{self.cfg.sink}.")
        proc = cluster.nodes[node].proc
        pid = proc.pid if proc else 0
        if not cluster.kill(node):
            return None
        self._down_node = node
        self.broker_targets.append(
            "coordinator" if why.startswith("coordinator") else
            "leader:staging" if why.startswith(f"leader of {topics[1]}/") else
            "leader:target" if why.startswith("leader of") else "random node")
        return f"node {node}, {why} (pid {pid})"

    def _after_kill(self, victim: str) -> None:
        if victim == "broker":
            down = self.rng.uniform(0.0, self.o.broker_down_max_s)
            time.sleep(down)  # bounded outage, then the same port and storage again
            broker = self.o.broker
            assert broker is not None
            from twophase.testing.kafkacluster import KafkaCluster

            if isinstance(broker, KafkaCluster):  # back, and in every ISR again
                broker.restart(self._down_node)
            else:
                broker.restart()
            self.broker_down.append(round(down, 3))
        if victim == "coordinator":
            assert self.daemon is not None
            time.sleep(self.rng.uniform(0.0, 1.0))  # a short outage, then the restart
            self.daemon.stop()
            self.daemon.start()
            self._daemon_spec = ""

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict[str, Any]:
        o = self.o
        job: JobRun | None = None
        kills_in_run = 0
        try:
            attempts = 0
            while len(self.events) < o.kills:
                if o.max_seconds is not None and self.now() > o.max_seconds:
                    o.log(f"time budget of {o.max_seconds:.0f}s spent after "
                          f"{len(self.events)} kills: finishing")
                    break
                attempts += 1
                if attempts > 4 * o.kills + 10:
                    raise ChaosError(f"only {len(self.events)} of {o.kills} kills landed in "
                                     f"{attempts - 1} tries; see {self.work / 'logs'}")
                victim = self._choose_victim()
                if job is not None and (not job.alive or self._run_ends(kills_in_run)):
                    self._finish_run(job)
                    job = None
                fresh = job is None
                spec = ""
                if fresh:
                    kills_in_run = 0
                    if self.rng.random() < o.failpoint_share:
                        spec = self._choose_failpoint(victim) or ""
                    job, once = self._start_run(spec, victim)
                assert job is not None
                if spec:
                    where = self._wait_for_failpoint(victim, job, once)
                    step = spec.split("=")[0].split("@")[0]
                    method = "failpoint"
                else:
                    where = self._timer_kill(victim, job, fresh)
                    step = "timer:" + self._step_state() if where else ""
                    method = "timer"
                if where is None:
                    self.missed[f"{victim}:{method}"] += 1
                    continue
                event = KillEvent(len(self.events) + 1, job.number, victim, method, step,
                                  where, self.now(), endtxn=self._in_endtxn_window(spec))
                self.events.append(event)
                kills_in_run += 1
                o.log(f"kill {event.n}/{o.kills}: {victim} by {method} at {step} ({where}), "
                      f"run {job.number}, t={event.at:.1f}s")
                self._after_kill(victim)
                if victim == "driver":
                    self._finish_run(job)
                    job = None
            # Run to the end: finish the current run, then one clean run with a last batch.
            if job is not None:
                self._finish_run(job)
            final_rc = None
            for _ in range(3):
                job, _once = self._start_run("", "driver")
                final_rc = self._finish_run(job)
                job = None
                if final_rc == 0:
                    break
            return self._report(final_rc)
        finally:
            if job is not None and job.alive:
                job.kill_tree()
            if self.daemon is not None:
                self.daemon.stop()

    # ------------------------------------------------------------------ report
    def _report(self, final_rc: int | None) -> dict[str, Any]:
        from twophase.testing.verify import verify

        commits = sorted(t - self.t0 for t, _, line in self.lines if "batch" in line)
        for ev in self.events:
            nxt = next((t for t in commits if t > ev.at), None)
            ev.recovery_s = None if nxt is None else round(nxt - ev.at, 3)
        rec = [ev.recovery_s for ev in self.events if ev.recovery_s is not None]
        from twophase.testing.kafkacluster import KafkaCluster

        if isinstance(self.o.broker, KafkaCluster):
            self.o.broker.wait_in_sync()  # every replica caught up first
        participants = build_participants(self.cfg)
        report = verify(participants,
                        expected_ids(self.total_batches, self.o.rows_per_batch),
                        sink=self.cfg.sink, backs=self._kafka_backs(participants))
        for p in participants:
            p.close()
        self._keep_broker_evidence(report)
        by_victim_step: dict[str, Counter[str]] = {}
        for ev in self.events:
            by_victim_step.setdefault(ev.victim, Counter())[ev.step] += 1
        unsettled = self._unsettled()
        out: dict[str, Any] = {
            "ok": bool(report.ok and final_rc == 0),
            "seed": self.o.seed,
            "kills_requested": self.o.kills,
            "kills": len(self.events),
            "by_victim": dict(Counter(ev.victim for ev in self.events)),
            "by_method": dict(Counter(ev.method for ev in self.events)),
            "by_step": dict(Counter(ev.step for ev in self.events)),
            "by_victim_step": {k: dict(v) for k, v in by_victim_step.items()},
            "missed": dict(self.missed),
            "kafka_vote_to_endtxn": sum(ev.endtxn for ev in self.events),
            "runs": len(self.runs),
            "job_failures": sum(1 for r in self.runs
                                if r["returncode"] not in (0, -signal.SIGKILL)),
            "final_returncode": final_rc,
            "batches": self.total_batches,
            "rows": self.total_batches * self.o.rows_per_batch,
            "recovery_seconds": summary(rec),
            "coordinator_mode": self.o.coordinator_mode,
            "coordinator_unsettled": unsettled,
            "coordinator_store": self.store_url,
            "kafka_reuse": self.cfg.kafka_reuse,
            "kafka_prepare": self.kafka_prepare,
            "broker_down_seconds": summary(self.broker_down),
            "broker_kills_by_target": dict(Counter(self.broker_targets)),
            "duration_s": self.now(),
            "verify": json.loads(report.to_json()),
            "verify_lines": report.lines(),
            "events": [asdict(ev) for ev in self.events],
            "run_log": self.runs,
            "job": asdict(self.cfg) | {"token": None, "files_options": redacted(
                self.cfg.files_options)},
            "workdir": str(self.work),
        }
        path = self.o.json_out or (self.work / "chaos-report.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str))
        out["json_path"] = str(path)
        return out

    def _kafka_backs(self, participants: Sequence[Any]) -> dict[str, Any] | None:
        """With a killed broker: Kafka read from its log, a transaction whose markers a
        crash lost settled by tansu's own stored outcome and named in the note
        (``KafkaParticipant.read_back(outcomes=...)``, docs/chaos.md "The lost marker");
        one tansu still has open stays open. None: every system reads itself."""
        if (self.o.broker is None or "broker" not in self.o.victims
                or self.o.broker.storage == "disk"):  # Apache Kafka: its log is whole
            return None
        from twophase.sinks.kafka import KafkaParticipant

        # tansu on S3 finds a partition's end from the objects' last_modified, which S3
        # keeps to the second: read within the second of the last commit, it can be stale.
        time.sleep(2.0)
        outcomes = self.o.broker.transaction_outcomes()
        return {p.name: p.read_back("id", outcomes=outcomes) for p in participants
                if isinstance(p, KafkaParticipant)}

    def _keep_broker_evidence(self, report: VerifyReport) -> None:
        """A killed broker's own log (logs/broker.log or tansu.log), and when Kafka's
        verdict fails,
        the evidence (logs/kafka-evidence.txt: the partition logs batch by batch, the
        coordinator's attempts, tansu's stored state): the broker and its bucket are
        gone when chaos returns."""
        broker = self.o.broker
        if broker is None or "broker" not in self.o.victims:
            return
        for i, node in getattr(broker, "nodes", {}).items():  # a cluster's nodes
            if node.dir is not None and (node.dir / node.log_name).exists():
                (self.work / "logs" / f"broker-node{i}.log").write_bytes(
                    (node.dir / node.log_name).read_bytes())
        if broker.dir is not None and (broker.dir / broker.log_name).exists():
            (self.work / "logs" / broker.log_name).write_bytes(
                (broker.dir / broker.log_name).read_bytes())
        if all(s.ok for s in report.systems if s.kind == "kafka"):
            return
        from twophase.testing.kafka_evidence import evidence

        text = evidence(broker.bootstrap, self.cfg.kafka_topic, self.store_url,
                        self.cfg.sink, broker.s3_client())
        (self.work / "logs" / "kafka-evidence.txt").write_text(text)
        self.o.log(f"Kafka failed its verdict: evidence in {self.work / 'logs'}")

    def _unsettled(self) -> int | str:
        """Transactions of the sink still OPEN/PREPARING/COMMITTING (informational)."""
        try:
            from twophase.coordinator.listing import fetch

            url = self.store_url
            txns = fetch(url, sink=self.cfg.sink, limit=100000, token=self.cfg.token)
        except Exception as exc:
            return f"unknown ({type(exc).__name__}: {exc})"
        return sum(1 for t in txns if t["state"] in ("OPEN", "PREPARING", "COMMITTING"))


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    """Run the chaos loop; returns the report (also written as JSON, see ``json_path``)."""
    return _Chaos(opts).run()
