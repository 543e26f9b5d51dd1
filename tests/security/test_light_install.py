"""The light install explains itself: in a virtualenv holding twophase without extras
(a real ``pip install`` of this checkout), every command's ``--help`` works, and each
path that needs an optional module fails as one line naming the extra to install, with
no traceback.

The virtualenv with the core dependencies is built once per machine (keyed by the core
dependency list and the Python version, under ~/.cache/twophase); each session only
reinstalls twophase into it (a few seconds)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["serve", "txns", "sinks", "force", "demo", "resolve", "chaos"]
OPTIONAL = ["psycopg", "pyarrow", "pyspark", "confluent_kafka", "boto3", "pyiceberg",
            "deltalake", "pymysql"]


_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BUILD = _PROJECT["build-system"]["requires"]


def _venv_dir() -> Path:
    deps = _PROJECT["project"]["dependencies"]
    key = hashlib.sha256(repr((sorted(deps), BUILD, sys.version_info[:2])).encode()
                         ).hexdigest()
    return Path.home() / ".cache" / "twophase" / f"light-venv-{key[:16]}"


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The light virtualenv's bin folder, with this checkout installed (no extras)."""
    venv = _venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions build it once
        if not (venv / "ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            # the build backend too, so that each session's reinstall needs no isolated
            # build environment (pyproject's [build-system])
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *BUILD, str(ROOT)],
                           check=True, timeout=600)
            (venv / "ready").touch()
        else:
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps",
                            "--no-build-isolation", "--force-reinstall", str(ROOT)],
                           check=True, timeout=300)
    yield venv / "bin"


def _twophase(light: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TWOPHASE_", "PYTHON", "VIRTUAL_ENV"))}
    env["TWOPHASE_TOKEN"] = "light-install-token-0123"
    return subprocess.run([str(light / "twophase"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _one_line(proc: subprocess.CompletedProcess[str], extra: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("{")]  # log lines
    assert len(lines) == 1 and f"twophase[{extra}]" in lines[0], proc.stderr


def test_the_light_install_has_no_extras(light: Path) -> None:
    code = f"import importlib.util as u; print([m for m in {OPTIONAL!r} if u.find_spec(m)])"
    out = subprocess.run([str(light / "python"), "-c", code], capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_helps(light: Path, tmp_path: Path, command: str) -> None:
    proc = _twophase(light, tmp_path, command, "--help")
    assert proc.returncode == 0 and "usage: twophase" in proc.stdout, proc.stderr


def test_missing_extras_are_one_line_naming_them(light: Path, tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'l.db'}"
    make = (
        "from twophase.coordinator.store import Store\n"
        f"s = Store({store!r})\n"
        "s.register('files', [{'kind': 'files', 'name': 'files', 'target': 't', "
        f"'options': {{'path': {str(tmp_path / 'out')!r}, 'format': 'parquet'}}}}])\n"
        "s.register('pg', [{'kind': 'postgres', 'name': 'pg', 'target': 't', 'options': "
        "{'dsn': 'host=127.0.0.1 port=1', 'schema': 'public', 'table': 't', "
        "'marker_table': 'm', 'create': True, 'connect_timeout': 1.0, 'secrets': ''}}])\n"
        "s.close()\n")
    subprocess.run([str(light / "python"), "-c", make], check=True, timeout=60, cwd="/")
    _one_line(_twophase(light, tmp_path, "serve", "--store", "postgresql://u@127.0.0.1:1/d"),
              "postgres")
    _one_line(_twophase(light, tmp_path, "resolve", "files", "--coordinator", store,
                        "--dry-run"), "spark")
    _one_line(_twophase(light, tmp_path, "resolve", "pg", "--coordinator", store,
                        "--dry-run"), "postgres")
    demo = _twophase(light, tmp_path, "demo")  # says so on its console (stdout)
    assert demo.returncode == 2 and "Traceback" not in demo.stderr
    assert demo.stdout.count("\n") == 1 and "twophase\\[all]" not in demo.stdout \
        and "twophase[all]" in demo.stdout, demo.stdout
    chaos = _twophase(light, tmp_path, "chaos", "--workdir", str(tmp_path / "chaos"))
    assert "Traceback" not in chaos.stderr and "twophase[postgres]" in chaos.stderr
    for command in ("txns", "sinks"):  # the core install reads a store by itself
        assert _twophase(light, tmp_path, command, "--coordinator", store).returncode == 0
