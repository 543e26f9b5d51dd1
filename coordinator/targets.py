"""What the sinks' targets hold open now, polled by the coordinator for its console and
``/metrics``: a Kafka transaction left open by a crash stalls every ``read_committed``
reader of its partitions until the broker's timeout, and nothing in the decision log
shows it.

Every ``interval`` seconds a daemon thread rebuilds each registered sink's participants
from the descriptors the sink recorded (secrets from this process's environment, as for
``twophase resolve``, and only to the descriptors an operator granted them:
:mod:`twophase.grants`) and asks each :meth:`~twophase.participant.Participant.open_on_target`.
Scrapes read the last answers and never wait on a target. A target that cannot be asked
(unreachable, a missing extra or secret) is reported as such, not retried faster.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from twophase.coordinator.store import Store
from twophase.grants import Grants
from twophase.participant import Participant, TargetBacklog

log = logging.getLogger("twophase.coordinator.targets")

DEFAULT_INTERVAL = 30.0


@dataclass(frozen=True)
class TargetState:
    """One participant's last answer: its backlog, or why it could not be asked."""

    sink: str
    participant: str
    at: float
    backlog: TargetBacklog | None = None
    error: str | None = None


class TargetWatch:
    """The poller; :meth:`check` runs one round (tests call it directly)."""

    def __init__(self, store: Store, interval: float = DEFAULT_INTERVAL,
                 grants: Grants | None = None) -> None:
        self.store = store
        self.grants = grants if grants is not None else Grants()
        self.interval = interval
        self._states: dict[tuple[str, str], TargetState] = {}
        self._built: dict[str, tuple[str, list[Participant]]] = {}  # sink -> (descs, parts)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def states(self) -> list[TargetState]:
        with self._lock:
            return sorted(self._states.values(), key=lambda s: (s.sink, s.participant))

    def check(self) -> list[TargetState]:
        """Ask every registered sink's participants once; returns the new states."""
        found: dict[tuple[str, str], TargetState] = {}
        for sink in (s["name"] for s in self.store.sinks_overview()):
            for state in self._check_sink(sink):
                found[(state.sink, state.participant)] = state
        with self._lock:
            self._states = found
        return sorted(found.values(), key=lambda s: (s.sink, s.participant))

    def _parts(self, sink: str) -> list[Participant]:
        from twophase.engine.resolve import participants_from

        descriptors = self.store.participants(sink)
        # a grant added or revoked rebuilds the sink's participants too
        granted = sorted(g for g in self.grants.allowed() if g[0] == sink)
        key = json.dumps([descriptors, granted], sort_keys=True)
        cached = self._built.get(sink)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None:
            _close(cached[1])
        parts = (participants_from(descriptors, sink=sink, grants=self.grants)
                 if descriptors else [])
        self._built[sink] = (key, parts)
        return parts

    def _check_sink(self, sink: str) -> list[TargetState]:
        try:
            parts = self._parts(sink)
        except Exception as exc:  # a missing extra or secret: say so, per sink
            return [TargetState(sink, "*", time.time(), error=_why(exc))]
        out = []
        for part in parts:
            try:
                backlog = part.open_on_target(sink)
            except Exception as exc:
                out.append(TargetState(sink, part.name, time.time(), error=_why(exc)))
                continue
            if backlog is not None:
                out.append(TargetState(sink, part.name, time.time(), backlog=backlog))
        return out

    def _loop(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # the store unreachable: try again next round
                log.exception("target watch round failed")
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="twophase-targets",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for _, parts in self._built.values():
            _close(parts)
        self._built = {}


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _close(parts: list[Any]) -> None:
    for part in parts:
        try:
            part.close()
        except Exception:  # closing a client of an unreachable target
            log.debug("closing %s failed", part, exc_info=True)
