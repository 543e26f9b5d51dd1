"""``IcebergParticipant.commit_batch`` alone, no Spark: does a commit grow with the
table's history? One 1,000-row file a batch, prepared by the Python path, committed
into one table (a SQL catalog on SQLite); prints the p50 per 10 batches (ms).
docs/performance.md, wt-icebergspeed. Reproduce: ``PYTHONPATH=$PWD .venv/bin/python
bench/iceberg_commit.py --batches 60``."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from twophase.participant import BranchRef  # noqa: E402
from twophase.protocol import TxnKey  # noqa: E402
from twophase.sinks.iceberg import IcebergParticipant  # noqa: E402
from twophase.testing.job import write_input  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=60)
    args = ap.parse_args(argv)
    import pyarrow.parquet as pq
    from pyiceberg.catalog import load_catalog

    work = Path(tempfile.mkdtemp(prefix="twophase-icecommit-"))
    (work / "wh").mkdir()
    props = {"type": "sql", "uri": f"sqlite:///{work}/cat.db",
             "warehouse": f"file://{work}/wh"}
    load_catalog("lake", **props).create_namespace("b")
    part = IcebergParticipant("b.t", {**props, "name": "lake"}, name="ice", native=False)
    write_input(work / "in", batches=1, rows_per_batch=1000)
    table = pq.read_table(next((work / "in").glob("*.parquet")))
    part.check(table.schema)
    ms = []
    for b in range(args.batches):
        handle = part.prepare(BranchRef("s", "lin", b, 1, "ice", 0), table.schema,
                              table.to_batches())
        t0 = time.perf_counter()
        part.commit_batch(TxnKey("s", "lin", b, 1), {0: handle})
        ms.append((time.perf_counter() - t0) * 1000)
    print("iceberg_commit: commit_batch p50 ms per 10 batches: " + " ".join(
        f"{statistics.median(ms[i:i + 10]):.1f}" for i in range(0, len(ms), 10)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
