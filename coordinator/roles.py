"""Who may call what: the route -> role table, and the daemon's set of bearer tokens.

Two roles (docs/coordinator-api.md, "Security"). **data**: what a sink's normal batch
path calls, from the driver and the executors (register, begin, votes, acks, abandon,
the decision long-poll, one transaction's status). **operator**: everything, including
the overviews, force-ack, abort, resolve and the console. A route missing from
:data:`ROUTE_ROLES` needs an operator token (default deny for the data role; a test
asserts every route of the app is in the table).

Tokens come from ``--token`` (one operator token, as before roles existed) and from a
token file of ``ROLE TOKEN`` lines, re-read when it changes (a ``stat`` at most every
``CHECK_EVERY`` seconds, so a request costs no file read), which is how tokens rotate
without a restart: add the new token, move the jobs to it, remove the old one. A data
line names the sinks its token may act on (``data TOKEN orders pay*``: names or
``fnmatch`` globs), so one job's token cannot begin, vote, ack, abandon or register
another's batches. A data line naming no sink is refused (it would let one job fence
and abort every other's); ``data TOKEN *`` is the explicit all-sinks token, which for
the jobs' routes is as strong as an operator's.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Final, Literal

from twophase.errors import InvalidRequest

__all__ = ["CHECK_EVERY", "MIN_TOKEN", "ROUTE_ROLES", "Grant", "Role", "TokenSet",
           "check_strength", "parse_token_file", "role_for", "sink_of"]

log = logging.getLogger("twophase.coordinator.roles")

Role = Literal["open", "data", "operator"]

_TXN: Final = "/v1/txns/{sink}/{lineage}/{checkpoint}/{attempt}"
_ADMIN_TXN: Final = "/v1/admin/txns/{sink}/{lineage}/{checkpoint}/{attempt}"

# (method, route path) -> the least role that may call it; the per-batch routes first
# (the guard tries them in this order)
ROUTE_ROLES: Final[dict[tuple[str, str], Role]] = {
    ("POST", _TXN + "/votes"): "data",
    ("POST", _TXN + "/acks"): "data",
    ("GET", _TXN + "/decision"): "data",
    ("POST", "/v1/sinks/{sink}/begin"): "data",
    ("GET", _TXN): "data",
    ("POST", _TXN + "/abandon"): "data",
    ("POST", "/v1/sinks/{sink}/register"): "data",
    ("GET", "/v1/sinks/{sink}/committing"): "data",  # a starting sink's cleanup
    ("GET", "/healthz"): "open",
    ("GET", "/metrics"): "open",
    ("GET", "/openapi.json"): "open",
    ("GET", "/docs"): "open",
    ("GET", "/ui"): "open",  # the console's sign-in page: no data in it
    ("GET", "/ui/view"): "operator",
    ("GET", "/v1/sinks"): "operator",
    ("GET", "/v1/sinks/{sink}"): "operator",
    ("GET", "/v1/sinks/{sink}/participants"): "operator",
    ("GET", "/v1/txns"): "operator",
    ("POST", _ADMIN_TXN + "/force-ack"): "operator",
    ("POST", _ADMIN_TXN + "/abort"): "operator",
    ("POST", "/v1/admin/sinks/{sink}/resolve"): "operator",
    ("POST", "/v1/admin/tick"): "operator",
}

# open by path, whatever the method (a wrong method is then FastAPI's 405, not a 401)
OPEN_PATHS: Final = frozenset(path for (_m, path), role in ROUTE_ROLES.items()
                              if role == "open")


def _compile(path: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(path)) + "$")


_MATCHERS: Final = [(method, _compile(path), role)
                    for (method, path), role in ROUTE_ROLES.items() if role != "open"]


def role_for(method: str, path: str) -> Role:
    """The role a request needs: its table entry, else ``operator`` (default deny)."""
    if path in OPEN_PATHS:
        return "open"
    method = "GET" if method == "HEAD" else method
    for m, pattern, role in _MATCHERS:
        if m == method and pattern.match(path):
            return role
    return "operator"


def sink_of(path: str) -> str | None:
    """The sink a data route acts on (``/v1/sinks/{sink}/...``, ``/v1/txns/{sink}/...``);
    None for a path that names none."""
    parts = path.split("/")
    if len(parts) > 3 and parts[1] == "v1" and parts[2] in ("sinks", "txns") and parts[3]:
        return parts[3]
    return None


MIN_TOKEN: Final = 16  # characters, for every source: flag, environment, file


def check_strength(token: str, what: str) -> str:
    """``token`` if it has at least :data:`MIN_TOKEN` characters, else a refusal naming
    ``what`` and how to make a good one."""
    if len(token) < MIN_TOKEN:
        raise InvalidRequest(
            f"{what} has {len(token)} character(s); a token needs at least {MIN_TOKEN} "
            "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(24))')")
    return token


CHECK_EVERY: Final = 1.0  # seconds between two stat() calls of the token file
ROLES: Final = ("data", "operator")
_SCOPE_RE: Final = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]{1,64}$")


@dataclass(frozen=True)
class Grant:
    """A token's role and, for a data token, the sinks it may act on (names or
    ``fnmatch`` globs; ``*``: every sink; empty: none)."""

    role: Role
    sinks: tuple[str, ...] = ()

    def allows(self, sink: str | None) -> bool:
        """Whether this token may act on ``sink`` (None: a route naming no sink)."""
        if sink is None:
            return True
        return any(fnmatch.fnmatchcase(sink, pattern) for pattern in self.sinks)


def parse_token_file(path: str) -> dict[str, Grant]:
    """``token -> grant`` from a file of ``ROLE TOKEN [SINK ...]`` lines (``#``
    comments, blank lines; sinks on data lines only); several tokens per role are what
    makes an overlap window possible."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read the token file {path}: {exc.strerror or exc}; pass an existing "
            "file of 'data <token>' / 'operator <token>' lines (--token-file, "
            "$TWOPHASE_TOKEN_FILE)"
        ) from exc
    tokens: dict[str, Grant] = {}
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) < 2 or parts[0] not in ROLES or (parts[0] == "operator"
                                                        and len(parts) > 2):
            raise InvalidRequest(
                f"token file {path}, line {n}: expected 'data <token>' (optionally followed "
                f"by the sinks it may act on, names or globs) or 'operator <token>', got "
                f"{len(parts)} word(s) starting {parts[0][:12]!r}"
            )
        role, token, sinks = parts[0], parts[1], tuple(parts[2:])
        if role == "data" and not sinks:
            raise InvalidRequest(
                f"token file {path}, line {n}: this data token names no sink, so it could "
                "begin, abandon and re-register (fence) every job's batches: list the "
                "sinks it may act on ('data <token> orders pay*'), or write '*' to give "
                "it every sink on purpose (as strong as an operator for the jobs' routes)")
        bad = [s for s in sinks if not _SCOPE_RE.match(s)]
        if bad:
            raise InvalidRequest(
                f"token file {path}, line {n}: {bad[0][:70]!r} is not a sink name or glob "
                "(1-64 characters from A-Z a-z 0-9 _ . - and the glob characters * ? [ ] !)")
        check_strength(token, f"token file {path}, line {n}: a {role} token")
        if token in tokens:
            raise InvalidRequest(
                f"token file {path}, line {n}: the same token is listed "
                + ("as data and as operator; give each role its own"
                   if tokens[token].role != role else "twice; list its sinks on one line"))
        tokens[token] = Grant("data" if role == "data" else "operator", sinks)
    return tokens


class TokenSet:
    """The tokens the daemon accepts, each with its role. ``token``: an operator token
    given on the command line; ``token_file``: the rotatable set, re-read when its
    mtime, size or inode changes. A file that becomes unreadable or malformed keeps the
    last good set (logged), so a half-written file never locks the jobs out."""

    def __init__(self, token: str | None = None, token_file: str | None = None,
                 *, check_every: float = CHECK_EVERY, data_token: str | None = None) -> None:
        self.fixed: dict[str, Grant] = {}
        if token:
            self.fixed[token] = Grant("operator")
        if data_token:  # the embedded server's per-run token: this process's sinks
            self.fixed[data_token] = Grant("data", ("*",))
        self.token_file = token_file
        self.check_every = check_every
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._from_file: dict[str, Grant] = {}
        self._current: list[tuple[bytes, Grant]] = []
        if token_file is not None:
            self._from_file = parse_token_file(token_file)
            self._seen = _signature(token_file)
            self._next_check = time.monotonic() + check_every
        self._rebuild()

    @property
    def enabled(self) -> bool:
        """Whether any token is configured (else the service runs without auth)."""
        return bool(self.fixed) or self.token_file is not None

    def roles(self) -> dict[str, int]:
        """How many tokens each role has now (for the start-up log; never the tokens)."""
        self._refresh()
        return self._count()

    def grant_of(self, authorization: bytes) -> Grant | None:
        """The grant of an ``Authorization`` header's bearer token; None: unknown."""
        self._refresh()
        found: Grant | None = None
        for expected, grant in self._current:  # compare with every token: constant time
            if hmac.compare_digest(authorization, expected):
                found = grant
        return found

    def role_of(self, authorization: bytes) -> Role | None:
        """The role of an ``Authorization`` header's bearer token; None: unknown."""
        grant = self.grant_of(authorization)
        return None if grant is None else grant.role

    def _rebuild(self) -> None:
        merged = {**self._from_file, **self.fixed}
        self._current = [(f"Bearer {tok}".encode(), grant) for tok, grant in merged.items()]

    def _refresh(self) -> None:
        if self.token_file is None or time.monotonic() < self._next_check:
            return
        with self._lock:
            now = time.monotonic()
            if now < self._next_check:
                return
            self._next_check = now + self.check_every
            sig = _signature(self.token_file)
            if sig == self._seen:
                return
            self._seen = sig  # a bad file is reported once per change, not per check
            try:
                self._from_file = parse_token_file(self.token_file)
            except InvalidRequest as exc:
                log.error("token file not reloaded, keeping the previous tokens",
                          extra={"error": str(exc)})
                return
            self._rebuild()
            log.warning("token file reloaded", extra={"file": self.token_file,
                                                      "tokens": self._count()})

    def _count(self) -> dict[str, int]:
        out = dict.fromkeys(ROLES, 0)
        for _tok, grant in self._current:
            out[grant.role] += 1
        return out


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)
