"""The daemon over HTTPS as a deployment runs it: ``twophase serve --ssl-certfile
--ssl-keyfile`` with a certificate signed by the deployment's CA, and clients that trust
that CA through ``TWOPHASE_CA_CERT``. A client without it is refused by the certificate
check, naming it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from twophase.client.api import CoordinatorClient
from twophase.testing.servers import LocalDaemon
from twophase.testing.tlscerts import CertificateAuthority


def test_clients_trusting_the_ca_reach_the_https_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    cert = ca.issue("daemon")
    token = "operator-token-0123456789"
    daemon = LocalDaemon(f"sqlite:///{tmp_path / 'tp.db'}", token, tmp_path / "d.log",
                         tls=(str(cert.cert), str(cert.key), str(ca.cert)))
    daemon.start()
    try:
        assert daemon.url.startswith("https://127.0.0.1:")
        monkeypatch.delenv("TWOPHASE_CA_CERT", raising=False)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{daemon.url}/healthz", timeout=5)  # the system's CAs only
        monkeypatch.setenv("TWOPHASE_CA_CERT", str(ca.cert))
        client = CoordinatorClient(daemon.url, token)
        assert client.register("https-sink") >= 1
        assert "https-sink" in str(client.sinks())
        client.close()
    finally:
        daemon.stop()
