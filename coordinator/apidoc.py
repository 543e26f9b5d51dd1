"""The daemon's description of itself: the OpenAPI document, with bearer security and
the role each call needs (``x-twophase-role``, from :data:`.roles.ROUTE_ROLES`), and the
plain ``/docs`` page that lists every route without loading anything from the internet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from twophase.coordinator.guard import OPEN_PATHS
from twophase.coordinator.roles import role_for

__all__ = ["docs_page", "openapi_with_roles"]


def docs_page(app: FastAPI) -> str:
    """The API's routes from its own OpenAPI document, as plain HTML (no scripts)."""
    from html import escape

    rows = []
    for path, ops in sorted(app.openapi().get("paths", {}).items()):
        for method, op in ops.items():
            rows.append(f"<tr><td><code>{escape(method.upper())}</code></td>"
                        f"<td><code>{escape(path)}</code></td>"
                        f"<td>{escape(str(op.get('summary', '')))}</td></tr>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>twophase coordinator API"
        "</title></head><body><h1>twophase coordinator API</h1>"
        "<p>The full description is the OpenAPI document at "
        "<a href='/openapi.json'>/openapi.json</a> (load it into any OpenAPI viewer); "
        "the reference is docs/coordinator-api.md. Calls other than /healthz, /metrics, "
        "/openapi.json and /docs need <code>Authorization: Bearer TOKEN</code>: a data "
        "token for the jobs' per-batch calls, an operator token for everything else "
        "(each operation's <code>x-twophase-role</code>).</p>"
        "<table border='1' cellpadding='4'><tr><th>method</th><th>path</th><th>what</th>"
        "</tr>" + "".join(rows) + "</table></body></html>"
    )


def openapi_with_roles(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The generated document plus bearer security (none on the open paths)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}
            }
            schema["security"] = [{"bearer": []}]
            for path, ops in schema.get("paths", {}).items():
                for method, op in ops.items():
                    # the role each call needs (roles.ROUTE_ROLES; docs/coordinator-api.md)
                    op["x-twophase-role"] = role_for(method.upper(), path)
            for path in OPEN_PATHS:
                for op in schema.get("paths", {}).get(path, {}).values():
                    op["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
