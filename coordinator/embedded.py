"""The service inside the calling process (the Spark driver), for ``coordinator=<store URL>``.

The same app as the daemon, run by uvicorn in a daemon thread on a free port with two
random tokens: a data token, which the tasks carry, and an operator token, which stays in
this process (the console's URL, ``twophase force``/``resolve`` on a store URL). Executors
on other hosts reach it over HTTP exactly like a daemon.
:mod:`twophase.client.connection` starts and shares these servers.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Any

from twophase.coordinator.app import create_app
from twophase.coordinator.background import Settings
from twophase.coordinator.db import normalize_url
from twophase.coordinator.roles import TokenSet
from twophase.coordinator.store import Store
from twophase.errors import CoordinatorUnavailable

__all__ = ["EmbeddedServer"]

log = logging.getLogger("twophase.coordinator.embedded")


class EmbeddedServer:
    """The service inside this process, on a free port, in a daemon thread."""

    @staticmethod
    def store_key(store_url: str) -> str:
        """The store URL in canonical form: a process runs one embedded server per store."""
        return normalize_url(store_url)

    def __init__(
        self,
        store_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        data_token: str | None = None,
        advertise_host: str | None = None,
        settings: Settings | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        create: bool = True,
    ) -> None:
        self.store_url = store_url
        self.create = create  # False: a missing SQLite file is refused, not created
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(24)  # operator: never shipped to tasks
        self.data_token = data_token or secrets.token_urlsafe(24)  # what the tasks carry
        self.advertise_host = advertise_host
        self.settings = settings
        self.ssl_certfile = ssl_certfile
        self.ssl_keyfile = ssl_keyfile
        # the certificate the tasks are told to trust (and nothing else)
        self.ca_pem: str | None = None
        if ssl_certfile is not None:
            with open(ssl_certfile) as f:
                self.ca_pem = f.read()
        self.store: Store | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::", ""):  # noqa: S104 - a bind-all needs a reachable name
            host = socket.getfqdn()
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EmbeddedServer:
        import uvicorn

        self.store = Store(self.store_url, create=self.create)
        tokens = TokenSet(self.token, data_token=self.data_token)
        app = create_app(self.store, None, settings=self.settings, tokens=tokens)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only
        # then, and without it Nagle + delayed ACK add ~40 ms to every response.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=75, ssl_certfile=self.ssl_certfile,
                                ssl_keyfile=self.ssl_keyfile)
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="twophase-coordinator",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise CoordinatorUnavailable(
                    f"embedded coordinator on {self.host} did not start"
                )
            time.sleep(0.005)
        log.info("embedded coordinator", extra={"url": self.url, "store": self.store.safe_url})
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None
        if self.store is not None:
            self.store.close()
            self.store = None
        self._server = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
