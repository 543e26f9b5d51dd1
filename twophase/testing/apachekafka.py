"""A private Apache Kafka broker (4.x, KRaft) for the test suite, ``twophase demo`` and
``twophase chaos``.

One JVM on loopback that is broker and controller at once, its jars from Maven
(:mod:`.kafkajars`), its log in a folder that survives :meth:`LocalKafka.kill` (SIGKILL)
so :meth:`LocalKafka.restart` comes back with its topics, committed offsets and
transaction state: what a broker crash is. Configured for transactions on one node
(replication factor 1 for the internal topics, no rebalance delay, and a timed-out
transaction aborted within a second of its deadline rather than Kafka's 10 s).

Why not tansu any more: tansu shows aborted records to ``read_committed`` readers and
loses acknowledged records when killed mid-produce (docs/kafka.md); Kafka's own rules
can only be tested on Kafka.
"""

from __future__ import annotations

import base64
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twophase.testing.kafkajars import KAFKA_VERSION, java_binary, kafka_libs
from twophase.testing.servers import (
    LocalServer,
    ServerUnavailable,
    answers_kafka_metadata,
    clean_env,
    free_port,
)
from twophase.testing.tlscerts import CertificateAuthority

__all__ = ["BROKER_DEFAULTS", "JVM_OPTS", "KafkaBrokerUnavailable", "KafkaSecurity",
           "LocalKafka"]

BROKER_DEFAULTS: dict[str, str] = {
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # a restart after a kill waits out the dead incarnation's session (9 s by default)
    # before it may register again; 4 s keeps the restart short and leaves room for a
    # heartbeat delayed by a busy 2-core machine
    "broker.session.timeout.ms": "4000",
    "broker.heartbeat.interval.ms": "500",
    # an expired transaction is aborted within ~1 s of transaction.timeout.ms (default 10 s)
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    # two cores shared by the whole suite: few threads
    "num.network.threads": "2",
    "num.io.threads": "2",
    "background.threads": "2",
    "num.recovery.threads.per.data.dir": "1",
    "log.cleaner.threads": "1",
}
"""Broker settings every :class:`LocalKafka` gets; ``config=`` overrides them."""

JVM_OPTS = ("-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true")
"""Small heap, one GC thread, the quick compiler only: a broker up in ~3 s on 2 cores."""

_LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.state.name = state.change.logger
logger.state.level = warn
"""


def _cluster_id() -> str:
    """A random KRaft cluster id (a base64url UUID) that does not start with '-': the
    storage tool's argument parser would take it for an option."""
    while True:
        found = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if found[0].isalnum():
            return found


class KafkaBrokerUnavailable(ServerUnavailable):
    """The Kafka broker could not be formatted or did not start."""


@dataclass(frozen=True)
class KafkaSecurity:
    """A SASL_SSL listener for :class:`LocalKafka`, as a secured cluster has one.

    Clients connect with TLS (a certificate signed by a throw-away CA, for ``127.0.0.1``
    and ``localhost``, so host-name verification is on as librdkafka has it by default)
    and sign in with SASL ``SCRAM-SHA-512`` or ``PLAIN``; each of ``users`` may use either.
    With ``acls`` the broker runs Kafka's ``StandardAuthorizer`` and refuses what no ACL
    allows: only ``superusers`` may do everything. The broker's own listeners (inter-broker,
    controller) stay plaintext on loopback."""

    users: Mapping[str, str] = field(default_factory=lambda: {"admin": "admin-secret"})
    superusers: tuple[str, ...] = ("admin",)
    acls: bool = True


class LocalKafka(LocalServer):
    """Start with :meth:`start` (or ``with``); :attr:`bootstrap` is ``HOST:PORT``
    (``host`` defaults to loopback; a cluster test passes its bridge address).

    The same interface as :class:`~twophase.testing.localkafka.LocalTansu`: ``start``,
    ``stop`` (removes the folder), ``kill`` (SIGKILL; the folder stays), ``restart``,
    ``bootstrap``, ``alive``, ``s3_client`` and ``transaction_outcomes`` (both empty: a
    real broker's log is its own record). ``config`` overrides :data:`BROKER_DEFAULTS`.
    """

    stop_timeout = 30.0  # a controlled shutdown flushes the log and the metadata
    storage = "disk"  # its log survives a kill (chaos's victim 'broker' needs that)
    log_name = "broker.log"

    def __init__(
        self, *, config: Mapping[str, str] | None = None, port: int | None = None,
        base_dir: str | None = None, jvm_opts: tuple[str, ...] = JVM_OPTS,
        security: KafkaSecurity | None = None, host: str = "127.0.0.1",
    ) -> None:
        super().__init__(port=port, base_dir=base_dir)
        # the address clients connect to and the broker advertises: another host's
        # (a Spark worker in its own network namespace) cannot reach our loopback
        self.host = host
        self.controller_port = free_port()
        self.security = security
        # with security, the broker's own plaintext listener (inter-broker, readiness)
        self.internal_port = free_port() if security else self.port
        self.ca_cert: Path | None = None  # with security: the CA clients trust
        self.config = {**BROKER_DEFAULTS, **(config or {})}
        self.jvm_opts = jvm_opts
        self.cluster_id = _cluster_id()
        self.version = KAFKA_VERSION
        self.start_seconds: float | None = None  # the last start's, formatting included

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def client_config(self, user: str | None = None) -> dict[str, str]:
        """What a client of this broker sets: ``bootstrap.servers`` and, on a SASL_SSL
        broker, the security settings for ``user`` (the first superuser by default)
        signing in with SCRAM-SHA-512."""
        if self.security is None:
            return {"bootstrap.servers": self.bootstrap}
        assert self.ca_cert is not None, "client_config() needs a started broker"
        name = user or self.security.superusers[0]
        return {"bootstrap.servers": self.bootstrap, "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": name,
                "sasl.password": self.security.users[name],
                "ssl.ca.location": str(self.ca_cert)}

    def _security_props(self) -> dict[str, str]:
        assert self.dir is not None and self.security is not None
        ca = CertificateAuthority(self.dir / "tls", "twophase Kafka test CA")
        self.ca_cert = ca.cert
        keystore = self.dir / "tls" / "broker-keystore.pem"
        if not keystore.exists():
            keystore = ca.issue("broker").combined
        plain_users = " ".join(f'user_{u}="{p}"' for u, p in self.security.users.items())
        props = {
            "listeners": f"SASL_SSL://127.0.0.1:{self.port},"
                         f"INTERNAL://127.0.0.1:{self.internal_port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{self.port},"
                                    f"INTERNAL://127.0.0.1:{self.internal_port}",
            "inter.broker.listener.name": "INTERNAL",
            "listener.security.protocol.map":
                "SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.sasl_ssl.plain.sasl.jaas.config":
                f"org.apache.kafka.common.security.plain.PlainLoginModule required "
                f"{plain_users};",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(keystore),
        }
        if self.security.acls:
            # the broker's own plaintext listeners authenticate as ANONYMOUS
            props["authorizer.class.name"] = (
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer")
            props["super.users"] = ";".join(
                f"User:{u}" for u in (*self.security.superusers, "ANONYMOUS"))
        return props

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the broker's log and of its console output (JVM errors)."""
        if self.dir is None:
            return ""
        out = []
        for name in (self.log_name, "kafka.out"):
            path = self.dir / name
            if path.exists():
                out.append(f"--- {name}\n" + path.read_text(errors="replace")[-chars:])
        return "\n".join(out)

    def _node_props(self) -> dict[str, str]:
        """Who this node is and where it listens (a cluster's node says otherwise)."""
        return {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://{self.host}:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
        }

    def _write_config(self) -> Path:
        assert self.dir is not None
        props = {
            **self._node_props(),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.dir / "data"),
            **(self._security_props() if self.security else {}),
            **self.config,
        }
        path = self.dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.dir / "log4j2.properties").write_text(
            _LOG4J2.format(log=self.dir / self.log_name))
        return path

    def _java(self, main: str, *args: str) -> list[str]:
        assert self.dir is not None
        return [*self._prefix(), java_binary(), *self.jvm_opts,
                f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
                "-cp", f"{kafka_libs()}/*", main, *args]

    def _prefix(self) -> list[str]:
        """What the JVM's command starts with (a cluster node: its namespace)."""
        return []

    def answers(self) -> bool:
        """Whether the broker answers a Metadata request with a broker in it (on its
        plaintext listener: with security, the internal one on loopback)."""
        ready = "127.0.0.1" if self.security else self.host
        return answers_kafka_metadata(self.internal_port, f"{ready}:{self.internal_port}",
                                      host=ready)

    def start(self, timeout: float = 60.0) -> LocalKafka:
        """Format the log folder (the first time), start the JVM, and wait until the
        broker answers a Metadata request with itself in it."""
        began = time.monotonic()
        self.launch(timeout)
        self.wait_ready(timeout, began)
        return self

    def launch(self, timeout: float = 60.0) -> None:
        """Format the log folder (the first time) and start the JVM; no wait (the nodes
        of a cluster start together: none answers before a quorum of them is up)."""
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="twophase-kafka-", dir=self._base_dir))
        props = self._write_config()
        if not (self.dir / "data" / "meta.properties").exists():
            scram = [arg for user, password in (self.security.users.items()
                                                if self.security else ())
                     for arg in ("--add-scram",
                                 f"SCRAM-SHA-512=[name={user},password={password}]")]
            fmt = subprocess.run(
                self._java("kafka.tools.StorageTool", "format", "-t", self.cluster_id,
                           "-c", str(props), *scram),
                capture_output=True, text=True, timeout=timeout, env=clean_env(),
                check=False)
            if fmt.returncode != 0:
                raise KafkaBrokerUnavailable(
                    f"kafka-storage format failed (exit {fmt.returncode}):\n"
                    f"{(fmt.stdout + fmt.stderr)[-3000:]}")
        with open(self.dir / "kafka.out", "ab") as out:
            self.proc = subprocess.Popen(
                self._java("kafka.Kafka", str(props)), stdout=out, stderr=subprocess.STDOUT,
                env=clean_env(), start_new_session=True)

    def wait_ready(self, timeout: float = 60.0, began: float | None = None) -> None:
        """Wait until :meth:`answers`; a JVM that exits or a timeout raises with the
        log's tail."""
        assert self.proc is not None, "wait_ready() after launch()"
        began = time.monotonic() if began is None else began
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                raise KafkaBrokerUnavailable(
                    f"Apache Kafka {self.version} exited with {self.proc.returncode} at "
                    f"start (its folder {self.dir} is kept):\n{tail}")
            if self.answers():
                self.start_seconds = time.monotonic() - began
                return
            time.sleep(0.1)
        tail = self.log_tail()
        self.kill()
        raise KafkaBrokerUnavailable(
            f"Apache Kafka {self.version} did not answer metadata requests within "
            f"{timeout}s (its folder {self.dir} is kept):\n{tail}")

    def stop(self) -> None:
        """Stop the broker, first closing this process's idle Kafka clients (the Kafka
        participant keeps them for the next batch): left open, they would go on trying
        to reconnect to the stopped broker, and logging it, until the process exits."""
        from twophase.sinks.kafka.clients import close_process_clients

        close_process_clients()
        super().stop()

    def restart(self, timeout: float = 60.0) -> LocalKafka:
        """Start again on the same ports and log folder after :meth:`kill` (a crash):
        Kafka recovers its log, topics, offsets and transactions from disk."""
        assert self.dir is not None, "restart() needs a started broker"
        return self.start(timeout)

    def s3_client(self) -> tuple[Any, str] | None:
        """None: the log is on local disk (the tansu-on-S3 evidence has no counterpart)."""
        return None

    def transaction_outcomes(self) -> dict[tuple[int, int], bool]:
        """{}: Kafka writes a decided transaction's markers itself after a crash, so the
        partition log is the whole record."""
        return {}



if __name__ == "__main__":  # `python -m twophase.testing.apachekafka`: start, time, stop
    with LocalKafka() as broker:
        print(f"Apache Kafka {broker.version} on {broker.bootstrap}: up in "
              f"{broker.start_seconds:.1f}s")
