"""The operators' side: every guarded path refuses a missing or wrong token, the sinks
overview, executor metrics in Prometheus, ``twophase force`` and ``twophase sinks`` run as
a user runs them, and a version 2 store upgraded in place to record descriptors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

from tests.support.old_store import old_store
from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.coordinator import schema as s
from twophase.coordinator.app import create_app
from twophase.coordinator.embedded import EmbeddedServer
from twophase.coordinator.guard import OPEN_PATHS
from twophase.coordinator.store import Store
from twophase.engine.commit import Committer
from twophase.engine.decide import decide, votes_of
from twophase.engine.plan import PREPARE, BatchPlan
from twophase.engine.task import run_partition
from twophase.errors import SchemaMismatch
from twophase.participant import BranchRef
from twophase.protocol import State, TxnKey
from twophase.sinks.files import StagedFileParticipant

SINK, LINEAGE = "orders", "L-console"
KEY = TxnKey(SINK, LINEAGE, 0, 1)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(f"sqlite:///{tmp_path / 'c.db'}", token="right-token") as srv:
        yield srv


def _stuck(client: CoordinatorClient) -> None:
    """Batch 0 decided COMMIT, nothing acknowledged: the writer died after the votes."""
    epoch = client.register(SINK, [{"kind": "files", "name": "lake", "target": "/x",
                                    "options": {"path": "/x", "format": "parquet"}}])
    client.begin(SINK, LINEAGE, 0, epoch, ["lake"], 2, 60)
    client.vote(KEY, epoch, [VoteIn("lake/0", True, {}), VoteIn("lake/1", True, {})])


def _concrete(path: str) -> str:
    values = {"sink": SINK, "lineage": LINEAGE, "checkpoint": "0", "attempt": "1"}
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)


def test_every_guarded_path_refuses_a_missing_or_wrong_token(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    with CoordinatorClient(server.url, server.token) as client:
        _stuck(client)
        before = client.get(KEY)
    app = create_app(f"sqlite:///{tmp_path / 'routes.db'}", None, insecure=True,
                     background=False)
    spec = app.openapi()  # every route of the service, as documented
    guarded = [(m.upper(), path) for path, ops in spec["paths"].items() for m in ops
               if path not in OPEN_PATHS]
    admin = [x for x in guarded if x[1].startswith("/v1/admin/")]
    assert len(admin) >= 4 and ("GET", "/ui/view") in guarded
    body = {"branch": "lake/0", "outcome": "COMMIT", "reason": "x", "dry_run": False}
    with httpx.Client(base_url=server.url) as http:
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong-token"},
                            {"Authorization": "right-token"}):
                r = http.request(method, _concrete(path), json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"] == "unauthorized"
        page = http.get("/ui")  # the sign-in page is open and carries no data
        assert page.status_code == 200 and "Sign in" in page.text and LINEAGE not in page.text
    with CoordinatorClient(server.url, server.token) as client:
        assert client.get(KEY) == before  # nothing changed


def test_sinks_overview_and_executor_metrics(server: EmbeddedServer, tmp_path: Path) -> None:
    lake = StagedFileParticipant(str(tmp_path / "lake"), name="lake")
    schema = pa.schema([("id", pa.int64())])
    with CoordinatorClient(server.url, server.token) as client:
        epoch = client.register(SINK, [lake.descriptor()])  # type: ignore[list-item]
        res = client.begin(SINK, LINEAGE, 0, epoch, ["lake"], 2, 60)
        assert res.txn is not None
        plan = BatchPlan(key=res.txn.key, epoch=epoch, partitions=2, mode=PREPARE,
                         coordinator_url=server.url, token=server.token,
                         participants=(lake,))

        def task(partition: int, ids: list[int]) -> dict[str, object]:  # two executors
            batch = pa.RecordBatch.from_pylist([{"id": i} for i in ids], schema=schema)
            return run_partition(plan, partition, schema, [batch]).as_dict()

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(task, (0, 1), ([1, 2, 3], [4])))
        final = decide(client, res.txn, epoch, votes_of(outcomes), "")  # as the driver
        committer = Committer((lake,))
        final, error = committer.apply(client, epoch, final)
        committer.close()
        assert (final.state.value, error) == ("COMMITTED", "")
        sinks = client.sinks()
        assert client.participants(SINK)[0]["options"]["path"] == str(lake.path)
    assert [(x["name"], x["last_committed"], x["in_doubt"], x["participants"])
            for x in sinks] == [(SINK, 0, 0, ["lake"])]
    metrics = httpx.get(server.url + "/metrics").text
    labels = f'participant="lake",sink="{SINK}"'
    for name in ("prepare", "commit"):  # the tasks' votes, the driver's acks
        assert f"twophase_branch_{name}_seconds_count{{{labels}}} 2.0" in metrics
    assert f"twophase_branch_rows_sum{{{labels}}} 4.0" in metrics


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env, input=stdin)


def test_force_and_sinks_commands(server: EmbeddedServer) -> None:
    with CoordinatorClient(server.url, server.token) as client:
        _stuck(client)
    where = ["--coordinator", server.url, "--token", server.token]
    out = _cli("sinks", *where, "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert (row["name"], row["in_doubt"], row["health"]) == (SINK, 1, "in doubt")
    txn = f"{SINK}/{LINEAGE}/0/attempt-1"
    # no terminal and no --yes: nothing is done, and the message says how
    out = _cli("force", txn, "ack", "--reason", "settled by hand", *where, stdin="yes\n")
    assert out.returncode == 2 and "--yes" in out.stderr
    out = _cli("force", txn, "abort", "--reason", "writer gone", "--yes", *where)
    assert out.returncode == 1 and "already decided COMMIT" in out.stderr
    out = _cli("force", txn, "ack", "--reason", "settled by hand", "--yes", "--json", *where)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["branches"] == ["lake/0", "lake/1"] and result["txn"]["state"] == "COMMITTED"
    with CoordinatorClient(server.url, server.token) as client:
        assert client.get(KEY).state == State.COMMITTED
        history = client.get_raw(KEY, history=True)["history"]
    forced = [h for h in history if h["kind"] == "force_ack"]
    assert [h["detail"]["reason"] for h in forced] == ["settled by hand"] * 2
    out = _cli("force", txn, "ack", "--reason", "x", "--yes", "--coordinator", server.url,
               "--token", "wrong")
    assert out.returncode == 1 and "unauthorized" in out.stderr


def test_a_version_2_store_is_upgraded_in_place(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'v2.db'}"
    old_store(url, version="2")  # what a version 2 daemon left behind
    with pytest.raises(SchemaMismatch, match="upgrade it in place"):
        Store(url, create=False)  # a read-only tool never upgrades
    store = Store(url)
    try:
        store.register("a", [{"kind": "files", "name": "lake", "target": "/x",
                              "options": {"path": "/x"}}])
        assert store.participants("a")[0]["name"] == "lake"
        assert store.sink("a") is not None and store.sink("a").epoch == 4  # type: ignore[union-attr]
        txn = store.get(TxnKey("a", "L", 0, 1))
        assert txn is not None and txn.state == State.COMMITTING and len(txn.branches) == 3
        with store.db.read() as conn:
            version = conn.execute(s.meta.select()).first()
    finally:
        store.close()
    assert version is not None and version.value == str(s.SCHEMA_VERSION) == "4"


def test_the_consoles_resolve_settles_a_sink_inside_the_coordinator(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    lake = StagedFileParticipant(str(tmp_path / "lake"), format="jsonl", name="lake")
    schema = pa.schema([("id", pa.int64())])
    with CoordinatorClient(server.url, server.token) as client:
        epoch = client.register(SINK, [lake.descriptor()])  # type: ignore[list-item]
        client.begin(SINK, LINEAGE, 0, epoch, ["lake"], 1, 60)
        ref = BranchRef(SINK, LINEAGE, 0, 1, "lake", 0)
        batch = pa.RecordBatch.from_pylist([{"id": 1}], schema=schema)
        client.vote(KEY, epoch, [VoteIn("lake/0", True, lake.prepare(ref, schema, [batch]))])
    path = f"/v1/admin/sinks/{SINK}/resolve"
    auth = {"Authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as http:
        dry = http.post(path, json={"dry_run": True}).json()
        assert {(a["branch"], a["status"], a["action"]) for a in dry["actions"]} == {
            ("lake/0", "PREPARED", "commit")}
        assert http.get(f"/v1/txns/{SINK}/{LINEAGE}/0/1").json()["state"] == "COMMITTING"
        done = http.post(path, json={"dry_run": False}).json()
        assert done["ok"] and http.get(f"/v1/txns/{SINK}/{LINEAGE}/0/1").json()["state"] == (
            "COMMITTED")
        assert http.post(path, json={"dry_run": "yes"}).status_code == 422  # strict body
    assert lake.status(ref).value == "COMMITTED"
