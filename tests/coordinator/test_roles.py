"""Least privilege against a real ``twophase serve`` process: the jobs' data token is
refused on every operator route (exact status and message), an operator token is not,
and tokens rotate through the daemon's token file while the daemon and a client run."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn, votes_body
from twophase.coordinator.app import create_app
from twophase.coordinator.roles import ROUTE_ROLES, TokenSet, role_for
from twophase.errors import CoordinatorError, InvalidRequest
from twophase.protocol import Decision, State, TxnKey
from twophase.testing.servers import LocalDaemon

SINK = "orders"
KEY = TxnKey(SINK, "L-roles", 0, 1)
TXN = "/v1/txns/orders/L-roles/0/1"
ADMIN = "/v1/admin/txns/orders/L-roles/0/1"


def _tok() -> str:
    return secrets.token_urlsafe(18)


def _routes(routes: list[Any]) -> Iterator[tuple[str, str]]:
    """Every (method, path) the app serves, through included routers."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        if inner is not None:
            yield from _routes(inner.routes)
            continue
        for m in sorted(getattr(r, "methods", None) or ()):
            if m != "HEAD":
                yield m, r.path


def test_every_route_of_the_app_has_a_role(tmp_path: Path) -> None:
    """A new route fails here until it is put in roles.ROUTE_ROLES (until then the guard
    lets only operators call it); a removed one must leave the table too."""
    app = create_app(f"sqlite:///{tmp_path / 'r.db'}", None, insecure=True, background=False)
    served = set(_routes(app.routes))
    assert len(served) >= 20
    assert served - set(ROUTE_ROLES) == set(), "routes without a role in ROUTE_ROLES"
    assert set(ROUTE_ROLES) - served == set(), "ROUTE_ROLES names routes the app lacks"
    assert role_for("POST", "/v1/admin/something-new") == "operator"  # default deny
    assert role_for("POST", TXN + "/votes") == "data"
    assert role_for("POST", ADMIN + "/force-ack") == "operator"
    ops = app.openapi()["paths"]
    assert ops["/v1/admin/tick"]["post"]["x-twophase-role"] == "operator"


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # as a secret manager swaps a file: never half written


@pytest.fixture
def roles_daemon(tmp_path: Path) -> Iterator[tuple[LocalDaemon, Path, str, str]]:
    """A daemon with a token file only: one data and one operator token."""
    data, operator = _tok(), _tok()
    tokens = tmp_path / "tokens"
    _write(tokens, f"# rotated by hand\ndata {data} *\noperator {operator}\n")
    d = LocalDaemon(f"sqlite:///{tmp_path / 'tp.db'}", None, tmp_path / "d.log",
                    token_file=str(tokens)).start()
    try:
        yield d, tokens, data, operator
    finally:
        d.stop()


FORBIDDEN = ("{m} {p} needs an operator token; this is a data token (for the jobs' begin, "
             "votes, acks and decisions only): send an operator token (an 'operator' line "
             "of the daemon's --token-file, or its --token)")


def test_the_data_token_is_refused_on_operator_routes(
    roles_daemon: tuple[LocalDaemon, Path, str, str]
) -> None:
    d, _f, data, operator = roles_daemon
    with CoordinatorClient(d.url, data, retry_budget=5) as job:
        epoch = job.register(SINK)  # the data path works with the data token
        job.begin(SINK, KEY.lineage, 0, epoch, ["pg"], 2, 60)
        job.vote(KEY, epoch, [VoteIn("pg/0", True, {})])
        assert job.get(KEY).state == State.PREPARING
        with pytest.raises(CoordinatorError) as err:
            job.force_ack(KEY, "pg/0", Decision.ABORT, "by a job")
        assert err.value.status == 403
    calls = [("POST", ADMIN + "/force-ack", {"branch": "pg/0", "outcome": "ABORT",
                                             "reason": "x"}),
             ("POST", ADMIN + "/abort", {"reason": "x"}),
             ("POST", f"/v1/admin/sinks/{SINK}/resolve", {"dry_run": True}),
             ("POST", "/v1/admin/tick", None),
             ("GET", "/ui/view", None), ("GET", "/v1/txns", None), ("GET", "/v1/sinks", None)]
    with httpx.Client(base_url=d.url, timeout=10) as http:
        for method, path, body in calls:
            r = http.request(method, path, json=body,
                             headers={"Authorization": f"Bearer {data}"})
            assert r.status_code == 403, (method, path, r.text)
            assert r.json() == {"error": "forbidden",
                                "message": FORBIDDEN.format(m=method, p=path)}
        r = http.post(ADMIN + "/abort", json={"reason": "x"},
                      headers={"Authorization": "Bearer not-a-token-of-this-daemon"})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        assert r.json()["message"].startswith("unknown bearer token")
        assert http.get(TXN, headers={"Authorization": f"Bearer {data}"}).json()[
            "state"] == "PREPARING"  # nothing the refused calls asked for happened
        # the operator token may do everything, the data path included
        op = {"Authorization": f"Bearer {operator}"}
        assert http.get("/ui/view", headers=op).status_code == 200
        r = http.post(ADMIN + "/abort", json={"reason": "writer gone"}, headers=op)
        assert r.status_code == 200 and r.json()["state"] == "ABORTING"
        assert http.get(TXN, headers=op).status_code == 200


def _refused(url: str, token: str, path: str = TXN) -> bool:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {token}"},
                     timeout=10).status_code == 401


def _until(what: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "the daemon did not re-read its token file"
        time.sleep(0.05)


def test_tokens_rotate_without_restarting_the_daemon_or_the_client(
    roles_daemon: tuple[LocalDaemon, Path, str, str], tmp_path: Path
) -> None:
    d, tokens, old, operator = roles_daemon
    pid = d.proc.pid if d.proc is not None else None
    mine = tmp_path / "job-token"
    _write(mine, old + "\n")
    with CoordinatorClient(d.url, token_file=str(mine), retry_budget=5) as job:
        epoch = job.register(SINK)
        job.begin(SINK, KEY.lineage, 0, epoch, ["pg"], 1, 60)
        new = _tok()
        # overlap: both accepted while the jobs move over
        _write(tokens, f"data {old} *\ndata {new} *\noperator {operator}\n")
        _write(mine, new + "\n")
        _until(lambda: not _refused(d.url, new))
        assert job.get(KEY).state == State.OPEN and job.token == old  # still the old one
        # the old token leaves the file: refused from now on; the client, refused once,
        # re-reads its own file and carries on with the new one
        _write(tokens, f"data {new} *\noperator {operator}\n")
        _until(lambda: _refused(d.url, old))
        job.vote(KEY, epoch, [VoteIn("pg/0", True, {})])
        assert job.token == new and job.get(KEY).state == State.COMMITTING
        r = httpx.get(d.url + TXN, headers={"Authorization": f"Bearer {old}"}, timeout=10)
        assert r.status_code == 401 and r.json()["message"].startswith("unknown bearer token")
        # a file that is malformed while being edited keeps the last good set
        _write(tokens, "data\n")
        time.sleep(1.3)  # past the daemon's once-a-second look at the file
        assert job.get(KEY).state == State.COMMITTING
        # operators rotate the same way
        op2 = _tok()
        _write(tokens, f"data {new} *\noperator {op2}\n")
        _until(lambda: _refused(d.url, operator, "/v1/sinks"))
        assert httpx.get(d.url + "/v1/sinks", timeout=10,
                         headers={"Authorization": f"Bearer {op2}"}).status_code == 200
    assert d.proc is not None and d.proc.pid == pid and d.proc.poll() is None


def test_token_files_are_checked_at_start(tmp_path: Path) -> None:
    """A token file the daemon cannot use is refused naming the line and the format."""
    bad = tmp_path / "tokens"
    bad.write_text(f"data {_tok()} *\nwriter {_tok()}\n")
    with pytest.raises(InvalidRequest, match=r"line 2: expected 'data <token>'"):
        TokenSet(None, str(bad))
    same = _tok()
    bad.write_text(f"data {same} *\noperator {same}\n")
    with pytest.raises(InvalidRequest, match="same token is listed as data and as operator"):
        TokenSet(None, str(bad))
    with pytest.raises(InvalidRequest, match="cannot read the token file"):
        TokenSet(None, str(tmp_path / "missing"))
    job = tmp_path / "job"
    job.write_text(f"data {_tok()}\n")
    with pytest.raises(InvalidRequest, match="is not a client's token file"):
        CoordinatorClient("http://127.0.0.1:1", token_file=str(job))


def test_the_documented_roles_are_the_guards() -> None:
    """docs/coordinator-api.md's endpoint table names each route's role as the guard
    decides it (the doc cannot drift from roles.ROUTE_ROLES)."""
    doc = (Path(__file__).parents[2] / "docs" / "coordinator-api.md").read_text()
    rows = [ln.split("|") for ln in doc.splitlines() if ln.startswith("| `")
            and ln.split("|")[2].strip() in ("open", "data", "operator")]
    assert len(rows) == len(ROUTE_ROLES)
    for row in rows:
        method, path = row[1].strip().strip("`").split(" ", 1)
        path = path.split("?")[0].replace("TXN", "/v1/txns/{sink}/{lineage}/{checkpoint}/"
                                          "{attempt}")
        assert ROUTE_ROLES[(method, path)] == row[2].strip(), (method, path)


def test_an_embedded_coordinator_ships_only_its_data_token(tmp_path: Path) -> None:
    """The tasks get the data token (what a Connection pickles to); the operator token
    stays in the driver, for the console and the operators' commands."""
    import pickle

    from twophase.client.connection import connect

    with connect(f"sqlite:///{tmp_path / 'e.db'}") as conn:
        assert conn.operator_token and conn.token and conn.operator_token != conn.token
        shipped = pickle.loads(pickle.dumps(conn))
        assert shipped.token == conn.token and shipped.operator_token is None
        assert conn.operator_token not in pickle.dumps(conn).decode("latin-1")
        job = shipped.client(retry_budget=5)
        epoch = job.register(SINK)
        job.begin(SINK, KEY.lineage, 0, epoch, ["pg"], 1, 60)
        with pytest.raises(CoordinatorError) as err:
            job.admin_abort(KEY, "a task may not")
        assert err.value.status == 403 and "needs an operator token" in str(err.value)
        assert conn.client(operator=True).admin_abort(KEY, "driver gone").decision \
            == Decision.ABORT
        shipped.close()


def test_a_data_token_scoped_to_a_sink_is_refused_on_another(tmp_path: Path) -> None:
    """A data line naming sinks (names or globs) lets its token act on those only: every
    data route of another sink is 403 naming the scope and the fix, and nothing happens;
    widening the line takes effect without a restart (the file is re-read)."""
    a, b, operator = _tok(), _tok(), _tok()
    tokens = tmp_path / "tokens"
    _write(tokens, f"data {a} orders\ndata {b} pay* refunds\noperator {operator}\n")
    d = LocalDaemon(f"sqlite:///{tmp_path / 'tp.db'}", None, tmp_path / "d.log",
                    token_file=str(tokens)).start()
    try:
        pay = TxnKey("payments", "L-scope", 0, 1)
        with CoordinatorClient(d.url, a, retry_budget=5) as job_a, \
                CoordinatorClient(d.url, b, retry_budget=5) as job_b:
            epoch = job_a.register(SINK)  # its own sink: the whole batch path
            job_a.begin(SINK, KEY.lineage, 0, epoch, ["pg"], 1, 60)
            pay_epoch = job_b.register("payments")  # a glob's sink
            job_b.begin("payments", pay.lineage, 0, pay_epoch, ["pg"], 1, 60)
            job_b.vote(pay, pay_epoch, [VoteIn("pg/0", True, {})])
            refused = [
                lambda: job_b.register(SINK),
                lambda: job_b.begin(SINK, KEY.lineage, 1, epoch, ["pg"], 1, 60),
                lambda: job_b.vote(KEY, epoch, [VoteIn("pg/0", True, {})]),
                lambda: job_b.ack(KEY, epoch, [("pg/0", Decision.COMMIT)]),
                lambda: job_b.await_decision(KEY, 0.1),
                lambda: job_b.get(KEY),
                lambda: job_a.begin("payments", pay.lineage, 1, pay_epoch, ["pg"], 1, 60),
                lambda: job_a.ack(pay, pay_epoch, [("pg/0", Decision.COMMIT)]),
            ]
            for call in refused:
                with pytest.raises(CoordinatorError) as err:
                    call()
                assert err.value.status == 403, err.value
            r = httpx.post(d.url + TXN + "/votes", timeout=10,
                           headers={"Authorization": f"Bearer {b}"},
                           json=votes_body(epoch, [VoteIn("pg/0", True, {})]))
            assert r.status_code == 403 and r.json() == {"error": "forbidden", "message": (
                f"POST {TXN}/votes acts on sink 'orders'; this data token is scoped to "
                "sinks pay* refunds (its line in the daemon's --token-file): give this job "
                "a data token whose line names 'orders', or add 'orders' to this token's "
                "line")}
            assert job_a.get(KEY).state == State.OPEN  # no refused call changed anything
            assert job_b.get(pay).state == State.COMMITTING
            # the scope widens without a restart: the file is re-read
            _write(tokens, f"data {a} orders payments\ndata {b} pay* refunds\n"
                           f"operator {operator}\n")
            _until(lambda: httpx.get(d.url + "/v1/txns/payments/L-scope/0/1", timeout=10,
                                     headers={"Authorization": f"Bearer {a}"}
                                     ).status_code == 200)
            assert job_a.ack(pay, pay_epoch, [("pg/0", Decision.COMMIT)]).state \
                == State.COMMITTED
    finally:
        d.stop()


def test_scoped_token_lines_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "tokens"
    bad.write_text(f"operator {_tok()} orders\n")
    with pytest.raises(InvalidRequest, match=r"line 1: expected 'data <token>' \(optionally "
                       r"followed by the sinks it may act on"):
        TokenSet(None, str(bad))
    bad.write_text(f"data {_tok()} orders/x\n")
    with pytest.raises(InvalidRequest, match=r"line 1: 'orders/x' is not a sink name or glob"):
        TokenSet(None, str(bad))
    same = _tok()
    bad.write_text(f"data {same} orders\ndata {same} payments\n")
    with pytest.raises(InvalidRequest, match="listed twice; list its sinks on one line"):
        TokenSet(None, str(bad))
