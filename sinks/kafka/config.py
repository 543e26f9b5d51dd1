"""Kafka configuration policy: which librdkafka settings a user may pass, and the defaults.

Kept apart from the clients so the rules that protect the protocol (a derived
``transactional.id``, idempotence, ``acks=all``) can be read and tested without a broker.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from twophase.errors import InvalidRequest

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TRANSACTION_MAX_TIMEOUT_MS",
    "KAFKA_CONFIG_ENV",
    "KAFKA_PASSWORD_ENV",
    "RECONNECT_BACKOFF_MS",
    "RECORD_OVERHEAD_BYTES",
    "TEST_BROKER_CLUSTER_ID",
    "common_config",
    "load_client_config",
    "validate_config",
    "validate_topic",
]

_TOPIC_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

DEFAULT_MAX_MESSAGE_BYTES: Final = 1_000_000
"""librdkafka's default ``message.max.bytes`` (the producer-side limit)."""

DEFAULT_TRANSACTION_MAX_TIMEOUT_MS: Final = 900_000
"""Apache Kafka's default ``transaction.max.timeout.ms``, assumed when a broker does not
report its own (tansu reports no broker configs)."""

RECONNECT_BACKOFF_MS: Final = 20
"""The transactional producers' ``reconnect.backoff.ms`` unless the config sets it
(librdkafka's default: 100). librdkafka spaces new broker connections by half of it (at
least 11 ms), and a new producer makes two before its first answer (the bootstrap
server's, then the broker's under its node id, which replaces it): at 100 ms the second
waits ~50 ms, at 20 ms ~11 ms, in every task (measured: bench/kafka_prepare_phases.py,
connecting 53 -> 15 ms). Only when a connection is tried changes, never what is sent."""

RECORD_OVERHEAD_BYTES: Final = 128
"""Room left for the record and batch headers when comparing key+value with the limit."""

_FORBIDDEN_KEYS: Final = {
    "transactional.id": "it is derived from sink, participant and partition so that a "
    "restart fences the zombie",
    "transaction.timeout.ms": "pass transaction_timeout_ms= so it can be checked against "
    "the broker's transaction.max.timeout.ms",
    "enable.auto.commit": "it is a consumer setting; markers are committed in the transaction",
    "isolation.level": "it is a consumer setting",
}

# Keys shared by producers, consumers and admin clients (connection and security).
_COMMON_PREFIXES: Final = (
    "bootstrap.servers", "security.protocol", "ssl.", "sasl.", "client.id", "socket.",
    "broker.", "metadata.", "reconnect.", "api.version", "topic.metadata.", "log_level",
    "debug", "connections.max.idle.ms", "client.dns.lookup", "enable.ssl",
    "https.", "retry.backoff",
)


def validate_topic(topic: str) -> str:
    """Kafka's legal topic alphabet; anything else is refused before it reaches a broker."""
    if not isinstance(topic, str) or not _TOPIC_RE.match(topic) or topic in (".", ".."):
        raise InvalidRequest(
            f"invalid Kafka topic name {topic!r}: use 1-249 characters from "
            "A-Z a-z 0-9 . _ - (and not '.' or '..')"
        )
    return topic


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def validate_config(config: Mapping[str, object]) -> dict[str, object]:
    """The user's librdkafka settings, minus nothing; refuses those that break the protocol."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping of librdkafka settings, got {config!r}")
    out: dict[str, object] = {}
    for key, value in config.items():
        if not isinstance(key, str):
            raise TypeError(f"config keys must be strings, got {key!r}")
        if key in _FORBIDDEN_KEYS:
            raise InvalidRequest(f"config key {key!r} may not be set: {_FORBIDDEN_KEYS[key]}")
        if key == "enable.idempotence" and not _truthy(value):
            raise InvalidRequest(
                "config enable.idempotence=false is refused: transactions need idempotence"
            )
        if key in ("acks", "request.required.acks") and str(value) not in ("all", "-1"):
            raise InvalidRequest(f"config {key}={value!r} is refused: transactions need acks=all")
        if callable(value) and key not in ("error_cb", "logger", "stats_cb", "oauth_cb"):
            raise InvalidRequest(f"config key {key!r} may not be a callable")
        out[key] = value
    if not str(out.get("bootstrap.servers", "")).strip():
        raise InvalidRequest("config must name the brokers: {'bootstrap.servers': 'host:9092'}")
    return out


def common_config(config: Mapping[str, object]) -> dict[str, object]:
    """The connection and security settings, for consumers and admin clients (producer
    settings would make them warn or fail)."""
    return {k: v for k, v in config.items() if k.startswith(_COMMON_PREFIXES)}


KAFKA_CONFIG_ENV: Final = "TWOPHASE_KAFKA_CONFIG"
"""The default of every CLI subcommand's ``--kafka-config``: a properties file of
librdkafka settings."""

KAFKA_PASSWORD_ENV: Final = "TWOPHASE_KAFKA_SASL_PASSWORD"  # noqa: S105 - a variable's name
"""``sasl.password`` for the settings of ``--kafka-config``, kept out of the file."""

_NEEDS_PASSWORD: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def load_client_config(path: str | Path, flag: str = "--kafka-config"
                       ) -> dict[str, str]:
    """librdkafka settings from a properties file (``key=value`` or ``key: value`` lines,
    ``#``/``!`` comments), ``sasl.password`` from :data:`KAFKA_PASSWORD_ENV` when set
    (it wins over the file's, so the secret can stay out of the file). Errors name the
    file, the line and the fix; a SASL sign-in with no password is refused here rather
    than as a broker's authentication failure."""
    fix = (f"Fix: pass {flag} the path of a readable file of librdkafka settings, one "
           "key=value a line (e.g. security.protocol=SASL_SSL), or unset "
           f"${KAFKA_CONFIG_ENV}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        cause = getattr(exc, "strerror", None) or str(exc)
        raise InvalidRequest(f"cannot read the Kafka settings {path} ({flag}): {cause}. "
                             f"{fix}") from None
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if cut < 0:
            raise InvalidRequest(f"{path} line {number} ({flag}) is not key=value: "
                                 f"{line[:60]!r}. {fix}")
        out[line[:cut].strip()] = line[cut + 1:].strip()
    password = os.environ.get(KAFKA_PASSWORD_ENV)
    if password:
        out["sasl.password"] = password
    if (out.get("security.protocol", "").upper().startswith("SASL")
            and out.get("sasl.mechanism", "GSSAPI").upper() in _NEEDS_PASSWORD
            and not out.get("sasl.password")):
        raise InvalidRequest(
            f"{path} ({flag}) signs in with SASL {out['sasl.mechanism']} but no "
            f"sasl.password is given. Fix: set ${KAFKA_PASSWORD_ENV} to the password of "
            f"sasl.username {out.get('sasl.username', '?')!r} (or add sasl.password= to "
            "the file)")
    return out


TEST_BROKER_CLUSTER_ID = "twophase-tansu"
"""The cluster id of the tansu brokers ``twophase.testing`` starts. tansu's
``read_committed`` view is not Kafka's (it shows aborted records, and hides committed ones
behind a transaction whose offset commit it deferred), so the verifier does not
cross-check its log judgement with a consumer on such a broker (docs/kafka.md)."""
