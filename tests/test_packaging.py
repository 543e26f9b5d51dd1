"""The core installs and runs without the heavy extras (pyspark, psycopg, confluent-kafka)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_core_dependencies_exclude_the_extras() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"]).lower()
    for heavy in ("pyspark", "psycopg", "confluent-kafka", "pyarrow"):
        assert heavy not in core, f"{heavy} must stay an extra"
    assert {"spark", "kafka", "postgres", "all", "dev"} <= set(meta["optional-dependencies"])
    assert meta["scripts"]["twophase"] == "twophase.cli:main"


def test_cli_help_and_core_imports_do_not_load_extras() -> None:
    code = (
        "import sys, contextlib, io\n"
        "import twophase, twophase.protocol, twophase.participant, twophase.client\n"
        "import twophase.cli as cli\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "assert 'demo' in buf.getvalue() and 'serve' in buf.getvalue(), buf.getvalue()\n"
        "heavy = ('pyspark', 'psycopg', 'confluent_kafka', 'twophase.sinks')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr


def test_every_subcommand_has_help() -> None:
    for cmd in ("serve", "txns", "demo", "resolve"):
        out = subprocess.run([sys.executable, "-m", "twophase.cli", cmd, "--help"],
                             capture_output=True, text=True, cwd=ROOT, check=False)
        assert out.returncode == 0, (cmd, out.stderr)
        assert "example" in out.stdout, cmd
