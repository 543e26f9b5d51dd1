"""A real multi-host Spark standalone cluster on one Linux machine, for the cluster tests.

Each worker is a "host" of its own: a network namespace (``ip netns``) joined to a bridge
by a veth pair, with its own private address (``10.213.X.0/24``, X picked free). The
master, the driver, PostgreSQL and the coordinator daemon live on the host side of the
bridge (``.1``), so every byte between the driver and the executors crosses the bridge:
an address that only works on loopback fails here as it would on a real cluster.

Needs root (or CAP_NET_ADMIN) and Debian's ``iproute2``. Everything it creates carries a
random prefix and is removed by :meth:`SparkStandalone.stop`; it never touches an
interface, namespace or process it did not create. The JVMs are started from pyspark's
own ``jars/`` (``SPARK_HOME`` is the pip package), the Python of the executors is this
interpreter (same file system), so the workers see the same virtual environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twophase.testing.netns import Bridge, NetnsUnavailable, ip
from twophase.testing.servers import free_port

__all__ = ["ClusterUnavailable", "SparkStandalone", "Worker", "spark_home"]


class ClusterUnavailable(NetnsUnavailable):
    """The test cluster could not be built (no ``ip``, no privileges, a JVM that died)."""


def spark_home() -> Path:
    """pyspark's own folder: it ships ``jars/``, ``bin/`` and ``sbin/``."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return ip(*args, check=check, error=ClusterUnavailable)


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise ClusterUnavailable("java not found: install openjdk-17-jre-headless")
    return java


def _scala_version() -> str:
    """``2.13`` from pyspark's ``spark-core_2.13-*.jar``."""
    for jar in (spark_home() / "jars").glob("spark-core_*.jar"):
        return jar.name.split("_", 1)[1].split("-", 1)[0]
    raise ClusterUnavailable(f"no spark-core jar in {spark_home() / 'jars'}")


def _twophase_hiders() -> list[Path]:
    """What makes ``import twophase`` work here, beyond PYTHONPATH: the editable-install
    hooks (``__editable__*twophase*.pth``), else the installed package folder."""
    import site

    import twophase

    hiders: list[Path] = []
    for d in {*site.getsitepackages(), site.getusersitepackages()}:
        if os.path.isdir(d):
            hiders += sorted(Path(d).glob("__editable__*twophase*.pth"))
            hiders += sorted(Path(d).glob("twophase*.pth"))
    pkg = Path(twophase.__file__).resolve().parent
    if not hiders or "site-packages" in str(pkg):
        hiders.append(pkg)
    return hiders


@dataclass
class Worker:
    """One worker "host": its namespace, address, veth ends and JVM."""

    index: int
    netns: str
    address: str
    host_veth: str  # the bridge side: link cuts are ``ip link set host_veth down``
    hostname: str  # its own UTS namespace: ``socket.gethostname()`` there
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    without_twophase: bool = False

    def pids(self) -> list[int]:
        """Every process in this worker's network namespace."""
        res = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit()]

    def _cmd(self, pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    def executor_pids(self) -> list[int]:
        """The executor JVMs this worker runs (``CoarseGrainedExecutorBackend``)."""
        return [p for p in self.pids() if "CoarseGrainedExecutorBackend" in self._cmd(p)]

    def python_pids(self) -> list[int]:
        """The executors' Python processes (``pyspark.daemon`` and its forked workers)."""
        return [p for p in self.pids() if "pyspark.daemon" in self._cmd(p)
                or "pyspark.worker" in self._cmd(p)]


class SparkStandalone:
    """A Spark standalone master on the host and ``workers`` workers, one per namespace.

    ``with SparkStandalone() as c:`` starts it; ``c.master_url`` is for the driver,
    ``c.host_address`` is the address the workers reach the host at (bind the driver,
    PostgreSQL and the coordinator there), :meth:`cut` / :meth:`restore` take one
    worker's link down and up, :meth:`add_worker` adds one more (optionally without
    twophase importable there).
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cores: int = 2,
        memory: str = "1g",
        base_dir: str | None = None,
    ) -> None:
        self.n_workers = workers
        self.cores = cores
        self.memory = memory
        self.tag = "tp" + secrets.token_hex(3)  # interface names must stay <= 15 chars
        self.net = Bridge(self.tag, error=ClusterUnavailable)
        self.bridge = self.net.name
        self.dir = Path(tempfile.mkdtemp(prefix="twophase-cluster-", dir=base_dir))
        self.master_port = 0
        self.master_ui_port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[Worker] = []

    # ------------------------------------------------------------------ addresses
    @property
    def subnet(self) -> int:
        return self.net.subnet

    @property
    def host_address(self) -> str:
        return self.net.host_address

    @property
    def network(self) -> str:
        return self.net.network

    @property
    def master_url(self) -> str:
        return f"spark://{self.host_address}:{self.master_port}"

    def contains(self, address: str) -> bool:
        return self.net.contains(address)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120.0) -> SparkStandalone:
        try:
            self.net.up()
            self._start_master()
            for _ in range(self.n_workers):
                self.add_worker(wait=False)
            self.wait_workers(self.n_workers, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TWOPHASE_FAILPOINTS", "SPARK_", "PYSPARK_"))}
        env["SPARK_HOME"] = str(spark_home())
        # The pip package has no RELEASE file: without this, a worker's launcher looks
        # for a source build's folders to learn the Scala version and gives up.
        env["SPARK_SCALA_VERSION"] = _scala_version()
        env.update(extra)
        return env

    def _jvm(self, main: str, args: list[str], log: Path, env: dict[str, str],
             netns: str | None = None, prelude: str = "") -> subprocess.Popen[bytes]:
        cmd = [_java(), "-Xmx256m", "-cp", f"{spark_home() / 'jars'}/*", main, *args]
        if prelude:  # shell steps inside the worker's own namespaces, then the JVM
            cmd = ["unshare", "--uts", "sh", "-c", prelude + ' exec "$@"', "sh", *cmd]
        if netns is not None:
            cmd = [shutil.which("ip") or "ip", "netns", "exec", netns, *cmd]
        with open(log, "ab") as out:
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.dir, start_new_session=True)

    def _start_master(self) -> None:
        self.master_port, self.master_ui_port = free_port(), free_port()
        self.master = self._jvm(
            "org.apache.spark.deploy.master.Master",
            ["--host", self.host_address, "--port", str(self.master_port),
             "--webui-port", str(self.master_ui_port)],
            self.dir / "master.log", self._env(SPARK_LOCAL_IP=self.host_address),
        )

    def add_worker(self, *, without_twophase: bool = False, wait: bool = True,
                   timeout: float = 120.0) -> Worker:
        """One more worker host. ``without_twophase``: twophase is not importable by
        the executors' Python there (its install hooks are hidden in that host's mount
        namespace and PYTHONPATH is unset), the rest of the environment is the same."""
        n = len(self.workers) + 1
        host = self.net.add_host(n, "w")
        netns, host_veth, address = host.netns, host.host_veth, host.address
        work = self.dir / f"worker{n}"
        work.mkdir()
        env = self._env(SPARK_LOCAL_IP=address)
        hostname = f"{self.tag}-w{n}"
        prelude = f"hostname '{hostname}' && "
        if without_twophase:
            env.pop("PYTHONPATH", None)
            empty_dir, empty_file = work / "empty", work / "empty.pth"
            empty_dir.mkdir()
            empty_file.write_text("")
            for h in _twophase_hiders():
                src = empty_dir if h.is_dir() else empty_file
                prelude += f"mount --bind '{src}' '{h}' && "
        log = work / "worker.log"
        w = Worker(n, netns, address, host_veth, hostname, log=log,
                   without_twophase=without_twophase)
        w.proc = self._jvm(
            "org.apache.spark.deploy.worker.Worker",
            ["--host", address, "--cores", str(self.cores), "--memory", self.memory,
             "--work-dir", str(work), "--webui-port", "0", self.master_url],
            log, env, netns=netns, prelude=prelude,
        )
        self.workers.append(w)
        if wait:
            self.wait_workers(len(self.workers), timeout)
        return w

    def state(self) -> dict[str, Any]:
        """The master's own view (its JSON page)."""
        url = f"http://{self.host_address}:{self.master_ui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as r:
            return dict(json.loads(r.read()))

    def wait_workers(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, p in [("master", self.master),
                            *((f"worker {w.index}", w.proc) for w in self.workers)]:
                if p is not None and p.poll() is not None:
                    raise ClusterUnavailable(
                        f"spark {name} exited with {p.returncode}; see {self.dir}")
            try:
                alive = [w for w in self.state().get("workers", [])
                         if w.get("state") == "ALIVE"]
                if len(alive) >= n:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterUnavailable(
                    f"{n} spark workers not registered within {timeout:.0f}s; see {self.dir}")
            time.sleep(0.5)

    def remove_worker(self, w: Worker) -> None:
        """Stop a worker (its executors die with it) and wait until the master drops it."""
        for pid in w.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if w.proc is not None:
            w.proc.wait(30)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if not any(x.get("host") == w.address and x.get("state") == "ALIVE"
                           for x in self.state().get("workers", [])):
                    break
            except OSError:
                pass
            time.sleep(0.5)

    # ------------------------------------------------------------------ faults
    def cut(self, w: Worker) -> None:
        """Take the worker's link to the bridge down: its host is unreachable."""
        _ip("link", "set", w.host_veth, "down")

    def restore(self, w: Worker) -> None:
        _ip("link", "set", w.host_veth, "up")

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        """Kill every process this cluster started, remove its namespaces, links, files."""
        for w in self.workers:
            for pid in w.pids():  # the executors and their Python workers too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in [self.master, *(w.proc for w in self.workers)]:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            if p is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
        self.net.down()
        self.master = None
        if os.environ.get("TWOPHASE_KEEP_CLUSTER_LOGS") is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SparkStandalone:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self, n: int = 40) -> str:
        """The tails of the master's and workers' logs (for a failing test's message)."""
        out = []
        for path in sorted(self.dir.rglob("*.log")) + sorted(self.dir.rglob("stderr")):
            try:
                lines = path.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            out.append(f"== {path}\n" + "\n".join(lines))
        return "\n".join(out)


if __name__ == "__main__":  # a manual look: python -m twophase.testing.cluster
    with SparkStandalone() as c:
        print(json.dumps({"master": c.master_url, "host": c.host_address,
                          "workers": [w.address for w in c.workers]}), flush=True)
        if sys.stdin.isatty():
            input("cluster up; press Enter to stop ")
