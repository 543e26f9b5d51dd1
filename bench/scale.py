"""What a batch of P branches costs the coordinator, and a 200-partition stream on 4 slots.

Two sections, side by side in one run (issue 30):

1. **Coordinator per branch.** A daemon (``twophase serve`` as a user starts it: its own
   process, SQLite store) and the driver's own calls for one batch of P branches: begin,
   the votes sent in chunks (``twophase.engine.decide``, as the sink sends its tasks' votes),
   the acknowledgements in chunks (``twophase.engine.commit.send_acks``). Per P (default 4, 64,
   256, 1,024, 4,096): requests per batch, JSON bytes sent and received per batch (the
   bodies as httpx sent and read them), the
   daemon process's CPU per batch and per branch (``/proc/PID/stat``), wall time. Then
   the store alone in this process: CPU and bytes written to disk per branch.
2. **200 partitions on 4 slots** (``local[4]``): the same stream (one Parquet file per
   batch, ``repartition(200)`` in the query) written by at-least-once ``foreachBatch``
   (A: ``batch.write.parquet``) and by ``TransactionalSink`` with one
   ``StagedFileParticipant`` (B: 200 ordinary tasks, the driver commits), alternating
   pairs; each batch's time is Spark's ``triggerExecution``; rows/s B/A per pair and the
   median. Both outputs are read back: every id once.

The last line: ``scale: per_branch_4096_vs_4=R finished_4096=yes|no ratio@200p=X``, where
R is the daemon's CPU per branch at 4,096 branches over that at 4 (issue 30's goal: within
2x, and P = 4,096 finishes; B/A >= 0.9).

Reproduce (from the repository root, in the README's venv, on an idle machine)::

    .venv/bin/python bench/scale.py
    .venv/bin/python bench/scale.py --sizes 4,64 --rounds 2 --pairs 1 --rows 2000  # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kafka_topics import committed_rows, drop_topic, new_topic  # noqa: E402
from twophase.client.api import CoordinatorClient  # noqa: E402
from twophase.client.wire import VoteIn  # noqa: E402
from twophase.engine.commit import send_acks  # noqa: E402
from twophase.engine.decide import decide  # noqa: E402
from twophase.protocol import Decision  # noqa: E402
from twophase.testing.job import EVENT_DDL, spark_session, write_input  # noqa: E402
from twophase.testing.servers import LocalDaemon  # noqa: E402

TOKEN = "bench-scale-token"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Wire:
    """Requests and body bytes (both ways) through one client, counted by httpx's hooks."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.requests = self.bytes = 0
        hooks = client._http.event_hooks
        hooks["request"] = [*hooks.get("request", []), self._request]
        hooks["response"] = [*hooks.get("response", []), self._response]

    def _request(self, request: Any) -> None:
        self.requests += 1
        self.bytes += len(request.content)

    def _response(self, response: Any) -> None:
        response.read()
        self.bytes += len(response.content)


def one_batch(client: CoordinatorClient, wire_: Wire, sink: str, epoch: int, batch: int,
              p: int) -> tuple[int, int, str]:
    """One batch of ``p`` branches as the sink runs it; (requests, JSON bytes, state)."""
    reqs0, bytes0 = wire_.requests, wire_.bytes
    handle = {"kind": "files", "participant": "files", "file": "x" * 40, "rows": "1000"}
    begun = client.begin(sink, "lineage-1", batch, epoch, ["files"], p, 300.0)
    txn = begun.txn
    assert txn is not None
    votes = [VoteIn(branch=f"files/{i}", yes=True, handle=handle, digest="v2:" + "0" * 32,
                    task=f"7/{i}") for i in range(p)]
    decided = decide(client, txn, epoch, votes, "")
    done = send_acks(client, txn.key, epoch, [(b, Decision.COMMIT) for b in decided.branches],
                     into=decided)
    assert done is not None
    return wire_.requests - reqs0, wire_.bytes - bytes0, done.state.value


def coordinator_section(sizes: list[int], rounds: int, work: Path) -> dict[int, float]:
    daemon = LocalDaemon(f"sqlite:///{work / 'scale.db'}", TOKEN, work / "daemon.log")
    daemon.start()
    client = CoordinatorClient(daemon.url, TOKEN)
    counted = Wire(client)
    per_branch: dict[int, float] = {}
    try:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        for p in sizes:
            sink = f"scale{p}"
            epoch = client.register(sink)
            # /proc counts CPU in 10 ms ticks: enough batches that each size spends at
            # least ~4,096 branches' worth of work (a P=4 batch is ~1 ms of daemon CPU)
            n = max(rounds, min(500, 4096 // p))
            wall, reqs, nbytes = [], 0, 0
            c0 = cpu_seconds(pid)
            for r in range(n):
                t0 = time.perf_counter()
                reqs, nbytes, state = one_batch(client, counted, sink, epoch, r, p)
                wall.append(time.perf_counter() - t0)
                if state != "COMMITTED":
                    raise SystemExit(f"P={p}: batch ended {state}")
            ms = 1000 * (cpu_seconds(pid) - c0) / n
            per_branch[p] = ms / p
            print(f"  P={p:5d}: {reqs} requests/batch, {nbytes / 1024:8.1f} KiB JSON/batch, "
                  f"daemon CPU {ms:8.2f} ms/batch = {1000 * per_branch[p]:7.1f} us/branch, "
                  f"wall p50 {1000 * statistics.median(wall):8.1f} ms ({n} batches)",
                  flush=True)
    finally:
        client.close()
        daemon.stop()
    return per_branch


def written_bytes() -> int:
    """Bytes this process has caused to be written to storage so far (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def store_section(sizes: list[int], work: Path) -> None:
    """The store alone (no HTTP), in this process: CPU and bytes written to disk per
    branch for one batch (begin, votes and acks in chunks of 1,000), the last of three."""
    from twophase import protocol
    from twophase.coordinator.store import Store

    st = Store(f"sqlite:///{work / 'store.db'}")
    handle = {"kind": "files", "participant": "files", "file": "x" * 40, "rows": "1000"}
    try:
        for p in sizes:
            sink = f"store{p}"
            epoch = st.register(sink).epoch
            for batch in range(3):
                c0, w0 = time.process_time(), written_bytes()
                txn = st.begin(protocol.Begin(sink, "L", batch, epoch, ("files",), p,
                                              time.time())).txn
                assert txn is not None
                bids = list(txn.branches)
                for i in range(0, p, 1000):
                    txn = st.apply(txn.key, [
                        protocol.Vote(b, epoch, True, time.time(), handle,
                                      digest="v2:" + "0" * 32, task=f"7/{b}")
                        for b in bids[i:i + 1000]])
                for i in range(0, p, 1000):
                    txn = st.apply(txn.key, [protocol.Ack(b, epoch, Decision.COMMIT, time.time())
                                             for b in bids[i:i + 1000]])
                if txn.state != protocol.State.COMMITTED:
                    raise SystemExit(f"store P={p}: batch ended {txn.state.value}")
                cpu, written = time.process_time() - c0, written_bytes() - w0
            print(f"  store P={p:5d}: CPU {1e6 * cpu / p:7.1f} us/branch, written "
                  f"{written / p:7.0f} bytes/branch ({written / 2**20:.1f} MiB/batch)",
                  flush=True)
    finally:
        st.close()


def _kafka_at_least_once(bootstrap: str, topic: str) -> Any:
    """A's ``mapInArrow`` function for ``--kafka``: the partition's rows as JSON through
    a plain idempotent producer kept per worker process (no transaction), flushed, every
    delivery report checked: what a careful at-least-once job writes."""

    def write(batches: Any) -> Any:
        import types

        import pyarrow as pa
        from confluent_kafka import Producer

        from twophase.jsoncodec import json_rows

        kept = sys.modules.setdefault("_scale_kafka", types.ModuleType("_scale_kafka"))
        producer = kept.__dict__.get(bootstrap)
        if producer is None:
            producer = kept.__dict__[bootstrap] = Producer(
                {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
        errors: list[Any] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        rows = 0
        for b in batches:
            for value in json_rows(b):
                while True:
                    try:
                        producer.produce(topic, value, on_delivery=delivered)
                        break
                    except BufferError:  # the local queue is full: serve reports
                        producer.poll(0.05)
            rows += b.num_rows
        if producer.flush(60) or errors:
            raise RuntimeError(f"kafka: {len(errors)} delivery errors: {errors[:3]}")
        yield pa.record_batch([pa.array([rows], pa.int64())], names=["rows"])

    return write


def run_query(spark: Any, work: Path, input_dir: Path, variant: str, parts: int,
              kafka: str | None = None) -> list[tuple[int, float]]:
    """One query; (rows, seconds) per batch from Spark's progress, warm-up first. With
    ``kafka`` (a bootstrap address) both sides write a fresh topic of ``parts``
    partitions instead of files: A with a plain idempotent producer, B with
    ``KafkaParticipant`` (its default prepare); the topic's log must hold every row."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from twophase import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant
    from twophase.sinks.kafka import KafkaParticipant

    tag = uuid.uuid4().hex[:10]
    out, ckpt = work / f"out-{tag}", work / f"ck-{tag}"
    out.mkdir()
    topic = new_topic(kafka, partitions=parts) if kafka else ""
    stream = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
              .parquet(str(input_dir)).repartition(parts))
    sink: TransactionalSink | None = None
    if variant == "A":
        alo = _kafka_at_least_once(kafka, topic) if kafka else None

        def at_least_once(batch: Any, batch_id: int) -> None:
            if alo is not None:
                batch.mapInArrow(alo, "rows long").collect()
            else:
                batch.write.mode("append").parquet(str(out))
        writer = stream.writeStream.foreachBatch(at_least_once)
    else:
        part: Any = (KafkaParticipant(topic, {"bootstrap.servers": kafka}) if kafka
                     else StagedFileParticipant(str(out), "parquet"))
        sink = TransactionalSink(f"sc{tag}", [part],
                                 coordinator=f"sqlite:///{work / f'coord-{tag}.db'}")
        writer = stream.writeStream.foreachBatch(sink)
    try:
        q = (writer.option("checkpointLocation", str(ckpt)).trigger(availableNow=True)
             .start())
        q.awaitTermination()
        batches = [(int(p["numInputRows"]), p["durationMs"]["triggerExecution"] / 1000)
                   for p in q.recentProgress if p["numInputRows"]]
        expected = sum(n for n, _ in batches)
        if kafka:
            found = committed_rows(kafka, topic)
            if found < expected or (variant == "B" and found != expected):
                raise SystemExit(f"{variant}: {found} committed records for {expected} read")
        else:
            ids = ds.dataset(str(out), format="parquet").to_table(columns=["id"]).column("id")
            if len(ids) != expected or pc.count_distinct(ids).as_py() != expected:
                raise SystemExit(f"{variant}: {len(ids)} rows for {expected} read")
        if sink is not None and any(r.partitions != parts for r in sink.history):
            raise SystemExit(f"B wrote {[r.partitions for r in sink.history]} partitions")
        return batches
    finally:
        if sink is not None:
            sink.close()
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        if kafka:
            drop_topic(kafka, topic)


DYNAMIC = {"spark.master": "local-cluster[2,2,1024]",
           "spark.dynamicAllocation.enabled": "true",
           "spark.dynamicAllocation.shuffleTracking.enabled": "true",
           "spark.dynamicAllocation.minExecutors": "0",
           "spark.dynamicAllocation.maxExecutors": "2",
           "spark.executor.cores": "2", "spark.executor.memory": "1g",
           # this checkout importable in the executors' Python workers
           "spark.executorEnv.PYTHONPATH": os.pathsep.join(
               [str(ROOT), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
"""``--dynamic``: 4 slots as two executors of a local standalone cluster that dynamic
allocation starts and stops (a user's elastic cluster, on one machine)."""


def stream_section(work: Path, pairs: int, batches: int, rows: int, parts: int,
                   kafka: str | None = None, dynamic: bool = False) -> float:
    if dynamic:  # the executors' Python workers: this interpreter, as PySpark reads it
        os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = spark_session(DYNAMIC if dynamic else {"spark.master": "local[4]"})
    try:
        warm = work / "in-warm"
        write_input(warm, batches=2, rows_per_batch=1000)
        for v in ("A", "B"):
            run_query(spark, work, warm, v, parts, kafka)
        input_dir = work / "in"
        write_input(input_dir, batches=batches + 1, rows_per_batch=rows)
        ratios = []
        for i in range(pairs):
            rates = {}
            for v in ("A", "B") if i % 2 == 0 else ("B", "A"):
                measured = run_query(spark, work, input_dir, v, parts, kafka)[1:]
                rates[v] = sum(n for n, _ in measured) / sum(s for _, s in measured)
            ratios.append(rates["B"] / rates["A"])
            print(f"  {parts} partitions pair {i + 1}: A {rates['A']:,.0f} rows/s, "
                  f"B {rates['B']:,.0f} rows/s, B/A {ratios[-1]:.2f}", flush=True)
        return statistics.median(ratios)
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,64,256,1024,4096",
                    help="branches per batch, comma-separated (default 4,64,256,1024,4096)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="batches per size at least (small sizes run more: CPU ticks)")
    ap.add_argument("--pairs", type=int, default=3, help="A,B pairs of the stream section")
    ap.add_argument("--batches", type=int, default=3, help="measured batches per run")
    ap.add_argument("--rows", type=int, default=100_000, help="rows per batch of the stream")
    ap.add_argument("--partitions", type=int, default=200, help="partitions per batch")
    ap.add_argument("--no-stream", action="store_true", help="the coordinator section only")
    ap.add_argument("--kafka", action="store_true",
                    help="the stream writes Apache Kafka (a private broker started here; A: "
                         "an idempotent producer, B: KafkaParticipant) instead of files")
    ap.add_argument("--dynamic", action="store_true",
                    help="the stream on local-cluster[2,2,1024] with dynamic allocation "
                         "(4 slots) instead of local[4]")
    ap.add_argument("--no-coordinator", action="store_true",
                    help="the stream section only")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="twophase-scale-"))
    coord = "" if args.no_coordinator else \
        f"; coordinator: daemon on SQLite, {args.rounds} batches per size"
    print(f"scale: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}{coord}", flush=True)
    try:
        per_branch: dict[int, float] = {}
        if not args.no_coordinator:
            per_branch = coordinator_section(sizes, args.rounds, work)
            print("store: SQLite in this process, one batch (the last of 3)", flush=True)
            store_section(sizes, work)
        ratio = float("nan")
        if not args.no_stream:
            broker = None
            if args.kafka:
                from twophase.testing.apachekafka import LocalKafka

                broker = LocalKafka(base_dir=str(work)).start()
            try:
                shape = ("local-cluster[2,2,1024], dynamic allocation" if args.dynamic
                         else "local[4]")
                into = ("Apache Kafka (B: KafkaParticipant, its default prepare)" if broker
                        else "files")
                print(f"stream: {shape}, {args.rows:,} rows per batch in {args.partitions} "
                      f"partitions into {into}, {args.pairs} pairs", flush=True)
                ratio = stream_section(work, args.pairs, args.batches, args.rows,
                                       args.partitions, broker.bootstrap if broker else None,
                                       args.dynamic)
            finally:
                if broker is not None:
                    broker.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not per_branch:
        print(f"scale: load {os.getloadavg()[0]:.1f}; ratio@{args.partitions}p={ratio:.2f}"
              f"{' kafka' if args.kafka else ''}{' dynamic' if args.dynamic else ''}")
        return 0
    lo, hi = min(sizes), max(sizes)
    mid = [per_branch[x] for x in (64, 256) if x in per_branch]
    if mid and hi in per_branch:  # P = 4 is mostly fixed cost: the flat range starts at 64
        print(f"coordinator: per branch at {hi} over the mean of 64 and 256: "
              f"{per_branch[hi] / statistics.mean(mid):.2f}")
    print(f"scale: load {os.getloadavg()[0]:.1f}; per_branch_{hi}_vs_{lo}="
          f"{per_branch[hi] / per_branch[lo]:.2f} finished_{hi}="
          f"{'yes' if hi in per_branch else 'no'} ratio@{args.partitions}p={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
