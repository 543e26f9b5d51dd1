"""The hot path (coordinator/hotpath.py) answers exactly as the FastAPI routes do.

Two real uvicorn servers on loopback, each on its own SQLite store: the default app and
the same app with ``hot_path=False``. The same requests, valid and invalid, go to both;
status, content type and JSON body must be the same (timestamps aside), and the valid
ones must have been answered by the hot path, not handed on to FastAPI.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from twophase.coordinator.app import create_app
from twophase.coordinator.hotpath import HotPath

TOKEN = "hot-path-token-0123456789"
TIMES = {"created", "deadline", "decided_at", "finished_at"}


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    handed_on: list[str] = field(default_factory=list)  # paths the hot path passed on


def _serve(app: Any) -> Served:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    served = Served(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    assert httpx.get(f"{served.url}/healthz").status_code == 200  # builds the stack
    stack = app.middleware_stack
    while stack is not None and not isinstance(stack, HotPath):
        stack = getattr(stack, "app", None)
    if stack is not None:  # count what the hot path hands on to FastAPI
        inner = stack.app

        async def counting(scope: Any, receive: Any, send: Any) -> None:
            served.handed_on.append(scope["path"])
            await inner(scope, receive, send)

        stack.app = counting
    return served


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    d: Path = tmp_path_factory.mktemp("hotpath")
    hot = _serve(create_app(f"sqlite:///{d}/hot.db", TOKEN))
    plain = _serve(create_app(f"sqlite:///{d}/plain.db", TOKEN, hot_path=False))
    assert not plain.handed_on and hot.server.started
    yield hot, plain
    for s in (hot, plain):
        s.server.should_exit = True
        s.thread.join(15)


def _normal(doc: Any) -> Any:
    """The answer with its clock readings blanked (the two stores' clocks differ)."""
    if isinstance(doc, dict):
        return {k: ("T" if k in TIMES and v is not None else _normal(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_normal(x) for x in doc]
    return doc


Call = Callable[[httpx.Client], httpx.Response]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TXN = "/v1/txns/s1/lin/0/1"
BEGIN = {"lineage": "lin", "checkpoint": 0, "epoch": 1, "participants": ["pg"],
         "partitions": 2}


def _post(path: str, body: Any = None, **kw: Any) -> Call:
    if body is not None:
        kw["json"] = body
    return lambda c: c.post(path, **kw)


def _get(path: str, **kw: Any) -> Call:
    return lambda c: c.get(path, **kw)


# (what, request, answered by the hot path?) -- in order: each builds on the state before
CASES: list[tuple[str, Call, bool]] = [
    ("register", _post("/v1/sinks/s1/register"), False),
    ("begin", _post("/v1/sinks/s1/begin", BEGIN), True),
    ("begin again (the same attempt)", _post("/v1/sinks/s1/begin", BEGIN), True),
    ("begin, stale epoch", _post("/v1/sinks/s1/begin", {**BEGIN, "epoch": 0}), True),
    ("begin, unknown sink", _post("/v1/sinks/nosuch/begin", BEGIN), True),
    ("begin, string checkpoint", _post("/v1/sinks/s1/begin", {**BEGIN, "checkpoint": "1"}),
     False),
    ("begin, extra field", _post("/v1/sinks/s1/begin", {**BEGIN, "x": 1}), False),
    ("begin, bad participant", _post("/v1/sinks/s1/begin", {**BEGIN, "participants": ["A!"]}),
     False),
    ("begin, bad sink name", _post("/v1/sinks/BAD!/begin", BEGIN), False),
    ("begin, no body", _post("/v1/sinks/s1/begin"), False),
    ("begin, malformed JSON", _post("/v1/sinks/s1/begin", content=b"{",
                                    headers={"content-type": "application/json"}), False),
    ("begin, text/plain", _post("/v1/sinks/s1/begin", content=b"{}",
                                headers={"content-type": "text/plain"}), False),
    ("begin, GET", _get("/v1/sinks/s1/begin"), False),
    ("begin, JSON nested too deep to parse", _post(
        "/v1/sinks/s1/begin", content=b"[" * 100_000 + b"]" * 100_000,
        headers={"content-type": "application/json"}), False),
    ("decision, undecided, timeout 0", _get(f"{TXN}/decision", params={"timeout": "0"}), True),
    ("decision, bad timeout", _get(f"{TXN}/decision", params={"timeout": "soon"}), False),
    ("decision, timeout too long", _get(f"{TXN}/decision", params={"timeout": "61"}), False),
    ("decision, bad until", _get(f"{TXN}/decision?timeout=0&until=never"), False),
    ("decision, unknown txn", _get("/v1/txns/s1/lin/9/1/decision?timeout=0"), True),
    ("decision, attempt 0", _get("/v1/txns/s1/lin/0/0/decision?timeout=0"), False),
    ("decision, checkpoint 00", _get("/v1/txns/s1/lin/00/1/decision?timeout=0"), False),
    ("votes, unknown branch", _post(f"{TXN}/votes", {"epoch": 1, "votes": [
        {"branch": "pg/7", "yes": True}]}), True),
    ("votes, malformed branch", _post(f"{TXN}/votes", {"epoch": 1, "votes": [
        {"branch": "nope", "yes": True}]}), False),
    ("votes, empty list", _post(f"{TXN}/votes", {"epoch": 1, "votes": []}), False),
    ("votes, stale epoch", _post(f"{TXN}/votes", {"epoch": 0, "votes": [
        {"branch": "pg/0", "yes": True}]}), True),
    ("votes, unknown txn", _post("/v1/txns/s1/lin/5/1/votes", {"epoch": 1, "votes": [
        {"branch": "pg/0", "yes": True}]}), True),
    ("votes, NUL in handle", _post(f"{TXN}/votes", {"epoch": 1, "votes": [
        {"branch": "pg/0", "yes": True, "handle": {"g": "a\x00b"}}]}), False),
    ("ack before the decision", _post(f"{TXN}/acks", {"epoch": 1, "acks": [
        {"branch": "pg/0", "outcome": "COMMIT"}]}), True),
    ("votes, first", _post(f"{TXN}/votes", {"epoch": 1, "votes": [
        {"branch": "pg/0", "yes": True, "handle": {"g": "1"}, "digest": "sha256:ab",
         "metrics": {"prepare_s": 0.5, "rows": 10}}]}), True),
    ("votes, last (decides)", _post(f"{TXN}/votes", {"epoch": 1, "votes": [
        {"branch": "pg/1", "yes": True}]}), True),
    ("decision, decided", _get(f"{TXN}/decision"), True),
    ("decision, decided, brief", _get(f"{TXN}/decision?brief=true"), True),
    ("decision, brief false", _get(f"{TXN}/decision?timeout=0&brief=false"), True),
    ("decision, brief spelled 1", _get(f"{TXN}/decision?brief=1"), False),
    ("decision, until finished, timeout 0", _get(f"{TXN}/decision",
                                                  params={"timeout": "0.000",
                                                          "until": "finished"}), True),
    ("acks, bad outcome", _post(f"{TXN}/acks", {"epoch": 1, "acks": [
        {"branch": "pg/0", "outcome": "MAYBE"}]}), False),
    ("acks, contrary outcome", _post(f"{TXN}/acks", {"epoch": 1, "acks": [
        {"branch": "pg/0", "outcome": "ABORT"}]}), True),
    ("acks", _post(f"{TXN}/acks", {"epoch": 1, "acks": [
        {"branch": "pg/0", "outcome": "COMMIT"}, {"branch": "pg/1", "outcome": "COMMIT",
                                                   "metrics": {"commit_s": 0.1}}]}), True),
    ("acks again", _post(f"{TXN}/acks", {"epoch": 1, "acks": [
        {"branch": "pg/1", "outcome": "COMMIT"}]}), True),
    ("read the txn", _get(TXN), False),
    ("no token", _post(f"{TXN}/votes", {"epoch": 1, "votes": []}, headers={"Authorization":
                                                                          ""}), False),
    ("body too large", _post(f"{TXN}/votes", content=b" " * (1 << 21),
                             headers={"content-type": "application/json"}), False),
]


def test_hot_path_answers_as_the_fastapi_routes(pair: tuple[Served, Served]) -> None:
    hot, plain = pair
    statuses = set()
    with httpx.Client(base_url=hot.url, headers=AUTH) as ch, \
            httpx.Client(base_url=plain.url, headers=AUTH) as cp:
        for what, call, by_hot in CASES:
            before = len(hot.handed_on)
            a, b = call(ch), call(cp)
            assert (a.status_code, a.headers.get("content-type")) == \
                (b.status_code, b.headers.get("content-type")), what
            assert _normal(a.json()) == _normal(b.json()), what
            statuses.add(a.status_code)
            if a.status_code != 401 and a.status_code != 413:
                handed_on = len(hot.handed_on) > before
                assert handed_on is not by_hot, (what, a.status_code, a.text)
    assert not plain.handed_on  # hot_path=False has no hot path at all
    # the walk reached every kind of answer the hot endpoints give
    assert statuses == {200, 400, 401, 404, 405, 409, 413, 422}, statuses
