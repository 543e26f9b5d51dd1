"""What the operator commands share, so that one flag means one thing in all of them.

``--coordinator URL`` (alias ``--store``, default ``$TWOPHASE_COORDINATOR``), ``--token``
(default ``$TWOPHASE_TOKEN``) and ``--token-file`` are added here for ``txns``, ``sinks``,
``force`` and ``resolve``; ``--kafka-config FILE`` (default ``$TWOPHASE_KAFKA_CONFIG``)
for every command that makes Kafka clients (``resolve``, ``demo``, ``chaos``). The
commands that only read (and ``force``, which settles what a store already holds) never
create a store: a SQLite path that does not exist is a typo, and is refused before
anything is opened (SQLite itself would create the file, and the store its folder).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from twophase.errors import InvalidRequest, TransactionNotFound

if TYPE_CHECKING:
    from twophase.coordinator.store import Store
    from twophase.protocol import Decision, Transaction, TxnKey

COORDINATOR_ENV: Final = "TWOPHASE_COORDINATOR"
# twophase.sinks.kafka.config's names, not imported: --help must work without confluent-kafka
KAFKA_CONFIG_ENV: Final = "TWOPHASE_KAFKA_CONFIG"
KAFKA_PASSWORD_ENV: Final = "TWOPHASE_KAFKA_SASL_PASSWORD"  # noqa: S105 - a variable's name


def add_coordinator_flags(p: argparse.ArgumentParser) -> None:
    """``--coordinator``/``--store`` and ``--token``, the same in every operator command."""
    p.add_argument("--coordinator", "--store", dest="coordinator",
                   default=os.environ.get(COORDINATOR_ENV), metavar="URL",
                   help="http(s)://host:port of a daemon, or a store URL (sqlite:///path.db, "
                   "postgresql://user@host/db) (default: $TWOPHASE_COORDINATOR)")
    p.add_argument("--token", default=None,
                   help="the daemon's bearer token, an operator one for force and resolve "
                   "(default: $TWOPHASE_TOKEN)")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="read the bearer token from this file (the token alone; default: "
                   "$TWOPHASE_CLIENT_TOKEN_FILE)")


def add_kafka_config_flag(p: argparse.ArgumentParser) -> None:
    """``--kafka-config FILE``, the same in every command that makes Kafka clients."""
    p.add_argument("--kafka-config", default=os.environ.get(KAFKA_CONFIG_ENV), metavar="FILE",
                   help="librdkafka settings for every Kafka client of this command, one "
                   "key=value a line (security.protocol=SASL_SSL, sasl.mechanism, "
                   "sasl.username, ssl.ca.location, ...); sasl.password from "
                   f"${KAFKA_PASSWORD_ENV} (default: ${KAFKA_CONFIG_ENV})")


def kafka_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings of ``--kafka-config`` (empty without it); a file that cannot be read
    or used raises ``InvalidRequest`` naming it and the fix."""
    if not args.kafka_config:
        return {}
    from twophase.sinks.kafka.config import load_client_config

    return load_client_config(args.kafka_config)


def kafka_hint(args: argparse.Namespace, message: str) -> str:
    """Where the settings of a Kafka TLS or SASL error (its message names ``sasl.`` or
    ``ssl.`` settings "in config=") came from, to add to it; else empty."""
    path = getattr(args, "kafka_config", None)
    if not path or path in message or not ("sasl." in message or "ssl." in message):
        return ""
    return (f" (this command's Kafka settings: --kafka-config {args.kafka_config}, "
            f"sasl.password from ${KAFKA_PASSWORD_ENV} when set)")


def require_store(url: str, command: str) -> None:
    """Refuse a SQLite store URL whose file does not exist (a daemon URL or a PostgreSQL
    store passes: the latter is refused without a write when it has no schema)."""
    from twophase.coordinator.db import StoreMissing, normalize_url, sqlite_path

    path = sqlite_path(normalize_url(url))
    if path is None or path.is_file():
        return
    raise StoreMissing.at(path, f"twophase {command}")


class StoreReader:
    """What ``resolve --dry-run`` needs of a store, opened without a coordinator on it:
    no schema created or upgraded, no background retention or alert marking. It has no
    way to change a transaction; a dry run never asks for one."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def participants(self, sink: str) -> list[dict[str, Any]]:
        if self.store.sink(sink) is None:
            raise TransactionNotFound(f"no sink {sink!r}")
        return self.store.participants(sink)

    def list(self, sink: str | None = None, state: str | None = None,
             limit: int = 100) -> list[Transaction]:
        return [row.txn for row in self.store.list(sink=sink, state=state, limit=limit)]

    def get(self, key: TxnKey) -> Transaction:
        txn = self.store.get(key)
        if txn is None:
            raise TransactionNotFound.for_key(key)
        return txn

    def admin_abort(self, key: TxnKey, reason: str) -> Transaction:
        raise InvalidRequest(f"a dry run changes nothing (asked to abort {key})")

    def force_ack(self, key: TxnKey, branch: str, outcome: Decision,
                  reason: str | None = None) -> Transaction:
        raise InvalidRequest(f"a dry run changes nothing (asked to ack {key} {branch})")


@contextmanager
def read_store(url: str, command: str) -> Iterator[StoreReader]:
    """An existing store, opened for reading (refused when missing or of an older schema,
    which only a coordinator upgrades)."""
    from twophase.coordinator.store import Store

    require_store(url, command)
    store = Store(url, read_only=True)
    try:
        yield StoreReader(store)
    finally:
        store.close()


def descriptor(text: str) -> dict[str, Any]:
    """One ``--participant`` value: a JSON descriptor, or ``@FILE`` holding one."""
    source = "it"
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read {source}: {exc.strerror or exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON ({exc.msg} at char {exc.pos}): pass a "
                         "descriptor such as '{\"kind\": \"mykind\", \"name\": \"p1\", "
                         "\"target\": \"...\", \"options\": {}}'") from None
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str) \
            or not isinstance(value.get("name"), str):
        raise ValueError(f"{source} must be a JSON object with string \"kind\" and "
                         "\"name\" (and the \"target\" and \"options\" its kind reads)")
    return value
