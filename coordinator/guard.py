"""Bearer token, its role and body size, checked before any routing or parsing.

A pure ASGI middleware, so that an unauthenticated, unauthorized or oversized request
costs no JSON parsing and no validation. A body without Content-Length is counted as it
arrives. Which role a route needs is :mod:`twophase.coordinator.roles`' table.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from twophase.client import wire
from twophase.coordinator.roles import OPEN_PATHS, TokenSet, role_for, sink_of
from twophase.errors import TwophaseError

__all__ = ["MAX_BODY", "OPEN_PATHS", "Guard"]

MAX_BODY: Final = 1 << 20  # 1 MiB

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Guard:
    """Refuses a request without a known bearer token (401), with a data token on an
    operator route or on a sink outside its scope (403), or with a body larger than
    ``max_body`` (413), answering in the service's error layout."""

    def __init__(self, app: ASGIApp, tokens: TokenSet, max_body: int) -> None:
        self.app = app
        self.tokens = tokens if tokens.enabled else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.tokens is not None and scope["path"] not in OPEN_PATHS:
            refusal = self._refusal(scope["method"], scope["path"],
                                    headers.get(b"authorization", b""))
            if refusal is not None:
                await _send_error(send, *refusal)
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

    def _refusal(self, method: str, path: str, got: bytes) -> tuple[int, str, str] | None:
        """(status, code, message) when the token may not make this call, else None."""
        assert self.tokens is not None
        if not got:
            return 401, "unauthorized", (
                "missing bearer token: send 'Authorization: Bearer <token>' (jobs: a data "
                "token, operators: an operator token, from the daemon's --token-file or "
                "--token; docs/coordinator-api.md, Security)")
        grant = self.tokens.grant_of(got)
        if grant is None:
            return 401, "unauthorized", (
                "unknown bearer token: it is not among the daemon's tokens (mistyped, or "
                "rotated out of its --token-file); send a current token: jobs a 'data' "
                "line, operators an 'operator' line of that file, or the daemon's --token")
        if grant.role != "data":
            return None
        if role_for(method, path) != "data":
            return 403, "forbidden", (
                f"{method} {path} needs an operator token; this is a data token (for the "
                "jobs' begin, votes, acks and decisions only): send an operator token (an "
                "'operator' line of the daemon's --token-file, or its --token)")
        sink = sink_of(path)
        if not grant.allows(sink):
            return 403, "forbidden", (
                f"{method} {path} acts on sink {sink!r}; this data token is scoped to sinks "
                f"{' '.join(grant.sinks)} (its line in the daemon's --token-file): give "
                f"this job a data token whose line names {sink!r}, or add {sink!r} to "
                "this token's line")
        return None


class _TooLarge(TwophaseError):
    pass


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps(wire.error_body(code, message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    elif status == 403:
        headers.append((b"www-authenticate", b'Bearer error="insufficient_scope"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
