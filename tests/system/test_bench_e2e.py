"""bench/e2e.py runs as a user runs it: the README's venv interpreter, no PYSPARK_PYTHON.

A smoke test at the smallest sizes (it measures nothing): the bench once failed from the
README's venv because the at-least-once side's workers ran ``python3`` without pyarrow
(fixed in 60fcd64), and nothing ran it that way. Here it runs as a real subprocess of this
interpreter with the user's environment (``tests/support/user.py``), and must exit 0 and
print every section and the documented last line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.user import user_env
from twophase.sinks.kafka.staged import DEFAULT_PREPARE

ROOT = Path(__file__).resolve().parents[2]
NUM = r"-?\d+(?:\.\d+)?"
LAST = re.compile(
    rf"^e2e: ratio@100k=(?:{NUM}|n/a) ratio@1M=(?:{NUM}|n/a) "
    rf"added_p50@100k=(?:{NUM}|n/a) ms empty_batch_p50=({NUM}) ms "
    rf"empty_relation_p50=({NUM}) ms ratio@10k=(?:{NUM}|n/a) added_p50@10k=(?:{NUM}|n/a) ms "
    rf"empty_added_p50=({NUM}) ms kafka_ratio@100k=(?:{NUM}|n/a) "
    rf"kafka_ratio@1M=(?:{NUM}|n/a)$"
)


def test_the_e2e_bench_runs_from_the_venv_as_a_user_runs_it(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "e2e.py"), "--sizes", "2000", "--pairs", "1",
         "--batches", "1", "--empty-batches", "2", "--empty-relations", "2",
         "--kafka-sizes", "2000", "--kafka-pairs", "1", "--dir", str(tmp_path)],
        env=user_env(), cwd=ROOT, capture_output=True, text=True, timeout=500, check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    text = "\n".join(lines)
    assert lines[0].startswith("e2e: Spark ") and "PostgreSQL + Parquet" in lines[0], text
    assert re.search(rf"^  2k pair 1: A [\d,]+ rows/s, B [\d,]+ rows/s, B/A {NUM};", text,
                     re.M), text
    assert re.search(rf"^2k: B/A rows/s per pair \[{NUM}\] median {NUM}$", text, re.M), text
    assert re.search(rf"^2k: A batch p50 {NUM} ms, B batch p50 {NUM} ms; added p50 {NUM} ms",
                     text, re.M), text
    assert re.search(rf"^empty file: A batch p50 {NUM} ms, B batch p50 {NUM} ms", text,
                     re.M), text
    assert re.search(rf"^empty relation \(2 calls per side, .*\): A p50 {NUM} ms, p99 {NUM} "
                     rf"ms; B p50 {NUM} ms, p99 {NUM} ms$", text, re.M), text
    # B's batch split by phase, as the sink measured it
    assert re.search(rf"^2k: A's job p50 \(ms\) {NUM} \[Spark's part {NUM}; slowest task "
                     rf"{NUM}\]$", text, re.M), text
    phase = (rf"B's phases p50 \(ms\): frame {NUM}, split {NUM}, setup {NUM}, begin {NUM}, "
             rf"plan {NUM}, job {NUM} ")
    assert re.search(rf"^2k: {phase}\[Spark's part {NUM}; slowest task {NUM} = prepare {NUM}"
                     rf"\], decide {NUM}, driver's commit {NUM}, settle {NUM}, driver {NUM}; "
                     rf"A's whole batch p50 {NUM}$", text, re.M), text
    assert re.search(rf"^empty file: {phase}", text, re.M), text
    # the Kafka section (by default), its warm-up counted in the topic's log
    assert re.search(rf"^kafka section: .*Apache Kafka; B's prepare {DEFAULT_PREPARE}", text,
                     re.M), text
    assert re.search(r"^  warm-up B: 2000 rows written, 2000 committed records", text,
                     re.M), text
    assert re.search(rf"^kafka 2k: B/A rows/s per pair \[{NUM}\] median {NUM}$", text,
                     re.M), text
    assert re.search(rf"^restart: .* {NUM} ms$", text, re.M), text
    assert LAST.match(lines[-1]), lines[-1]
    assert not list(tmp_path.iterdir())  # its work folder is removed
