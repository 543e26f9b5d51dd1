"""Bearer token and body size, checked before any routing or parsing.

A pure ASGI middleware, so that an unauthenticated or oversized request costs no JSON
parsing and no validation. A body without Content-Length is counted as it arrives.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from twophase import wire
from twophase.errors import TwophaseError

__all__ = ["MAX_BODY", "OPEN_PATHS", "Guard"]

MAX_BODY: Final = 1 << 20  # 1 MiB
# reachable without a token: probes, scrapers and the API's own description
# and the console's sign-in page (/ui: no data in it; /ui/view and every action need it)
OPEN_PATHS: Final = frozenset({"/healthz", "/metrics", "/openapi.json", "/docs",
                               "/ui"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Guard:
    """Refuses a request without the expected bearer token (401) or with a body larger
    than ``max_body`` (413), answering in the service's error layout."""

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


class _TooLarge(TwophaseError):
    pass


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps(wire.error_body(code, message)).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")],
    })
    await send({"type": "http.response.body", "body": body})
