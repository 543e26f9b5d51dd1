"""The core installs and runs without the heavy extras (pyspark, psycopg, confluent-kafka)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_core_dependencies_exclude_the_extras() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"]).lower()
    for heavy in ("pyspark", "psycopg", "confluent-kafka", "pyarrow", "boto3", "moto",
                  "pyiceberg", "duckdb"):
        assert heavy not in core, f"{heavy} must stay an extra"
    assert {"spark", "kafka", "postgres", "s3", "iceberg", "all", "dev"} <= set(
        meta["optional-dependencies"])
    assert meta["scripts"]["twophase"] == "twophase.cli:main"


def _console_script() -> Path:
    """The ``twophase`` command pip installed beside this interpreter, as a user runs it."""
    script = Path(sys.executable).parent / "twophase"
    assert script.is_file(), f"{script} missing: pip install -e . into this venv"
    return script


def test_version_is_one_number_everywhere() -> None:
    """``twophase.__version__`` is the one version: pyproject.toml reads it at build time,
    and the installed metadata and ``twophase --version`` say the same (a stale install or
    a second copy of the number fails here; tests/system/test_wheel.py checks the wheel)."""
    import importlib.metadata

    import twophase

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "one version: twophase.__version__"
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "twophase.__version__"}
    out = subprocess.run([str(_console_script()), "--version"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"twophase {twophase.__version__}", out.stdout
    assert importlib.metadata.version("twophase") == twophase.__version__
    assert f"## {twophase.__version__} " in (ROOT / "CHANGELOG.md").read_text()


def test_metadata_states_python_versions_and_pyspark() -> None:
    from packaging.specifiers import SpecifierSet

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    supported = SpecifierSet(meta["requires-python"])
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        assert minor in supported, (minor, meta["requires-python"])
        assert f"Programming Language :: Python :: {minor}" in meta["classifiers"]
    assert "3.9" not in supported
    assert "Typing :: Typed" in meta["classifiers"]
    # the lower bound is the floor the sink checks at run time (twophase.spark.compat)
    from twophase.spark.compat import SPARK_FLOOR

    floor = ".".join(map(str, SPARK_FLOOR))
    assert f"pyspark>={floor}" in meta["optional-dependencies"]["spark"]
    assert f"pyspark[connect]>={floor}" in meta["optional-dependencies"]["connect"]


def test_cli_help_and_core_imports_do_not_load_extras() -> None:
    code = (
        "import sys, contextlib, io\n"
        "import twophase, twophase.protocol, twophase.participant, twophase.client.api\n"
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
    for cmd in ("serve", "txns", "sinks", "force", "demo", "resolve"):
        out = subprocess.run([sys.executable, "-m", "twophase.cli", cmd, "--help"],
                             capture_output=True, text=True, cwd=ROOT, check=False)
        assert out.returncode == 0, (cmd, out.stderr)
        assert "example" in out.stdout, cmd
