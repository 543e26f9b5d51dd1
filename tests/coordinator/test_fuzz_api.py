"""Hostile requests: schemathesis fuzzes the daemon's own OpenAPI document against a real
``twophase serve`` process on loopback, with each role: an operator token, a job's data
token scoped to sink ``orders``, and none.

With the operator token, every answer must be below 500 (a bad request is a 4xx in the
service's error layout, naming the field); with the data token the same, and every
operator route and every other sink's route answers 403; without a token, every
protected route must answer 401 and the store must not change at all. The daemon's
store holds a seeded transaction whose key is the document's example, so generated
requests reach an existing transaction too.

Bounded (``max_examples`` per operation and mode); the default run fuzzes a SQLite store,
the ``slow`` run a PostgreSQL store too (its 64-bit limits are also checked directly by
tests/system/test_bad_inputs.py in every run).
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.support.pg import fresh_pg_db
from twophase.client.api import CoordinatorClient
from twophase.coordinator.guard import OPEN_PATHS
from twophase.coordinator.roles import ROUTE_ROLES
from twophase.testing.servers import LocalDaemon

TOKEN = "fuzz-token-1234-0123456789"
DATA = "fuzz-data-token-0123456789"  # a job's token, scoped to sink "orders"
EXAMPLES = 10
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=list(HealthCheck))


def _seed(url: str) -> None:
    """The transaction named by the OpenAPI examples (orders/lin/0/1), undecided."""
    client = CoordinatorClient(url, TOKEN, retry_budget=10.0)
    epoch = client.register("orders")
    client.begin("orders", "lin", 0, epoch, ["pg"], 1)


def _start(store: str, log: Path) -> LocalDaemon:
    tokens = log.parent / "tokens"
    tokens.write_text(f"data {DATA} orders\n")
    d = LocalDaemon(store, TOKEN, log, token_file=str(tokens)).start()
    _seed(d.url)
    return d


@pytest.fixture(scope="module", params=[
    "sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LocalDaemon]:
    tmp = tmp_path_factory.mktemp("fuzz")
    if request.param == "sqlite":
        store = f"sqlite:///{tmp}/log.db"
    else:
        store = fresh_pg_db(request.getfixturevalue("pg_dsn"), f"tp_fuzz_{uuid.uuid4().hex[:6]}")
    d = _start(store, tmp / "daemon.log")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def open_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, Path]]:
    """A daemon on SQLite for the no-token run; the test reads its file directly."""
    tmp = tmp_path_factory.mktemp("fuzz-noauth")
    d = _start(f"sqlite:///{tmp}/log.db", tmp / "daemon.log")
    try:
        yield d, tmp / "log.db"
    finally:
        d.stop()


def _bounded(case: Any) -> None:
    """A long-poll answers after its ``timeout``: keep valid ones short."""
    q = case.query
    if isinstance(q, dict) and isinstance(q.get("timeout"), (int, float)) \
            and not isinstance(q.get("timeout"), bool) and q["timeout"] > 0.2:
        q["timeout"] = 0.2


def _state(db: Path) -> list[Any]:
    with sqlite3.connect(db) as conn:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall()
                for t in ("twophase_sinks", "twophase_txns", "twophase_branches",
                          "twophase_events")]


def _describe(case: Any, resp: Any) -> str:
    return (f"{case.method} {case.formatted_path} query={case.query!r} body={case.body!r} "
            f"-> {resp.status_code} {resp.text[:300]}")


SEEDED = {"sink": "orders", "lineage": "lin", "checkpoint": 0, "attempt": 1}


def _fuzz(url: str, check: Callable[[Any], None]) -> int:
    """Run ``check`` on generated requests for every operation of the daemon's document:
    valid and invalid ones (schemathesis's positive and negative modes), and for the
    routes of one transaction also with the seeded key. Returns the operations run."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        strategies = []
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(op.as_strategy(mode))
            if "{attempt}" in op.path:
                strategies.append(op.as_strategy(mode, path_parameters=SEEDED))

        @FUZZ
        @given(st.one_of(strategies))
        def run(case: Any) -> None:
            _bounded(case)
            check(case)

        run()
        # schemathesis's coverage phase: the boundaries of every parameter and field
        # (the largest integer, one past it, empty and overlong strings, wrong types):
        # the cases random generation rarely hits and where 5xx hide
        config = schema.config.generation_for(operation=op, phase="coverage")
        for case in schema.iter_coverage_cases(
                op, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                generation_config=config):
            _bounded(case)
            check(case)
        ran += 1
    return ran


def test_fuzz_with_token_no_server_error(daemon: LocalDaemon) -> None:
    def check(case: Any) -> None:
        resp = case.call(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert resp.status_code < 500, _describe(case, resp)
        if resp.status_code >= 400:
            body = resp.json()
            assert set(body) == {"error", "message"} and body["message"], \
                _describe(case, resp)

    assert _fuzz(daemon.url, check) >= 14


def test_fuzz_with_scoped_data_token(daemon: LocalDaemon) -> None:
    """A job's token: no server error; an operator route, or another sink's data route,
    refused before anything is parsed (401 when the generator dropped the header)."""
    def check(case: Any) -> None:
        resp = case.call(headers={"Authorization": f"Bearer {DATA}"}, timeout=30)
        assert resp.status_code < 500, _describe(case, resp)
        role = ROUTE_ROLES.get((case.method, case.path))
        sink = (case.path_parameters or {}).get("sink")
        if role == "operator" or (role == "data" and sink != "orders"):
            assert resp.status_code in (401, 403), _describe(case, resp)

    assert _fuzz(daemon.url, check) >= 14


def test_fuzz_without_token_changes_nothing(open_daemon: tuple[LocalDaemon, Path]) -> None:
    d, db = open_daemon
    before = _state(db)

    def check(case: Any) -> None:
        headers = {"Authorization": "Bearer not-the-token"} if case.method == "POST" else {}
        resp = case.call(headers=headers, timeout=30)
        assert resp.status_code < 500, _describe(case, resp)
        if case.path not in OPEN_PATHS:
            assert resp.status_code == 401, _describe(case, resp)
            assert resp.json()["error"] == "unauthorized"

    assert _fuzz(d.url, check) >= 14
    assert _state(db) == before


def test_seeded_transaction_is_reachable(open_daemon: tuple[LocalDaemon, Path]) -> None:
    """The examples the fuzzer starts from name a real transaction (else every generated
    request would stop at 404 and the body validation would go untested)."""
    d = open_daemon[0]
    r = httpx.get(f"{d.url}/v1/txns/orders/lin/0/1",
                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["state"] == "OPEN"
