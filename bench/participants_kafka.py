"""Kafka participant throughput against a plain confluent-kafka producer, same run, same rows.

Reproduce (from the repository root, with the dev venv)::

    .venv/bin/python bench/participants_kafka.py                  # tansu, 10k + 100k
    .venv/bin/python bench/participants_kafka.py --bootstrap host:9092 --repeats 9
    .venv/bin/python bench/participants_kafka.py --reuse --sizes 100 10000   # producer reuse

Without ``--bootstrap`` a private tansu broker (``twophase.testing.localkafka``) is started and
stopped at the end. Compared (median of ``--repeats`` alternating runs, fresh topic each):

- participant: ``KafkaParticipant.prepare + commit`` as one Spark task runs it: a new
  transactional producer (``init_transactions``), the marker check, ``begin``, JSON rows
  from Arrow, produce with delivery reports, ``send_offsets_to_transaction``, flush, commit;
- raw: a new plain producer with the same guarantees a careful non-transactional writer
  uses (``enable.idempotence``, ``acks=all``, delivery reports checked), the same JSON
  encoding of the same Arrow batch, produce, flush.

Both pay producer start-up (the idempotent producer's InitProducerId) inside the timing,
as every task does. The goal is participant/raw >= 0.90.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from confluent_kafka import Producer  # noqa: E402

from bench.kafka_topics import new_topic  # noqa: E402
from twophase.jsoncodec import json_rows  # noqa: E402
from twophase.participant import BranchRef  # noqa: E402
from twophase.sinks.kafka import KafkaParticipant  # noqa: E402
from twophase.testing.localkafka import LocalTansu  # noqa: E402


def make_batch(n: int) -> pa.RecordBatch:
    """Orders-like rows (the same shape as bench/participants.py)."""
    ids = pa.array(range(n), pa.int64())
    labels = pc.binary_join_element_wise(
        pa.array(["customer \"", "a,b", "line\nbreak", "plain"] * (n // 4 + 1))[:n],
        pc.cast(ids, pa.string()), "-",
    )
    amount = pc.multiply(pc.cast(ids, pa.float64()), 0.25)
    qty = pa.array([None if i % 10 == 0 else i % 100 for i in range(n)], pa.int32())
    ts = pc.cast(pc.add(ids, 1_700_000_000_000_000), pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays(
        [ids, labels, amount, qty, ts], names=["id", "label", "amount", "qty", "ts"]
    )


def _participant_run(bootstrap: str, batch: pa.RecordBatch) -> float:
    topic = new_topic(bootstrap)
    p = KafkaParticipant(topic, {"bootstrap.servers": bootstrap})
    b = BranchRef("bench", uuid.uuid4().hex[:16], 0, 0, p.name, 0)
    t = time.perf_counter()
    p.commit(b, p.prepare(b, batch.schema, [batch]))
    elapsed = time.perf_counter() - t
    p.close()
    return elapsed


def _batches_in_one_process(bootstrap: str, batch: pa.RecordBatch, n: int,
                            reuse: bool) -> list[float]:
    """``n`` consecutive batches of one branch (same topic, sink, partition: the same
    transactional.id) in this process, as a reused Spark worker runs them; each batch is
    a new unpickled participant (a new task). ``reuse=False`` empties the producer and
    marker-consumer caches before each batch: a new producer with ``init_transactions``
    and a new marker consumer every batch, as before they were reused. Returns the
    seconds of each batch after the first."""
    import pickle

    from twophase.sinks.kafka.marker import marker_key
    from twophase.sinks.kafka.participant import MARKER_CONSUMERS, PRODUCERS
    from twophase.sinks.kafka.producers import cache_key

    topic = new_topic(bootstrap)
    p = KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, reuse_clients=reuse)
    lineage = uuid.uuid4().hex[:16]
    out = []
    for i in range(n + 1):
        own: KafkaParticipant = pickle.loads(pickle.dumps(p))
        b = BranchRef("bench", lineage, i, 1, own.name, 0)
        if not reuse:
            PRODUCERS.drop(cache_key(own, b))
            MARKER_CONSUMERS.drop(marker_key(own, own.marker_group(b)))
        t = time.perf_counter()
        own.commit(b, own.prepare(b, batch.schema, [batch]))
        own.close()
        if i:
            out.append(time.perf_counter() - t)
    PRODUCERS.drop(cache_key(p, BranchRef("bench", lineage, 0, 1, p.name, 0)))
    return out


def bench_reuse(sizes: list[int], bootstrap: str | None, batches: int = 9) -> None:
    """Per-batch time of the participant in a reused worker, producer cache off / on,
    alternating runs of ``batches`` batches."""
    broker = LocalTansu().start() if bootstrap is None else None
    try:
        servers = broker.bootstrap if broker is not None else str(bootstrap)
        print(f"{'rows/batch':>10} {'new clients per batch':>24} {'clients reused':>16} "
              f"{'saved':>8}")
        for n in sizes:
            batch = make_batch(n)
            off: list[float] = []
            on: list[float] = []
            _batches_in_one_process(servers, batch, 1, True)  # warm-up
            for _ in range(3):
                off += _batches_in_one_process(servers, batch, batches, False)
                on += _batches_in_one_process(servers, batch, batches, True)
            a, b = statistics.median(off) * 1000, statistics.median(on) * 1000
            print(f"{n:>10} {a:>21.1f} ms {b:>13.1f} ms {a - b:>5.1f} ms")
    finally:
        if broker is not None:
            broker.stop()


def _raw_run(bootstrap: str, batch: pa.RecordBatch, warm: bool = False) -> float:
    """A plain producer; ``warm`` starts it (and its ProducerId) before the clock starts."""
    topic = new_topic(bootstrap)
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    def start() -> Any:
        return Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "acks": "all"})

    if warm:
        producer = start()
        producer.produce(new_topic(bootstrap), b"warm-up")
        producer.flush(30)
    t = time.perf_counter()
    if not warm:
        producer = start()
    produce, poll = producer.produce, producer.poll
    for value in json_rows(batch):
        while True:
            try:
                produce(topic, value, None, on_delivery=on_delivery)
                break
            except BufferError:
                poll(0.05)
    left = producer.flush(60)
    elapsed = time.perf_counter() - t
    if errors or left:
        raise RuntimeError(f"raw producer failed: {errors[:1]} {left} left")
    return elapsed


def _alternate(
    repeats: int, a: Callable[[], float], b: Callable[[], float]
) -> tuple[list[float], list[float]]:
    ta: list[float] = []
    tb: list[float] = []
    a()  # warm-up of both paths (imports, broker caches), not timed
    b()
    for i in range(repeats):
        if i % 2:
            tb.append(b())
            ta.append(a())
        else:
            ta.append(a())
            tb.append(b())
    return ta, tb


def bench_kafka_rows(rows: int, bootstrap: str | None, repeats: int = 5) -> dict[str, float]:
    """One size: rows/s of the participant, the raw producer started inside the timing
    (``raw_rps``, like every task) and started before it (``raw_warm_rps``), and ratios."""
    broker = LocalTansu().start() if bootstrap is None else None
    try:
        servers = broker.bootstrap if broker is not None else str(bootstrap)
        batch = make_batch(rows)
        tp, tr = _alternate(repeats, lambda: _participant_run(servers, batch),
                            lambda: _raw_run(servers, batch))
        tw = [_raw_run(servers, batch, warm=True) for _ in range(repeats)]
        prps = rows / statistics.median(tp)
        rrps = rows / statistics.median(tr)
        wrps = rows / statistics.median(tw)
        return {"rows": float(rows), "participant_rps": prps, "raw_rps": rrps,
                "ratio": prps / rrps, "raw_warm_rps": wrps, "ratio_warm": prps / wrps}
    finally:
        if broker is not None:
            broker.stop()


def bench_kafka(
    sizes: list[int], repeats: int = 5, bootstrap: str | None = None
) -> list[tuple[str, int, float, float]]:
    """``(section, rows, participant_rows_per_s, raw_rows_per_s)`` per size, for
    ``bench/participants.py``; starts tansu when ``bootstrap`` is None."""
    broker = LocalTansu().start() if bootstrap is None else None
    section = "kafka (tansu)" if broker is not None else "kafka"
    try:
        servers = broker.bootstrap if broker is not None else str(bootstrap)
        out = []
        for n in sizes:
            r = bench_kafka_rows(n, servers, repeats)
            out.append((section, n, r["participant_rps"], r["raw_rps"]))
            out.append((f"{section} vs raw without producer start-up", n,
                        r["participant_rps"], r["raw_warm_rps"]))
        return out
    finally:
        if broker is not None:
            broker.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bootstrap", help="a real broker (default: start tansu)")
    ap.add_argument("--reuse", action="store_true",
                    help="per-batch time in one process, producer cache off vs on")
    args = ap.parse_args(argv)
    if args.reuse:
        bench_reuse(args.sizes, args.bootstrap)
        return 0
    results = bench_kafka(args.sizes, args.repeats, args.bootstrap)
    print(f"{'section':<50} {'rows':>8} {'participant r/s':>16} {'raw r/s':>12} {'ratio':>7}")
    for section, n, prps, rrps in results:
        ratio = prps / rrps
        flag = "" if ratio >= 0.90 or "without" in section else "  < 0.90"
        print(f"{section:<50} {n:>8} {prps:>16,.0f} {rrps:>12,.0f} {ratio:>7.2f}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
