"""A ``coordinator=`` setting turned into a connection: a daemon, or one started here.

``http(s)://host:port`` is a daemon. A store URL (``sqlite:///path.db``,
``postgresql://...``) starts the coordinator inside this process, on a free port, so that
executors reach it over HTTP exactly like a daemon; one embedded server per store URL and
host is shared by every sink of the process and stops when its last user closes.

This is the one module of the core that imports the coordinator (lazily, only when an
embedded coordinator is asked for); the layering is otherwise core -> nothing above it.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

from twophase.client import TOKEN_ENV, CoordinatorClient
from twophase.errors import InvalidRequest

__all__ = ["EMBEDDED_HOST_ENV", "Connection", "check_coordinator", "connect"]

EMBEDDED_HOST_ENV: Final = "TWOPHASE_EMBEDDED_HOST"

_STORE_PREFIXES: Final = ("sqlite:///", "postgresql://", "postgresql+psycopg://", "postgres://")


class Connection:
    """What :func:`connect` returns. Pickles to ``url`` + ``token`` only, so it can be
    shipped to Spark executors; there it reaches the (daemon or embedded) coordinator."""

    def __init__(self, url: str, token: str | None, server: Any = None, cache_key: Any = None):
        self.url = url
        self.token = token
        self._server = server
        self._cache_key = cache_key
        self._client: CoordinatorClient | None = None
        self._lock = threading.Lock()

    def client(self, *, retry_budget: float = 120.0) -> CoordinatorClient:
        """A shared, thread-safe client for this connection (do not close it yourself);
        ``retry_budget``: seconds it rides through an unreachable coordinator."""
        with self._lock:
            if self._client is None:
                self._client = CoordinatorClient(self.url, self.token, retry_budget=retry_budget)
            return self._client

    def close(self) -> None:
        """Close the client; stop the embedded server when its last user closes."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
        if self._server is not None:
            _release_embedded(self._cache_key)
            self._server = None

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "token": self.token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["token"])  # type: ignore[misc]

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


def connect(coordinator: str, token: str | None = None) -> Connection:
    """``http(s)://host:port`` -> a daemon (token: the parameter, else $TWOPHASE_TOKEN);
    ``sqlite:///path.db`` / ``postgresql://...`` -> an embedded coordinator in this process
    (one per store URL, shared by every sink of the process; random token)."""
    if coordinator.startswith(("http://", "https://")):
        return Connection(coordinator.rstrip("/"), token or os.environ.get(TOKEN_ENV))
    if coordinator.startswith(_STORE_PREFIXES):
        # lazy, and the core's only import of the coordinator (see the module docstring)
        from twophase.coordinator.embedded import EmbeddedServer

        host = os.environ.get(EMBEDDED_HOST_ENV, "127.0.0.1")
        key = (EmbeddedServer.store_key(coordinator), host)
        with _EMBEDDED_LOCK:
            entry = _EMBEDDED.get(key)
            if entry is None:
                server = EmbeddedServer(coordinator, host=host).start()
                _EMBEDDED[key] = (server, 1)
            else:
                server, users = entry
                _EMBEDDED[key] = (server, users + 1)
        return Connection(server.url, server.token, server=server, cache_key=key)
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
