"""The layering the module split promises, checked on the source (no imports run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or lazily inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _core_files() -> list[Path]:
    core = ROOT / "twophase"
    return [f for f in core.rglob("*.py")
            if f.relative_to(core).parts[0] not in ("coordinator", "sinks", "cli", "testing")]


def test_only_the_connection_module_imports_the_coordinator() -> None:
    offenders = [
        str(f.relative_to(ROOT)) for f in _core_files()
        if f.name != "connection.py"
        and any(m.startswith("twophase.coordinator") for m in _imports(f))
    ]
    assert not offenders, offenders
    assert "twophase.coordinator.embedded" in _imports(ROOT / "twophase" / "connection.py")


def test_client_is_only_the_http_client() -> None:
    names = _imports(ROOT / "twophase" / "client.py")
    assert not any(m.startswith("twophase.coordinator") for m in names), names


def test_group_commit_and_db_know_nothing_of_the_protocol() -> None:
    for name in ("groupcommit.py", "db.py"):
        names = _imports(ROOT / "coordinator" / name)
        assert not any(m.startswith(("twophase.protocol", "twophase.wire")) for m in names), (
            name, names)
