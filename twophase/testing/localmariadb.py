"""A private, throw-away MariaDB server for the test-suite, the benchmark and chaos runs.

It runs Debian's ``mariadbd`` from a temporary directory: its own datadir (made by
``mariadb-install-db``), its own socket and pid file, on a free loopback port, with no
option file read (``--no-defaults``), so a server installed on the machine is neither
used nor disturbed. ``mariadbd`` refuses to run as root without ``--user``, so as root it
runs as the ``mysql`` user (Debian's package creates it) and the folder is handed to it.
The server dies with the process that started it (``PR_SET_PDEATHSIG``, set after the
switch to that user, which would clear it), so a killed test run leaves no server behind.

Fast settings for tests, chosen so a SIGKILLed server still keeps every XA PREPARE and
commit (the crash tests rely on it): the redo log is written to the OS at each commit
(``innodb_flush_log_at_trx_commit=2``, survives the process, not the machine), no
doublewrite buffer, a small buffer pool, no binary log unless asked for.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from twophase.testing.servers import LocalServer, ServerUnavailable

__all__ = ["LocalMariaDB", "MariaDBUnavailable", "find_mariadbd"]

_PR_SET_PDEATHSIG = 1


class MariaDBUnavailable(ServerUnavailable):
    """The server binaries are missing or the server would not start."""


def find_mariadbd() -> Path | None:
    """Where ``mariadbd`` lives (Debian: /usr/sbin, outside a user's PATH)."""
    for name in ("mariadbd", "mysqld"):
        which = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
        if which:
            return Path(which)
    return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalMariaDB(LocalServer):
    """Start with :meth:`start` (or ``with``); :attr:`url` is a SQLAlchemy URL
    (``mysql+pymysql://root@127.0.0.1:PORT/twophase``) for database ``twophase``."""

    stop_signal = signal.SIGTERM  # a clean shutdown; prepared XA branches stay prepared

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | None = None,
        host: str = "127.0.0.1",
        database: str = "twophase",
        binlog: bool = False,
        tls: bool = False,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir)
        self.host = host
        self.database = database
        self.binlog = binlog
        # TLS: a certificate for 127.0.0.1/localhost from a throw-away CA (:attr:`ca_cert`)
        # and require_secure_transport (TCP clients without TLS are refused)
        self.tls = tls
        self.ca_cert: Path | None = None

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@{self.host}:{self.port}/{self.database}"

    def tls_url(self, user: str = "root", password: str | None = None) -> str:
        """A URL a deployment would use on a TLS server: PyMySQL verifies the server's
        certificate against the CA and checks the host name."""
        assert self.ca_cert is not None, "tls_url() needs a started server with tls=True"
        auth = f"{user}:{password}" if password else user
        return (f"mysql+pymysql://{auth}@{self.host}:{self.port}/{self.database}"
                f"?ssl_ca={self.ca_cert}&ssl_check_hostname=true")

    def _tls_args(self, user: str | None) -> list[str]:
        from twophase.testing.tlscerts import CertificateAuthority

        assert self.dir is not None
        ca = CertificateAuthority(self.dir / "tls", "twophase MariaDB test CA")
        cert = ca.issue("server", (self.host, "localhost"))
        self.ca_cert = ca.cert
        if user:
            for path in (self.dir / "tls", cert.cert, cert.key, ca.cert):
                shutil.chown(path, user)
        return [f"--ssl-ca={ca.cert}", f"--ssl-cert={cert.cert}", f"--ssl-key={cert.key}",
                "--require-secure-transport=ON"]

    @property
    def socket_path(self) -> Path:
        assert self.dir is not None, "the server is not started"
        return self.dir / "mysqld.sock"

    def _user(self) -> str | None:
        return "mysql" if os.geteuid() == 0 else None

    def start(self, timeout: float = 60.0) -> LocalMariaDB:
        mariadbd = find_mariadbd()
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        if mariadbd is None or install is None:
            raise MariaDBUnavailable(
                "MariaDB server binaries not found (mariadbd, mariadb-install-db); install "
                "Debian's 'mariadb-server' package: apt-get install -y mariadb-server"
            )
        user = self._user()
        self.dir = Path(tempfile.mkdtemp(prefix="twophase-mariadb-", dir=self._base_dir))
        data = self.dir / "data"
        data.mkdir()
        if user:
            shutil.chown(self.dir, user)
            shutil.chown(data, user)
        init = subprocess.run(
            [install, "--no-defaults", f"--datadir={data}",
             "--auth-root-authentication-method=normal", "--skip-test-db",
             "--skip-name-resolve", *([f"--user={user}"] if user else [])],
            capture_output=True, text=True, check=False, timeout=300,
        )
        if init.returncode != 0:
            self.stop()
            raise MariaDBUnavailable(
                f"mariadb-install-db failed: {(init.stderr or init.stdout).strip()[-2000:]}"
            )
        try:
            self._launch(mariadbd, user, timeout)
            self._create_database()
        except MariaDBUnavailable:
            self.stop()
            raise
        return self

    def restart(self, timeout: float = 60.0) -> LocalMariaDB:
        """Start the server again on the same datadir and port after :meth:`kill` (a
        crash: InnoDB recovers, and XA branches that were prepared are prepared again,
        listed by ``XA RECOVER``)."""
        mariadbd = find_mariadbd()
        assert mariadbd is not None and self.dir is not None, "restart() needs a started server"
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._launch(mariadbd, self._user(), max(1.0, deadline - time.monotonic()))
                return self
            except MariaDBUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _args(self, mariadbd: Path, user: str | None) -> list[str]:
        assert self.dir is not None
        args = [
            str(mariadbd), "--no-defaults",
            f"--datadir={self.dir / 'data'}",
            f"--socket={self.socket_path}",
            f"--pid-file={self.dir / 'mysqld.pid'}",
            f"--port={self.port}",
            f"--bind-address={self.host}",
            "--skip-name-resolve",
            f"--log-error={self.dir / 'server.log'}",
            "--innodb-flush-log-at-trx-commit=2",
            "--innodb-doublewrite=0",
            "--innodb-buffer-pool-size=128M",
            "--innodb-log-file-size=64M",
            "--max-connections=300",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_bin",
            "--default-time-zone=+00:00",
        ]
        if self.tls:
            args += self._tls_args(user)
        if self.binlog:
            args += [f"--log-bin={self.dir / 'data' / 'binlog'}", "--server-id=1",
                     "--sync-binlog=0"]
        return args

    def _launch(self, mariadbd: Path, user: str | None, timeout: float) -> None:
        assert self.dir is not None
        log = self.dir / "server.log"
        # Started as the user itself (not mariadbd --user=, whose setuid would clear the
        # parent-death signal): the prctl runs after Popen's user switch.
        self.proc = subprocess.Popen(
            self._args(mariadbd, user), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            user=user, preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise MariaDBUnavailable(f"mariadbd exited at start:\n{text}")
            if self.socket_path.exists():
                try:
                    with socket.create_connection((self.host, self.port), timeout=0.5):
                        return
                except OSError:
                    pass
            time.sleep(0.1)
        self.kill()  # the folder stays: start() removes it, restart() tries again
        raise MariaDBUnavailable(f"mariadbd did not accept connections within {timeout}s")

    def _create_database(self) -> None:
        import pymysql

        deadline = time.monotonic() + 30
        while True:
            try:
                conn = pymysql.connect(unix_socket=str(self.socket_path), user="root",
                                       autocommit=True)
                break
            except pymysql.err.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise MariaDBUnavailable(f"cannot connect to the new server: {exc}") from exc
                time.sleep(0.2)
        with conn:
            conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{self.database}`")

    def sql(self, statement: str) -> list[tuple[object, ...]]:
        """Run one statement as root (tests and tooling: ``XA RECOVER``, a count)."""
        import pymysql

        conn = pymysql.connect(unix_socket=str(self.socket_path), user="root",
                               database=self.database, autocommit=True)
        with conn, conn.cursor() as cur:
            cur.execute(statement)
            return list(cur.fetchall())
