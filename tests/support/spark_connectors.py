"""Spark's own Delta and Iceberg connectors, to read back with Spark the tables twophase
writes (issue 32): the jars from Maven Central and a Spark they are built for.

The connectors follow Spark's minor version closely and lag it: ``pip install pyspark``
gives a Spark newer than any published connector (4.3 while Delta 4.3.1 is built for
Spark 4.1 and Iceberg's newest runtime is ``iceberg-spark-runtime-4.1``; on Spark 4.3
both fail at their first query). So the reader is its own process with its own pyspark,
``READER_PYSPARK``, in a virtual environment of its own, beside the connectors' jars:

- jars: ``mvn package`` of ``tools/spark-connectors/pom.xml`` (the versions are its
  properties) into ``<cache>/spark-connectors-<versions>/``;
- the reader's interpreter: ``<cache>/spark-reader-pyspark<READER_PYSPARK>/``.

``<cache>`` is ``$TWOPHASE_CACHE`` or ``~/.cache/twophase``. Each is made once (under a
lock, so concurrent test processes wait for one another) and reused; ``scripts/test.sh``
makes both before pytest (``python -m tests.support.spark_connectors``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
POM = ROOT / "tools" / "spark-connectors" / "pom.xml"
READER = Path(__file__).resolve().with_name("spark_reader.py")
READER_PYSPARK = "4.1.4"
"""The Spark the reader runs: the newest one both connectors in the pom are built for."""
_DONE = ".complete"


class MissingTool(RuntimeError):
    """A program the connectors need is not installed; the message names the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("TWOPHASE_CACHE") or Path.home() / ".cache" / "twophase")


def versions() -> dict[str, str]:
    """The pom's properties: delta.version, iceberg.spark, iceberg.version, ..."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    props = ET.parse(POM).getroot().find("m:properties", ns)
    assert props is not None, f"{POM} has no <properties>"
    return {el.tag.split("}", 1)[1]: (el.text or "").strip() for el in props}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _need(tool: str, package: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise MissingTool(
            f"{tool} not found: the Spark connector tests resolve Spark's Delta and Iceberg "
            f"jars from Maven Central with Maven and Java. Fix: apt-get install {package} "
            "(scripts/test.sh installs it when missing)"
        )
    return found


def connector_jars() -> list[Path]:
    """The connectors' jars (Delta, Iceberg's Spark runtime, SQLite's JDBC driver),
    resolved from Maven Central the first time, then from the cache."""
    v = versions()
    folder = cache_root() / (
        f"spark-connectors-delta{v['delta.version']}-iceberg{v['iceberg.version']}"
        f"-spark{v['iceberg.spark']}-sqlite{v['sqlite.jdbc.version']}")
    if not (folder / _DONE).exists():
        with _locked(folder.with_name(folder.name + ".lock")):
            if not (folder / _DONE).exists():
                _resolve(folder)
    jars = sorted(folder.glob("*.jar"))
    assert jars, f"{folder} holds no jar; delete it to resolve again"
    return jars


def _resolve(folder: Path) -> None:
    _need("java", "openjdk-17-jre-headless")
    mvn = _need("mvn", "maven")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(
        [mvn, "-q", "-B", "-f", str(POM), f"-Dconnectors.dir={tmp}", "package"],
        cwd=POM.parent, capture_output=True, text=True, timeout=1200, check=False)
    shutil.rmtree(POM.parent / "target", ignore_errors=True)
    if proc.returncode != 0 or not list(tmp.glob("*.jar")):
        raise MissingTool(
            f"Maven could not resolve the Spark connectors of {POM} (exit "
            f"{proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}\nFix: let Maven "
            "reach Maven Central (~/.m2/settings.xml for a mirror or proxy), then run "
            "`python -m tests.support.spark_connectors` again")
    (tmp / _DONE).touch()
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def reader_python() -> Path:
    """The interpreter of the reader's virtual environment (pyspark ``READER_PYSPARK``
    only), made the first time from this interpreter's ``venv`` and pip."""
    folder = cache_root() / f"spark-reader-pyspark{READER_PYSPARK}"
    python = folder / "bin" / "python"
    if not (folder / _DONE).exists():
        with _locked(folder.with_name(folder.name + ".lock")):
            if not (folder / _DONE).exists():
                shutil.rmtree(folder, ignore_errors=True)
                for cmd in ([sys.executable, "-m", "venv", str(folder)],
                            [str(python), "-m", "pip", "install", "-q",
                             f"pyspark=={READER_PYSPARK}"]):
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                                          check=False)
                    if proc.returncode != 0:
                        raise MissingTool(
                            f"cannot make the Spark reader's environment {folder} "
                            f"({' '.join(cmd[:4])}: exit {proc.returncode}): "
                            f"{(proc.stdout + proc.stderr)[-2000:]}\nFix: let pip reach "
                            "PyPI (or its mirror), then run "
                            "`python -m tests.support.spark_connectors` again")
                (folder / _DONE).touch()
    return python


def bench_python() -> Path:
    """The reader's interpreter with twophase's own dependencies added (its core, the
    ``spark``, ``delta`` and ``iceberg`` extras from pyproject.toml, pyspark kept at
    ``READER_PYSPARK``), for ``bench/tables_vs_spark.py``, which runs TransactionalSink
    beside Spark's connectors in one Spark; twophase itself comes from ``PYTHONPATH``."""
    python = reader_python()
    done = python.parent.parent / ".bench-complete"
    if not done.exists():
        with _locked(python.parent.parent.with_name(python.parent.parent.name + ".lock")):
            if not done.exists():
                cmd = [str(python), "-m", "pip", "install", "-q",
                       f"pyspark=={READER_PYSPARK}", *bench_requirements()]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                                      check=False)
                if proc.returncode != 0:
                    raise MissingTool(
                        f"cannot add twophase's dependencies to {python} (exit "
                        f"{proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}\nFix: "
                        "let pip reach PyPI (or its mirror), then run "
                        "`python -m tests.support.spark_connectors --bench` again")
                done.touch()
    return python


def bench_requirements() -> list[str]:
    """twophase's dependencies and its spark, delta and iceberg extras, less pyspark."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("spark", "delta", "iceberg"):
        reqs += project["optional-dependencies"][extra]
    return sorted({r for r in reqs if not r.startswith("pyspark")})


def spark_read(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run ``spark_reader.py`` on ``spec`` in its own JVM with the connectors; returns
    what it read. Its stderr (Spark's log) goes to ``log``."""
    python, jars = reader_python(), connector_jars()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH", "SPARK_HOME")}
    env.update(PYSPARK_PYTHON=str(python), SPARK_LOCAL_IP="127.0.0.1", TZ="UTC")
    with open(log, "w") as err:
        proc = subprocess.run(
            [str(python), str(READER), json.dumps({**spec, "jars": [str(j) for j in jars]})],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, \
        f"the Spark reader failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


if __name__ == "__main__":
    print("spark connectors:", *connector_jars(), sep="\n  ")
    print("spark reader:", reader_python())
    if "--bench" in sys.argv[1:]:
        print("bench (reader + twophase's dependencies):", bench_python())
