"""A ``coordinator=`` setting turned into a connection: a daemon, or one started here.

``http(s)://host:port`` is a daemon. A store URL (``sqlite:///path.db``,
``postgresql://...``) starts the coordinator inside this process, on a free port, so that
executors reach it over HTTP exactly like a daemon; one embedded server per store URL and
address is shared by every sink of the process and stops when its last user closes.

Where it listens: ``host`` (the sink passes the Spark driver's ``spark.driver.bindAddress``
and advertises ``spark.driver.host`` on a cluster, loopback under a ``local`` master),
overridden by ``$TWOPHASE_EMBEDDED_HOST`` (bind address) and
``$TWOPHASE_EMBEDDED_ADVERTISE`` (the address the executors are told). Every embedded
server has its own random data token, which the tasks carry, and an operator token, which
stays in this process (``Connection.operator_token``); ``tls=(certfile, keyfile)``
serves HTTPS and the tasks trust exactly that certificate.

This is the one module of the core that imports the coordinator (lazily, only when an
embedded coordinator is asked for); the layering is otherwise core -> nothing above it.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

from twophase.client.api import TOKEN_ENV, TOKEN_FILE_ENV, CoordinatorClient, pinned
from twophase.errors import InvalidRequest

__all__ = [
    "EMBEDDED_ADVERTISE_ENV", "EMBEDDED_HOST_ENV", "Connection", "check_coordinator", "connect",
]

EMBEDDED_HOST_ENV: Final = "TWOPHASE_EMBEDDED_HOST"
EMBEDDED_ADVERTISE_ENV: Final = "TWOPHASE_EMBEDDED_ADVERTISE"

_STORE_PREFIXES: Final = ("sqlite:///", "postgresql://", "postgresql+psycopg://", "postgres://")


class Connection:
    """What :func:`connect` returns. Pickles to ``url``, ``token`` and ``token_file``
    only (never the operator token), so it can be shipped to Spark executors; there it
    reaches the (daemon or embedded) coordinator."""

    def __init__(self, url: str, token: str | None, server: Any = None, cache_key: Any = None,
                 ca_pem: str | None = None, *, token_file: str | None = None,
                 operator_token: str | None = None):
        self.url = url
        self.token = token
        self.token_file = token_file  # re-read on a 401 (a rotated token)
        self.operator_token = operator_token  # an embedded server's; None for a daemon
        self.ca_pem = ca_pem  # the embedded server's own certificate, when it serves TLS
        self._server = server
        self._cache_key = cache_key
        self._clients: dict[bool, CoordinatorClient] = {}
        self._lock = threading.Lock()

    def client(self, *, retry_budget: float = 120.0, operator: bool = False
               ) -> CoordinatorClient:
        """A shared, thread-safe client for this connection (do not close it yourself);
        ``retry_budget``: seconds it rides through an unreachable coordinator;
        ``operator``: with an embedded server's operator token (force, abort, resolve)
        rather than the data token (a daemon's client has the one token it was given)."""
        op = operator and self.operator_token is not None
        with self._lock:
            cl = self._clients.get(op)
            if cl is None:
                cl = self._clients[op] = CoordinatorClient(
                    self.url, self.operator_token if op else self.token,
                    token_file=None if op else self.token_file,
                    verify=pinned(self.ca_pem), retry_budget=retry_budget)
            return cl

    def close(self) -> None:
        """Close the clients; stop the embedded server when its last user closes."""
        with self._lock:
            for cl in self._clients.values():
                cl.close()
            self._clients.clear()
        if self._server is not None:
            _release_embedded(self._cache_key)
            self._server = None

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "token": self.token, "ca_pem": self.ca_pem,
                "token_file": self.token_file}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["token"], ca_pem=state.get("ca_pem"),  # type: ignore[misc]
                      token_file=state.get("token_file"))

    def __repr__(self) -> str:
        kind = "embedded" if self._server is not None else "daemon"
        return f"Connection({self.url!r}, {kind})"

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# (store URL, host) -> (server, users): one embedded coordinator per store and address
_EMBEDDED: dict[tuple[str, str], tuple[Any, int]] = {}
_EMBEDDED_LOCK = threading.Lock()


def _release_embedded(cache_key: Any) -> None:
    with _EMBEDDED_LOCK:
        entry = _EMBEDDED.get(cache_key)
        if entry is None:
            return
        server, users = entry
        if users > 1:
            _EMBEDDED[cache_key] = (server, users - 1)
            return
        del _EMBEDDED[cache_key]
    server.stop()


def connect(
    coordinator: str,
    token: str | None = None,
    *,
    host: str | None = None,
    advertise: str | None = None,
    tls: tuple[str, str] | None = None,
    token_file: str | None = None,
    create: bool = True,
) -> Connection:
    """``http(s)://host:port`` -> a daemon (token: ``token``, else the one in
    ``token_file`` or $TWOPHASE_CLIENT_TOKEN_FILE, else $TWOPHASE_TOKEN);
    ``sqlite:///path.db`` / ``postgresql://...`` -> an embedded coordinator in this process
    (one per store URL and address, shared by every sink of the process; random token),
    listening on ``host`` (default loopback) and known to the tasks as ``advertise``
    (default ``host``); the environment overrides both (module docstring). ``create=False``
    (operators' commands): a store URL naming a SQLite file that does not exist is
    refused instead of created."""
    if coordinator.startswith(("http://", "https://")):
        if not token and token_file is None:
            token_file = os.environ.get(TOKEN_FILE_ENV) or None
        if not token and token_file is None:
            token = os.environ.get(TOKEN_ENV)
        return Connection(coordinator.rstrip("/"), token or None, token_file=token_file)
    if coordinator.startswith(_STORE_PREFIXES):
        # lazy, and the core's only import of the coordinator (see the module docstring)
        from twophase.coordinator.embedded import EmbeddedServer

        bind = os.environ.get(EMBEDDED_HOST_ENV) or host or "127.0.0.1"
        shown = os.environ.get(EMBEDDED_ADVERTISE_ENV) or (
            advertise if not os.environ.get(EMBEDDED_HOST_ENV) else None)
        key = (EmbeddedServer.store_key(coordinator), bind)
        with _EMBEDDED_LOCK:
            entry = _EMBEDDED.get(key)
            if entry is None:
                server = EmbeddedServer(
                    coordinator, host=bind, advertise_host=shown,
                    ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None,
                    create=create,
                ).start()
                _EMBEDDED[key] = (server, 1)
            else:
                server, users = entry
                _EMBEDDED[key] = (server, users + 1)
        return Connection(server.url, server.data_token, server=server, cache_key=key,
                          ca_pem=server.ca_pem, operator_token=server.token)
    raise _not_understood(coordinator)


def check_coordinator(coordinator: object) -> str:
    """``coordinator`` if :func:`connect` understands it, else the error it would raise
    (checked when a sink is built, long before its first batch connects)."""
    if not isinstance(coordinator, str) or not coordinator.startswith(
            ("http://", "https://", *_STORE_PREFIXES)):
        raise _not_understood(coordinator)
    return coordinator


def _not_understood(coordinator: object) -> InvalidRequest:
    return InvalidRequest(
        f"coordinator={coordinator!r} is not understood: use 'http://host:port' or "
        "'https://host:port' for a daemon, or a store URL 'sqlite:///path.db' / "
        "'postgresql://user@host:port/db' for an embedded coordinator"
    )
