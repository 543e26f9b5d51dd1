"""Load: 100 concurrent sinks on one daemon, and on two replicas sharing one PostgreSQL
store, for ``TWOPHASE_LOAD_SECONDS`` (default 600) each. Slow; run with

    TWOPHASE_LOAD_SECONDS=600 python -m pytest tests/coordinator/test_load.py -m slow -s

Each sink is a thread doing what a driver and its tasks do per batch over HTTP: begin,
two branch votes, the decision, two acks. At the end every transaction of every sink must
be COMMITTED with every branch acknowledged COMMIT, batch ids without gaps: 0 lost,
0 contradictory decisions. Latency percentiles of a whole batch (begin -> last ack) and
the throughput are printed and written to ``load-report.json`` in the test's folder.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pg import fresh_pg_db
from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.errors import TwophaseError
from twophase.testing.servers import LocalDaemon

pytestmark = pytest.mark.slow

TOKEN = "load-token-0123456789"
SINKS = 100


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else 0.0


def run_load(urls: list[str], seconds: float, sinks: int = SINKS) -> dict[str, object]:
    latencies: list[float] = []
    errors: list[str] = []
    done: dict[str, int] = {}
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    run = uuid.uuid4().hex[:6]

    def sink_loop(i: int) -> None:
        url = urls[i % len(urls)]
        name = f"load-{run}-{i}"
        c = CoordinatorClient(url, TOKEN, retry_budget=60.0)
        try:
            epoch = c.register(name)
            batch = 0
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                res = c.begin(name, "lin", batch, epoch, ["pg", "files"], 1, 60.0)
                assert res.txn is not None
                key = res.txn.key
                c.vote(key, epoch, [VoteIn("pg/0", True, {"gid": f"g{batch}"})])
                t = c.vote(key, epoch, [VoteIn("files/0", True, {"file": f"f{batch}"})])
                if t.decision is None:
                    t = c.await_decision(key, 30)
                c.ack(key, epoch, [("pg/0", t.decision), ("files/0", t.decision)])
                with lock:
                    latencies.append(time.perf_counter() - t0)
                batch += 1
            with lock:
                done[name] = batch
        except (TwophaseError, AssertionError) as exc:
            with lock:
                errors.append(f"{name}: {exc}")
        finally:
            c.close()

    threads = [threading.Thread(target=sink_loop, args=(i,)) for i in range(sinks)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    # every transaction of every sink, as the store has it
    check = CoordinatorClient(urls[0], TOKEN)
    lost = contradictory = 0
    for name, n in done.items():
        txns = check.list(sink=name, limit=10_000)
        by_batch = {t.batch_id: t for t in txns}
        lost += sum(1 for b in range(n) if b not in by_batch
                    or by_batch[b].state.value != "COMMITTED")
        contradictory += sum(
            1 for t in txns for br in t.branches.values()
            if t.decision is None or br.vote is None or br.ack != t.decision)
    check.close()
    return {
        "sinks": sinks, "replicas": len(urls), "seconds": round(wall, 1),
        "batches": len(latencies), "batches_per_s": round(len(latencies) / wall, 1),
        "lost": lost, "contradictory": contradictory, "errors": errors[:5],
        "error_count": len(errors),
        "latency_ms": {
            "p50": round(_pct(latencies, 50) * 1000, 1),
            "p90": round(_pct(latencies, 90) * 1000, 1),
            "p99": round(_pct(latencies, 99) * 1000, 1),
            "max": round(max(latencies, default=0) * 1000, 1),
            "mean": round(statistics.fmean(latencies) * 1000, 1) if latencies else 0.0,
        },
    }


SECONDS = float(os.environ.get("TWOPHASE_LOAD_SECONDS", "600"))


@pytest.fixture
def report(tmp_path: Path) -> Iterator[list[dict[str, object]]]:
    out: list[dict[str, object]] = []
    yield out
    (tmp_path / "load-report.json").write_text(json.dumps(out, indent=2))


@pytest.mark.parametrize("replicas", [1, 2])
def test_100_sinks(replicas: int, pg_dsn: str, tmp_path: Path,
                   report: list[dict[str, object]]) -> None:
    store = fresh_pg_db(pg_dsn, "tp_load")
    daemons = [LocalDaemon(store, TOKEN, tmp_path / f"d{i}.log").start()
               for i in range(replicas)]
    try:
        res = run_load([d.url for d in daemons], SECONDS)
    finally:
        for d in daemons:
            d.stop()
    report.append(res)
    print(json.dumps(res))
    assert res["error_count"] == 0, res["errors"]
    assert res["lost"] == 0 and res["contradictory"] == 0, res
    assert int(res["batches"]) > SINKS  # type: ignore[call-overload]
