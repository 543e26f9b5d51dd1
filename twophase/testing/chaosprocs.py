"""The processes of a chaos run: the reference job's driver process, what runs below it
(its JVM, the Spark Python workers a worker kill picks from) read from Linux ``/proc``,
and SIGKILL. Plain process handling, no Spark here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["JobRun", "descendants", "kill", "python_workers", "read_json_lines", "zombie"]


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) for every process we can see (Linux /proc)."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fb:
                cmd = fb.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        table[int(entry)] = (ppid, cmd)
    return table


def descendants(pid: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    table = table if table is not None else _proc_table()
    children: dict[int, list[int]] = {}
    for p, (pp, _) in table.items():
        children.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def python_workers(job_pid: int) -> list[int]:
    """The job's Spark Python workers: children of its ``pyspark.daemon`` process."""
    table = _proc_table()
    out = []
    for p in descendants(job_pid, table):
        ppid, cmd = table[p]
        if "pyspark.daemon" in cmd and "pyspark.daemon" in table.get(ppid, (0, ""))[1]:
            out.append(p)
    return sorted(out)


def kill(pid: int) -> bool:
    """SIGKILL ``pid``; False when it was gone already."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def read_json_lines(stream: Iterable[str], add: Callable[[dict[str, Any]], None]) -> None:
    """Each line of a job's stdout that is a JSON object goes to ``add`` (its report
    lines); anything else is chatter (Spark's, a library's)."""
    for raw in stream:
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                add(json.loads(raw))
            except ValueError:
                continue


class JobRun:
    """One driver process; its stdout lines are timestamped into the shared ``lines``."""

    def __init__(self, number: int, config: Path, env: dict[str, str], log: Path,
                 lines: list[tuple[float, int, dict[str, Any]]]) -> None:
        self.number = number
        self.started = time.monotonic()
        self.ended: float | None = None
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "twophase.testing.job", str(config)],
                env=env, stdout=subprocess.PIPE, stderr=err, text=True,
            )
        self.log = log
        self._lines = lines
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        read_json_lines(self.proc.stdout,
                        lambda x: self._lines.append((time.monotonic(), self.number, x)))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        self.ended = self.ended or time.monotonic()
        return rc

    def kill_tree(self) -> None:
        """SIGKILL the driver, then whatever it leaves (its JVM, Python workers)."""
        rest = descendants(self.proc.pid)
        kill(self.proc.pid)
        self.wait(60)
        deadline = time.monotonic() + 10
        while rest and time.monotonic() < deadline:
            rest = [p for p in rest if os.path.exists(f"/proc/{p}")
                    and not zombie(p)]
            time.sleep(0.1)
        for p in rest:  # the JVM normally exits by itself when its parent dies
            kill(p)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def zombie(pid: int) -> bool:
    """Dead but not yet reaped (or gone): no longer worth a kill."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
