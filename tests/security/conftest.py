"""One real daemon (``twophase serve``) per module, with an operator token and two jobs'
data tokens, each scoped to its own sink, and the operator's Kafka and PostgreSQL
secrets for sink ``orders`` in its environment: the set-up the threat model's actors
(docs/user/security.md) are played against."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from twophase.testing.servers import LocalDaemon

OPERATOR = "operator-token-0123456789"
ORDERS = "orders-data-token-0123456789"  # the job writing sink "orders"
EVIL = "evil-data-token-0123456789"  # another job's token, scoped to its sink "evil"
KAFKA_PASSWORD = "orders-kafka-password-S3CRET"
PG_PASSWORD = "orders-pg-password-S3CRET"
SECRET_ENV = {
    "TWOPHASE_SECRET_KAFKA_ORDERS_SASL_PASSWORD": KAFKA_PASSWORD,
    "TWOPHASE_SECRET_PG_ORDERS_PASSWORD": PG_PASSWORD,
}


@dataclass
class Daemon:
    url: str
    log: Path
    grants: Path
    server: LocalDaemon

    def call(self, method: str, path: str, token: str | None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, needle: str, timeout: float = 10.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if needle in self.log_text():
                return True
            time.sleep(0.1)
        return False


def kafka_descriptor(name: str, bootstrap: str, topic: str = "orders") -> dict[str, Any]:
    """A Kafka participant signing in with SASL/PLAIN, its password left to the daemon."""
    return {"kind": "kafka", "name": name, "target": f"topic {topic}", "options": {
        "topic": topic, "config.bootstrap.servers": bootstrap,
        "config.security.protocol": "SASL_PLAINTEXT", "config.sasl.mechanism": "PLAIN",
        "config.sasl.username": "orders", "connect_timeout_s": 2.0,
        "secrets": "sasl.password"}}


def pg_descriptor(name: str, address: str) -> dict[str, Any]:
    host, port = address.split(":")
    return {"kind": "postgres", "name": name, "target": f"public.orders at {address}",
            "options": {"dsn": f"host={host} port={port} user=orders dbname=orders "
                        "connect_timeout=3", "schema": "public", "table": "orders",
                        "marker_table": "twophase_markers", "create": True,
                        "connect_timeout": 3.0, "secrets": "password"}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("daemon")
    tokens = d / "tokens"
    tokens.write_text(f"operator {OPERATOR}\ndata {ORDERS} orders\ndata {EVIL} evil\n")
    grants = d / "grants"
    grants.write_text("# sink participant fingerprint\n")
    log = d / "daemon.log"
    server = LocalDaemon(
        f"sqlite:///{d}/log.db", None, log, token_file=str(tokens),
        args=("--target-watch", "0.3s"),
        env={**SECRET_ENV, "TWOPHASE_SECRET_GRANTS_FILE": str(grants)})
    server.start()
    try:
        yield Daemon(server.url, log, grants, server)
    finally:
        server.stop()
