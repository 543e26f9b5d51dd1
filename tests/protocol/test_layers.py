"""The layers of DESIGN.md hold, and the check that keeps them would catch a breach.

``lint-imports`` (import-linter, configured in pyproject.toml) runs in the test command.
Here it runs on a copy of the package: as it is (passes), and with one upward import
added, lazily inside a function, to the bottom layer (must fail and name the import).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"


def _copy(tmp: Path) -> Path:
    # symlinks=False: twophase/sinks and twophase/coordinator become real folders
    shutil.copytree(ROOT / "twophase", tmp / "twophase", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(tree / "pyproject.toml")],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)


def test_the_tree_keeps_its_layers(tmp_path: Path) -> None:
    out = _lint(_copy(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 6 kept, 0 broken" in out.stdout, out.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    errors = tree / "twophase" / "errors.py"
    errors.write_text(errors.read_text() + (
        "\n\ndef _sneaky() -> None:\n"
        "    from twophase.coordinator import store  # noqa: F401 - the breach under test\n"
    ))
    out = _lint(tree)
    assert out.returncode != 0
    assert "twophase.errors is not allowed to import twophase.coordinator" in out.stdout, (
        out.stdout
    )


def test_the_sql_participant_uses_only_the_public_contract(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    xid = tree / "twophase" / "sinks" / "sql" / "xid.py"
    xid.write_text(xid.read_text() + (
        "\n\ndef _sneaky() -> None:\n"
        "    from twophase import failpoints  # noqa: F401 - the breach under test\n"
    ))
    out = _lint(tree)
    assert out.returncode != 0
    assert "twophase.sinks.sql is not allowed to import twophase.failpoints" in out.stdout, (
        out.stdout
    )


def test_the_old_top_level_names_are_forbidden(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    for name in ("sinks", "coordinator"):  # a user's own packages of these names
        (tree / name).mkdir()
        (tree / name / "__init__.py").write_text("")
    names = tree / "twophase" / "names.py"
    names.write_text(names.read_text() + "\n\nimport sinks  # noqa: E402,F401 - under test\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "twophase is not allowed to import sinks" in out.stdout, out.stdout
    assert "twophase.names -> sinks" in out.stdout, out.stdout
