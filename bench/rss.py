"""Peak resident memory of the Python workers of this process's Spark, per bench run
(``bench/e2e.py``'s memory column)."""

from __future__ import annotations

import os
import threading
import time


def _status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` size field in bytes (0 when gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class WorkerRss:
    """Peak resident memory of each Python worker process of this process's Spark, per run.

    The workers are the processes ``pyspark.daemon`` forks (the daemon itself, a small
    fork server, is not counted; other users' Spark is not either). The peak of a process
    is the kernel's own high-water mark (``VmHWM``), read every 20 ms while armed, so a
    short spike between two reads is not missed. ``arm()`` resets it (``clear_refs``) in
    the workers alive then, so a reused worker reports this run's peak, not its lifetime's;
    but memory an earlier run left in pyarrow's allocator still counts. With Spark's
    ``spark.python.worker.reuse=false`` (``--fresh-workers``) every task runs in a new
    worker: the figure is then the peak of one task.
    """

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}  # worker pid -> its peak RSS this run
        self._daemons: set[int] = set()
        self._lock = threading.Lock()
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _parents() -> dict[int, int]:
        parent: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    parent[int(d)] = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue
        return parent

    @staticmethod
    def _is_daemon_cmd(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"pyspark.daemon" in f.read()
        except OSError:
            return False

    def _find_daemons(self) -> set[int]:
        """pyspark.daemon processes descending from this one whose parent is not one."""
        parent, me = self._parents(), os.getpid()
        out = set()
        for pid in parent:
            p, seen = pid, 0
            while p in parent and p != me and seen < 50:
                p, seen = parent[p], seen + 1
            if p == me and pid != me and self._is_daemon_cmd(pid) \
                    and not self._is_daemon_cmd(parent[pid]):
                out.add(pid)
        return out

    @staticmethod
    def _children(pid: int) -> list[int]:
        out: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
        return out

    def _workers(self) -> list[int]:
        return [c for d in self._daemons for c in self._children(d)]

    def _loop(self) -> None:
        last_scan = 0.0
        while not self._stop.is_set():
            if not self._armed.wait(0.2):
                continue
            now = time.monotonic()
            if now - last_scan > 1.0:
                self._daemons, last_scan = self._find_daemons(), now
            with self._lock:
                for pid in self._workers():
                    hwm = _status(pid, "VmHWM:")
                    if hwm:
                        self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
            time.sleep(0.02)

    def arm(self) -> None:
        self._daemons = self._find_daemons()
        for pid in self._workers():  # a reused worker: count this run's peak only
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        with self._lock:
            self.peaks = {}
        self._armed.set()

    def disarm(self) -> list[int]:
        """Every worker's peak RSS during the run (bytes), highest first."""
        time.sleep(0.05)
        self._armed.clear()
        with self._lock:
            return sorted(self.peaks.values(), reverse=True)
