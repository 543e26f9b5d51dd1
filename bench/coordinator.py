"""Coordinator benchmark: complete 2PC rounds per second through the HTTP API.

Each round is what one micro-batch costs the coordinator: begin, the branch votes (one call
with every vote, or one call per branch with --per-branch, like real executor tasks),
await the decision, acknowledge every branch. N client threads (spread over --procs
processes) run rounds on their own sinks against a coordinator daemon. Rounds are run
twice: with the await call, and without it when the (last) vote's answer already carries
the decision (3 requests instead of 4). The daemon's CPU time per round is shown: on this
2-core machine the daemon (one Python process) and the load generator share the cores, so
CPU per round is the figure that sets the ceiling.

The daemon runs as ``twophase serve`` does (same app, same uvicorn settings), in two
variants side by side (``--paths``): ``hot``, the default app, where the per-batch
endpoints skip FastAPI's routing (coordinator/hotpath.py), and ``fastapi``, the same app
with ``hot_path=False``. Each variant gets a fresh daemon; ``--paths hot,fastapi,hot``
alternates them.

It also measures the parts separately, to show where the time goes:
- ``store only``: the same rounds straight on the Store, no HTTP (one thread);
- ``app alone``: CPU per round of the app itself, both variants alternating in this
  process, requests handed to the ASGI app one by one (no sockets): the change's figure
  that the machine's other load moves least;
- ``bare HTTP``: requests per second on an endpoint that does no store write;
- ``bare ASGI`` (``--hello``): rounds of small JSON POSTs and GETs per second against a
  bare ASGI app on the same uvicorn settings: the ceiling of the HTTP stack and of this
  load generator.

    python bench/coordinator.py --paths fastapi,hot,fastapi,hot --hello   # the doc's figures
    python bench/coordinator.py                       # SQLite and PostgreSQL, 16 x 4
    python bench/coordinator.py --stores sqlite --clients 32 --branches 4 --seconds 20
    python bench/coordinator.py --profile             # cProfile of the store-only loop
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twophase import protocol as p  # noqa: E402
from twophase.client.api import CoordinatorClient  # noqa: E402
from twophase.client.wire import VoteIn  # noqa: E402
from twophase.coordinator.store import Store  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402
from twophase.testing.servers import free_port  # noqa: E402

TOKEN = "bench-token-0123456789"


def daemon(store: str, port: int, variant: str) -> None:
    """What ``twophase serve --log-level warning`` runs (cli/serve.py), for one variant;
    ``hello`` is a bare ASGI app instead."""
    import uvicorn

    from twophase.coordinator.app import create_app
    from twophase.coordinator.logs import setup_logging

    setup_logging("warning")
    app: object
    if variant == "hello":
        async def hello(scope, receive, send):  # type: ignore[no-untyped-def]
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"{}"})
        app = hello
    else:
        app = create_app(Store(store), TOKEN, hot_path=variant == "hot")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning",
                access_log=False, timeout_keep_alive=75)


def start_daemon(store: str, variant: str = "hot") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--daemon", store, str(port), variant],
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200 or variant == "hello":
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("daemon did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_proc(url: str, threads: int, branches: int, per_branch: bool, seconds: float,
                skip_await: bool, out: mp.Queue) -> None:  # type: ignore[type-arg]
    lat: list[float] = []
    lock = threading.Lock()
    cpu0 = time.process_time()  # this process's CPU from here: its start-up not counted
    stop_at = time.monotonic() + seconds
    participants = [f"p{i}" for i in range(branches)]

    def run() -> None:
        c = CoordinatorClient(url, TOKEN)
        sink = f"b{uuid.uuid4().hex[:10]}"
        epoch = c.register(sink)
        ckpt = 0
        mine = []
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            res = c.begin(sink, "lin", ckpt, epoch, participants, 1)
            assert res.txn is not None
            key = res.txn.key
            bids = list(res.txn.branches)
            if per_branch:
                for b in bids:
                    t = c.vote(key, epoch, [VoteIn(b, True, {"h": b})])
            else:
                t = c.vote(key, epoch, [VoteIn(b, True, {"h": b}) for b in bids])
            if not (skip_await and t.state.decided):
                t = c.await_decision(key, 30)
            assert t.state == p.State.COMMITTING, t.state
            if per_branch:
                for b in bids:
                    c.ack(key, epoch, [(b, p.Decision.COMMIT)])
            else:
                c.ack(key, epoch, [(b, p.Decision.COMMIT) for b in bids])
            mine.append(time.perf_counter() - t0)
            ckpt += 1
        with lock:
            lat.extend(mine)
        c.close()

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put((lat, time.process_time() - cpu0))


def hello_proc(url: str, threads: int, branches: int, per_branch: bool, seconds: float,
               skip_await: bool, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Rounds of 4 (3 with ``skip_await``) small JSON POSTs to the bare ASGI app: what a
    round costs the HTTP stack and this load generator when the coordinator does nothing."""
    lat: list[float] = []
    lock = threading.Lock()
    cpu0 = time.process_time()  # this process's CPU from here: its start-up not counted
    stop_at = time.monotonic() + seconds
    body = {"epoch": 1, "votes": [{"branch": f"p{i}/0", "yes": True, "handle": {"h": "x"}}
                                  for i in range(branches)]}

    def run() -> None:
        c = httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"})
        mine = []
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            for _ in range(3 if skip_await else 4):
                c.post(f"{url}/", json=body).raise_for_status()
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)
        c.close()

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put((lat, time.process_time() - cpu0))


def http_round(url: str | list[str], clients: int, branches: int, procs: int,
               per_branch: bool, seconds: float, skip_await: bool = False,
               server_pid: int | list[int] | None = None,
               target: Callable[..., None] | None = None) -> dict[str, float]:
    """Rounds for ``seconds``; with several ``url`` (replicas) client process i talks to
    url i mod n, and ``server_pid`` lists every daemon whose CPU counts."""
    # spawned, not forked: a fork while this process has threads (http_only's clients)
    # can copy a held OpenSSL lock and hang the child in httpx.Client()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    urls = [url] if isinstance(url, str) else url
    pids = [] if server_pid is None else [server_pid] if isinstance(server_pid, int) \
        else server_pid
    ps = [ctx.Process(target=target or client_proc,  # type: ignore[attr-defined,unused-ignore]
                     args=(urls[i % len(urls)], n, branches, per_branch, seconds, skip_await,
                           q))
          for i, n in enumerate(per) if n]
    cpu0 = sum(map(cpu_seconds, pids))
    client_cpu = 0.0
    t0 = time.perf_counter()
    for pr in ps:
        pr.start()
    lat: list[float] = []
    for _ in ps:
        try:  # a client process that died puts nothing: fail instead of waiting forever
            got, cpu = q.get(timeout=seconds + 120)
            lat.extend(got)
            client_cpu += cpu
        except queue.Empty:
            for pr in ps:
                pr.kill()
            raise RuntimeError("a client process did not report (see its error above)") \
                from None
    for pr in ps:
        pr.join()
    wall = time.perf_counter() - t0
    cpu = sum(map(cpu_seconds, pids)) - cpu0
    lat.sort()
    return {
        "server_cpu_ms": 1000 * cpu / max(len(lat), 1),
        "client_cpu_ms": 1000 * client_cpu / max(len(lat), 1),
        "tx": len(lat),
        "tx_per_s": len(lat) / seconds,
        "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else 0.0,
        "wall_s": wall,
    }


def asgi_direct(url: str, branches: int, rounds: int, repeats: int) -> dict[str, float]:
    """CPU per round of the app itself, both variants in this process, no sockets and no
    concurrency: each round's 4 requests are handed to the ASGI app one after the other.
    Alternating the variants ``repeats`` times, the median CPU ms per round of each: a
    figure the machine's other load moves far less than the HTTP rounds'."""
    import asyncio
    import json

    from twophase.coordinator.app import create_app

    st = Store(url)
    apps = {v: create_app(st, TOKEN, hot_path=v == "hot", background=False)
            for v in ("fastapi", "hot")}
    auth = (b"authorization", f"Bearer {TOKEN}".encode())

    async def call(app: object, method: str, path: str, body: object = None,
                   query: bytes = b"") -> object:
        raw = json.dumps(body).encode() if body is not None else b""
        headers = [auth, (b"content-type", b"application/json"),
                   (b"content-length", str(len(raw)).encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        out: list[bytes] = []
        status = [0]

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(msg: dict[str, object]) -> None:
            if msg["type"] == "http.response.start":
                status[0] = int(msg["status"])  # type: ignore[call-overload]
            else:
                out.append(msg.get("body", b""))  # type: ignore[arg-type]

        await app(scope, receive, send)  # type: ignore[operator]
        assert status[0] == 200, (path, status[0], b"".join(out))
        return json.loads(b"".join(out))

    async def run(app: object, n: int) -> float:
        sink = f"d{uuid.uuid4().hex[:10]}"
        epoch = st.register(sink).epoch
        parts = [f"p{i}" for i in range(branches)]
        t0 = time.process_time()
        for ckpt in range(n):
            res = await call(app, "POST", f"/v1/sinks/{sink}/begin", {
                "lineage": "lin", "checkpoint": ckpt, "epoch": epoch,
                "participants": parts, "partitions": 1})
            txn = res["txn"]  # type: ignore[index]
            path = f"/v1/txns/{sink}/lin/{ckpt}/{txn['attempt']}"
            bids = list(txn["branches"])
            await call(app, "POST", f"{path}/votes", {"epoch": epoch, "votes": [
                {"branch": b, "yes": True, "handle": {"h": b}} for b in bids]})
            await call(app, "GET", f"{path}/decision", query=b"timeout=30.000&until=decided")
            await call(app, "POST", f"{path}/acks", {"epoch": epoch, "acks": [
                {"branch": b, "outcome": "COMMIT"} for b in bids]})
        return 1000 * (time.process_time() - t0) / n

    async def main() -> dict[str, float]:
        got: dict[str, list[float]] = {"fastapi": [], "hot": []}
        for app in apps.values():
            await run(app, 20)  # warm-up (FastAPI builds its routing state lazily)
        for _ in range(repeats):
            for v, app in apps.items():
                got[v].append(await run(app, rounds))
        return {v: statistics.median(xs) for v, xs in got.items()}

    try:
        return asyncio.run(main())
    finally:
        st.close()


def store_only(url: str, branches: int, seconds: float, profile: bool) -> dict[str, float]:
    st = Store(url)
    sink = f"s{uuid.uuid4().hex[:10]}"
    epoch = st.register(sink).epoch
    parts = tuple(f"p{i}" for i in range(branches))
    n = 0
    prof = cProfile.Profile() if profile else None
    stop_at = time.monotonic() + seconds
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    while time.monotonic() < stop_at:
        now = time.time()
        res = st.begin(p.Begin(sink, "lin", n, epoch, parts, 1, now))
        assert res.txn is not None
        key = res.txn.key
        st.apply(key, [p.Vote(b, epoch, True, now, {"h": b}) for b in res.txn.branches])
        st.apply(key, [p.Ack(b, epoch, p.Decision.COMMIT, now) for b in res.txn.branches])
        n += 1
    dt = time.perf_counter() - t0
    if prof:
        prof.disable()
        print(f"\n--- cProfile, store only ({url.split(':')[0]}), top 15 by own time ---")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    st.close()
    return {"tx_per_s": n / dt, "ms_per_tx": 1000 * dt / max(n, 1)}


def http_only(url: str, seconds: float, threads: int = 8,
              path: str = "/v1/sinks/none-such") -> float:
    count = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def run() -> None:
        c = httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"})
        n = 0
        while time.monotonic() < stop_at:
            c.get(f"{url}{path}")  # default: a 404 after one indexed read
            n += 1
        with lock:
            count[0] += n

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return count[0] / seconds


def replicas(dsn: str, args: argparse.Namespace) -> None:
    """Rounds/s on one daemon, then on ``--replicas`` daemons sharing one PostgreSQL store
    (the hot path, with await), alternating 1, N, 1, N; each replica's clients in their
    own process. Every process shares this machine's cores: the line says how many."""
    n = args.replicas
    procs = max(args.procs, n)
    got: dict[int, list[float]] = {1: [], n: []}
    for count in (1, n, 1, n):
        started = [start_daemon(dsn, "hot") for _ in range(count)]
        try:
            r = http_round([u for _, u in started], args.clients, args.branches, procs,
                           args.per_branch, args.seconds, False, [pr.pid for pr, _ in started])
        finally:
            for pr, _ in started:
                pr.terminate()
                pr.wait(20)
        got[count].append(r["tx_per_s"])
        print(f"postgresql {count} daemon(s): {r['tx_per_s']:7.1f} rounds/s  p50 "
              f"{r['p50_ms']:6.1f} ms  CPU/round daemons {r['server_cpu_ms']:5.2f} ms, "
              f"clients {r['client_cpu_ms']:5.2f} ms", flush=True)
    one, many = statistics.median(got[1]), statistics.median(got[n])
    print(f"replicas: {n} daemons on one PostgreSQL store {many:.1f} rounds/s vs one "
          f"{one:.1f}: {many / one:.2f}x, on {os.cpu_count()} cores shared by the daemons, "
          f"PostgreSQL and {procs} client processes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="sqlite,postgresql")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--procs", type=int, default=2, help="client processes")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--per-branch", action="store_true",
                    help="one vote call and one ack call per branch (like executor tasks)")
    ap.add_argument("--paths", default="fastapi,hot",
                    help="daemon variants, in this order: hot (the default app) and/or "
                    "fastapi (hot_path=False)")
    ap.add_argument("--no-await-only", action="store_true",
                    help="only the rounds without the await call")
    ap.add_argument("--hello", action="store_true",
                    help="also measure a bare ASGI app (the HTTP stack's ceiling)")
    ap.add_argument("--replicas", type=int, default=2,
                    help="also run the rounds on 1 and on N daemons sharing one PostgreSQL "
                    "store, clients split evenly (0: skip; default 2)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--daemon", nargs=3, metavar=("STORE", "PORT", "VARIANT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.daemon:
        daemon(args.daemon[0], int(args.daemon[1]), args.daemon[2])
        return
    load = os.getloadavg()
    print(f"cores={os.cpu_count()} clients={args.clients} branches={args.branches} "
          f"per_branch={args.per_branch} seconds={args.seconds} "
          f"load={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}")
    if args.hello:
        proc, hurl = start_daemon("", "hello")
        try:
            time.sleep(0.5)
            hello = http_only(hurl, min(args.seconds, 5.0), path="/")
            hello_rounds = [
                (skip, http_round(hurl, args.clients, args.branches, args.procs, False,
                                  args.seconds, skip, proc.pid, hello_proc))
                for skip in ((True,) if args.no_await_only else (False, True))
            ]
        finally:
            proc.terminate()
            proc.wait(20)
        for skip, r in hello_rounds:
            print(f"bare ASGI  rounds of {3 if skip else 4} POSTs: {r['tx_per_s']:7.1f} "
                  f"rounds/s  p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  CPU/round "
                  f"server {r['server_cpu_ms']:5.2f} ms, clients {r['client_cpu_ms']:5.2f} ms")
        print(f"bare ASGI  hello-world: {hello:7.1f} requests/s (GET, 8 threads); the "
              "ceiling of uvicorn + this load generator, no coordinator work")
    pg: LocalPostgres | None = None
    tmp = tempfile.mkdtemp(prefix="tp-bench-")
    try:
        for kind in args.stores.split(","):
            if kind == "sqlite":
                url = f"sqlite:///{tmp}/bench-{uuid.uuid4().hex[:6]}.db"
            else:
                if pg is None:
                    pg = LocalPostgres(fsync=True).start()  # durable, like production
                url = pg.dsn
            so = store_only(url, args.branches, min(args.seconds, 5.0), args.profile)
            print(f"{kind:10s} store only: {so['tx_per_s']:7.1f} tx/s  "
                  f"({so['ms_per_tx']:.2f} ms per round, 3 write transactions, one thread)")
            direct = asgi_direct(url, args.branches, 200, 5)
            print(f"{kind:10s} app alone (ASGI calls, no sockets, 4 requests a round, median "
                  f"of 5 x 200 rounds): CPU/round fastapi {direct['fastapi']:5.2f} ms, hot "
                  f"{direct['hot']:5.2f} ms ({direct['hot'] / direct['fastapi']:.2f}x)")
            for variant in args.paths.split(","):
                proc, durl = start_daemon(url, variant)
                try:
                    bare = http_only(durl, min(args.seconds, 5.0))
                    rounds = [
                        (skip, http_round(durl, args.clients, args.branches, args.procs,
                                          args.per_branch, args.seconds, skip, proc.pid))
                        for skip in ((True,) if args.no_await_only else (False, True))
                    ]
                finally:
                    proc.terminate()
                    proc.wait(20)
                for skip, r in rounds:
                    how = "no await " if skip else "with await"
                    print(f"{kind:10s} {variant:7s} rounds ({how}): {r['tx_per_s']:7.1f} tx/s  "
                          f"p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  "
                          f"CPU/tx daemon {r['server_cpu_ms']:5.2f} ms, clients "
                          f"{r['client_cpu_ms']:5.2f} ms  ({r['tx']} tx)")
                print(f"{kind:10s} {variant:7s} bare HTTP: {bare:7.1f} requests/s "
                      "(GET 404, one read, 8 threads)")
        if args.replicas > 1:
            if pg is None:
                pg = LocalPostgres(fsync=True).start()
            replicas(pg.dsn, args)
    finally:
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
