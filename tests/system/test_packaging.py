"""The core installs and runs without the heavy extras (pyspark, psycopg, confluent-kafka)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
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
    """pyproject.toml, ``twophase.__version__`` and the installed ``twophase --version``
    say the same version (a stale install or a forgotten bump fails here)."""
    import twophase

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = subprocess.run([str(_console_script()), "--version"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"twophase {meta['version']}", (out.stdout, meta["version"])
    assert twophase.__version__ == meta["version"]
    assert meta["version"] == "0.3.0"
    assert f"## {meta['version']} " in (ROOT / "CHANGELOG.md").read_text()


def test_metadata_states_python_versions_and_pyspark() -> None:
    from packaging.specifiers import SpecifierSet

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    supported = SpecifierSet(meta["requires-python"])
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        assert minor in supported, (minor, meta["requires-python"])
        assert f"Programming Language :: Python :: {minor}" in meta["classifiers"]
    assert "3.9" not in supported
    assert "Typing :: Typed" in meta["classifiers"]
    # the lower bound is the floor the sink checks at run time (twophase.sparkcompat)
    from twophase.sparkcompat import SPARK_FLOOR

    floor = ".".join(map(str, SPARK_FLOOR))
    assert f"pyspark>={floor}" in meta["optional-dependencies"]["spark"]
    assert f"pyspark[connect]>={floor}" in meta["optional-dependencies"]["connect"]


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
    for cmd in ("serve", "txns", "sinks", "force", "demo", "resolve"):
        out = subprocess.run([sys.executable, "-m", "twophase.cli", cmd, "--help"],
                             capture_output=True, text=True, cwd=ROOT, check=False)
        assert out.returncode == 0, (cmd, out.stderr)
        assert "example" in out.stdout, cmd


def test_wheel_claims_no_generic_top_level_names(tmp_path: Path) -> None:
    """Installed, twophase owns only ``twophase``: a user's own packages named ``sinks``
    and ``coordinator`` import side by side with ``twophase.sinks`` and
    ``twophase.coordinator`` (a fresh venv, the built wheel, a plain interpreter)."""
    # Build from a copy (links kept, as git checks them out) so no build/ lands in the tree.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", "tests", "bench"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("twophase-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"twophase"}, tops
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[kafka,postgres]"],
                   check=True, capture_output=True, text=True)
    user = tmp_path / "user"
    for name in ("sinks", "coordinator"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(f'WHO = "the user\'s {name}"\n')
    code = (
        "import sinks, coordinator\n"
        "from twophase import TransactionalSink\n"
        "from twophase.sinks.postgres import PostgresParticipant\n"
        "from twophase.sinks.files import StagedFileParticipant\n"
        "from twophase.sinks.kafka import KafkaParticipant\n"
        "import twophase.coordinator.store, twophase.cli\n"
        "assert sinks.WHO == \"the user's sinks\", sinks.__file__\n"
        "assert coordinator.WHO == \"the user's coordinator\", coordinator.__file__\n"
        "import twophase.sinks, twophase.coordinator\n"
        "assert 'site-packages' in twophase.sinks.__file__, twophase.sinks.__file__\n"
        "assert 'site-packages' in twophase.coordinator.__file__\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([str(py), "-c", code], cwd=user, env=env, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    cli = subprocess.run([str(venv / "bin" / "twophase"), "--help"], cwd=user, env=env,
                         capture_output=True, text=True, check=False)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr
