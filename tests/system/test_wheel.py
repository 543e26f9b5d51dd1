"""The release as a user gets it: ``python -m build`` makes the sdist and the wheel (the
wheel from the sdist), ``twine check`` passes on both, and a clean venv that holds only the
wheel and its dependencies (not editable, no checkout on the path) runs ``twophase demo``
and a smoke job per extra (tests/support/wheel_smoke.py) against the suite's servers.

One build and one venv for the module (~2 minutes on 2 cores: the venv's install is most
of it, from pip's cache after the suite's own install).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import twophase
from twophase.testing.localmariadb import LocalMariaDB
from twophase.testing.locals3 import LocalS3

ROOT = Path(__file__).resolve().parents[2]
VERSION = twophase.__version__
# one worker builds and installs (pytest-xdist: the module's tests share its fixtures)
pytestmark = pytest.mark.xdist_group("wheel")
# what the package reads beside its modules ([tool.setuptools.package-data])
PACKAGE_DATA = {"twophase/py.typed", "twophase/testing/kafka-broker.pom.xml",
                "twophase/testing/spark-kafka.pom.xml", "twophase/testing/s3a.pom.xml"}


def _clean_env() -> dict[str, str]:
    """The environment without anything that would put this checkout on the path."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel, built from a copy of the checkout (its links kept, as git
    checks them out), so no build/ or egg-info lands in the tree."""
    base = tmp_path_factory.mktemp("build")
    src = base / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    out = base / "dist"
    res = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob(f"twophase-{VERSION}-py3-none-any.whl")
    return wheel


def _package_files() -> set[str]:
    """Every module and data file of the package in the checkout, through its links
    (twophase/sinks -> ../sinks, twophase/coordinator -> ../coordinator)."""
    found = set()
    for folder, dirs, files in os.walk(ROOT / "twophase", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(folder).relative_to(ROOT)
        found |= {f"{rel}/{f}" for f in files if f.endswith(".py")}
    return found | PACKAGE_DATA


def test_twine_check_passes_on_the_sdist_and_the_wheel(dist: Path) -> None:
    files = sorted(str(p) for p in dist.iterdir())
    assert len(files) == 2, files
    res = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_wheel_holds_every_module_and_data_file_as_real_files(dist: Path) -> None:
    """The wheel has exactly the package's modules and data files (the Maven poms the
    jar resolvers read, py.typed), the linked folders as real files, and claims no other
    top-level name (a user's own ``sinks`` or ``coordinator`` stays theirs)."""
    with zipfile.ZipFile(_wheel(dist)) as zf:
        infos = zf.infolist()
    names = {i.filename for i in infos}
    tops = {n.split("/")[0] for n in names}
    assert tops == {"twophase", f"twophase-{VERSION}.dist-info"}, tops
    assert {n for n in names if n.startswith("twophase/")} == _package_files()
    assert "twophase/sinks/kafka/participant.py" in names
    assert "twophase/coordinator/ui.py" in names  # the console (its page is rendered here)
    assert f"twophase-{VERSION}.dist-info/licenses/LICENSE" in names  # Apache-2.0's text
    links = [i.filename for i in infos if stat.S_ISLNK(i.external_attr >> 16)]
    assert links == [], links
    with tarfile.open(next(dist.glob("*.tar.gz"))) as tf:
        members = tf.getmembers()
    assert not [m.name for m in members if m.issym() or m.islnk()]
    sdist = {m.name.split("/", 1)[1] for m in members if m.isfile()}
    assert _package_files() <= sdist, sorted(_package_files() - sdist)


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new venv with the wheel and every extra (pip's cache serves the dependencies the
    suite's own install fetched; no bytecode compile: this venv is used once)."""
    where = tmp_path_factory.mktemp("wheelvenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    res = subprocess.run(
        [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
         "--disable-pip-version-check", f"{_wheel(dist)}[all]"],
        capture_output=True, text=True, timeout=1200, check=False, env=_clean_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _run(venv: Path, cwd: Path, *argv: str, timeout: float = 300) -> str:
    res = subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, env=_clean_env(),
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert res.returncode == 0, (argv[:3], res.stdout[-4000:], res.stderr[-4000:])
    return res.stdout


def test_installed_wheel_is_the_package_and_leaves_user_names_alone(
        venv: Path, tmp_path: Path) -> None:
    """From a folder holding a user's own ``sinks`` and ``coordinator`` packages: they
    import side by side with ``twophase.sinks`` and ``twophase.coordinator``, which come
    from the venv's site-packages (not this checkout), and ``twophase --version`` is the
    package's one version (pyproject.toml reads ``twophase.__version__``)."""
    for name in ("sinks", "coordinator"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'WHO = "the user\'s {name}"\n')
    code = (
        "import sys; sys.path.insert(0, '')\n"  # the user's folder, as `python` there has
        "import importlib.metadata as md, sinks, coordinator, twophase\n"
        "from twophase import TransactionalSink\n"
        "import twophase.sinks.kafka, twophase.sinks.postgres, twophase.coordinator.app\n"
        "assert sinks.WHO == \"the user's sinks\", sinks.__file__\n"
        "assert coordinator.WHO == \"the user's coordinator\", coordinator.__file__\n"
        f"site = {str(venv)!r}\n"
        "for m in (twophase, twophase.sinks, twophase.coordinator):\n"
        "    assert m.__file__.startswith(site) and 'site-packages' in m.__file__, m.__file__\n"
        "print(twophase.__version__, md.version('twophase'))\n"
    )
    out = _run(venv, tmp_path, "python", "-I", "-c", code)
    assert out.split() == [VERSION, VERSION], out
    assert _run(venv, tmp_path, "twophase", "--version").strip() == f"twophase {VERSION}"
    assert "serve" in _run(venv, tmp_path, "twophase", "--help")


def test_installed_wheel_runs_the_demo_exactly_once(venv: Path, tmp_path: Path) -> None:
    """``twophase demo --kafka-bootstrap local`` from the wheel: Spark, a private
    PostgreSQL, staged Parquet files and a Kafka topic on a private Apache Kafka (its jars
    through the wheel's Maven pom; the spark, postgres and kafka extras), every id exactly
    once in each, Kafka judged from its log with a read_committed consumer agreeing."""
    out = _run(venv, tmp_path, "twophase", "demo", "--batches", "3", "--rows-per-batch",
               "100", "--partitions", "2", "--workdir", str(tmp_path / "demo"),
               "--kafka-bootstrap", "local", "--json", timeout=600)
    report, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
    systems = {s["kind"]: s for s in report["systems"]}
    assert set(systems) == {"postgres", "files", "kafka"}, systems
    for system in systems.values():
        assert system["ok"] and system["exact"] and system["rows"] == 300, system
        assert system["duplicates"] == system["missing"] == 0, system
    assert systems["kafka"]["open_transactions"] == 0
    assert "a read_committed consumer agrees" in systems["kafka"]["note"], systems["kafka"]


def test_installed_wheel_runs_a_smoke_job_per_extra(
        venv: Path, tmp_path: Path, mariadb_server: LocalMariaDB, s3: LocalS3,
        s3_bucket: str) -> None:
    """Delta, Iceberg, SQL (MariaDB), S3 and Spark Connect's client, from the wheel: each
    participant's prepared rows stay invisible until its commit, then read back exactly."""
    args = {"mariadb": mariadb_server.url, "s3": s3.storage_options, "bucket": s3_bucket,
            "workdir": str(tmp_path / "work")}
    source = (ROOT / "tests" / "support" / "wheel_smoke.py").read_text()
    out = _run(venv, tmp_path, "python", "-I", "-c", source, json.dumps(args))
    assert out.split("\n")[:-1] == [f"ok {x}" for x in
                                    ("delta", "iceberg", "sql", "s3", "connect")], out


def test_installation_page_names_the_wheel_this_version_builds() -> None:
    """installation.md's commands name the files ``python -m build`` makes of this
    version (a version bump that leaves the page behind fails here)."""
    page = (ROOT / "docs" / "user" / "installation.md").read_text(encoding="utf-8")
    named = set(re.findall(r"twophase-(\d[\w.]*?)(?:-py3-none-any\.whl|\.tar\.gz)", page))
    assert named == {VERSION}, named
    assert f"dist/twophase-{VERSION}-py3-none-any.whl[all]" in page
