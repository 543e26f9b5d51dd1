"""Where the resumable Kafka prepare's time goes, call by call, beside at-least-once's kept
producer: the measured split of bench/e2e.py's Kafka gap (issue 42: B's task ~360 ms
longer than A's at 100k rows a batch).

Reproduce (from the repository root, with the dev venv; it starts Apache Kafka, so run it
alone on a small machine, e.g. ``/work/heavy-alone``)::

    .venv/bin/python bench/kafka_prepare_phases.py                      # 0 / 100k / 1M rows
    .venv/bin/python bench/kafka_prepare_phases.py --sizes 100000 --repeats 10
    .venv/bin/python bench/kafka_prepare_phases.py --bootstrap host:9092    # your broker

A private Apache Kafka broker (``twophase.testing.apachekafka``, one KRaft node) is
started unless ``--bootstrap`` names one, and a topic of 2 partitions made per size, as
bench/e2e.py's. The rows are bench/e2e.py's events (``twophase.testing.job.write_input``),
in Arrow batches of 10,000 rows (Spark's ``maxRecordsPerBatch``). In bench/e2e.py a batch
is one Parquet file of one row group, so one task reads all its rows and B's sink keeps
that split (one branch a participant): the default sizes are that task's share at 100k and
1M rows a batch, and an empty branch (the fixed calls alone).

Per repeat, alternating which runs first:

- B: the real ``KafkaParticipant.prepare`` (``prepare="resumable"``, the default) of one
  branch, on a participant unpickled as a Spark task gets it, a new batch id each repeat
  (the same sink and partition: the same pool of transactional ids, as batch after batch
  in one reused Python worker), then the driver's ``commit`` from the vote's handle (timed
  apart: not the task's). Each call the prepare makes is timed by wrapping it from here
  (the confluent_kafka Producer's methods, the marker functions, ``choose_id``,
  ``produce_all``, ``describe_transaction``; nothing is added to the package): exclusive
  times, so the rows add up to the total; "rest" is what no wrapper covers.
- A: the at-least-once writer's produce loop of bench/e2e.py on one idempotent producer
  kept for the whole run (as A keeps one per Python worker): the same rows as JSON, no
  key, delivery reports checked, flushed.
- A+h: A with the four ``twophase.*`` headers B puts on every record, to tell the
  headers' share of B's produce and flush from the rest.

Printed per size: p50 and p90 of each phase in ms, the totals, B - A, and the load average
before and after. Warm-ups (2 per size) are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import confluent_kafka  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bench.kafka_topics import drop_topic, new_topic  # noqa: E402
from twophase.jsoncodec import json_rows  # noqa: E402
from twophase.participant import BranchRef  # noqa: E402
from twophase.sinks.kafka import KafkaParticipant, marker, resumable  # noqa: E402
from twophase.sinks.kafka.records import headers as branch_headers  # noqa: E402
from twophase.testing.job import write_input  # noqa: E402

PLAIN_PRODUCER = confluent_kafka.Producer  # A's, never timed
WARM_UPS = 2
PARTITIONS = 2  # bench/e2e.py's topic


class Clock:
    """Exclusive time per phase of the current prepare: a wrapped call's time less the
    wrapped calls it made, so the phases add up to the prepare."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []

    def reset(self) -> None:
        self.phases.clear()
        self.calls.clear()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._inner.append(0.0)
        t = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t
            inner = self._inner.pop()
            self.phases[name] += spent - inner
            self.calls[name] += 1
            if self._inner:
                self._inner[-1] += spent


CLOCK = Clock()


def _timed(name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CLOCK.phase(name(*args, **kwargs) if callable(name) else name):
            return fn(*args, **kwargs)
    return wrapper


class _TimedProducer(confluent_kafka.Producer):
    """The transactional producer the prepare makes, its calls timed."""

    def __init__(self, config: dict[str, Any]) -> None:
        with CLOCK.phase("Producer() (new transactional producer)"):
            super().__init__(config)

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        with CLOCK.phase("connect (list_topics)"):
            return super().list_topics(*args, **kwargs)

    def init_transactions(self, *args: Any) -> Any:
        with CLOCK.phase("init_transactions"):
            return super().init_transactions(*args)

    def begin_transaction(self) -> Any:
        with CLOCK.phase("begin_transaction"):
            return super().begin_transaction()

    def flush(self, *args: Any) -> Any:
        with CLOCK.phase("flush"):
            return super().flush(*args)


class _TimedParked(dict[str, Any]):
    """``resumable.PARKED``: taking the id's producer of the batch before out drops it,
    and librdkafka's destroy (its threads joined) runs right there."""

    def pop(self, key: str, default: Any = None) -> Any:
        with CLOCK.phase("drop the id's parked producer"):
            found = super().pop(key, default)
            del found
        return None


def instrument() -> None:
    """Wrap the calls the resumable prepare makes (module globals, looked up per call)."""
    marker_reads = [0]

    def read_name(*_: Any) -> str:
        marker_reads[0] += 1
        return ("marker read (OffsetFetch), before" if marker_reads[0] % 2
                else "marker read (OffsetFetch), after")

    in_choose = [False]
    choose = resumable.choose_id

    def describe_name(*_: Any) -> str:
        return ("choose_id: DescribeTransactions per slot" if in_choose[0]
                else "DescribeTransactions after the flush")

    def choose_id(p: KafkaParticipant, branch: BranchRef) -> str:
        in_choose[0] = True  # its own time is "rest"
        try:
            return choose(p, branch)
        finally:
            in_choose[0] = False

    for module, attr, name in (
            (resumable, "read_marker_now", read_name),
            (resumable, "describe_transaction", describe_name),
            (resumable, "produce_all", "produce (encode + produce)"),
            (resumable, "add_marker", "send_offsets_to_transaction"),
            (marker, "marker_consumer", "marker consumer: Consumer()"),
            (marker, "marker_done", "marker consumer: close()")):
        setattr(module, attr, _timed(name, getattr(module, attr)))
    resumable.choose_id = choose_id
    resumable.PARKED = _TimedParked()
    setattr(confluent_kafka, "Producer", _TimedProducer)  # noqa: B010 (mypy: a class)


def event_batches(rows: int) -> list[pa.RecordBatch]:
    """bench/e2e.py's input rows, as Spark hands them to a task (10,000-row batches)."""
    if rows == 0:
        return []
    with tempfile.TemporaryDirectory() as d:
        write_input(d, 1, rows)
        batches: list[pa.RecordBatch] = pq.read_table(d).to_batches(max_chunksize=10_000)
    return batches


def prepare_once(p: KafkaParticipant, lineage: str, batch_id: int, schema: pa.Schema,
                 batches: list[pa.RecordBatch]
                 ) -> tuple[dict[str, float], dict[str, int], float]:
    """B: one task's prepare: its phases (seconds), the calls per phase, and the driver's
    commit (seconds)."""
    own: KafkaParticipant = pickle.loads(pickle.dumps(p))  # as a Spark task gets it
    branch = BranchRef("kphases", lineage, batch_id, 0, own.name, 0)
    CLOCK.reset()
    t = time.perf_counter()
    handle = own.prepare(branch, schema, iter(batches))
    total = time.perf_counter() - t
    phases = dict(CLOCK.phases)
    phases["rest"] = total - sum(phases.values())
    phases["total"] = total
    calls = dict(CLOCK.calls)
    t = time.perf_counter()
    p.commit(branch, handle)  # the driver, from the vote's handle
    return phases, calls, time.perf_counter() - t


def at_least_once(producer: Any, topic: str, batches: list[pa.RecordBatch],
                  hdrs: list[tuple[str, bytes]] | None) -> dict[str, float]:
    """A (``hdrs`` None) or A+h: bench/e2e.py's produce loop on the kept producer."""
    errors: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    t = time.perf_counter()
    for b in batches:
        for value in json_rows(b):
            while True:
                try:
                    producer.produce(topic, value, on_delivery=delivered, headers=hdrs)
                    break
                except BufferError:  # local queue full: serve reports
                    producer.poll(0.05)
    produced = time.perf_counter()
    left = producer.flush(60)
    done = time.perf_counter()
    if errors or left:
        raise RuntimeError(f"kafka: {left} not delivered, errors {errors[:1]}")
    return {"produce (encode + produce)": produced - t, "flush": done - produced,
            "total": done - t}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(bootstrap: str, rows: int, repeats: int) -> None:
    topic = new_topic(bootstrap, partitions=PARTITIONS)
    batches = event_batches(rows)
    schema = batches[0].schema if batches else event_batches(1)[0].schema
    p = KafkaParticipant(topic, {"bootstrap.servers": bootstrap})
    p.check(schema)  # the driver's check, once per sink
    lineage = uuid.uuid4().hex[:16]
    kept = PLAIN_PRODUCER({"bootstrap.servers": bootstrap,
                                     "enable.idempotence": True, "acks": "all"})
    hdrs = branch_headers(BranchRef("kphases", lineage, 0, 0, p.name, 0))
    b_runs: list[dict[str, float]] = []
    b_calls: list[dict[str, int]] = []
    commits: list[float] = []
    a_runs: list[dict[str, float]] = []
    h_runs: list[dict[str, float]] = []
    try:
        for i in range(WARM_UPS + repeats):
            def b_step(i: int = i) -> None:
                phases, calls, commit = prepare_once(p, lineage, i, schema, batches)
                if i >= WARM_UPS:
                    b_runs.append(phases)
                    b_calls.append(calls)
                    commits.append(commit)

            def a_step(i: int = i) -> None:
                run = at_least_once(kept, topic, batches, None)
                if i >= WARM_UPS:
                    a_runs.append(run)

            def h_step(i: int = i) -> None:
                run = at_least_once(kept, topic, batches, hdrs)
                if i >= WARM_UPS:
                    h_runs.append(run)

            steps: list[Callable[[], None]] = [b_step, a_step, h_step]
            for step in steps[i % 3:] + steps[:i % 3]:
                step()
    finally:
        kept.flush(10)
        p.close()
        drop_topic(bootstrap, topic)
    report(rows, repeats, b_runs, b_calls, commits, a_runs, h_runs)


def report(rows: int, repeats: int, b_runs: list[dict[str, float]],
           b_calls: list[dict[str, int]], commits: list[float],
           a_runs: list[dict[str, float]], h_runs: list[dict[str, float]]) -> None:
    names = list(dict.fromkeys(k for r in b_runs for k in r if k not in ("rest", "total")))
    names.sort(key=lambda k: -statistics.median(r.get(k, 0.0) for r in b_runs))
    print(f"\n{rows:,} rows, {repeats} repeats: B = resumable prepare (exclusive ms per "
          "phase; calls per prepare), A = kept idempotent producer, A+h = A with B's headers")
    print(f"  {'phase':<46} {'calls':>5} {'B p50':>8} {'B p90':>8} {'A p50':>8} "
          f"{'A+h p50':>8}")

    def ms(runs: list[dict[str, float]], k: str, q: float) -> str:
        vals = [r[k] for r in runs if k in r]
        return f"{1000 * pct(vals, q):8.1f}" if vals else f"{'-':>8}"

    for k in [*names, "rest", "total"]:
        calls = statistics.mean(c.get(k, 0) for c in b_calls) if k in names else 0.0
        print(f"  {k:<46} {calls:>5.1f} {ms(b_runs, k, 0.5)} {ms(b_runs, k, 0.9)} "
              f"{ms(a_runs, k, 0.5)} {ms(h_runs, k, 0.5)}")
    gap = [b["total"] - a["total"] for b, a in zip(b_runs, a_runs, strict=True)]
    print(f"  {'B - A (repeat by repeat)':<46} {'':>5} {1000 * pct(gap, 0.5):8.1f} "
          f"{1000 * pct(gap, 0.9):8.1f}")
    print(f"  {'driver commit (EndTxn + settle; not the task)':<46} {'':>5} "
          f"{1000 * pct(commits, 0.5):8.1f} {1000 * pct(commits, 0.9):8.1f}")
    b50, a50 = (1000 * pct([r["total"] for r in runs], 0.5) for runs in (b_runs, a_runs))
    print(f"kafka_prepare_phases@{rows}: B_p50={b50:.0f} ms A_p50={a50:.0f} ms "
          f"gap_p50={1000 * pct(gap, 0.5):.0f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0,100000,1000000",
                    help="rows per prepare, comma separated (default: an empty branch and "
                         "bench/e2e.py's task share at 100k and 1M rows a batch)")
    ap.add_argument("--repeats", type=int, default=20, help="measured repeats per size")
    ap.add_argument("--large-repeats", type=int, default=5,
                    help="measured repeats for sizes of 500,000 rows or more")
    ap.add_argument("--bootstrap", help="a broker to use (default: start Apache Kafka)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    load = os.getloadavg()
    print(f"kafka_prepare_phases: confluent-kafka {confluent_kafka.__version__} "
          f"(librdkafka {confluent_kafka.libversion()[0]}), sizes {sizes}, load average "
          f"before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    instrument()
    broker: Any = None
    try:
        if args.bootstrap is None:
            from twophase.testing.apachekafka import LocalKafka

            broker = LocalKafka().start()
        bootstrap = broker.bootstrap if broker is not None else str(args.bootstrap)
        for rows in sizes:
            measure(bootstrap, rows, args.large_repeats if rows >= 500_000 else args.repeats)
    finally:
        from twophase.sinks.kafka.clients import close_process_clients

        close_process_clients()
        if broker is not None:
            broker.stop()
    load = os.getloadavg()
    print(f"load average after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
