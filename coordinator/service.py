"""The coordinator's HTTP/JSON service (FastAPI) and the embedded server.

The service only translates: it validates a request, stamps the event with the store's
clock, hands it to :class:`~coordinator.store.Store` (which runs the pure state machine
under compare-and-set) and encodes the answer with :mod:`twophase.wire`. The API is
described in ``docs/coordinator-api.md`` and served as OpenAPI at ``/openapi.json``.

:class:`EmbeddedServer` runs the same app with uvicorn in a daemon thread of the calling
process (the Spark driver) on a free port, so executors reach it exactly like a daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Annotated, Any, Final, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from twophase import __version__, wire
from twophase import protocol as p
from twophase.coordinator.background import Background, Settings
from twophase.coordinator.metrics import Metrics
from twophase.coordinator.store import Store
from twophase.errors import StoreError, TransactionNotFound, TwophaseError
from twophase.names import LINEAGE_PATTERN, NAME_PATTERN
from twophase.protocol import TxnKey

__all__ = ["MAX_BODY", "DecisionHub", "EmbeddedServer", "create_app", "setup_logging"]

log = logging.getLogger("twophase.coordinator.service")

MAX_BODY: Final = 1 << 20  # 1 MiB
OPEN_PATHS: Final = frozenset({"/healthz", "/metrics", "/openapi.json", "/docs", "/redoc"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# ---------------------------------------------------------------------------------------
# request bodies (strict: "5" is not an int, unknown fields are refused)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class BeginIn(_Strict):
    lineage: str = Field(pattern=LINEAGE_PATTERN, description="identity of the Spark checkpoint")
    checkpoint: int = Field(ge=0, description="Spark's micro-batch id (batch_id)")
    epoch: int = Field(ge=0, description="writer epoch from /register")
    participants: list[str] = Field(min_length=1, max_length=64)
    partitions: int = Field(ge=1, le=100_000)
    vote_timeout: float = Field(default=300.0, gt=0, le=7 * 86400)


class VoteItem(_Strict):
    branch: str = Field(max_length=96, description="participant/partition")
    yes: bool
    handle: dict[str, str] | None = None
    reason: str | None = Field(default=None, max_length=4096)


class VotesIn(_Strict):
    epoch: int = Field(ge=0)
    votes: list[VoteItem] = Field(min_length=1)


DecisionName = Literal["COMMIT", "ABORT"]


class AckItem(_Strict):
    branch: str = Field(max_length=96)
    outcome: DecisionName


class AcksIn(_Strict):
    epoch: int = Field(ge=0)
    acks: list[AckItem] = Field(min_length=1)


class AbandonIn(_Strict):
    epoch: int = Field(ge=0)
    reason: str = Field(min_length=1, max_length=4096)


class ForceAckIn(_Strict):
    branch: str = Field(max_length=96)
    outcome: DecisionName


class AbortIn(_Strict):
    reason: str = Field(min_length=1, max_length=4096)


class ErrorOut(BaseModel):
    error: str
    message: str


class BranchOut(BaseModel):
    vote: p.Decision | None
    handle: dict[str, str] | None
    reason: str | None
    ack: p.Decision | None


class TxnOut(BaseModel):
    sink: str
    lineage: str
    checkpoint: int
    attempt: int
    epoch: int
    partitions: int
    state: p.State
    decision: p.Decision | None
    reason: str | None
    deadline: float
    created: float
    decided_at: float | None
    finished_at: float | None
    version: int
    branches: dict[str, BranchOut]
    alert: bool | None = None


class SinkOut(BaseModel):
    name: str
    epoch: int
    lineage: str | None
    last_committed: int | None


class BeginOut(BaseModel):
    kind: p.BeginKind
    sink: SinkOut
    txn: TxnOut | None
    recover: list[TxnOut]
    changed: list[TxnOut]
    new_lineage: bool


class TxnListOut(BaseModel):
    txns: list[TxnOut]


# ---------------------------------------------------------------------------------------
# plumbing


def _json(obj: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, separators=(",", ":")), status_code=status,
        media_type="application/json",
    )


def _error(status: int, code: str, message: str) -> Response:
    return _json({"error": code, "message": message}, status)


class DecisionHub:
    """Wakes long-polls in this process the moment a change is durable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[TxnKey, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]]]
        self._waiters = {}

    def subscribe(self, key: TxnKey) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._waiters.setdefault(key, set()).add((loop, fut))
        return fut

    def unsubscribe(self, key: TxnKey, fut: asyncio.Future[Any]) -> None:
        with self._lock:
            ws = self._waiters.get(key)
            if ws is not None:
                ws.discard((fut.get_loop(), fut))
                if not ws:
                    del self._waiters[key]

    def publish(self, txn: p.Transaction) -> None:
        if not self._waiters:
            return
        with self._lock:
            ws = list(self._waiters.get(txn.key, ()))
        for loop, fut in ws:
            loop.call_soon_threadsafe(_resolve, fut, txn)


def _resolve(fut: asyncio.Future[Any], txn: p.Transaction) -> None:
    if not fut.done():
        fut.set_result(txn)


class _Guard:
    """Pure ASGI middleware: bearer token and body size, before any routing or parsing."""

    def __init__(self, app: ASGIApp, token: str | None, max_body: int) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                why = "missing bearer token" if not got else "wrong bearer token"
                await _send_error(send, 401, "unauthorized", f"{why}: send 'Authorization: "
                                  "Bearer <token>' (the daemon's --token / TWOPHASE_TOKEN)")
                return
        length = headers.get(b"content-length")
        too_big = f"request body is larger than {self.max_body} bytes"
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _send_error(send, 413, "body_too_large", too_big)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _send_error(send, 413, "body_too_large", too_big)


class _TooLarge(Exception):
    pass


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": code, "message": message}).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")],
    })
    await send({"type": "http.response.body", "body": body})


def _describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return 400, "malformed_json", f"request body is not valid JSON: {ctx.get('error', '')}"
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}")
    return 422, "invalid_request", "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------------------------------
# the app


SinkName = Annotated[str, Path(pattern=NAME_PATTERN, description="sink name")]
Lineage = Annotated[str, Path(pattern=LINEAGE_PATTERN)]
Checkpoint = Annotated[int, Path(ge=0)]
Attempt = Annotated[int, Path(ge=1)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": ErrorOut} for c in (400, 401, 404, 409, 413, 422, 503)
}


def create_app(
    store: Store | str,
    token: str | None,
    *,
    insecure: bool = False,
    settings: Settings | None = None,
    background: bool = True,
    poll_interval: float | None = None,
    max_body: int = MAX_BODY,
) -> FastAPI:
    """Build the service around ``store`` (a :class:`Store` or a store URL).

    A token is required unless ``insecure`` is set explicitly.
    """
    if not token and not insecure:
        raise ValueError("a bearer token is required (or pass insecure=True explicitly)")
    if isinstance(store, str):
        store = Store(store)
    st: Store = store
    hub = DecisionHub()
    metrics = Metrics(st)
    previous = st.on_change

    def on_change(before: p.Transaction | None, after: p.Transaction) -> None:
        if previous is not None:
            previous(before, after)
        metrics.observe(before, after)
        hub.publish(after)

    st.on_change = on_change
    bg = Background(st, settings) if background else None
    poll = poll_interval if poll_interval is not None else (1.0 if st.is_sqlite else 0.1)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = 128
        if bg is not None:
            bg.start()
        log.info("coordinator started", extra={"store": st.safe_url, "auth": bool(token)})
        try:
            yield
        finally:
            if bg is not None:
                bg.stop()

    app = FastAPI(
        title="twophase coordinator",
        version=__version__,
        description="Durable 2PC decision log. See docs/coordinator-api.md.",
        lifespan=lifespan,
    )
    app.state.store = st
    app.state.hub = hub
    app.state.metrics = metrics
    app.state.background = bg

    @app.exception_handler(TwophaseError)
    async def _twophase_error(_r: Request, exc: TwophaseError) -> Response:
        # every refusal maps itself: its class names the code and the status
        metrics.requests.labels(exc.code).inc()
        if isinstance(exc, StoreError):
            log.error("store error", extra={"error": str(exc)})
        return _error(exc.http_status, exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> Response:
        status, code, msg = _describe_validation(exc)
        metrics.requests.labels(code).inc()
        return _error(status, code, msg)

    @app.exception_handler(ValueError)
    async def _value_error(_r: Request, exc: ValueError) -> Response:
        metrics.requests.labels("invalid_request").inc()
        return _error(422, "invalid_request", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    def key_of(sink: str, lineage: str, checkpoint: int, attempt: int) -> TxnKey:
        return TxnKey(sink, lineage, checkpoint, attempt)

    def txn_json(txn: p.Transaction) -> Response:
        return _json(wire.encode_txn(txn))

    txn_path = "/v1/txns/{sink}/{lineage}/{checkpoint}/{attempt}"

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        """Liveness and store reachability (no token needed)."""
        st.sink("__healthz__")
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def prometheus() -> Response:
        """Prometheus text format (no token needed)."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/sinks/{sink}/register", tags=["sinks"], response_model=SinkOut,
              responses=_ERRORS)
    async def register(sink: SinkName) -> Response:
        """A writer (driver) starts: returns the sink's next epoch, fencing older writers."""
        return _json(wire.encode_sink(await st.register_async(sink)))

    @app.get("/v1/sinks/{sink}", tags=["sinks"], response_model=SinkOut, responses=_ERRORS)
    def get_sink(sink: SinkName) -> Response:
        rec = st.sink(sink)
        if rec is None:
            return _error(404, "not_found", f"no sink {sink!r}")
        return _json(wire.encode_sink(rec))

    @app.post("/v1/sinks/{sink}/begin", tags=["sinks"], response_model=BeginOut,
              responses=_ERRORS)
    async def begin(sink: SinkName, body: BeginIn) -> Response:
        """Start (or find) the attempt for a checkpoint; see protocol.begin."""
        res = await st.begin_async(
            p.Begin(
                sink=sink, lineage=body.lineage, batch_id=body.checkpoint, epoch=body.epoch,
                participants=tuple(body.participants), partitions=body.partitions,
                now=st.clock(), vote_timeout=body.vote_timeout,
            )
        )
        return _json(wire.encode_begin(res))

    @app.post(txn_path + "/votes", tags=["txns"], response_model=TxnOut, responses=_ERRORS)
    async def vote(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                   body: VotesIn) -> Response:
        """Record one or more branch votes; the answer shows the decision if it was made."""
        now = st.clock()
        events: list[p.Event] = [
            p.Vote(branch=v.branch, epoch=body.epoch, yes=v.yes, now=now, handle=v.handle,
                   reason=v.reason)
            for v in body.votes
        ]
        return txn_json(await st.apply_async(key_of(sink, lineage, checkpoint, attempt), events))

    @app.post(txn_path + "/acks", tags=["txns"], response_model=TxnOut, responses=_ERRORS)
    async def ack(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                  body: AcksIn) -> Response:
        """Branches confirm they applied the decision."""
        now = st.clock()
        events: list[p.Event] = [
            p.Ack(branch=a.branch, epoch=body.epoch, outcome=p.Decision(a.outcome), now=now)
            for a in body.acks
        ]
        return txn_json(await st.apply_async(key_of(sink, lineage, checkpoint, attempt), events))

    @app.post(txn_path + "/abandon", tags=["txns"], response_model=TxnOut, responses=_ERRORS)
    def abandon(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                body: AbandonIn) -> Response:
        """The writer gives up on an undecided attempt: ABORT."""
        ev = p.Abandon(epoch=body.epoch, reason=body.reason, now=st.clock())
        return txn_json(st.apply(key_of(sink, lineage, checkpoint, attempt), [ev]))

    @app.get(txn_path + "/decision", tags=["txns"], response_model=TxnOut, responses=_ERRORS)
    async def decision(
        sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
        timeout: Annotated[float, Query(ge=0, le=60)] = 25.0,
        until: Annotated[Literal["decided", "finished"], Query()] = "decided",
    ) -> Response:
        """Long-poll: answers as soon as the transaction is decided (or finished, with
        ``until=finished``), or after ``timeout`` seconds with the undecided transaction."""
        key = key_of(sink, lineage, checkpoint, attempt)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout

        def done(t: p.Transaction) -> bool:
            return t.state.decided if until == "decided" else t.state.finished

        while True:
            fut = hub.subscribe(key)
            try:
                txn = await run_in_threadpool(st.get, key)
                if txn is None:
                    raise TransactionNotFound.for_key(key)
                left = end - loop.time()
                if done(txn) or left <= 0:
                    return txn_json(txn)
                with contextlib.suppress(asyncio.TimeoutError):
                    woke = await asyncio.wait_for(fut, min(left, poll))
                    if done(woke):
                        return txn_json(woke)
            finally:
                hub.unsubscribe(key, fut)

    @app.get(txn_path, tags=["txns"], response_model=TxnOut, responses=_ERRORS)
    def get_txn(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                history: bool = False) -> Response:
        """One transaction with its branches; ``history=true`` adds the event history."""
        key = key_of(sink, lineage, checkpoint, attempt)
        txn = st.get(key)
        if txn is None:
            raise TransactionNotFound.for_key(key)
        out: dict[str, Any] = {**wire.encode_txn(txn)}
        if history:
            out["history"] = st.history(key)
        return _json(out)

    @app.get("/v1/txns", tags=["txns"], response_model=TxnListOut, responses=_ERRORS)
    def list_txns(
        sink: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        state: Annotated[p.State | Literal["ALERT"] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> Response:
        """Newest first. ``state=ALERT`` lists decided transactions flagged by the alert."""
        if state == "ALERT":
            rows = st.list(sink=sink, limit=limit, alert=True)
        else:
            rows = st.list(sink=sink, state=state.value if state else None, limit=limit)
        return _json({"txns": [{**wire.encode_txn(r.txn), "alert": r.alert} for r in rows]})

    @app.post("/v1/admin" + txn_path[3:] + "/force-ack", tags=["admin"], response_model=TxnOut,
              responses=_ERRORS)
    def force_ack(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                  body: ForceAckIn) -> Response:
        """Operator: a branch is settled by hand (no epoch check)."""
        key = key_of(sink, lineage, checkpoint, attempt)
        log.warning("force-ack", extra={"txn": list(key), "branch": body.branch,
                                        "outcome": body.outcome})
        return txn_json(st.force(key, body.branch, p.Decision(body.outcome)))

    @app.post("/v1/admin" + txn_path[3:] + "/abort", tags=["admin"], response_model=TxnOut,
              responses=_ERRORS)
    def admin_abort(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint,
                    attempt: Attempt, body: AbortIn) -> Response:
        """Operator: write ABORT for an undecided transaction whose writer is gone
        (a decided one keeps its decision)."""
        key = key_of(sink, lineage, checkpoint, attempt)
        log.warning("admin abort", extra={"txn": list(key), "reason": body.reason})
        ev = p.AdminAbort(reason=body.reason, now=st.clock())
        return txn_json(st.apply(key, [ev]))

    @app.post("/v1/admin/tick", tags=["admin"])
    def admin_tick() -> dict[str, int]:
        """Run one background round now (deadlines, alerts, retention)."""
        if bg is None:
            return {"expired": 0, "alerts": 0, "purged": 0}
        return bg.tick()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}
            }
            schema["security"] = [{"bearer": []}]
            for path in OPEN_PATHS:
                for op in schema.get("paths", {}).get(path, {}).values():
                    op["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(_Guard, token=token, max_body=max_body)
    return app


# ---------------------------------------------------------------------------------------
# logs


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    _STD: Final = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._STD:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("twophase")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


# ---------------------------------------------------------------------------------------
# embedded


class EmbeddedServer:
    """The service inside this process, on a free port, in a daemon thread."""

    def __init__(
        self,
        store_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        advertise_host: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.store_url = store_url
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(24)
        self.advertise_host = advertise_host
        self.settings = settings
        self.store: Store | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::", ""):  # noqa: S104 - a bind-all needs a reachable name
            host = socket.getfqdn()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EmbeddedServer:
        import uvicorn

        self.store = Store(self.store_url)
        app = create_app(self.store, self.token, settings=self.settings)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only
        # then, and without it Nagle + delayed ACK add ~40 ms to every response.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=75)
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="twophase-coordinator",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"embedded coordinator on {self.host} did not start")
            time.sleep(0.005)
        log.info("embedded coordinator", extra={"url": self.url, "store": self.store.safe_url})
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None
        if self.store is not None:
            self.store.close()
            self.store = None
        self._server = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
