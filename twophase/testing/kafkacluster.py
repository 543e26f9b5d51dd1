"""A 3-broker Apache Kafka cluster (KRaft) on one machine, for leader-failover tests and
``twophase chaos --kafka-cluster 3``.

Each node is broker and controller at once (a 3-voter quorum) and a host of its own: a
network namespace on a bridge (:mod:`.netns`) with its own address, listening on
``ADDRESS:9092`` (clients) and ``ADDRESS:9093`` (the quorum). The Spark driver and its
local executors run on the host side of the bridge and reach every node there, as a
client reaches a real cluster: a partition's leader is one address among three, and when
it dies the clients must find the next one.

Replication as a production cluster is told to run transactions: every topic (the
internal ones too) has 3 replicas and ``min.insync.replicas=2``, so one node may die
without a loss and without stopping writes; a second one down at once stops writes
(``NOT_ENOUGH_REPLICAS``), which is why :meth:`KafkaCluster.restart` waits until the
node is back in every ISR before it returns.

Needs root (or CAP_NET_ADMIN) and ``iproute2``, like the Spark cluster; everything it
creates (namespaces, links, JVMs, folders) is removed by :meth:`KafkaCluster.stop`.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from twophase.testing.apachekafka import (
    BROKER_DEFAULTS,
    JVM_OPTS,
    KafkaBrokerUnavailable,
    LocalKafka,
    _cluster_id,
)
from twophase.testing.netns import Bridge, Host
from twophase.testing.servers import answers_kafka_metadata

__all__ = ["CLUSTER_DEFAULTS", "KafkaCluster", "KafkaNode", "transaction_partition"]

CLIENT_PORT, QUORUM_PORT = 9092, 9093

CLUSTER_DEFAULTS: dict[str, str] = {
    **BROKER_DEFAULTS,
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    "unclean.leader.election.enable": "false",
}
"""Every node's settings: :data:`~.apachekafka.BROKER_DEFAULTS` with replication 3 and
``min.insync.replicas`` 2 everywhere (``config=`` overrides)."""


def transaction_partition(transactional_id: str, partitions: int) -> int:
    """The ``__transaction_state`` partition whose leader coordinates this id: Kafka's
    ``Utils.abs(transactionalId.hashCode()) % partitions`` (Java's String hash)."""
    data = transactional_id.encode("utf-16-be")
    h = 0
    for unit in struct.unpack(f">{len(data) // 2}H", data):
        h = (31 * h + unit) & 0xFFFFFFFF
    if h & 0x80000000:
        h -= 1 << 32
    return (0 if h == -(1 << 31) else abs(h)) % partitions


class KafkaNode(LocalKafka):
    """One node of a :class:`KafkaCluster`: a :class:`LocalKafka` in its own namespace."""

    def __init__(self, host: Host, node_id: int, voters: str, cluster_id: str, *,
                 config: Mapping[str, str], base_dir: str, jvm_opts: tuple[str, ...]
                 ) -> None:
        super().__init__(config=config, port=CLIENT_PORT, base_dir=base_dir,
                         jvm_opts=jvm_opts, host=host.address)
        self.node = host  # its network namespace
        self.node_id = node_id
        self.voters = voters
        self.controller_port = QUORUM_PORT
        self.cluster_id = cluster_id
        self.dir = Path(base_dir) / f"node{node_id}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _node_props(self) -> dict[str, str]:
        a = self.node.address
        return {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "listeners": f"PLAINTEXT://{a}:{self.port},CONTROLLER://{a}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{a}:{self.port}",
        }

    def _prefix(self) -> list[str]:
        return self.node.exec_prefix()

    def answers(self) -> bool:
        return answers_kafka_metadata(self.port, self.bootstrap, host=self.node.address)

    def shutdown(self, timeout: float = 30.0) -> bool:
        """A controlled shutdown (SIGTERM: leadership handed over first); the folder
        stays for :meth:`restart`. True if it was running."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        return True


class KafkaCluster:
    """``brokers`` Kafka nodes, each in its own namespace; ``with`` starts and stops it.

    :attr:`bootstrap` lists every node. :meth:`kill` (SIGKILL), :meth:`shutdown`
    (controlled) and :meth:`restart` act on one node by its id (1..brokers);
    :meth:`leader` and :meth:`coordinator_of` say which node leads a partition or
    coordinates a transactional id, from the cluster's own metadata.
    """

    storage = "disk"  # a killed node's log stays for its restart
    log_name = "broker.log"  # each node's, in its folder (chaos keeps them)

    def __init__(self, brokers: int = 3, *, config: Mapping[str, str] | None = None,
                 base_dir: str | None = None,
                 jvm_opts: tuple[str, ...] = JVM_OPTS) -> None:
        self.n = brokers
        self.config = {**CLUSTER_DEFAULTS, **(config or {})}
        self.jvm_opts = jvm_opts
        self.net = Bridge("tk" + secrets.token_hex(3), error=KafkaBrokerUnavailable)
        self.dir = Path(tempfile.mkdtemp(prefix="twophase-kafka3-", dir=base_dir))
        self.nodes: dict[int, KafkaNode] = {}
        self.cluster_id = _cluster_id()
        self.start_seconds: float | None = None
        self.version = ""

    # ------------------------------------------------------------------ addresses
    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes.values())

    @property
    def host_address(self) -> str:
        """The bridge's host-side address (where the driver reaches the nodes from)."""
        return self.net.host_address

    @property
    def alive(self) -> bool:
        return all(node.alive for node in self.nodes.values())

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120.0) -> KafkaCluster:
        """Bridge and namespaces, format and start every node, wait until the cluster's
        metadata lists all of them."""
        began = time.monotonic()
        try:
            self.net.up()
            hosts = [self.net.add_host(i, "k") for i in range(1, self.n + 1)]
            voters = ",".join(f"{i}@{h.address}:{QUORUM_PORT}"
                              for i, h in enumerate(hosts, start=1))
            for i, host in enumerate(hosts, start=1):
                self.nodes[i] = KafkaNode(host, i, voters, self.cluster_id,
                                          config=self.config, base_dir=str(self.dir),
                                          jvm_opts=self.jvm_opts)
            for node in self.nodes.values():
                node.launch(timeout)
            for node in self.nodes.values():
                node.wait_ready(timeout, began)
            self.version = self.nodes[1].version
            self.wait_brokers(set(self.nodes), timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGKILL every node (the cluster is thrown away: no controlled shutdown, which
        would wait on a quorum its peers are leaving), close this process's idle Kafka
        clients, remove the namespaces, links and folder."""
        from twophase.sinks.kafka.clients import close_process_clients

        close_process_clients()
        for node in self.nodes.values():
            node.kill()
            for pid in node.node.pids():  # anything else started in its namespace
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.net.down()
        if os.environ.get("TWOPHASE_KEEP_CLUSTER_LOGS") is None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.nodes = {}

    # ------------------------------------------------------------------ one node
    def kill(self, node_id: int) -> bool:
        """SIGKILL one node (a crash); its log stays. True if it was running."""
        return self.nodes[node_id].kill()

    def shutdown(self, node_id: int) -> bool:
        """Stop one node the polite way (controlled shutdown); its log stays."""
        return self.nodes[node_id].shutdown()

    def restart(self, node_id: int, timeout: float = 120.0) -> None:
        """Start a stopped node on its address and log, and wait until the others see
        it and it is back in every partition's ISR (so one more node may fail)."""
        node = self.nodes[node_id]
        node.launch(timeout)
        node.wait_ready(timeout)
        self.wait_brokers(set(self.nodes), timeout)
        self.wait_in_sync(timeout)

    # ------------------------------------------------------------------ metadata
    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def wait_brokers(self, ids: set[int], timeout: float = 60.0) -> None:
        """Until the cluster's metadata lists exactly these brokers alive."""
        admin, deadline = self.admin(), time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                seen = set(admin.list_topics(timeout=5).brokers)
                if seen == ids:
                    return
            time.sleep(0.2)
        raise KafkaBrokerUnavailable(
            f"the Kafka cluster's metadata lists brokers {sorted(seen)}, not {sorted(ids)}, "
            f"after {timeout:.0f}s; node logs in {self.dir}")

    def wait_in_sync(self, timeout: float = 120.0) -> None:
        """Until every partition of every topic has all its replicas in sync."""
        admin, deadline = self.admin(), time.monotonic() + timeout
        behind: list[str] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                md = admin.list_topics(timeout=5)
                behind = [f"{t}/{p}" for t, tm in md.topics.items()
                          for p, pm in tm.partitions.items()
                          if set(pm.isrs) != set(pm.replicas) or pm.leader < 0]
                if not behind:
                    return
            time.sleep(0.2)
        raise KafkaBrokerUnavailable(
            f"partitions not back in sync within {timeout:.0f}s: {behind[:10]}; node logs "
            f"in {self.dir}")

    def leader(self, topic: str, partition: int = 0, timeout: float = 30.0) -> int:
        """The node id leading ``topic``/``partition`` now (the cluster's metadata)."""
        admin, deadline = self.admin(), time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                t = admin.list_topics(topic, timeout=5).topics.get(topic)
                if t is not None and t.error is None and partition in t.partitions:
                    leader = int(t.partitions[partition].leader)
                    if leader in self.nodes:
                        return leader
            if time.monotonic() > deadline:
                raise KafkaBrokerUnavailable(
                    f"no leader for {topic!r} partition {partition} within {timeout:.0f}s")
            time.sleep(0.2)

    def coordinator_of(self, transactional_id: str, timeout: float = 30.0) -> int:
        """The node coordinating ``transactional_id``: the leader of its
        ``__transaction_state`` partition."""
        partitions = int(self.config["transaction.state.log.num.partitions"])
        return self.leader("__transaction_state",
                           transaction_partition(transactional_id, partitions), timeout)

    def ongoing(self, prefix: str = "") -> dict[str, int]:
        """Open (``Ongoing``) transactions whose id starts with ``prefix``: id -> the
        node coordinating it (ListTransactions asks every broker for its own; through
        kafka-python, as :mod:`twophase.sinks.kafka.lingering` does)."""
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","),
                                 client_id="twophase-kafka3", request_timeout_ms=10000)
        try:
            listed = admin.list_transactions(state_filters=["Ongoing"])
        finally:
            admin.close()
        return {t.transactional_id: int(node) for node, txns in listed.items()
                for t in txns if t.transactional_id.startswith(prefix)}

    def pick_leader(self, rng: random.Random, topics: Sequence[str],
                    txn_prefix: str = "") -> tuple[int, str]:
        """A node to kill and why, for chaos: the coordinator of one of the open
        transactions of ``txn_prefix`` (a third of the draws, when there is one), else
        the leader of a random partition of ``topics``; a random node while none of
        them has a leader yet (said so in the reason)."""
        with contextlib.suppress(Exception):
            if rng.random() < 1 / 3:
                open_now = sorted(self.ongoing(txn_prefix).items())
                if open_now:
                    tid, node = rng.choice(open_now)
                    return node, f"coordinator of open transaction {tid}"
        admin = self.admin()
        found: list[tuple[str, int, int]] = []
        with contextlib.suppress(Exception):
            md = admin.list_topics(timeout=5)
            found = [(t, p, pm.leader) for t in topics if t in md.topics
                     for p, pm in sorted(md.topics[t].partitions.items())
                     if pm.leader in self.nodes]
        if found:
            topic, partition, leader = rng.choice(found)
            return leader, f"leader of {topic}/{partition}"
        node = rng.choice(sorted(self.nodes))
        return node, "no leader known yet: a random node"

    def s3_client(self) -> None:
        """None: the logs are on local disk (as :meth:`LocalKafka.s3_client`)."""
        return None

    def transaction_outcomes(self) -> dict[tuple[int, int], bool]:
        """{}: Kafka's own log is the whole record (as :class:`LocalKafka`)."""
        return {}

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"=== node {i}\n{node.log_tail(chars)}"
                         for i, node in self.nodes.items())


if __name__ == "__main__":  # `python -m twophase.testing.kafkacluster`: start, time, stop
    with KafkaCluster() as cluster:
        print(f"Apache Kafka {cluster.version}, {cluster.n} nodes on {cluster.bootstrap}: "
              f"up in {cluster.start_seconds:.1f}s")
