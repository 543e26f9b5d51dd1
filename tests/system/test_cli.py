"""The operator commands as one tool, run as a user runs them (the installed ``twophase``
script, a subprocess): a mistyped store is refused without creating anything, a dry run
changes nothing, ``resolve`` takes the coordinator the way the others do and recovers a
sink without the test tooling."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twophase.coordinator import schema as s
from twophase.coordinator.store import Store
from twophase.protocol import Begin, State, TxnKey
from twophase.sinks.files import StagedFileParticipant

SINK, LINEAGE = "orders", "L-cli"
KEY = TxnKey(SINK, LINEAGE, 0, 1)
TWOPHASE = Path(sys.executable).parent / "twophase"


def _run(*args: str, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("TWOPHASE_COORDINATOR", "TWOPHASE_TOKEN")}
    return subprocess.run([str(TWOPHASE), *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)


def _undecided_store(tmp_path: Path) -> str:
    """A store whose sink has one undecided transaction (its writer died before voting),
    with a staged-files participant recorded at register."""
    db = tmp_path / "tp.db"
    lake = _lake(tmp_path)
    store = Store(f"sqlite:///{db}")
    try:
        epoch = store.register(SINK, [dict(lake.descriptor())]).epoch
        store.begin(Begin(SINK, LINEAGE, 0, epoch, (lake.name,), 2, time.time()))
    finally:
        store.close()
    return f"sqlite:///{db}"


def _lake(tmp_path: Path) -> StagedFileParticipant:
    """The participant by its default name, as ``--files-path`` names it by hand."""
    return StagedFileParticipant(str(tmp_path / "lake"), format="jsonl")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("command", [
    ["resolve", SINK, "--dry-run"],
    ["resolve", SINK],
    ["txns"],
    ["sinks"],
    ["force", f"{SINK}/{LINEAGE}/0/1", "abort", "--reason", "writer gone", "--yes"],
])
def test_a_mistyped_sqlite_store_is_refused_and_nothing_is_created(
    tmp_path: Path, command: list[str]
) -> None:
    """Before: a dry run on a typo created the folder and a fresh store (and the others an
    empty database file)."""
    work = tmp_path / "work"
    work.mkdir()
    out = _run(*command, "--coordinator", "sqlite:///typo/tp.db", cwd=work)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"no SQLite store at {work / 'typo' / 'tp.db'}: the file does not exist" \
        in out.stderr, out.stderr
    assert "never creates one" in out.stderr
    assert list(work.iterdir()) == []
    (work / "folder.db").mkdir()  # a folder where the file should be: named, not opened
    out = _run(*command, "--store", "sqlite:///folder.db", cwd=work)
    assert out.returncode == 1 and "it is a folder" in out.stderr, out.stderr
    assert [p.name for p in work.iterdir()] == ["folder.db"]
    assert list((work / "folder.db").iterdir()) == []


def test_resolve_dry_run_changes_nothing_then_resolve_does_what_it_said(
    tmp_path: Path
) -> None:
    url = _undecided_store(tmp_path)
    before = _digest(tmp_path)
    # the coordinator from the environment, as txns, sinks and force take it
    out = _run("resolve", SINK, "--dry-run", "--json", env={"TWOPHASE_COORDINATOR": url})
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)["actions"]
    assert {"txn": f"{SINK}/{LINEAGE}/0/attempt-1", "branch": "*", "status": "undecided",
            "action": "abort"} in planned, planned
    assert _digest(tmp_path) == before  # not a byte of the store changed
    store = Store(url, create=False)
    try:
        assert store.get(KEY).state == State.OPEN  # type: ignore[union-attr]
    finally:
        store.close()

    out = _run("resolve", SINK, "--store", url, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["actions"] == planned
    store = Store(url, create=False)
    try:
        assert store.get(KEY).state == State.ABORTED  # type: ignore[union-attr]
    finally:
        store.close()


def test_resolve_dry_run_does_not_upgrade_an_old_store(tmp_path: Path) -> None:
    """A version 2 store stays version 2 under a dry run (a coordinator started on it, as
    the dry run did before, upgrades it in place)."""
    url = _undecided_store(tmp_path)
    store = Store(url)
    try:
        with store.db.write() as conn:  # what a version 2 daemon left behind
            s.participants.drop(conn)
            conn.execute(s.meta.update().values(value="2"))
    finally:
        store.close()
    out = _run("resolve", SINK, "--coordinator", url, "--dry-run",
               "--files-path", str(tmp_path / "lake"))
    assert out.returncode == 1
    assert "schema version 2; a read-only tool does not upgrade it" in out.stderr, out.stderr
    with sqlite3.connect(tmp_path / "tp.db") as conn:
        (version,) = conn.execute("select value from twophase_meta "
                                  "where key = 'schema_version'").fetchone()
    assert version == "2"


def test_resolve_by_hand_needs_no_test_tooling(tmp_path: Path) -> None:
    """Participants named by flags or descriptors are built from the participants' own
    classes: ``twophase.testing`` is never imported (it was, through its job config)."""
    url = _undecided_store(tmp_path)
    lake = json.dumps(dict(_lake(tmp_path).descriptor()))
    for by_hand in (["--participant", lake],
                    ["--files-path", str(tmp_path / "lake"), "--files-format", "jsonl"]):
        code = (
            "import json, sys\n"
            "from twophase.cli import main\n"
            f"rc = main(['resolve', {SINK!r}, '--store', {url!r}, '--dry-run', '--json', "
            f"*{by_hand!r}])\n"
            "testing = sorted(m for m in sys.modules if m.startswith('twophase.testing'))\n"
            "print(json.dumps({'rc': rc, 'testing': testing}), file=sys.stderr)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=False)
        result = json.loads(out.stderr.strip().splitlines()[-1])
        assert result == {"rc": 0, "testing": []}, (by_hand, out.stderr)
        assert json.loads(out.stdout)["actions"][0]["action"] == "abort", out.stdout


def test_demo_starts_a_daemon_with_the_flag_chaos_uses(tmp_path: Path) -> None:
    """``--coordinator-mode daemon`` means in ``demo`` what it means in ``chaos``: a
    ``twophase serve`` process on WORKDIR/coordinator.db, which the job writes through."""
    work = tmp_path / "demo"
    out = _run("demo", "--coordinator-mode", "daemon", "--coordinator", "http://x:7070",
               "--workdir", str(work))
    assert out.returncode == 2 and "not both" in out.stdout, out.stdout + out.stderr
    out = _run("demo", "--coordinator-mode", "daemon", "--no-postgres", "--batches", "2",
               "--rows-per-batch", "50", "--partitions", "2", "--workdir", str(work))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "coordinator daemon (twophase serve) on http://127.0.0.1:" in out.stdout
    assert "OK: every id exactly once" in out.stdout
    assert (work / "coordinator.log").is_file()  # the daemon's own log: it ran apart
    # its table is its own: Spark's log went to a file, and every phase column is filled
    # (the driver commits on this path: the commit column is its work)
    assert (work / "spark.log").is_file()
    assert not re.search(r"NativeCodeLoader|log4j|WARN ", out.stdout + out.stderr), out.stderr
    rows = re.findall(r"^\s+\d+\s+committed\s+\d+\s+\d+\s+(\d+)ms\s+(\d+)ms\s+(\d+)ms",
                      out.stdout, re.M)
    assert len(rows) == 2 and all(int(commit) > 0 for _p, _w, commit in rows), out.stdout
    store = Store(f"sqlite:///{work / 'coordinator.db'}", create=False)
    try:
        states = [row.txn.state for row in store.list(sink="demo_orders")]
    finally:
        store.close()
    assert states == [State.COMMITTED] * 2, states


def test_serve_and_the_operator_commands_take_the_environment(tmp_path: Path) -> None:
    """The daemon from $TWOPHASE_STORE (as the Docker image sets it) and $TWOPHASE_TOKEN,
    the tools from $TWOPHASE_COORDINATOR and the same token: no flag needed."""
    import httpx

    from twophase.testing.servers import free_port

    out = _run("serve")
    assert out.returncode == 2 and "pass --store URL or set TWOPHASE_STORE" in out.stderr
    port = free_port()
    env = {"TWOPHASE_STORE": f"sqlite:///{tmp_path / 'env.db'}",
           "TWOPHASE_TOKEN": "t0k-0123456789abcdef",
           "TWOPHASE_STORE_WAIT": "0"}
    base = {k: v for k, v in os.environ.items() if k != "TWOPHASE_COORDINATOR"}
    daemon = subprocess.Popen([str(TWOPHASE), "serve", "--port", str(port)],
                              env={**base, **env}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert daemon.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        tools = {"TWOPHASE_COORDINATOR": url, "TWOPHASE_TOKEN": "t0k-0123456789abcdef"}
        out = _run("sinks", "--json", env=tools)
        assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
        out = _run("txns", "--json", env=tools)
        assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
        out = _run("sinks", env={**tools, "TWOPHASE_TOKEN": "wrong"})
        assert out.returncode == 1 and "unauthorized" in out.stderr, out.stderr
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert (tmp_path / "env.db").is_file()
