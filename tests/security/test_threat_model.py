"""docs/user/security.md's threat model names, for every "cannot", the test that plays
it; each named ``file.py::test`` must exist under tests/security/ (the doc cannot name
a test that was renamed or removed), and every test playing an actor is named."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).parent
DOC = HERE.parents[1] / "docs" / "user" / "security.md"
# modules here that play no actor of the model (the doc itself; the light install)
NOT_ACTORS = ("test_threat_model.py::", "test_light_install.py::")


def _tests() -> set[str]:
    out = set()
    for f in HERE.glob("test_*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out.add(f"{f.name}::{node.name}")
    return out


def test_every_test_the_threat_model_names_exists() -> None:
    model = DOC.read_text().split("## Threat model", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+\.py::test_\w+)`", model))
    assert len(named) >= 10, named
    assert named <= _tests(), sorted(named - _tests())
    unnamed = {t for t in _tests() - named if not t.startswith(NOT_ACTORS)}
    assert not unnamed, f"tests/security tests the threat model does not name: {unnamed}"
