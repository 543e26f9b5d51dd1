"""Which rebuilt participant may receive an operator's secrets: the secret grants.

A participant's descriptor is stored by whoever registered the sink, usually a job with
a data token; the secrets (``TWOPHASE_SECRET_<PARTICIPANT>_<KEY>``, ``--secrets``) are
the operator's. So a secret is handed to a rebuilt participant only when an operator
granted exactly that descriptor for that sink: a line ``SINK PARTICIPANT FINGERPRINT``
of the grants file, the fingerprint a hash of the whole descriptor (kind, name, target,
every option: the bootstrap servers, the DSN's host). A job that renames a participant,
moves it to another sink or points it at another host changes the fingerprint, and gets
nothing (Vault's rule: a secret goes only to the identity it is bound to). Every
hand-out, and the first refusal of each descriptor, is logged with the sink, the
participant and where the secret goes, never the value.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Collection, Mapping
from typing import Any, Final

from twophase.errors import InvalidRequest
from twophase.participant import secrets_from_env

__all__ = ["GRANTS_ENV", "Grants", "destination", "fingerprint", "grant_line",
           "secrets_for"]

log = logging.getLogger("twophase.grants")

GRANTS_ENV: Final = "TWOPHASE_SECRET_GRANTS_FILE"
_WHERE: Final = re.compile(r"(bootstrap|servers|dsn|host|endpoint|url|uri|warehouse)",
                           re.IGNORECASE)


_WITHHELD: set[tuple[str, str, str]] = set()  # refusals already logged by this process


def fingerprint(descriptor: Mapping[str, Any]) -> str:
    """A hash of the whole descriptor, in canonical JSON (32 hex digits)."""
    body = {k: descriptor.get(k) for k in ("kind", "name", "target", "options")}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def destination(descriptor: Mapping[str, Any]) -> str:
    """Where the descriptor's secrets would go, for the log and messages: its target and
    the options that name a host (bootstrap servers, DSN, endpoint, URI)."""
    opts = descriptor.get("options") or {}
    where = [f"{k}={v}" for k, v in sorted(opts.items()) if _WHERE.search(k) and v]
    return "; ".join([str(descriptor.get("target", "")), *where])


def grant_line(sink: str, descriptor: Mapping[str, Any]) -> str:
    """The grants-file line that approves ``descriptor`` for ``sink``, with a comment
    saying where its secrets would go."""
    return (f"{sink} {descriptor.get('name')} {fingerprint(descriptor)}"
            f"  # {descriptor.get('kind')}: {destination(descriptor)}")


class Grants:
    """The grants file (``path``; None: ``$TWOPHASE_SECRET_GRANTS_FILE``, else no
    grants), read at each use: the daemon asks every few seconds at most, and an edit
    applies without a restart."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get(GRANTS_ENV) or None

    def allowed(self) -> set[tuple[str, str, str]]:
        if self.path is None:
            return set()
        try:
            with open(self.path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise InvalidRequest(
                f"cannot read the secret grants file {self.path}: {exc.strerror or exc}; "
                f"pass an existing file of 'SINK PARTICIPANT FINGERPRINT' lines "
                f"(--secret-grants, ${GRANTS_ENV})") from exc
        out = set()
        for n, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 3 or not re.fullmatch(r"[0-9a-f]{32}", words[2]):
                raise InvalidRequest(
                    f"secret grants file {self.path}, line {n}: expected 'SINK PARTICIPANT "
                    "FINGERPRINT' (32 hex digits; `twophase sinks SINK --grants` prints "
                    "the lines for a sink's recorded participants)")
            out.add((words[0], words[1], words[2]))
        return out


def secrets_for(sink: str, descriptor: Mapping[str, Any], grants: Grants,
                given: Mapping[str, str] | None = None,
                also: Collection[str] = ()) -> dict[str, str]:
    """The secrets ``descriptor`` asks for (its ``options.secrets``), from ``given`` or
    the environment, if an operator granted it for ``sink``; a descriptor asking for
    none gets none. ``also``: secret settings the caller adds itself (an operator's
    ``--kafka-config`` password), checked against the grant the same way. An ungranted
    descriptor is refused with the line that would grant it."""
    name = str(descriptor.get("name"))
    wanted = [k for k in str((descriptor.get("options") or {}).get("secrets") or "")
              .split(",") if k]
    if not wanted and not also:
        return {}
    where = destination(descriptor)
    key = (sink, name, fingerprint(descriptor))
    if key not in grants.allowed():
        if key not in _WITHHELD:  # once per descriptor: the target watch asks every 30 s
            _WITHHELD.add(key)
            log.warning("secret withheld: participant not granted",
                        extra={"sink": sink, "participant": name, "keys": [*wanted, *also],
                               "target": where})
        raise InvalidRequest(
            f"participant {name!r} of sink {sink!r} asks for the secret(s) "
            f"{', '.join([*wanted, *also])}, to be used at {where}; no operator granted this "
            "descriptor its secrets (it was stored by whoever registered the sink, "
            "possibly a job's data token). If that is the sink's real target, add the "
            f"line '{grant_line(sink, descriptor)}' to the secret grants file "
            f"(--secret-grants, ${GRANTS_ENV})")
    found = dict(given) if given is not None else secrets_from_env(name, wanted)
    log.warning("secret handed out", extra={
        "sink": sink, "participant": name,
        "keys": sorted({*(k for k in wanted if k in found), *also}),
        "target": where})
    return {k: v for k, v in found.items() if k in wanted}
