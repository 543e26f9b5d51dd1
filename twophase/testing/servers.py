"""Private local servers for the tests, ``twophase demo`` and ``twophase chaos``.

:class:`LocalServer` is what every one of them shares: a free loopback port, a child
process, and one way to stop it (a polite signal, then SIGKILL) and remove its
throw-away folder. :class:`LocalDaemon` is the coordinator daemon (``twophase serve``)
as a child process that can be SIGKILLed and restarted on the same port and store.
PostgreSQL and tansu live in :mod:`.localpg` and :mod:`.localkafka`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

from twophase import failpoints
from twophase.errors import TwophaseError

__all__ = [
    "DaemonUnavailable",
    "LocalDaemon",
    "LocalServer",
    "ServerUnavailable",
    "answers_kafka_metadata",
    "clean_env",
    "free_port",
    "netns_prefix",
]

_S = TypeVar("_S", bound="LocalServer")


class ServerUnavailable(TwophaseError, RuntimeError):
    """A local server's binary is missing or the server would not start."""


class DaemonUnavailable(ServerUnavailable):
    """The coordinator daemon exited at start or did not become healthy."""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without its failpoints (a child arms its own), plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV)}
    env.update(extra)
    return env


def netns_prefix(netns: str | None) -> list[str]:
    """The command prefix that runs a server inside network namespace ``netns``."""
    return ["ip", "netns", "exec", netns] if netns else []


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """A child process on ``127.0.0.1:port``; ``with`` starts and stops it.

    Subclasses implement :meth:`start`, set :attr:`proc` (and :attr:`dir` when they need
    a throw-away folder, removed by :meth:`stop`) and choose how they are asked to stop.
    """

    stop_signal: signal.Signals = signal.SIGTERM
    stop_timeout: float = 15.0

    def __init__(self, *, port: int | None = None, base_dir: str | None = None) -> None:
        self.port = port or free_port()
        self._base_dir = base_dir
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self: _S) -> _S:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> bool:
        """SIGKILL the server (a crash); True if it was running. Its folder stays."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.proc.wait()
        return True

    def stop(self) -> None:
        """Ask the server to stop, SIGKILL it if it does not in time, remove its folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalDaemon(LocalServer):
    """``twophase serve`` as a child process; :meth:`start` again restarts it on the same
    port and store (what a coordinator crash and restart looks like to clients)."""

    def __init__(
        self, store: str, token: str | None, log: Path | None = None, *,
        port: int | None = None, host: str = "127.0.0.1", netns: str | None = None,
        token_file: str | None = None, tls: tuple[str, str, str] | None = None,
        args: tuple[str, ...] = (), env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(port=port)
        self.env = env or {}  # more environment (e.g. the daemon's secrets)
        # (certificate, key, CA that signed it): serve HTTPS, and trust the CA for /healthz
        self.tls = tls
        self.args = args  # more `twophase serve` flags
        self.store = store
        self.token = token  # an operator token (--token); None: token_file only
        self.token_file = token_file  # the daemon's --token-file (roles, rotatable)
        self.log = log
        self.host = host
        self.netns = netns  # run inside this network namespace (`ip netns exec`; root)
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"

    def start(
        self, failpoint_spec: str = "", once_dir: str = "", timeout: float = 60
    ) -> LocalDaemon:
        """Start and wait until ``/healthz`` answers. ``failpoint_spec`` arms failpoints
        in the daemon only (the caller's own are never inherited)."""
        import httpx

        env = clean_env(**self.env)
        env.pop("TWOPHASE_TOKEN", None)
        env.pop("TWOPHASE_TOKEN_FILE", None)
        if self.token:
            env["TWOPHASE_TOKEN"] = self.token
        if self.token_file:
            env["TWOPHASE_TOKEN_FILE"] = self.token_file
        if failpoint_spec:
            env[failpoints.ENV] = failpoint_spec
            env[failpoints.ONCE_DIR_ENV] = once_dir
        out: IO[bytes] | int = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [*netns_prefix(self.netns), sys.executable, "-m", "twophase.cli", "serve",
                 "--store", self.store, "--host", self.host, "--port", str(self.port),
                 "--log-level", "warning",
                 *(["--ssl-certfile", self.tls[0], "--ssl-keyfile", self.tls[1]]
                   if self.tls else []),
                 # a test's private bridge or namespace: plain HTTP beyond loopback
                 *(["--insecure-http"] if not self.tls and self.host not in (
                     "127.0.0.1", "::1", "localhost") else []),
                 *self.args],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        where = f"; see {self.log}" if self.log else ""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DaemonUnavailable(f"coordinator daemon exited with "
                                        f"{self.proc.returncode} at start{where}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=(
                        ssl.create_default_context(cafile=self.tls[2]) if self.tls
                        else True)).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise DaemonUnavailable(
                    f"coordinator daemon not healthy within {timeout}s{where}")
            time.sleep(0.05)

    def wait_dead(self, timeout: float = 20) -> int:
        """The exit status of a daemon expected to die (``-9``: SIGKILLed by a failpoint)."""
        assert self.proc is not None
        return self.proc.wait(timeout)


def answers_kafka_metadata(port: int, bootstrap: str, host: str = "127.0.0.1") -> bool:
    """True once a broker on ``host:port`` answers a Kafka Metadata request (not just a
    TCP accept): the readiness probe of the suite's local brokers."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            pass
    except OSError:
        return False
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        md = admin.list_topics(timeout=2.0)
    except Exception:
        return False
    return bool(md.brokers)
