"""The four per-batch endpoints (begin, votes, long-poll, acks) without FastAPI's routing.

FastAPI's per-request machinery (route matching over every route, dependency solving,
parameter extraction, its middleware layers) cost more daemon CPU than the store's writer
(docs/coordinator-api.md, Performance). This ASGI middleware answers a well-formed hot
request itself: it matches the four paths, validates the path, query and body with the
same pydantic constraints as the FastAPI routes, and calls the same handler. Anything it
does not recognise exactly -- another route or method, a content type other than
``application/json``, unparsable JSON, any validation failure, an unexpected query
parameter -- goes to the FastAPI app unchanged (the buffered body is replayed), so every
refusal keeps the FastAPI routes' status code and message, and the OpenAPI document still
describes these routes. A refusal raised by the handler itself (a protocol or store
error) is answered by the same mapping as the app's exception handlers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import Field, StringConstraints, TypeAdapter
from starlette.responses import Response

from twophase.client.wire import MAX_INT
from twophase.coordinator.models import AcksIn, BeginIn, VotesIn
from twophase.errors import TwophaseError
from twophase.names import LINEAGE_PATTERN, NAME_PATTERN
from twophase.protocol import TxnKey

__all__ = ["HotPath", "HotRoutes"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# the same constraints as models.SinkName / Lineage / Checkpoint / Attempt and the
# decision route's query parameters
_SINK: Final = TypeAdapter(Annotated[str, StringConstraints(pattern=NAME_PATTERN)])
_LINEAGE: Final = TypeAdapter(Annotated[str, StringConstraints(pattern=LINEAGE_PATTERN)])
_CHECKPOINT: Final = TypeAdapter(Annotated[int, Field(ge=0, le=MAX_INT)])
_ATTEMPT: Final = TypeAdapter(Annotated[int, Field(ge=1, le=MAX_INT)])
_TIMEOUT: Final = TypeAdapter(Annotated[float, Field(ge=0, le=60)])
_UNTIL: Final = ("decided", "finished")
_JSON: Final = b"application/json"


@dataclass(frozen=True)
class HotRoutes:
    """The handlers the FastAPI routes call too (one copy of each)."""

    begin: Callable[[str, BeginIn], Awaitable[Response]]
    votes: Callable[[TxnKey, VotesIn], Awaitable[Response]]
    acks: Callable[[TxnKey, AcksIn], Awaitable[Response]]
    decision: Callable[[TxnKey, float, Literal["decided", "finished"], bool],
                       Awaitable[Response]]
    # the app's exception handlers' mapping: a refusal's answer, or None to re-raise
    refusal: Callable[[Exception], Response | None]


class _NotHot(TwophaseError):
    """Internal: the request is not one this path answers: hand it to the app (never
    leaves this module; a TwophaseError like every exception twophase defines)."""


class HotPath:
    """Answers valid begin / votes / acks / decision requests; passes on everything else."""

    def __init__(self, app: ASGIApp, routes: HotRoutes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if scope.get("root_path") or not path.startswith(("/v1/txns/", "/v1/sinks/")):
            await self.app(scope, receive, send)
            return
        parts = path.split("/")
        method: str = scope["method"]
        n = len(parts)
        if method == "GET" and n == 8 and parts[7] == "decision" and parts[2] == "txns":
            try:
                key = _key(parts)
                timeout, until, brief = _decision_query(scope.get("query_string", b""))
            except Exception:  # any doubt: the app answers as it would
                await self.app(scope, receive, send)
                return
            await self._answer(self.routes.decision(key, timeout, until, brief), scope,
                               receive, send)
            return
        if method != "POST" or not (
            (n == 8 and parts[2] == "txns" and parts[7] in ("votes", "acks"))
            or (n == 5 and parts[2] == "sinks" and parts[4] == "begin")
        ):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client is gone before its request arrived
            return
        try:
            if not _is_json(scope):
                raise _NotHot
            doc = json.loads(body)
            if n == 5:
                sink = _canonical_str(_SINK, parts[3])
                call = self.routes.begin(sink, BeginIn.model_validate(doc))
            elif parts[7] == "votes":
                call = self.routes.votes(_key(parts), VotesIn.model_validate(doc))
            else:
                call = self.routes.acks(_key(parts), AcksIn.model_validate(doc))
        except Exception:  # not only ValueErrors: json.loads raises
            # RecursionError on deep nesting, which FastAPI answers with a 400
            await self.app(scope, _replay(body, receive), send)
            return
        await self._answer(call, scope, receive, send)

    async def _answer(self, call: Awaitable[Response], scope: Scope, receive: Receive,
                      send: Send) -> None:
        try:
            response = await call
        except Exception as exc:
            refused = self.routes.refusal(exc)
            if refused is None:
                raise
            response = refused
        await response(scope, receive, send)


def _key(parts: list[str]) -> TxnKey:
    return TxnKey(_canonical_str(_SINK, parts[3]), _canonical_str(_LINEAGE, parts[4]),
                  _canonical_int(_CHECKPOINT, parts[5]), _canonical_int(_ATTEMPT, parts[6]))


def _canonical_str(adapter: TypeAdapter[str], raw: str) -> str:
    return adapter.validate_python(raw)


def _canonical_int(adapter: TypeAdapter[int], raw: str) -> int:
    # plain decimal digits only: any other spelling the app may accept or refuse itself
    if not (raw.isascii() and raw.isdigit()) or (len(raw) > 1 and raw[0] == "0"):
        raise _NotHot
    return adapter.validate_python(raw)


def _decision_query(raw: bytes) -> tuple[float, Literal["decided", "finished"], bool]:
    """``timeout``, ``until`` and ``brief`` only, each at most once, in plain spelling
    (``brief``: ``true`` or ``false``)."""
    timeout, until, brief = 25.0, "decided", False
    seen: set[bytes] = set()
    for item in raw.split(b"&") if raw else ():
        name, eq, value = item.partition(b"=")
        if not eq or name in seen:
            raise _NotHot
        seen.add(name)
        text = value.decode("ascii", "replace")
        if name == b"timeout":
            whole, _dot, frac = text.partition(".")
            if not (whole.isascii() and whole.isdigit() and (not frac or
                                                            (frac.isascii() and frac.isdigit()))):
                raise _NotHot
            timeout = _TIMEOUT.validate_python(text)
        elif name == b"until" and text in _UNTIL:
            until = text
        elif name == b"brief" and text in ("true", "false"):
            brief = text == "true"
        else:
            raise _NotHot
    return timeout, "decided" if until == "decided" else "finished", brief


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value == _JSON)
    return False


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the connection's own messages (a disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again

