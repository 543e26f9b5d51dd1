"""The Kafka participant's options: checked when it is made, written to its descriptor
and read back from it (``twophase resolve``, the console), so each option has one rule."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twophase.errors import InvalidRequest
from twophase.participant import Descriptor, required_secret
from twophase.sinks.kafka.legacy import RETIRED
from twophase.sinks.kafka.staged import DEFAULT_PREPARE, PREPARE_MODES

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["check_flag", "check_prepare", "check_timeouts", "check_value", "constructor_args",
           "default_name", "descriptor_options", "key_columns", "rebuilt_prepare"]


def default_name(topic: str) -> str:
    """``kafka-<topic>``, refused when over the 64 characters of a participant name."""
    name = f"kafka-{topic}"
    if len(name) > 64:
        raise InvalidRequest(
            f"default participant name {name[:40]!r}... is longer than 64 "
            "characters: pass name="
        )
    return name


def check_value(value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequest(f"value must be a column name, got {value!r}")
    return value


def key_columns(key: str | Sequence[str] | None) -> tuple[str, ...]:
    """Key columns: one column's value is the key as is; several make a JSON object."""
    keys: tuple[str, ...] = (
        (key,) if isinstance(key, str)
        else tuple(key) if isinstance(key, (list, tuple)) else ()
    )
    if key is not None and (
        not keys or not all(isinstance(c, str) and c for c in keys)
        or len(set(keys)) != len(keys)
    ):
        raise InvalidRequest(
            f"key must be a column name or a list of distinct column names, got {key!r}"
        )
    return keys


def check_timeouts(transaction_timeout_ms: int, connect_timeout_s: float,
                   commit_retry_s: float) -> None:
    if (
        not isinstance(transaction_timeout_ms, int)
        or isinstance(transaction_timeout_ms, bool)
        or transaction_timeout_ms < 1000
    ):
        raise InvalidRequest(
            f"transaction_timeout_ms must be an int >= 1000, got {transaction_timeout_ms!r}"
        )
    if connect_timeout_s <= 0 or commit_retry_s <= 0:
        raise InvalidRequest("connect_timeout_s and commit_retry_s must be positive")


def check_flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be True or False, got {value!r}")
    return value


def check_prepare(prepare: str) -> str:
    """One of :data:`.staged.PREPARE_MODES`; the retired "in_task" is refused naming the
    replacement (:data:`.legacy.RETIRED`)."""
    if prepare == "in_task":
        raise InvalidRequest(RETIRED)
    if prepare not in PREPARE_MODES:
        raise InvalidRequest(f"prepare must be one of {PREPARE_MODES}, got {prepare!r}")
    return prepare


def is_secret_key(key: str) -> bool:
    """Whether a librdkafka setting holds a secret (never recorded in a descriptor)."""
    k = key.lower()
    return any(w in k for w in ("password", "secret", "sasl.oauthbearer.config", "key.pem"))


def descriptor_options(p: KafkaParticipant) -> dict[str, Any]:
    """Topic and settings; secret settings (passwords, keys) are left out and named in
    ``secrets``: rebuilt from ``TWOPHASE_SECRET_<NAME>_<KEY>``."""
    options: dict[str, Any] = {
        "topic": p.topic, "key": p.key, "value": p.value,
        "keys": json.dumps(list(p.keys)) if len(p.keys) > 1 else None,
        "transaction_timeout_ms": p.transaction_timeout_ms,
        "connect_timeout_s": p.connect_timeout_s, "commit_retry_s": p.commit_retry_s,
        "reuse_clients": p.reuse_clients, "prepare": p.prepare_mode,
        "staging_topic": p.staging_topic,
    }
    secrets = []
    for k, v in p.config.items():
        if is_secret_key(k):
            secrets.append(k)
        else:
            options[f"config.{k}"] = v if isinstance(v, (str, int, float, bool)) else str(v)
    options["secrets"] = ",".join(secrets)
    return options


def constructor_args(descriptor: Descriptor, secrets: Mapping[str, str]
                     ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(topic, config, keyword options) of a descriptor, its secrets filled in."""
    o = descriptor["options"]
    name = descriptor["name"]
    config: dict[str, Any] = {
        k[len("config."):]: v for k, v in o.items() if k.startswith("config.")
    }
    for k in str(o.get("secrets") or "").split(","):
        if k:
            config[k] = required_secret(name, secrets, k)
    return str(o["topic"]), config, {
        "key": json.loads(str(o["keys"])) if o.get("keys") else o.get("key"),
        "value": o.get("value"), "name": name,
        "transaction_timeout_ms": int(o.get("transaction_timeout_ms", 600_000)),
        "connect_timeout_s": float(o.get("connect_timeout_s", 30.0)),
        "commit_retry_s": float(o.get("commit_retry_s", 120.0)),
        "reuse_clients": str(o.get("reuse_clients", False)).lower() == "true",
        "prepare": rebuilt_prepare(o.get("prepare")),
        "staging_topic": o.get("staging_topic"),
    }


def rebuilt_prepare(recorded: Any) -> str:
    """The mode of a participant rebuilt from its descriptor. A 0.3 descriptor may name
    the retired "in_task" (or, older, nothing): rebuilt in the default mode, since each
    vote's handle says how its branch was prepared (:mod:`.legacy` ends an in-task one)."""
    if recorded is None or str(recorded) == "in_task":
        return DEFAULT_PREPARE
    return str(recorded)
