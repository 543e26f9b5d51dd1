"""Tokens and transport: one minimum strength for every token source, a warning for a
token on the command line, the help showing the token file, no plain HTTP beyond
loopback without saying so, and a client that trusts only the CA it was given.

The refusals come before the store is opened, so each check runs ``twophase serve``'s
entry point in this process (``--retention bogus`` ends a run that got past them, with
its own message)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.security.conftest import OPERATOR
from twophase.cli import main
from twophase.client.api import CoordinatorClient
from twophase.errors import CoordinatorUnavailable
from twophase.testing.servers import LocalDaemon, clean_env, free_port
from twophase.testing.tlscerts import CertificateAuthority


def _serve(tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
           *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``twophase serve`` in this process, up to its first refusal: (exit code, stderr)."""
    for k in ("TWOPHASE_TOKEN", "TWOPHASE_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(["serve", "--store", f"sqlite:///{tmp}/a.db", "--port", str(free_port()),
               "--retention", "bogus", *args])
    return rc, capsys.readouterr().err


Run = tuple[pytest.MonkeyPatch, pytest.CaptureFixture[str]]


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> Iterator[Run]:
    """The serve command's environment, its stderr, and the ``twophase`` logger given
    back as it was (``serve`` points it at stderr, unpropagated)."""
    logger = logging.getLogger("twophase")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield monkeypatch, capsys
    logger.handlers[:], logger.level, logger.propagate = saved


def test_short_tokens_are_refused_from_every_source(tmp_path: Path, run: Run) -> None:
    rc, err = _serve(tmp_path, *run, "--token", "t")
    assert rc == 2 and "--token has 1 character" in err, err
    rc, err = _serve(tmp_path, *run, env={"TWOPHASE_TOKEN": "short-token"})
    assert rc == 2 and "$TWOPHASE_TOKEN has 11" in err, err
    tokens = tmp_path / "tokens"
    tokens.write_text("operator short-token\n")
    rc, err = _serve(tmp_path, *run, "--token-file", str(tokens))
    assert rc == 2 and "line 1" in err and "at least 16" in err, err
    assert not (tmp_path / "a.db").exists()


def test_a_token_on_the_command_line_warns(tmp_path: Path, run: Run) -> None:
    _, err = _serve(tmp_path, *run, "--token", OPERATOR)
    assert "cannot read duration 'bogus'" in err, err  # it got that far
    assert "--token on the command line is visible" in err
    _, err = _serve(tmp_path, *run, env={"TWOPHASE_TOKEN": OPERATOR})
    assert "cannot read duration" in err and "visible" not in err


def test_help_shows_the_token_file() -> None:
    out = subprocess.run([sys.executable, "-m", "twophase.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=30, env=clean_env()).stdout
    assert "--token-file /etc/twophase/tokens" in out
    assert "--token t " not in out and "s3cret" not in out and "TWOPHASE_TOKEN=" not in out


def test_plain_http_beyond_loopback_needs_saying_so(tmp_path: Path, run: Run) -> None:
    env = {"TWOPHASE_TOKEN": OPERATOR}
    everywhere = "0.0.0.0"
    rc, err = _serve(tmp_path, *run, "--host", everywhere, env=env)
    assert rc == 2 and "--insecure-http" in err, err
    _, err = _serve(tmp_path, *run, "--host", everywhere, "--insecure-http", env=env)
    assert "cannot read duration" in err, err
    _, err = _serve(tmp_path, *run, "--host", "::1", env=env)
    assert "cannot read duration" in err, err


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
