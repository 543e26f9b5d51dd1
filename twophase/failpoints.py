"""Named failpoints at every protocol step, for chaos tests and ``twophase chaos``.

Switched on by the environment variable ``TWOPHASE_FAILPOINTS``, read once per process::

    TWOPHASE_FAILPOINTS="after_prepare@postgres-orders/1=kill;before_commit=sleep(2.5)"

Each entry is ``POINT[@PARTICIPANT[/PARTITION]]=ACTION`` where ACTION is ``kill``
(SIGKILL this process), ``raise`` (raise :class:`FailpointHit`) or ``sleep(SECONDS)``.
An entry may end in ``*N`` (e.g. ``raise*2``) to fire only on its first N hits in
this process. With the variable unset, :func:`hit` is one dict lookup on an empty dict.

Counts across processes: with ``TWOPHASE_FAILPOINTS_ONCE_DIR=/some/dir`` a ``*N`` entry
fires on its first N hits *in all processes together* (a retried Spark task runs in a
new Python worker, which would otherwise fire again). Each firing claims a file in that
folder with ``O_CREAT|O_EXCL`` and writes where it fired into it. Without the variable
nothing changes and nothing touches the file system.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Final

from twophase.errors import FailpointHit, InvalidRequest

ENV: Final = "TWOPHASE_FAILPOINTS"
ONCE_DIR_ENV: Final = "TWOPHASE_FAILPOINTS_ONCE_DIR"

# Every point the code base hits, in protocol order. ``twophase chaos`` picks from these.
POINTS: Final = (
    "before_begin",  # driver, before asking the coordinator to begin
    "before_prepare",  # task, per branch
    "after_prepare",  # task, per branch: prepared, vote not sent
    "after_decision",  # coordinator: decision written, answer not sent
    "before_commit",  # driver, per branch: decision known, not applied
    "mid_commit",  # per branch, Kafka's staged copy on the driver: its transaction
    # open, records and marker offset sent, commit_transaction not called
    "after_commit",  # per branch, the same: applied, ack not sent
    "before_ack",  # driver, once per apply: every branch's decision applied, acks not sent
    "before_batch_commit",  # driver, per batch participant: COMMIT decided, table untouched
    "after_batch_commit",  # driver, per batch participant: table committed, acks not sent
    "before_return",  # driver: coordinator shows COMMITTED, foreachBatch not returned
    "coordinator_before_decision",  # coordinator: all votes in, decision not written
)


@dataclass
class _Rule:
    action: str
    arg: float = 0.0
    remaining: int | None = None
    participant: str | None = None
    partition: int | None = None
    hits: int = field(default=0)
    key: str = ""  # names this entry's claim files in the once-dir
    count: int | None = None


_ENTRY: Final = re.compile(
    r"^(?P<point>[a-z_]+)(@(?P<participant>[A-Za-z0-9_.-]+)(/(?P<partition>\d+))?)?"
    r"=(?P<action>kill|raise|sleep\((?P<secs>[0-9.]+)\))(\*(?P<count>\d+))?$"
)


def parse(spec: str) -> dict[str, list[_Rule]]:
    """Parse the variable's value; an unknown point or malformed entry is an error."""
    rules: dict[str, list[_Rule]] = {}
    for raw in spec.split(";"):
        entry = raw.strip()
        if not entry:
            continue
        m = _ENTRY.match(entry)
        if not m:
            raise InvalidRequest(
                f"{ENV}: cannot parse {entry!r}; expected POINT[@PARTICIPANT[/PARTITION]]="
                "kill|raise|sleep(SECONDS)[*COUNT]"
            )
        point = m["point"]
        if point not in POINTS:
            raise InvalidRequest(f"{ENV}: unknown failpoint {point!r}; known: {', '.join(POINTS)}")
        action = m["action"].split("(")[0]
        count = int(m["count"]) if m["count"] else None
        rules.setdefault(point, []).append(
            _Rule(
                action=action,
                arg=float(m["secs"] or 0),
                remaining=count,
                participant=m["participant"],
                partition=int(m["partition"]) if m["partition"] else None,
                key=_entry_key(entry),
                count=count,
            )
        )
    return rules


def _entry_key(entry: str) -> str:
    """A file-name-safe key for one entry: readable prefix plus a digest of the whole."""
    digest = hashlib.sha1(entry.encode(), usedforsecurity=False).hexdigest()[:12]
    return f"{entry.split('=', 1)[0].replace('/', '.').replace('@', '.')}-{digest}"


_RULES: dict[str, list[_Rule]] = parse(os.environ.get(ENV, ""))
_ONCE_DIR: str | None = os.environ.get(ONCE_DIR_ENV) or None


def reload(spec: str | None = None, once_dir: str | None = None) -> None:
    """Re-read the rules (tests; a Python worker reused across jobs)."""
    global _RULES, _ONCE_DIR
    _RULES = parse(os.environ.get(ENV, "") if spec is None else spec)
    _ONCE_DIR = (os.environ.get(ONCE_DIR_ENV) if once_dir is None else once_dir) or None


def _claim(rule: _Rule, where: str) -> bool:
    """Take one of the rule's N firings for all processes sharing the once-dir."""
    assert _ONCE_DIR is not None and rule.count is not None
    os.makedirs(_ONCE_DIR, exist_ok=True)
    for i in range(rule.count):
        path = os.path.join(_ONCE_DIR, f"{rule.key}.{i}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        try:
            os.write(fd, f"{where} pid={os.getpid()} t={time.time():.6f}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    rule.remaining = 0  # every firing is taken: stop looking in this process
    return False


def fired(once_dir: str) -> list[str]:
    """What the once-dir recorded, one line per firing (``POINT@P/N pid=.. t=..``)."""
    if not os.path.isdir(once_dir):
        return []
    out = []
    for name in sorted(os.listdir(once_dir)):
        with open(os.path.join(once_dir, name)) as f:
            out.append(f.read().strip())
    return out


def hit(point: str, participant: str | None = None, partition: int | None = None) -> None:
    """Fire the failpoint ``point`` if a rule matches; a no-op when none is set."""
    rules = _RULES.get(point)
    if not rules:
        return
    for rule in rules:
        if rule.participant is not None and rule.participant != participant:
            continue
        if rule.partition is not None and rule.partition != partition:
            continue
        where = f"{point}@{participant}/{partition}" if participant else (
            f"{point}/{partition}" if partition is not None else point)
        if rule.remaining is not None:
            if rule.remaining <= 0:
                continue
            if _ONCE_DIR is not None:
                if not _claim(rule, where):
                    continue
            else:
                rule.remaining -= 1
        rule.hits += 1
        if rule.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif rule.action == "sleep":
            time.sleep(rule.arg)
        else:
            raise FailpointHit(f"failpoint {where} fired")
