"""The vote's content digest (twophase.digest): µs per row of the current kind (v2,
vectorised over Arrow buffers) against the older kind (b2s1, a Python repr per row).

Reproduce (from the repository root)::

    .venv/bin/python bench/digest.py                 # 100k rows, best of 5
    .venv/bin/python bench/digest.py --rows 1000000 --repeats 3

The table is the one ``bench/e2e.py`` writes (id, label, value) plus a wider one with a
timestamp, a decimal and a boolean; rows are cut in 10,000-row Arrow batches as Spark
hands them over. Last line: ``digest: v2=<µs/row> b2s1=<µs/row> speedup=<x>`` (wide table).
"""

from __future__ import annotations

import argparse
import decimal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from twophase.digest import LEGACY, VERSION, rows_digest  # noqa: E402


def tables(n: int) -> dict[str, pa.Table]:
    rng = np.random.default_rng(1)
    ids = np.arange(n, dtype=np.int64)
    narrow = pa.table({"id": pa.array(ids), "label": pa.array([f"row-{i}" for i in range(n)]),
                       "value": pa.array(rng.random(n))})
    wide = narrow.append_column("ts", pa.array(ids * 1000, pa.timestamp("us", "UTC")))
    wide = wide.append_column("amount", pa.array([decimal.Decimal(i) / 100 for i in range(n)],
                                                 pa.decimal128(12, 2)))
    wide = wide.append_column("flag", pa.array(ids % 2 == 0))
    return {"narrow (3 cols)": narrow, "wide (6 cols)": wide}


def us_per_row(t: pa.Table, kind: str, repeats: int) -> float:
    batches = t.to_batches(max_chunksize=10_000)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows_digest(t.schema, batches, kind)
        best = min(best, time.perf_counter() - t0)
    return best / t.num_rows * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    last = (0.0, 0.0)
    print(f"{'table':<16} {VERSION + ' µs/row':>12} {LEGACY + ' µs/row':>14} {'speedup':>8}")
    for name, t in tables(args.rows).items():
        new = us_per_row(t, VERSION, args.repeats)
        old = us_per_row(t, LEGACY, max(1, args.repeats // 2))
        print(f"{name:<16} {new:>12.3f} {old:>14.2f} {old / new:>7.0f}x")
        last = (new, old)
    new, old = last
    print(f"digest: {VERSION}={new:.3f} {LEGACY}={old:.2f} speedup={old / new:.0f}x")


if __name__ == "__main__":
    main()
