"""A throw-away certificate authority for the test servers' TLS (Kafka SASL_SSL,
PostgreSQL and MariaDB with ``ssl=on``).

Why: TLS is only tested when a client verifies a real chain and host name, as a
deployment's clients do (librdkafka's default ``ssl.endpoint.identification.algorithm``
is ``https``, PostgreSQL's ``sslmode=verify-full``). So the suite makes its own CA with
``openssl`` and signs each server's certificate for ``127.0.0.1`` and ``localhost``.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from twophase.testing.servers import ServerUnavailable

__all__ = ["CertificateAuthority", "ServerCert"]


@dataclass(frozen=True)
class ServerCert:
    """A server's certificate and unencrypted key (PEM files), and both in one file
    (Kafka's PEM keystore wants the key and the chain together)."""

    cert: Path
    key: Path
    combined: Path


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise ServerUnavailable("openssl not found: install it (apt-get install -y openssl)")
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise ServerUnavailable(f"openssl {args[0]} failed: {done.stderr.strip()[-1500:]}")


class CertificateAuthority:
    """A self-signed CA in ``folder``: :attr:`cert` is what clients trust
    (``ssl.ca.location``, ``sslrootcert``)."""

    def __init__(self, folder: Path, name: str = "twophase test CA") -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cert = self.folder / "ca.pem"
        self.key = self.folder / "ca.key"
        if not self.cert.exists():
            _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                     "-subj", f"/CN={name}", "-keyout", str(self.key), "-out", str(self.cert),
                     "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=self.folder)

    def issue(self, name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> ServerCert:
        """A server certificate for ``hosts`` (IP addresses and DNS names), signed here."""
        key, csr = self.folder / f"{name}.key", self.folder / f"{name}.csr"
        cert, ext = self.folder / f"{name}.pem", self.folder / f"{name}.ext"
        alt = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}"
                       for h in hosts)
        ext.write_text(f"subjectAltName={alt}\nextendedKeyUsage=serverAuth\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={hosts[0]}",
                 "-keyout", str(key), "-out", str(csr), cwd=self.folder)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey",
                 str(self.key), "-CAcreateserial", "-days", "2", "-extfile", str(ext),
                 "-out", str(cert), cwd=self.folder)
        key.chmod(0o600)
        combined = self.folder / f"{name}-keystore.pem"
        combined.write_text(key.read_text() + cert.read_text())
        combined.chmod(0o600)
        return ServerCert(cert, key, combined)
