"""A Kafka batch prepared resumable vs staged, same rows, one broker.

Reproduce (from the repository root, with the dev venv)::

    .venv/bin/python bench/kafka_staged.py                    # Apache Kafka, 10k + 100k
    .venv/bin/python bench/kafka_staged.py --bootstrap host:9092 --sizes 10000

A batch of ``--branches`` partitions (threads, as tasks) prepares ``rows / branches`` rows
each, then every branch is committed by a fresh unpickled object in a thread per branch,
as the driver's Committer does. Runs alternate resumable / staged on fresh topics, with one
participant name and one staging topic, so the staged commit pool, its readers and the
staging producer are warm after the first run (a long-running query's steady state).
Printed: prepare, commit and total seconds per mode (median of ``--repeats``), and staged/resumable.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kafka_topics import new_topic  # noqa: E402
from bench.participants_kafka import make_batch  # noqa: E402
from twophase.participant import BranchRef  # noqa: E402
from twophase.sinks.kafka import KafkaParticipant  # noqa: E402

STAGING = f"bench-staging-{uuid.uuid4().hex[:8]}"
"""One staging topic for every run, as a sink keeps one for its life."""


def run(bootstrap: str, mode: str, rows: int, branches: int) -> tuple[float, float]:
    topic = new_topic(bootstrap)
    p = KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, name="bench-kafka",
                         prepare=mode, staging_topic=STAGING)
    batch = make_batch(rows // branches)
    p.check(batch.schema)
    lineage = uuid.uuid4().hex[:16]
    refs = [BranchRef("bench", lineage, 0, 0, p.name, i) for i in range(branches)]
    tasks = [pickle.loads(pickle.dumps(p)) for _ in refs]
    with ThreadPoolExecutor(branches) as pool:
        t0 = time.perf_counter()
        handles = list(pool.map(lambda i: tasks[i].prepare(refs[i], batch.schema, [batch]),
                                range(branches)))
        t1 = time.perf_counter()
        committers = [pickle.loads(pickle.dumps(p)) for _ in refs]  # the driver's
        list(pool.map(lambda i: committers[i].commit(refs[i], handles[i]), range(branches)))
        t2 = time.perf_counter()
    for c in {id(x): x for x in tasks + committers}.values():
        c.close()
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--bootstrap", help="a running broker (default: start Apache Kafka)")
    args = ap.parse_args(argv)
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from twophase.testing.apachekafka import LocalKafka

        broker = LocalKafka()
        broker.start()
        bootstrap = broker.bootstrap
    try:
        for mode in ("resumable", "staged"):  # warm-up: clients, pool, staging producer
            run(bootstrap, mode, 1000, args.branches)
        for rows in args.sizes:
            got: dict[str, list[tuple[float, float]]] = {"resumable": [], "staged": []}
            for _ in range(args.repeats):
                for mode in got:
                    got[mode].append(run(bootstrap, mode, rows, args.branches))
            total = {}
            for mode, runs in got.items():
                prep = statistics.median(r[0] for r in runs)
                com = statistics.median(r[1] for r in runs)
                total[mode] = statistics.median(r[0] + r[1] for r in runs)
                print(f"{rows:>8} rows {mode:>9}: prepare {prep:6.3f}s commit {com:6.3f}s "
                      f"total {total[mode]:6.3f}s", flush=True)
            print(f"{rows:>8} rows staged/resumable = {total['staged'] / total['resumable']:.2f}",
                  flush=True)
    finally:
        if broker is not None:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
