"""A private, throw-away PostgreSQL server for the test-suite and ``twophase demo``.

It runs Debian's server binaries from a temporary directory on a free loopback port.
``initdb`` refuses to run as root, so as root the server runs as the ``postgres`` user.
``max_prepared_transactions`` is set: without it PREPARE TRANSACTION is refused.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from twophase.testing.servers import LocalServer, ServerUnavailable, netns_prefix

__all__ = ["LocalPostgres", "PostgresUnavailable", "find_bindir"]


class PostgresUnavailable(ServerUnavailable):
    """The server binaries are missing or the server would not start."""


def find_bindir() -> Path | None:
    """Where ``initdb`` and ``postgres`` live (Debian keeps them out of PATH)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    which = shutil.which("initdb")
    if which:
        candidates.insert(0, str(Path(os.path.realpath(which)).parent))
    for c in candidates:
        if (Path(c) / "initdb").exists() and (Path(c) / "postgres").exists():
            return Path(c)
    return None


class LocalPostgres(LocalServer):
    """Start with :meth:`start` (or ``with``); :attr:`dsn` points at database ``postgres``."""

    stop_signal = signal.SIGINT  # fast shutdown: rolls back open sessions

    def __init__(
        self,
        *,
        max_prepared_transactions: int = 100,
        fsync: bool = True,
        port: int | None = None,
        base_dir: str | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        also_listen: str | None = None,
        trust_network: str | None = None,
        tls: bool = False,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir)
        self.host = host
        self.netns = netns  # run inside this network namespace (`ip netns exec`; root)
        self.max_prepared_transactions = max_prepared_transactions
        self.fsync = fsync
        # one more address to listen on (the cluster tests' bridge), and the network
        # whose clients are trusted there (pg_hba.conf)
        self.also_listen = also_listen
        self.trust_network = trust_network
        # TLS: ssl=on with a certificate for 127.0.0.1/localhost signed by a throw-away CA
        # (:attr:`ca_cert`), and TCP clients must use it (pg_hba ``hostssl`` only)
        self.tls = tls
        self.ca_cert: Path | None = None

    def dsn_at(self, host: str) -> str:
        """The DSN through another listening address (``also_listen``)."""
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    def tls_dsn(self, user: str = "postgres", password: str | None = None) -> str:
        """A DSN a deployment would use on a TLS server: the CA verified and the host
        name checked (``sslmode=verify-full``)."""
        assert self.ca_cert is not None, "tls_dsn() needs a started server with tls=True"
        auth = f"{user}:{password}" if password else user
        return (f"postgresql://{auth}@{self.host}:{self.port}/postgres"
                f"?sslmode=verify-full&sslrootcert={self.ca_cert}")

    def _user(self) -> str | None:
        return "postgres" if os.geteuid() == 0 else None

    def start(self, timeout: float = 60.0) -> LocalPostgres:
        bindir = find_bindir()
        if bindir is None:
            raise PostgresUnavailable(
                "PostgreSQL server binaries not found (initdb); install Debian's "
                "'postgresql' package: apt-get install -y postgresql"
            )
        user = self._user()
        self.dir = Path(tempfile.mkdtemp(prefix="twophase-pg-", dir=self._base_dir))
        data, sock = self.dir / "data", self.dir / "sock"
        sock.mkdir()
        if user:
            shutil.chown(self.dir, user)
            shutil.chown(sock, user)
        init = subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
             "-E", "UTF8", "--locale=C", "--no-sync"],
            user=user, capture_output=True, text=True, check=False,
        )
        if init.returncode != 0:
            raise PostgresUnavailable(f"initdb failed: {init.stderr.strip() or init.stdout}")
        if self.host != "127.0.0.1":  # initdb trusts loopback only: add the link's subnet
            with open(data / "pg_hba.conf", "a") as hba:
                hba.write("host all all samenet trust\n")
        if self.trust_network:
            with open(data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {self.trust_network} trust\n")
        if self.tls:
            self._tls_setup(data, user)
        try:
            self._launch(bindir, user, timeout)
        except PostgresUnavailable:
            self.stop()
            raise
        return self

    def _tls_setup(self, data: Path, user: str | None) -> None:
        """The CA and server certificate, ``ssl=on``, and a pg_hba.conf that refuses
        plaintext TCP (hostnossl reject) so a client that does not use TLS is turned away."""
        from twophase.testing.tlscerts import CertificateAuthority

        assert self.dir is not None
        ca = CertificateAuthority(self.dir / "tls", "twophase PostgreSQL test CA")
        cert = ca.issue("server", (self.host, "localhost"))
        self.ca_cert = ca.cert
        for src, name in ((cert.cert, "server.crt"), (cert.key, "server.key")):
            shutil.copy(src, data / name)
            (data / name).chmod(0o600)
            if user:
                shutil.chown(data / name, user)
        hba = (data / "pg_hba.conf").read_text()
        (data / "pg_hba.conf").write_text(
            "hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n" + hba)
        with open(data / "postgresql.conf", "a") as conf:
            conf.write("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n")

    def restart(self, timeout: float = 60.0) -> LocalPostgres:
        """Start the server again on the same data folder and port, after :meth:`kill`
        (a crash: PostgreSQL runs crash recovery; prepared transactions survive). Backends
        orphaned by a SIGKILLed postmaster still hold the shared memory for a moment: the
        start is retried until they are gone."""
        bindir = find_bindir()
        assert bindir is not None and self.dir is not None, "restart() needs a started server"
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._launch(bindir, self._user(), max(1.0, deadline - time.monotonic()))
                return self
            except PostgresUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _launch(self, bindir: Path, user: str | None, timeout: float) -> None:
        assert self.dir is not None
        data = self.dir / "data"
        sock = self.dir / "sock"
        log = self.dir / "server.log"
        listen = self.host + (f",{self.also_listen}" if self.also_listen else "")
        args = [
            str(bindir / "postgres"), "-D", str(data), "-p", str(self.port),
            "-k", str(sock), "-c", f"listen_addresses={listen}",
            "-c", f"max_prepared_transactions={self.max_prepared_transactions}",
            "-c", "max_connections=200",
            "-c", f"fsync={'on' if self.fsync else 'off'}",
        ]
        if not self.fsync:
            args += ["-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        with open(log, "ab") as out:
            if user:
                shutil.chown(log, user)
            if self.netns:  # setns needs root: enter the namespace, then become the user
                # (setpriv execs: the pid stays the server's, so kill() still SIGKILLs it)
                args = [*netns_prefix(self.netns),
                        *(["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
                          if user else []), *args]
                user = None
            self.proc = subprocess.Popen(args, user=user, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PostgresUnavailable(f"postgres exited at start:\n{log.read_text()[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    pass
                ready = subprocess.run(
                    [str(bindir / "pg_isready"), "-h", self.host, "-p", str(self.port)],
                    capture_output=True, check=False,
                )
                if ready.returncode == 0:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()  # the folder stays: start() removes it, restart() tries again
        raise PostgresUnavailable(f"postgres did not accept connections within {timeout}s")
