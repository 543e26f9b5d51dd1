"""bench/restart.py, bench/files_vs_spark.py and bench/tables_vs_spark.py run as a user
runs them (the README's venv interpreter, or for tables_vs_spark the connectors' Spark 4.1
one, the user's environment, no PYSPARK_PYTHON), at their smallest sizes.

Smoke tests: they measure nothing, but each bench checks its own outputs (restart: B
holds every id exactly once after the SIGKILL, A lost none; files_vs_spark: both sides'
Parquet files hold every id once) and exits non-zero when they do not, and the documented
last line must be printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.user import user_env

ROOT = Path(__file__).resolve().parents[2]
NUM = r"-?\d+(?:\.\d+)?"


def _bench(tmp_path: Path, name: str, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), *args, "--dir", str(tmp_path)],
        env=user_env(), cwd=ROOT, capture_output=True, text=True, timeout=500, check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout.strip().splitlines()


@pytest.mark.slow  # CI time (52 s): a bench smoke test; the kills it makes are the kill matrix's
def test_the_restart_bench_kills_and_restarts_both_sides_and_counts_the_rows(
    tmp_path: Path
) -> None:
    lines = _bench(tmp_path, "restart.py", "--pairs", "1", "--rows", "2000",
                   "--kill-after", "0.05")
    text = "\n".join(lines)
    assert re.search(r"^  pair 1 A: restart -> first batch [\d,]+ ms \(to its foreachBatch "
                     r"[\d,]+ ms, the batch -?[\d,]+ ms\); [\d,]+ rows, [\d,]+ duplicates$",
                     text, re.M), text
    # B: exactly once after the kill (the bench exits 1 otherwise), its first batch named
    assert re.search(r"^  pair 1 B: .*, (committed|recovered)\); B's phases \(ms\) .*; "
                     r"6,000 rows, 0 duplicates$", text, re.M), text
    assert re.fullmatch(rf"restart: added_p50={NUM} ms", lines[-1]), text


def test_the_files_bench_compares_with_sparks_own_parquet_sink(tmp_path: Path) -> None:
    lines = _bench(tmp_path, "files_vs_spark.py", "--sizes", "2000", "--pairs", "1",
                   "--batches", "1")
    text = "\n".join(lines)
    assert re.search(r"^  2k pair 1: A [\d,]+ rows/s, B [\d,]+ rows/s, B/A [\d.]+$", text,
                     re.M), text
    assert re.fullmatch(rf"files_vs_spark: load {NUM}; ratio@2k={NUM}", lines[-1]), text


def test_the_tables_bench_names_the_spark_its_connectors_need() -> None:
    # the project's pyspark is newer than Spark's Delta and Iceberg connectors: the bench
    # stops before starting Spark and says which interpreter to use
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tables_vs_spark.py"),
                          "--quick"], env=user_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "python -m tests.support.spark_connectors --bench" in out.stderr, out.stderr


@pytest.mark.slow
def test_the_tables_bench_compares_with_sparks_delta_and_iceberg_sinks(
    tmp_path: Path
) -> None:
    from tests.support.spark_connectors import bench_python

    env = {k: v for k, v in user_env().items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME")}
    if "TWOPHASE_CACHE" in os.environ:  # the jars where bench_python found them
        env["TWOPHASE_CACHE"] = os.environ["TWOPHASE_CACHE"]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    out = subprocess.run([str(bench_python()), str(ROOT / "bench" / "tables_vs_spark.py"),
                          "--quick", "--dir", str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=500, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    text = "\n".join(lines)
    for kind in ("delta", "iceberg"):
        assert re.search(rf"^  {kind} 10k pair 1: A [\d,]+ rows/s, B [\d,]+ rows/s, "
                         r"B/A [\d.]+$", text, re.M), text
    assert re.fullmatch(rf"tables_vs_spark: load {NUM}; delta@10k={NUM} iceberg@10k={NUM}",
                        lines[-1]), text
