"""The coordinator's HTTP/JSON service (FastAPI), for the daemon and the embedded server.

The service only translates: it validates a request (:mod:`~twophase.coordinator.models`),
stamps the event with the store's clock, hands it to :class:`~twophase.coordinator.store.
Store` (which runs the pure state machine under compare-and-set) and encodes the answer
with :mod:`twophase.client.wire`, whose TypedDicts are also the documented response schemas. The
API is described in ``docs/coordinator-api.md`` and served as OpenAPI at ``/openapi.json``.

Routes come in groups, each built by one function below: ops (health, metrics), sinks
(register, begin), transactions (votes, acks, abandon, long-poll, reads) and admin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from twophase import __version__
from twophase import protocol as p
from twophase.client import wire
from twophase.coordinator.apidoc import docs_page, openapi_with_roles
from twophase.coordinator.background import Background, Settings
from twophase.coordinator.guard import MAX_BODY, Guard
from twophase.coordinator.hotpath import HotPath, HotRoutes
from twophase.coordinator.hub import DecisionHub
from twophase.coordinator.metrics import Metrics
from twophase.coordinator.models import (
    ERRORS,
    AbandonIn,
    AbortIn,
    AcksIn,
    Attempt,
    BeginIn,
    BranchMetricsIn,
    Checkpoint,
    ForceAckIn,
    Lineage,
    RegisterIn,
    ResolveIn,
    SinkName,
    VotesIn,
)
from twophase.coordinator.roles import TokenSet
from twophase.coordinator.store import Store
from twophase.coordinator.ui import StoreDecisions, ui_routes
from twophase.errors import (
    InvalidRequest,
    ParticipantError,
    StoreError,
    TransactionNotFound,
    TwophaseError,
)
from twophase.extras import missing_extra
from twophase.grants import Grants
from twophase.names import NAME_PATTERN
from twophase.protocol import TxnKey

__all__ = ["create_app"]

log = logging.getLogger("twophase.coordinator.app")

TXN_PATH = "/v1/txns/{sink}/{lineage}/{checkpoint}/{attempt}"
ADMIN_TXN_PATH = "/v1/admin/txns/{sink}/{lineage}/{checkpoint}/{attempt}"


@dataclass(frozen=True)
class _Service:
    """What the routes share."""

    store: Store
    hub: DecisionHub
    metrics: Metrics
    background: Background | None
    poll: float  # long-poll re-read interval: catches changes made by other replicas


def create_app(
    store: Store | str,
    token: str | None,
    *,
    insecure: bool = False,
    settings: Settings | None = None,
    background: bool = True,
    poll_interval: float | None = None,
    max_body: int = MAX_BODY,
    hot_path: bool = True,
    tokens: TokenSet | None = None,
) -> FastAPI:
    """Build the service around ``store`` (a :class:`Store` or a store URL).

    ``token`` is an operator token; ``tokens`` the full set with roles (a token file,
    several per role; ``token`` is ignored then). A token is required unless
    ``insecure`` is set explicitly. ``hot_path=False`` sends the per-batch endpoints
    through FastAPI's routing too (same answers, more CPU; for the benchmark's
    comparison).
    """
    if tokens is None:
        tokens = TokenSet(token)
    if not tokens.enabled and not insecure:
        raise InvalidRequest("a bearer token is required (or pass insecure=True explicitly)")
    st = Store(store) if isinstance(store, str) else store
    svc = _Service(
        store=st,
        hub=DecisionHub(),
        metrics=Metrics(st),
        background=Background(st, settings) if background else None,
        poll=poll_interval if poll_interval is not None else (1.0 if st.is_sqlite else 0.1),
    )
    st.on_change = _observer(svc, st.on_change)
    if svc.background is not None:
        svc.metrics.watch(svc.background.targets)

    app = FastAPI(
        title="twophase coordinator",
        version=__version__,
        description="Durable 2PC decision log. See docs/coordinator-api.md.",
        lifespan=_lifespan(svc, auth=tokens.enabled),
        # Swagger UI and ReDoc load their scripts from a CDN (blank offline): /docs is a
        # self-contained page instead (docs/decisions.md, issue 10).
        docs_url=None,
        redoc_url=None,
    )
    for name, value in (("store", st), ("hub", svc.hub), ("metrics", svc.metrics),
                        ("background", svc.background)):
        setattr(app.state, name, value)
    _error_handlers(app, svc.metrics)
    hot = _hot_routes(svc)
    app.include_router(_ops_routes(svc))
    app.include_router(_sink_routes(svc, hot))
    app.include_router(_txn_routes(svc, hot))
    app.include_router(_admin_routes(svc))
    app.include_router(ui_routes(svc.store, svc.metrics))
    app.openapi = openapi_with_roles(app)  # type: ignore[method-assign]
    if hot_path:
        # inside the guard: the token and the body limit apply to it as to every route
        app.add_middleware(HotPath, routes=hot)
    app.add_middleware(Guard, tokens=tokens, max_body=max_body)
    return app


def _observer(
    svc: _Service, previous: Callable[[p.Transaction | None, p.Transaction], None] | None
) -> Callable[[p.Transaction | None, p.Transaction], None]:
    """The store's ``on_change``: count the change, wake its long-polls (keeping any
    observer the store already had)."""

    def on_change(before: p.Transaction | None, after: p.Transaction) -> None:
        if previous is not None:
            previous(before, after)
        svc.metrics.observe(before, after)
        svc.hub.publish(after)

    return on_change


def _lifespan(svc: _Service, *, auth: bool) -> Callable[[FastAPI], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        import anyio.to_thread

        # sync routes and store reads run in worker threads; long-polls hold none
        anyio.to_thread.current_default_thread_limiter().total_tokens = 128
        if svc.background is not None:
            svc.background.start()
        log.info("coordinator started", extra={"store": svc.store.safe_url, "auth": auth})
        try:
            yield
        finally:
            if svc.background is not None:
                svc.background.stop()

    return lifespan


# ---------------------------------------------------------------------------------------
# answers and refusals


def _json(obj: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, separators=(",", ":")), status_code=status,
        media_type="application/json",
    )


def _error(status: int, code: str, message: str) -> Response:
    return _json(wire.error_body(code, message), status)


def _txn_json(txn: p.Transaction, *, brief: bool = False,
              only: list[str] | None = None) -> Response:
    return _json(wire.encode_txn(txn, brief=brief, only=only))


def _describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return 400, "malformed_json", f"request body is not valid JSON: {ctx.get('error', '')}"
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}")
    return 422, "invalid_request", "; ".join(parts) or "invalid request"


def _refusals(metrics: Metrics) -> dict[type[Exception], Callable[[Any], Response]]:
    """What a handler's exception is answered with, by exception class (the app's
    exception handlers and the hot path use this one table)."""

    def twophase_error(exc: TwophaseError) -> Response:
        # every refusal maps itself: its class names the code and the status
        metrics.requests.labels(exc.code).inc()
        if isinstance(exc, StoreError):
            log.error("store error", extra={"error": str(exc)})
        return _error(exc.http_status, exc.code, str(exc))

    def store_down(exc: DBAPIError) -> Response:
        # the store is unreachable or failing (not a bad request): 503, which clients
        # retry; the daemon reconnects by itself once the database is back
        metrics.requests.labels(StoreError.code).inc()
        why = str(exc.orig if exc.orig is not None else exc).strip().splitlines()[0]
        log.error("store error", extra={"error": why})
        return _error(503, StoreError.code, f"the coordinator's store is unreachable or "
                      f"failing: {why}; retry later (check the database behind --store)")

    def value_error(exc: ValueError) -> Response:
        metrics.requests.labels("invalid_request").inc()
        return _error(422, "invalid_request", str(exc))

    return {TwophaseError: twophase_error, DBAPIError: store_down, ValueError: value_error}


def _refusal(table: dict[type[Exception], Callable[[Any], Response]]
             ) -> Callable[[Exception], Response | None]:
    """The answer for ``exc`` from ``table``, looked up along its class's MRO as
    Starlette looks up exception handlers; None when no entry applies."""

    def refusal(exc: Exception) -> Response | None:
        for cls in type(exc).__mro__:
            handler = table.get(cls)
            if handler is not None:
                return handler(exc)
        return None

    return refusal


def _error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every refusal in one layout (``wire.ErrorOut``), counted by code."""
    for cls, answer in _refusals(metrics).items():
        app.add_exception_handler(cls, _as_handler(answer))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> Response:
        status, code, msg = _describe_validation(exc)
        metrics.requests.labels(code).inc()
        return _error(status, code, msg)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))


def _as_handler(answer: Callable[[Any], Response]) -> Callable[[Request, Any], Any]:
    async def handler(_r: Request, exc: Any) -> Response:
        return answer(exc)

    return handler


# ---------------------------------------------------------------------------------------
# the per-batch handlers: called by the FastAPI routes and by the hot path (hotpath.py)


def _hot_routes(svc: _Service) -> HotRoutes:
    st, hub = svc.store, svc.hub

    def observe(txn: p.Transaction, sent: list[tuple[str, BranchMetricsIn | None]]) -> None:
        """The executors' figures, once the change was accepted, for known branches only
        (so the metrics' labels stay the sink's own participants)."""
        for branch, m in sent:
            if m is not None and branch in txn.branches:
                svc.metrics.branch(txn.key, branch, m.model_dump())

    async def begin(sink: str, body: BeginIn) -> Response:
        res = await st.begin_async(
            p.Begin(
                sink=sink, lineage=body.lineage, batch_id=body.checkpoint, epoch=body.epoch,
                participants=tuple(body.participants), partitions=body.partitions,
                now=st.clock(), vote_timeout=body.vote_timeout,
            )
        )
        return _json(wire.encode_begin(res))

    async def votes(key: TxnKey, body: VotesIn) -> Response:
        now = st.clock()
        events: list[p.Event] = [
            p.Vote(branch=v.branch, epoch=body.epoch, yes=v.yes, now=now, handle=v.handle,
                   reason=v.reason, digest=v.digest, task=v.task)
            for v in body.votes
        ]
        txn = await st.apply_async(key, events)
        observe(txn, [(v.branch, v.metrics) for v in body.votes])
        return _txn_json(txn, brief=body.brief,
                         only=[v.branch for v in body.votes] if body.touched else None)

    async def acks(key: TxnKey, body: AcksIn) -> Response:
        now = st.clock()
        events: list[p.Event] = [
            p.Ack(branch=a.branch, epoch=body.epoch, outcome=p.Decision(a.outcome), now=now)
            for a in body.acks
        ]
        txn = await st.apply_async(key, events)
        observe(txn, [(a.branch, a.metrics) for a in body.acks])
        return _txn_json(txn, brief=body.brief,
                         only=[a.branch for a in body.acks] if body.touched else None)

    async def decision(key: TxnKey, timeout: float,
                       until: Literal["decided", "finished"], brief: bool = False) -> Response:
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
                    return _txn_json(txn, brief=brief)
                with contextlib.suppress(asyncio.TimeoutError):
                    woke = await asyncio.wait_for(fut, min(left, svc.poll))
                    if done(woke):
                        return _txn_json(woke, brief=brief)
            finally:
                hub.unsubscribe(key, fut)

    return HotRoutes(begin=begin, votes=votes, acks=acks, decision=decision,
                     refusal=_refusal(_refusals(svc.metrics)))


# ---------------------------------------------------------------------------------------
# route groups


def _ops_routes(svc: _Service) -> APIRouter:
    """Probes and scrapers; open without a token (guard.OPEN_PATHS)."""
    r = APIRouter(tags=["ops"])

    @r.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness and store reachability (no token needed)."""
        svc.store.sink("__healthz__")
        return {"status": "ok", "version": __version__}

    @r.get("/docs", response_class=Response, include_in_schema=False)
    def docs(request: Request) -> Response:
        """Every route, in one page that loads nothing from elsewhere (works offline)."""
        return Response(docs_page(request.app), media_type="text/html; charset=utf-8")

    @r.get("/metrics", response_class=Response)
    def prometheus() -> Response:
        """Prometheus text format (no token needed)."""
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")

    return r


def _sink_routes(svc: _Service, hot: HotRoutes) -> APIRouter:
    """What a driver does once per run (register) and once per batch (begin)."""
    r = APIRouter(tags=["sinks"])
    st = svc.store

    @r.post("/v1/sinks/{sink}/register", response_model=wire.SinkOut, responses=ERRORS)
    async def register(sink: SinkName, body: RegisterIn | None = None) -> Response:
        """A writer (driver) starts: returns the sink's next epoch, fencing older writers.
        The optional body records the participants' descriptors (for ``twophase
        resolve``); without it the recorded ones are kept."""
        descriptors = None
        if body is not None:
            descriptors = [d.model_dump() for d in body.participants]
            names = [d["name"] for d in descriptors]
            if len(set(names)) != len(names):
                raise InvalidRequest(f"participant names must be unique, got {names}")
        return _json(wire.encode_sink(await st.register_async(sink, descriptors)))

    @r.get("/v1/sinks", response_model=wire.SinkListOut, responses=ERRORS)
    def list_sinks() -> Response:
        """Every sink: last committed batch, in-doubt count and age, alerts."""
        out: wire.SinkListOut = {"sinks": st.sinks_overview()}  # type: ignore[typeddict-item]
        return _json(out)

    @r.get("/v1/sinks/{sink}/participants", response_model=wire.ParticipantsOut,
           responses=ERRORS)
    def participants(sink: SinkName) -> Response:
        """The participant descriptors recorded at the sink's last register (no secrets)."""
        if st.sink(sink) is None:
            return _error(404, "not_found", f"no sink {sink!r}")
        return _json({"sink": sink, "participants": st.participants(sink)})

    @r.get("/v1/sinks/{sink}/committing", response_model=wire.TxnListOut, responses=ERRORS)
    def committing(sink: SinkName) -> Response:
        """The sink's COMMIT-decided transactions not yet finished (newest first, up to
        10,000): what its starting writer must not abort. A data route: a sink's own
        start-up cleanup reads it with the jobs' token."""
        rows = st.list(sink=sink, state=p.State.COMMITTING.value, limit=10_000)
        out: wire.TxnListOut = {"txns": [{**wire.encode_txn(r.txn), "alert": r.alert}
                                         for r in rows]}
        return _json(out)

    @r.get("/v1/sinks/{sink}", response_model=wire.SinkOut, responses=ERRORS)
    def get_sink(sink: SinkName) -> Response:
        rec = st.sink(sink)
        if rec is None:
            return _error(404, "not_found", f"no sink {sink!r}")
        return _json(wire.encode_sink(rec))

    @r.post("/v1/sinks/{sink}/begin", response_model=wire.BeginOut, responses=ERRORS)
    async def begin(sink: SinkName, body: BeginIn) -> Response:
        """Start (or find) the attempt for a checkpoint; see protocol.begin."""
        return await hot.begin(sink, body)

    return r


def _txn_routes(svc: _Service, hot: HotRoutes) -> APIRouter:
    """One transaction's life: votes, the decision (long-poll), acks; and reads."""
    r = APIRouter(tags=["txns"])
    st = svc.store

    @r.post(TXN_PATH + "/votes", response_model=wire.TxnOut, responses=ERRORS)
    async def vote(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                   body: VotesIn) -> Response:
        """Record one or more branch votes; the answer shows the decision if it was made."""
        return await hot.votes(TxnKey(sink, lineage, checkpoint, attempt), body)

    @r.post(TXN_PATH + "/acks", response_model=wire.TxnOut, responses=ERRORS)
    async def ack(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                  body: AcksIn) -> Response:
        """Branches confirm they applied the decision."""
        return await hot.acks(TxnKey(sink, lineage, checkpoint, attempt), body)

    @r.post(TXN_PATH + "/abandon", response_model=wire.TxnOut, responses=ERRORS)
    def abandon(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                body: AbandonIn) -> Response:
        """The writer gives up on an undecided attempt: ABORT. A decided attempt is
        answered unchanged (the last vote won the race: the writer finishes the commit)."""
        ev = p.Abandon(epoch=body.epoch, reason=body.reason, now=st.clock())
        return _txn_json(st.apply(TxnKey(sink, lineage, checkpoint, attempt), [ev]))

    @r.get(TXN_PATH + "/decision", response_model=wire.TxnOut, responses=ERRORS)
    async def decision(
        sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
        timeout: Annotated[float, Query(ge=0, le=60)] = 25.0,
        until: Annotated[Literal["decided", "finished"], Query()] = "decided",
        brief: Annotated[bool, Query()] = False,
    ) -> Response:
        """Long-poll: answers as soon as the transaction is decided (or finished, with
        ``until=finished``), or after ``timeout`` seconds with the undecided transaction
        (``brief=true``: without its branches, state and decision only)."""
        return await hot.decision(TxnKey(sink, lineage, checkpoint, attempt), timeout, until,
                                  brief)

    @r.get(TXN_PATH, response_model=wire.TxnOut, responses=ERRORS)
    def get_txn(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                history: bool = False) -> Response:
        """One transaction with its branches; ``history=true`` adds the event history."""
        key = TxnKey(sink, lineage, checkpoint, attempt)
        txn = st.get(key)
        if txn is None:
            raise TransactionNotFound.for_key(key)
        out: dict[str, Any] = {**wire.encode_txn(txn)}
        if history:
            out["history"] = st.history(key)
        return _json(out)

    @r.get("/v1/txns", response_model=wire.TxnListOut, responses=ERRORS)
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
        out: wire.TxnListOut = {
            "txns": [{**wire.encode_txn(r.txn), "alert": r.alert} for r in rows]
        }
        return _json(out)

    return r


def _admin_routes(svc: _Service) -> APIRouter:
    """Operators: settle a branch or abort an orphan by hand, run a background round."""
    r = APIRouter(tags=["admin"])
    st, bg = svc.store, svc.background
    grants = Grants(bg.settings.secret_grants if bg is not None else None)

    @r.post(ADMIN_TXN_PATH + "/force-ack", response_model=wire.TxnOut, responses=ERRORS)
    def force_ack(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint, attempt: Attempt,
                  body: ForceAckIn) -> Response:
        """Operator: a branch is settled by hand (no epoch check)."""
        key = TxnKey(sink, lineage, checkpoint, attempt)
        log.warning("force-ack", extra={"txn": list(key), "branch": body.branch,
                                        "outcome": body.outcome, "reason": body.reason})
        return _txn_json(st.force(key, body.branch, p.Decision(body.outcome), body.reason))

    @r.post(ADMIN_TXN_PATH + "/abort", response_model=wire.TxnOut, responses=ERRORS)
    def admin_abort(sink: SinkName, lineage: Lineage, checkpoint: Checkpoint,
                    attempt: Attempt, body: AbortIn) -> Response:
        """Operator: write ABORT for an undecided transaction whose writer is gone
        (a decided one keeps its decision)."""
        key = TxnKey(sink, lineage, checkpoint, attempt)
        log.warning("admin abort", extra={"txn": list(key), "reason": body.reason})
        ev = p.AdminAbort(reason=body.reason, now=st.clock())
        return _txn_json(st.apply(key, [ev]))

    @r.post("/v1/admin/sinks/{sink}/resolve", responses=ERRORS)
    def admin_resolve(sink: SinkName, body: ResolveIn) -> Response:
        """Settle the sink's leftovers here, with participants rebuilt from the recorded
        descriptors (secrets from this process's environment); see ``twophase resolve``."""
        from twophase.engine.resolve import participants_from, resolve_sink

        try:
            parts = participants_from(st.participants(sink), sink=sink, grants=grants)
        except ImportError as exc:
            hint = missing_extra(exc) or f"pip install 'twophase[all]' ({exc.name} missing)"
            return _error(422, "invalid_request", f"resolving sink {sink!r} here: {hint} "
                          "in the coordinator's environment, or run twophase resolve "
                          "elsewhere")
        log.warning("admin resolve", extra={"sink": sink, "dry_run": body.dry_run})
        try:
            report = resolve_sink(StoreDecisions(st), sink, parts, dry_run=body.dry_run)
        except ParticipantError as exc:
            # a target that fails is not the coordinator's fault: 502, never 500
            return _error(502, exc.code, f"resolving sink {sink!r}: {exc}")
        finally:
            for part in parts:
                part.close()
        return _json(report.as_dict())

    @r.post("/v1/admin/tick")
    def admin_tick() -> dict[str, int]:
        """Run one background round now (deadlines, alerts, retention)."""
        if bg is None:
            return {"expired": 0, "alerts": 0, "purged": 0}
        return bg.tick()

    return r
