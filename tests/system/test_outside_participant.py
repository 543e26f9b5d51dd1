"""A participant from outside the tree, as its author would ship it: the example package
of docs/writing-a-participant.md (docs/examples/jsondir), built only on twophase's public
contract and registered by entry point, installed into a fresh virtual environment beside
the twophase wheel. There it passes the installed conformance kit under pytest, and
``twophase resolve`` rebuilds it by kind from the coordinator's record and settles its
in-doubt branches. Everything runs in that venv's plain interpreter."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.user import user_env
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    Participant,
    Rebuildable,
)
from twophase.testing.conformance import ALL_CHECKS, CROSS_PROCESS_CHECKS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "jsondir"

KIT_TEST = '''
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from twophase.testing.conformance import Harness, applicable_checks
from twophase_jsondir import JsonDirParticipant


class DirTarget:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="jsondir-"))

    def participant(self) -> JsonDirParticipant:
        return JsonDirParticipant(str(self.root), name="jd")

    def rows(self) -> list[dict]:
        return [json.loads(line) for f in sorted(self.root.glob("*.jsonl"))
                for line in f.read_text().splitlines()]

    def close(self) -> None:
        shutil.rmtree(self.root)


HARNESS = Harness(id="jsondir", new_target=DirTarget)
CHECKS = applicable_checks(HARNESS)


def test_the_kit_has_its_crash_checks() -> None:
    assert any("sigkill" in c.__name__ for c in CHECKS), [c.__name__ for c in CHECKS]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(check) -> None:
    check(HARNESS)
'''

JOB_DIES = '''
import sys

import pyarrow as pa

from twophase.client.connection import connect
from twophase.participant import BranchRef
from twophase.protocol import Decision, TxnKey
from twophase.client.wire import VoteIn
from twophase_jsondir import JsonDirParticipant

coordinator, out = sys.argv[1], sys.argv[2]
schema = pa.schema([("id", pa.int64())])
part = JsonDirParticipant(out, name="jd")
rows = {0: [1, 2], 1: [3]}
with connect(coordinator) as conn:
    client = conn.client()
    epoch = client.register("orders", [part.descriptor()])
    # batch 0: both branches prepared and voted YES (COMMIT), then the job dies
    client.begin("orders", "L-outside", 0, epoch, ["jd"], 2, 60)
    votes = []
    for p, ids in rows.items():
        ref = BranchRef("orders", "L-outside", 0, 1, "jd", p)
        batch = pa.RecordBatch.from_pylist([{"id": i} for i in ids], schema=schema)
        votes.append(VoteIn(ref.branch_id, True, part.prepare(ref, schema, [batch])))
    txn = client.vote(TxnKey("orders", "L-outside", 0, 1), epoch, votes)
    assert txn.decision == Decision.COMMIT, txn
    # batch 1: prepared, never begun: no record, presumed abort
    ref = BranchRef("orders", "L-outside", 1, 1, "jd", 0)
    batch = pa.RecordBatch.from_pylist([{"id": 9}], schema=schema)
    part.prepare(ref, schema, [batch])
print("died")
'''


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_an_outside_participant_passes_the_kit_and_is_resolved_by_kind(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("TWOPHASE_")}
    # twophase as a wheel, built from a copy (links kept, as git checks them out)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", "tests", "bench"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)],
         tmp_path, env)
    (wheel,) = dist.glob("twophase-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    py, bindir = venv / "bin" / "python", venv / "bin"
    _run([str(py), "-m", "pip", "install", "-q", str(wheel), "pyarrow", "pytest"], tmp_path, env)
    # the author's package, from a copy of the example (nothing of the tree on its path)
    pkg = tmp_path / "twophase-jsondir"
    shutil.copytree(EXAMPLE, pkg)
    _run([str(py), "-m", "pip", "install", "-q", str(pkg)], tmp_path, env)

    user = tmp_path / "user"
    user.mkdir()
    (user / "test_kit.py").write_text(KIT_TEST)
    kit = _run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_kit.py"],
               user, env)
    counts = re.search(r"^(\d+) passed in ", kit, re.MULTILINE)  # nothing failed or skipped
    every = len(ALL_CHECKS) + len(CROSS_PROCESS_CHECKS) + 1  # every check, crash ones too
    assert counts and int(counts.group(1)) == every, kit[-2000:]

    # resolve: the job prepared and died; only the sink name and the coordinator are given
    out = tmp_path / "out"
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    (user / "job_dies.py").write_text(JOB_DIES)
    assert _run([str(py), "job_dies.py", coordinator, str(out)], user, env).strip() == "died"
    assert len(list((out / "_prepared").iterdir())) == 3
    report = json.loads(_run([str(bindir / "twophase"), "resolve", "orders", "--coordinator",
                              coordinator, "--json"], user, env))
    assert report["ok"] and not report["unresolved"], report
    done = sorted((a["txn"].split("/")[2], a["action"]) for a in report["actions"])
    assert done == [("0", "commit"), ("0", "commit"), ("1", "abort")], done
    committed = sorted(f.name for f in out.glob("*.jsonl"))
    assert committed == ["orders+L-outside+0+jd+0.jsonl", "orders+L-outside+0+jd+1.jsonl"]
    ids = sorted(json.loads(line)["id"] for f in out.glob("*.jsonl")
                 for line in f.read_text().splitlines())
    assert ids == [1, 2, 3]
    assert list((out / "_prepared").iterdir()) == []


def test_the_example_in_the_guide_is_the_shipped_package() -> None:
    """The guide links the example, and the example registers its kind by entry point."""
    guide = (ROOT / "docs" / "writing-a-participant.md").read_text()
    assert "examples/jsondir" in guide
    toml = (EXAMPLE / "pyproject.toml").read_text()
    assert textwrap.dedent('''
        [project.entry-points."twophase.participants"]
        jsondir = "twophase_jsondir:JsonDirParticipant"''') in toml


# a chaos run (about 100 s): slow, to keep CI within 45 minutes; the outside participant's
# rebuild by kind is what `twophase resolve` does in the resolve test above
@pytest.mark.spark
@pytest.mark.slow
def test_the_chaos_runner_rebuilds_an_outside_participant_by_kind(tmp_path: Path) -> None:
    """``twophase chaos --participant DESCRIPTOR`` drives a third party's participant,
    rebuilt by kind from its entry point in the job's driver and its Python workers: the
    user's venv holds twophase (with pyspark) and the example package, installed by pip;
    the job is SIGKILLed and restarted, and every id is counted through its read_back."""
    env = user_env()
    # the user's venv: this environment's packages (pyspark is too big to install per test)
    # and the example installed into it by pip, entry point and all
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                tmp_path, env).strip()
    ours = sysconfig.get_path("purelib")
    (Path(site) / "outer.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    pkg = tmp_path / "twophase-jsondir"
    shutil.copytree(EXAMPLE, pkg)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(pkg)], tmp_path, env)

    out, report_path = tmp_path / "jd-out", tmp_path / "report.json"
    descriptor = {"kind": "jsondir", "name": "jd", "target": str(out), "options": {}}
    proc = subprocess.run(
        [str(py), "-m", "twophase.cli", "chaos", "--no-postgres", "--no-files",
         "--participant", json.dumps(descriptor), "--kills", "2", "--seed", "5",
         "--batches", "2", "--rows-per-batch", "30", "--workdir", str(tmp_path / "w"),
         "--json-out", str(report_path), "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] is True, report["verify_lines"]
    [system] = report["verify"]["systems"]
    assert system["kind"] == "jsondir", system
    assert system["rows"] == report["rows"] > 0, report["verify_lines"]
    assert system["duplicates"] == system["missing"] == system["prepared_leftovers"] == 0
    assert report["kills"] == 2, report["by_victim_step"]
    assert list(out.glob("*.jsonl")), "nothing committed by the outside participant"


def test_chaos_refuses_a_participant_it_cannot_count_or_build(tmp_path: Path) -> None:
    """A descriptor of an unregistered kind, one that is not JSON and one without a name:
    each is refused before any job runs, with the fix named."""
    def chaos(value: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "twophase.cli", "chaos", "--no-postgres", "--no-files",
             "--participant", value, "--kills", "0", "--workdir", str(tmp_path / "w")],
            capture_output=True, text=True, timeout=120, check=False)

    nokind = chaos('{"kind": "nosuchkind", "name": "x", "target": "/tmp/x", "options": {}}')
    assert nokind.returncode == 2, nokind.stderr
    assert "'nosuchkind', which this process cannot rebuild: install the package" \
        in nokind.stderr
    broken = chaos("{kind: jsondir}")
    assert broken.returncode == 2 and "--participant: it is not JSON" in broken.stderr
    nameless = chaos('{"kind": "jsondir"}')
    assert nameless.returncode == 2 and 'string "kind" and "name"' in nameless.stderr


class Unverifiable(Participant, Rebuildable):
    """Rebuildable but not Verifiable: chaos could run it but never count its rows."""

    kind = "unverifiable"

    def prepare(self, branch: BranchRef, schema: Any, batches: Any) -> Handle:
        return {}

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        return None

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        return None

    def status(self, branch: BranchRef) -> BranchStatus:
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        return []

    def descriptor(self) -> Descriptor | None:
        return {"kind": self.kind, "name": self.name, "target": "", "options": {}}

    @classmethod
    def from_descriptor(cls, descriptor: Descriptor, secrets: Mapping[str, str]) -> Any:
        return cls(descriptor["name"])


def test_chaos_refuses_a_participant_it_could_not_verify(tmp_path: Path) -> None:
    from twophase.participant import register_kind
    from twophase.testing.chaos import ChaosError, ChaosOptions, run_chaos

    register_kind(Unverifiable.kind, Unverifiable)
    opts = ChaosOptions(workdir=tmp_path / "w", kills=0, files=False,
                        participants=({"kind": "unverifiable", "name": "blind",
                                       "target": "", "options": {}},))
    with pytest.raises(ChaosError, match=r"cannot count the rows of .*blind.*: its class "
                       r"does not implement read_back\(column\); inherit "
                       r"twophase\.participant\.Verifiable"):
        run_chaos(opts)
    assert not (tmp_path / "w" / "input").exists()  # refused before any job ran
