"""The driver's fixed cost per batch, counted: py4j round trips and coordinator requests
per phase of ``TransactionalSink``'s batch (``BatchReport.phases``), with their time.

Round trips are counts, not timings, so they compare two versions of the driver on a
loaded machine where milliseconds do not (docs/performance.md, "The fixed costs per
batch"). Runs bench/e2e.py's B (PostgreSQL + Parquet, an embedded SQLite coordinator)
over one query; the first batch (connect, preflight, the first UDF) is left out.

    .venv/bin/python bench/driver_calls.py --size 10000 --batches 6
    .venv/bin/python bench/driver_calls.py --size 0 --batches 6     # empty files
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COUNT = {"py4j": 0, "py4j_s": 0.0, "http": 0, "http_s": 0.0}
REQUESTS: dict[str, list[float]] = defaultdict(list)  # coordinator requests by route, seconds


def _count_py4j() -> None:
    """Every py4j command the driver sends (one round trip each), and its time."""
    import py4j.clientserver
    import py4j.java_gateway

    for cls in (py4j.clientserver.ClientServerConnection, py4j.java_gateway.GatewayConnection):
        original = cls.send_command

        def send(self: Any, command: str, _orig: Any = original) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(self, command)
            finally:
                COUNT["py4j"] += 1
                COUNT["py4j_s"] += time.perf_counter() - t0

        cls.send_command = send  # type: ignore[method-assign]


def _route(request: Any) -> str:
    """A request's route, by its last path segment (begin, votes, acks, a record: get)."""
    last = request.url.path.rstrip("/").rsplit("/", 1)[-1]
    return last if last in ("begin", "votes", "acks", "abandon", "decision",
                            "register") else "get"


def _count_http() -> None:
    """Every coordinator request of the driver's client, and its time by route."""
    import httpx

    original = httpx.Client.send

    def send(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            took = time.perf_counter() - t0
            COUNT["http"] += 1
            COUNT["http_s"] += took
            REQUESTS[_route(a[0] if a else kw["request"])].append(took)

    httpx.Client.send = send  # type: ignore[method-assign]


def _per_phase(store: list[dict[str, tuple[int, float, int, float]]]) -> None:
    """Each lap of a batch records the counters' growth in its phase."""
    try:
        from twophase.engine.report import Laps
    except ImportError:  # an older tree: the driver's own
        from twophase.driver import _Laps as Laps  # type: ignore[attr-defined,no-redef]

    original_init, original_lap = Laps.__init__, Laps.lap

    def init(self: Any, started: float) -> None:
        original_init(self, started)
        self._mark = (COUNT["py4j"], COUNT["py4j_s"], COUNT["http"], COUNT["http_s"])
        self._calls = {}
        store.append(self._calls)

    def lap(self: Any, phase: str) -> None:
        original_lap(self, phase)
        now = (COUNT["py4j"], COUNT["py4j_s"], COUNT["http"], COUNT["http_s"])
        c, s, h, hs = self._calls.get(phase, (0, 0.0, 0, 0.0))
        self._calls[phase] = (c + now[0] - self._mark[0], s + now[1] - self._mark[1],
                              h + now[2] - self._mark[2], hs + now[3] - self._mark[3])
        self._mark = now

    Laps.__init__ = init  # type: ignore[method-assign]
    Laps.lap = lap  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=10000, help="rows per batch (0: empty files)")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--runs", type=int, default=1, help="queries, one after another")
    args = ap.parse_args(argv)

    import pyarrow as pa

    from bench.e2e import Setup, run_query

    try:
        from bench.rss import WorkerRss
    except ImportError:  # an older tree (to compare with): the sampler was in e2e.py
        from bench.e2e import WorkerRss  # type: ignore[attr-defined,no-redef]
    from twophase.testing.job import place_batch, spark_session, write_input
    from twophase.testing.localpg import LocalPostgres

    _count_py4j()
    _count_http()
    calls: list[dict[str, tuple[int, float, int, float]]] = []
    _per_phase(calls)
    work = Path(tempfile.mkdtemp(prefix="twophase-calls-"))
    pg = LocalPostgres(fsync=True).start()
    try:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = spark_session({})
        setup = Setup(spark, work, pg.dsn, WorkerRss())
        inp = work / "in"
        if args.size:
            write_input(str(inp), batches=args.batches, rows_per_batch=args.size)
        else:
            write_input(str(inp), batches=1, rows_per_batch=1000)
            for i in range(1, args.batches):
                place_batch(inp, i, pa.table({"id": pa.array([], pa.int64())}))
        phases: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.runs):
            mark = len(calls)
            run = run_query(setup, str(inp), "B")
            for ph in run.phases[1:]:
                for k, v in ph.items():
                    phases[k].append(v)
            for batch in calls[mark + 1:]:
                for k, (c, s, h, hs) in batch.items():
                    phases[f"{k}#py4j"].append(c)
                    phases[f"{k}#py4j_s"].append(s)
                    phases[f"{k}#http"].append(h)
                    phases[f"{k}#http_s"].append(hs)
        import twophase

        print(f"driver_calls: twophase from {Path(twophase.__file__).parent}, size "
              f"{args.size}, {args.batches - 1} measured batches x {args.runs}; load "
              f"{os.getloadavg()[0]:.1f}")
        order = ("frame_s", "split_s", "setup_s", "begin_s", "settle_s", "plan_s", "job_s",
                 "decide_s", "driver_commit_s", "driver_s")
        for k in order:
            if k not in phases:
                continue
            print(f"  {k:16s} p50 {1000 * statistics.median(phases[k]):7.2f} ms; py4j "
                  f"{statistics.median(phases.get(k + '#py4j', [0])):5.0f} calls "
                  f"({1000 * statistics.median(phases.get(k + '#py4j_s', [0])):6.2f} ms); "
                  f"coordinator {statistics.median(phases.get(k + '#http', [0])):3.0f} "
                  f"({1000 * statistics.median(phases.get(k + '#http_s', [0])):5.2f} ms)")
        print("  coordinator requests p50 (ms, every batch of every run): " + ", ".join(
            f"{route} {1000 * statistics.median(took):.2f} (x{len(took)})"
            for route, took in sorted(REQUESTS.items())))
        spark.stop()
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
