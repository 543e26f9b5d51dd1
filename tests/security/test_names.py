"""One name rule for sinks and participants, the same in the routes' path patterns,
the request bodies, ``validate_name`` and the store: ``.``, ``..``, ``/``, NUL, control
characters and over-long names are refused, raw or percent-encoded."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.security.conftest import OPERATOR, Daemon
from twophase.coordinator.store import Store
from twophase.errors import InvalidRequest
from twophase.names import NAME_PATTERN, validate_name

BAD = [".", "..", "a/b", "a\x00b", "a\nb", "a\tb", "a\x7fb", "x" * 65, "x" * 256, "",
       "a b", "ü"]
BAD_PATHS = [".", "..", "%2e", "%2E%2e", "%2e%2e", "a%2fb", "a%00b", "a%0ab", "x" * 256]


def _raw(daemon: Daemon, method: str, path: str, body: object = None) -> int:
    """A request sent as written (no client normalises ``..`` away)."""
    url = urlsplit(daemon.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={
            "Authorization": f"Bearer {OPERATOR}", "Content-Type": "application/json"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_bad_sink_names_are_refused_raw_and_percent_encoded(daemon: Daemon) -> None:
    for name in BAD_PATHS:
        status = _raw(daemon, "POST", f"/v1/sinks/{name}/register")
        assert 400 <= status < 500, (name, status)
    listed = {s["name"] for s in daemon.call("GET", "/v1/sinks", OPERATOR).json()["sinks"]}
    assert not listed & {".", "..", "a/b", "x" * 256}, listed


def test_bad_participant_names_are_refused_in_a_register_body(daemon: Daemon) -> None:
    for name in BAD:
        body = {"participants": [{"kind": "files", "name": name, "target": "t",
                                  "options": {}}]}
        r = daemon.call("POST", "/v1/sinks/names-ok/register", OPERATOR, json=body)
        assert r.status_code == 422, (name, r.text)


def test_one_rule_everywhere(tmp_path: Path) -> None:
    """validate_name, the HTTP pattern (as Python reads it) and the store agree."""
    store = Store(f"sqlite:///{tmp_path / 'n.db'}")
    try:
        for name in [*BAD, "orders", "a.b", ".a", "...", "x" * 64, "A-Z_0.9"]:
            ok = re.fullmatch(NAME_PATTERN, name) is not None
            try:
                validate_name("sink name", name)
                valid = True
            except InvalidRequest:
                valid = False
            assert ok == valid, name
            if not valid:
                with pytest.raises(InvalidRequest):
                    store.register(name)
                with pytest.raises(InvalidRequest):
                    store.register("orders", [{"kind": "files", "name": name,
                                               "target": "t", "options": {}}])
    finally:
        store.close()
