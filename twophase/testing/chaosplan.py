"""What a chaos run is asked to do: the victims, the failpoints a kill may land on for
each, and the options (``twophase chaos``) with their checks; the record of one kill."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twophase.errors import TwophaseError
from twophase.testing.job import JobConfig

if TYPE_CHECKING:
    from twophase.testing.apachekafka import LocalKafka
    from twophase.testing.kafkacluster import KafkaCluster
    from twophase.testing.localkafka import LocalTansu

__all__ = ["COORDINATOR_POINTS", "DRIVER_POINTS", "ENDTXN_POINTS", "KAFKA_COPY_POINTS",
           "PER_BRANCH_POINTS",
           "TABLE_POINTS", "VICTIMS", "ChaosError", "ChaosOptions", "KillEvent",
           "points_for"]

VICTIMS = ("driver", "worker", "coordinator", "broker")
DRIVER_POINTS = ("before_begin", "before_return")
TABLE_POINTS = ("before_batch_commit", "after_batch_commit")
"""Driver points around a table's once-per-batch commit: chosen only when the job writes
a participant that commits per batch (Iceberg, Delta)."""
COORDINATOR_POINTS = ("coordinator_before_decision", "after_decision")
PREPARE_POINTS = ("before_prepare", "after_prepare")
"""The task's points: tasks prepare and end, the driver commits."""
DRIVER_COMMIT_POINTS = ("before_commit", "after_commit")
"""Where the driver applies a decision to each branch."""
KAFKA_COPY_POINTS = ("mid_commit",)
"""Inside a staged Kafka branch's commit on the driver: the copy's transaction open."""
ENDTXN_POINTS = ("coordinator_before_decision", "after_decision", "before_commit")
"""Where a kill leaves a written-once (resumable) Kafka branch voted and its transaction
open, ``EndTxn`` not sent: every vote in, decision not written; decision written, not
answered; decision known, not applied (``before_commit`` of a Kafka branch, on the
driver)."""
# Points hit once per branch (participant and partition known); the others are hit once
# per task (partition only) or outside tasks.
PER_BRANCH_POINTS = frozenset({"before_prepare", "after_prepare", "before_commit", "after_commit",
                               "mid_commit"})


class ChaosError(TwophaseError, RuntimeError):
    """The chaos run itself could not go on (bad options, a job that never finishes)."""


def points_for(
    victim: str, mode: str, tables: bool = False, kafka_staged: bool = False,
) -> tuple[str, ...]:
    """The failpoints whose ``kill`` lands in ``victim`` for this coordinator mode
    (``tables``: the job writes a participant that commits once per batch;
    ``kafka_staged``: a staged Kafka participant, whose copy the driver commits). The
    tasks only prepare; the driver commits."""
    if victim == "driver":
        # The embedded coordinator lives in the driver: its points kill the driver.
        return (DRIVER_POINTS + (TABLE_POINTS if tables else ())
                + DRIVER_COMMIT_POINTS
                + (KAFKA_COPY_POINTS if kafka_staged else ())
                + (COORDINATOR_POINTS if mode == "embedded" else ()))
    if victim == "worker":
        return PREPARE_POINTS
    if victim == "coordinator":
        return COORDINATOR_POINTS if mode == "daemon" else ()
    if victim == "broker":
        return ()  # the broker runs no twophase code: timer kills only
    raise ValueError(f"unknown victim {victim!r}; one of {', '.join(VICTIMS)}")


@dataclass
class ChaosOptions:
    """What to run and how hard to hit it (see ``twophase chaos --help``)."""

    workdir: Path
    kills: int = 10
    seed: int = 0
    victims: tuple[str, ...] = ("driver", "worker")  # add "coordinator" in daemon mode
    batches: int = 3  # new input batches for every job run
    rows_per_batch: int = 200
    coordinator_mode: str = "embedded"
    pg_dsn: str | None = None
    files: bool = True
    files_path: str | None = None  # default: a folder in workdir; or s3://bucket/prefix
    files_options: dict[str, Any] | None = None  # storage_options of an s3:// files_path
    kafka_bootstrap: str | None = None
    kafka_reuse: bool = False  # KafkaParticipant(reuse_clients=True)
    kafka_prepare: str | None = None  # KafkaParticipant(prepare=...); None: its default
    kafka_config_file: str | None = None  # librdkafka settings (TLS, SASL): a properties file
    # The Kafka broker chaos may kill (victim "broker"): a started LocalKafka (or a
    # LocalTansu on S3 storage), whose kafka_bootstrap this is; None without that victim.
    # A KafkaCluster (--kafka-cluster 3): a kill takes the node leading a partition of the
    # target or staging topic, or coordinating an open transaction of the sink.
    broker: LocalKafka | LocalTansu | KafkaCluster | None = None
    broker_down_max_s: float = 5.0  # a broker kill keeps it down uniform(0, this) seconds
    sql_url: str | None = None  # SqlAlchemyParticipant (e.g. a private MariaDB)
    delta_path: str | None = None  # DeltaParticipant (e.g. a folder in the workdir)
    iceberg_local: bool = False  # IcebergParticipant on a SQL catalog in the workdir
    # participants rebuilt by kind from descriptors (entry points: a third party's too)
    participants: tuple[dict[str, Any], ...] = ()
    job: JobConfig | None = None  # a user's job; chaos writes its input
    partitions: int = 2
    failpoint_share: float = 0.5  # the rest of the kills are timer kills
    max_kills_per_run: int = 4
    # Aim failpoint kills between a Kafka vote and its EndTxn (ENDTXN_POINTS) until this
    # many have landed there (--aim-endtxn); 0: points drawn evenly.
    aim_endtxn: int = 0
    run_timeout: float = 900.0
    max_seconds: float | None = None  # stop killing after this long, then finish and verify
    json_out: Path | None = None
    log: Callable[[str], None] = field(default=lambda _m: None, repr=False)

    def validate(self) -> None:
        if self.kills < 0:
            raise ChaosError(f"--kills must be >= 0, got {self.kills}")
        if self.batches < 1 or self.rows_per_batch < 1:
            raise ChaosError("--batches and --rows-per-batch must be >= 1")
        if self.coordinator_mode not in ("embedded", "daemon"):
            raise ChaosError(f"--coordinator-mode must be embedded or daemon, "
                             f"got {self.coordinator_mode!r}")
        if not self.victims:
            raise ChaosError("--victims is empty")
        for v in self.victims:
            if v not in VICTIMS:
                raise ChaosError(f"unknown victim {v!r}; choose from {', '.join(VICTIMS)}")
        if "coordinator" in self.victims and self.coordinator_mode != "daemon":
            raise ChaosError("victim 'coordinator' needs --coordinator-mode daemon (the "
                             "embedded coordinator dies with the driver: victim 'driver')")
        if "broker" in self.victims:
            if self.broker is None or self.job is not None:
                raise ChaosError("victim 'broker' needs --kafka-local (chaos kills and "
                                 "restarts the Kafka broker it starts itself)")
            if self.broker.storage.startswith("memory://"):
                raise ChaosError("victim 'broker' needs a tansu on s3:// storage (its log "
                                 "must survive the kill)")
        if not 0.0 <= self.broker_down_max_s <= 60.0:
            raise ChaosError(f"--broker-down-max must be within 0..60 seconds, got "
                             f"{self.broker_down_max_s:g}")
        if self.aim_endtxn < 0:
            raise ChaosError(f"--aim-endtxn must be >= 0, got {self.aim_endtxn}")
        if not 0.0 <= self.failpoint_share <= 1.0:
            raise ChaosError("failpoint share must be within 0..1")


@dataclass
class KillEvent:
    n: int
    run: int
    victim: str
    method: str  # "failpoint" or "timer"
    step: str  # the failpoint, or "timer:<newest transaction state>"
    where: str  # failpoint firing place, or the pid killed
    at: float  # seconds since the chaos run started
    recovery_s: float | None = None
    endtxn: bool = False  # a Kafka branch voted, its EndTxn not sent (ENDTXN_POINTS)
