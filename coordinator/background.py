"""Periodic work of a coordinator: vote deadlines, alerts, retention (and, in a thread
of its own, what the sinks' targets hold open: :mod:`.targets`).

Every replica may run it: deadlines go through the same compare-and-set as any other
change, so two replicas expiring one transaction write one ABORT.

- vote deadline passed, still undecided -> ``Expire`` -> ABORT;
- decided more than ``alert_after`` seconds ago and branches still not acknowledged ->
  the transaction's ``alert`` flag (visible in ``twophase txns`` and ``/metrics``); the
  coordinator keeps the decision and keeps waiting, it never gives up on a COMMIT;
- finished more than ``retention`` seconds ago and no longer needed for a replay ->
  deleted, so the log does not grow without bound.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Final

from twophase.coordinator.store import Store
from twophase.coordinator.targets import DEFAULT_INTERVAL, TargetWatch
from twophase.errors import InvalidRequest
from twophase.grants import Grants

log = logging.getLogger("twophase.coordinator.background")

DEFAULT_RETENTION: Final = 3 * 86400.0
DEFAULT_ALERT_AFTER: Final = 600.0

_DURATION: Final = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$")
_UNIT: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``3d`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise InvalidRequest(f"cannot read duration {text!r}; use e.g. 90s, 15m, 12h or 3d")
    return float(m[1]) * _UNIT[m[2]]


PURGE_BATCH = 1000
"""Finished transactions deleted per round (one database transaction each)."""


@dataclass(frozen=True)
class Settings:
    interval: float = 1.0  # seconds between rounds
    retention: float = DEFAULT_RETENTION
    alert_after: float = DEFAULT_ALERT_AFTER
    purge_every: float = 60.0
    target_watch: float = DEFAULT_INTERVAL  # seconds between asks of the sinks' targets; 0: off
    secret_grants: str | None = None  # the grants file (twophase.grants); None: from the env


class Background:
    """A daemon thread running :meth:`tick` every ``settings.interval`` seconds."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_purge = 0.0
        self._backlog = False  # the last purge hit its limit: more are due
        self.targets = TargetWatch(store, self.settings.target_watch,
                                   Grants(self.settings.secret_grants))

    def tick(self, now: float | None = None) -> dict[str, int]:
        """One round; returns what it did (tests call it directly)."""
        now = self.store.clock() if now is None else now
        expired = len(self.store.expire_due(now))
        alerts = self.store.mark_alerts(now, self.settings.alert_after)
        purged = 0
        if self._backlog or now - self._last_purge >= self.settings.purge_every:
            # A full purge means more are due: purge again next round (1,000 a second
            # at most) rather than a minute later, so retention keeps up with a fast
            # sink (one per minute was ~17 transactions a second).
            purged = self.store.purge(now - self.settings.retention, PURGE_BATCH)
            self._backlog = purged >= PURGE_BATCH
            self._last_purge = now
        return {"expired": expired, "alerts": alerts, "purged": purged}

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.interval):
            try:
                self.tick()
            except Exception:  # keep running: a dropped DB connection is retried next round
                log.exception("background round failed")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="twophase-background", daemon=True
            )
            self._thread.start()
        self.targets.start()

    def stop(self) -> None:
        self.targets.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
