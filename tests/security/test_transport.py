"""Tokens and transport: one minimum strength for every token source, a warning for a
token on the command line, the help showing the token file, no plain HTTP beyond
loopback without saying so, and a client that trusts only the CA it was given.

The refusals come before the store is opened, so each check is one short process
(``--retention bogus`` ends a run that got past them, with its own message)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.security.conftest import OPERATOR
from twophase.client import CoordinatorClient
from twophase.errors import CoordinatorUnavailable
from twophase.testing.servers import LocalDaemon, clean_env, free_port
from twophase.testing.tlscerts import CertificateAuthority


def _serve(tmp: Path, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    e = clean_env(**(env or {}))
    for k in ("TWOPHASE_TOKEN", "TWOPHASE_TOKEN_FILE"):
        if not env or k not in env:
            e.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "twophase.cli", "serve", "--store", f"sqlite:///{tmp}/a.db",
         "--port", str(free_port()), "--retention", "bogus", *args],
        env=e, capture_output=True, text=True, timeout=30)


def test_short_tokens_are_refused_from_every_source(tmp_path: Path) -> None:
    flag = _serve(tmp_path, "--token", "t")
    assert flag.returncode == 2 and "--token has 1 character" in flag.stderr, flag.stderr
    env = _serve(tmp_path, env={"TWOPHASE_TOKEN": "short-token"})
    assert env.returncode == 2 and "$TWOPHASE_TOKEN has 11" in env.stderr, env.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text("operator short-token\n")
    file = _serve(tmp_path, "--token-file", str(tokens))
    assert file.returncode == 2 and "line 1" in file.stderr and "at least 16" in file.stderr
    assert not (tmp_path / "a.db").exists()


def test_a_token_on_the_command_line_warns(tmp_path: Path) -> None:
    proc = _serve(tmp_path, "--token", OPERATOR)
    assert "cannot read duration 'bogus'" in proc.stderr, proc.stderr  # got that far
    assert "--token on the command line is visible" in proc.stderr
    quiet = _serve(tmp_path, env={"TWOPHASE_TOKEN": OPERATOR})
    assert "cannot read duration" in quiet.stderr and "visible" not in quiet.stderr


def test_help_shows_the_token_file() -> None:
    out = subprocess.run([sys.executable, "-m", "twophase.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=30, env=clean_env()).stdout
    assert "--token-file /etc/twophase/tokens" in out
    assert "--token t " not in out and "s3cret" not in out and "TWOPHASE_TOKEN=" not in out


def test_plain_http_beyond_loopback_needs_saying_so(tmp_path: Path) -> None:
    env = {"TWOPHASE_TOKEN": OPERATOR}
    refused = _serve(tmp_path, "--host", "0.0.0.0", env=env)
    assert refused.returncode == 2 and "--insecure-http" in refused.stderr, refused.stderr
    said = _serve(tmp_path, "--host", "0.0.0.0", "--insecure-http", env=env)
    assert "cannot read duration" in said.stderr, said.stderr
    loop = _serve(tmp_path, "--host", "127.0.0.1", env=env)
    assert "cannot read duration" in loop.stderr, loop.stderr


def test_client_trusts_only_the_pinned_ca(tmp_path: Path) -> None:
    """A daemon whose certificate another CA signed (a man in the middle) is refused by a
    client pinned to the operator's CA, before any token is sent."""
    ours, theirs = CertificateAuthority(tmp_path / "ours"), CertificateAuthority(
        tmp_path / "theirs")
    cert = theirs.issue("daemon")
    daemon = LocalDaemon(f"sqlite:///{tmp_path / 'tp.db'}", OPERATOR, tmp_path / "d.log",
                         tls=(str(cert.cert), str(cert.key), str(theirs.cert))).start()
    try:
        with pytest.raises((CoordinatorUnavailable, httpx.ConnectError)):
            CoordinatorClient(daemon.url, OPERATOR, verify=str(ours.cert),
                              retry_budget=0.5).sinks()
        with CoordinatorClient(daemon.url, OPERATOR, verify=str(theirs.cert)) as client:
            assert client.sinks() == []
    finally:
        daemon.stop()
