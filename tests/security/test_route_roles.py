"""The route x role table of docs/user/security.md is generated from the guard's own
table (``coordinator/roles.py``'s ``ROUTE_ROLES``: the doc cannot drift from it), and a
running daemon answers each route as the table says for each actor: an operator, a job's
data token on its own sink and on another job's, and no token."""

from __future__ import annotations

from pathlib import Path

from tests.security.conftest import EVIL, OPERATOR, ORDERS, Daemon
from twophase.coordinator.roles import ROUTE_ROLES

DOC = Path(__file__).parents[2] / "docs" / "user" / "security.md"
ACTORS = ("operator", "data, own sink", "data, other sink", "no token")
_ALLOWED = {"open": (True, True, True, True), "data": (True, True, False, False),
            "operator": (True, False, False, False)}


def table() -> str:
    """The markdown table, one row per route of the guard's table."""
    rows = ["| route | " + " | ".join(ACTORS) + " |", "|---|" + "---|" * len(ACTORS)]
    for (method, path), role in sorted(ROUTE_ROLES.items(), key=lambda x: (x[0][1], x[0][0])):
        cells = ["allowed" if ok else "refused" for ok in _ALLOWED[role]]
        rows.append(f"| `{method} {path}` | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def test_the_documented_table_is_generated_from_the_guard() -> None:
    assert table() in DOC.read_text(), "regenerate the table: python -c 'from " \
        "tests.security.test_route_roles import table; print(table())'"


def test_the_running_daemon_answers_as_the_table_says(daemon: Daemon) -> None:
    assert daemon.call("POST", "/v1/sinks/orders/register", ORDERS).status_code == 200
    tokens = (OPERATOR, ORDERS, EVIL, None)
    bodies = {"/resolve": {"dry_run": True}}
    wrong = []
    for (method, route), role in ROUTE_ROLES.items():
        path = (route.replace("{sink}", "orders").replace("{lineage}", "lin")
                .replace("{checkpoint}", "0").replace("{attempt}", "1"))
        if path.endswith("/decision"):
            path += "?timeout=0"
        body = next((b for end, b in bodies.items() if path.endswith(end)), {})
        for actor, token, allowed in zip(ACTORS, tokens, _ALLOWED[role], strict=True):
            r = daemon.call(method, path, token, json=body if method == "POST" else None)
            assert r.status_code < 500, (method, path, actor, r.text)
            if (r.status_code not in (401, 403)) != allowed:
                wrong.append(f"{method} {path} as {actor}: {r.status_code}")
    assert not wrong, wrong
