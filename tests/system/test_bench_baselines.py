"""bench/restart.py and bench/files_vs_spark.py run as a user runs them (the README's venv
interpreter, the user's environment, no PYSPARK_PYTHON), at their smallest sizes.

Smoke tests: they measure nothing, but each bench checks its own outputs (restart: B
holds every id exactly once after the SIGKILL, A lost none; files_vs_spark: both sides'
Parquet files hold every id once) and exits non-zero when they do not, and the documented
last line must be printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
