"""Prometheus metrics of one coordinator service (own registry, so that several embedded
servers in one process never collide).

Counters and histograms are observed by this process as it changes transactions; gauges
(transactions by state, in-doubt count, age of the oldest in-doubt transaction, alerts) are
read from the store at scrape time, so they are right for every replica sharing the log.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from twophase import protocol as p
from twophase.coordinator.store import Store
from twophase.coordinator.targets import TargetWatch
from twophase.protocol import TxnKey, parse_branch_id

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30, 60, 300)

_ROW_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000)
_RECENT = 2000  # transactions whose executor figures this process keeps for the console


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.store.stats()
        by_state = GaugeMetricFamily(
            "twophase_transactions", "Transactions in the log by state", labels=["state"]
        )
        for name, n in st["by_state"].items():
            by_state.add_metric([name], n)
        yield by_state
        yield GaugeMetricFamily(
            "twophase_in_doubt_transactions",
            "Decided transactions still waiting for branch acknowledgements",
            value=st["in_doubt"],
        )
        yield GaugeMetricFamily(
            "twophase_oldest_in_doubt_age_seconds",
            "Seconds since the oldest in-doubt transaction was decided (0 when none)",
            value=st["oldest_in_doubt_age"],
        )
        yield GaugeMetricFamily(
            "twophase_alert_transactions",
            "Decided transactions whose branches have not acknowledged within alert_after",
            value=st["alerts"],
        )


class _TargetCollector(Collector):
    """What the sinks' targets hold open, as the target watch last saw it."""

    def __init__(self, watch: TargetWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["sink", "participant"]
        txns = GaugeMetricFamily(
            "twophase_target_open_transactions",
            "Transactions the sink's writers hold open on the target now (any process's; "
            "a Kafka one stalls read_committed readers)", labels=labels)
        age = GaugeMetricFamily(
            "twophase_target_oldest_open_transaction_age_seconds",
            "Age of the oldest of them (0 when none)", labels=labels)
        unstable = GaugeMetricFamily(
            "twophase_target_unstable_records",
            "Records past the partition's last stable offset (committed readers wait)",
            labels=[*labels, "partition"])
        ok = GaugeMetricFamily(
            "twophase_target_check_ok",
            "1 when the target answered the coordinator's last ask, 0 when it could not "
            "be asked (the console says why)", labels=labels)
        for st in self.watch.states():
            ok.add_metric([st.sink, st.participant], 0 if st.backlog is None else 1)
            if st.backlog is None:
                continue
            txns.add_metric([st.sink, st.participant], st.backlog.open_transactions)
            age.add_metric([st.sink, st.participant], st.backlog.oldest_open_age_s)
            for part, n in st.backlog.unstable.items():
                unstable.add_metric([st.sink, st.participant, part], n)
        yield from (txns, age, unstable, ok)


class Metrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.targets: TargetWatch | None = None
        self.decisions = Counter(
            "twophase_decisions", "Decisions written by this process", ["outcome"],
            registry=self.registry,
        )
        self.finished = Counter(
            "twophase_finished", "Transactions this process saw finish", ["outcome"],
            registry=self.registry,
        )
        self.vote_phase = Histogram(
            "twophase_vote_phase_seconds", "From begin to decision", ["outcome"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.ack_phase = Histogram(
            "twophase_ack_phase_seconds", "From decision to the last acknowledgement",
            ["outcome"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "twophase_http_errors", "Refused or failed requests by error code", ["code"],
            registry=self.registry,
        )
        branch_labels = ["sink", "participant"]
        self.branch_seconds = {
            field: Histogram(
                f"twophase_branch_{metric}_seconds", help_, branch_labels,
                buckets=_LATENCY_BUCKETS, registry=self.registry,
            )
            for field, metric, help_ in (
                ("prepare_s", "prepare", "Executor time to prepare one branch"),
                ("wait_s", "vote_wait", "Executor time from its vote to the decision"),
                ("commit_s", "commit",
                 "Time to apply the decision to one branch (in its task or from the driver)"),
            )
        }
        self.branch_rows = Histogram(
            "twophase_branch_rows", "Rows one branch prepared", branch_labels,
            buckets=_ROW_BUCKETS, registry=self.registry,
        )
        # per transaction: the slowest branch's phases and the rows, as executors sent them
        self._recent: OrderedDict[TxnKey, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.registry.register(_StoreCollector(store))

    def branch(self, key: TxnKey, branch_id: str, m: Mapping[str, float | int | None]) -> None:
        """Observe what an executor measured for one branch (sent with a vote or an ack)."""
        try:
            participant, _ = parse_branch_id(branch_id)
        except ValueError:
            return  # the machine refuses unknown branches; nothing to label
        labels = (key.sink, participant)
        with self._lock:
            rec = self._recent.setdefault(key, {})
            self._recent.move_to_end(key)
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
            for field, hist in self.branch_seconds.items():
                v = m.get(field)
                if v is not None:
                    hist.labels(*labels).observe(float(v))
                    rec[field] = max(rec.get(field, 0.0), float(v))
            rows = m.get("rows")
            if rows is not None:
                self.branch_rows.labels(*labels).observe(float(rows))
                rec["rows"] = rec.get("rows", 0.0) + float(rows)

    def recent(self, key: TxnKey) -> dict[str, float]:
        """The executors' figures for one transaction, if this process received them."""
        with self._lock:
            return dict(self._recent.get(key, {}))

    def observe(self, before: p.Transaction | None, after: p.Transaction) -> None:
        """Count a change this process wrote (called once it is durable)."""
        decision = after.decision
        if decision is None:
            return
        outcome = decision.value
        if (before is None or before.decision is None) and after.decided_at is not None:
            self.decisions.labels(outcome).inc()
            self.vote_phase.labels(outcome).observe(max(0.0, after.decided_at - after.created))
        if after.state.finished and (before is None or not before.state.finished):
            self.finished.labels(outcome).inc()
            if after.finished_at is not None and after.decided_at is not None:
                self.ack_phase.labels(outcome).observe(
                    max(0.0, after.finished_at - after.decided_at)
                )

    def watch(self, targets: TargetWatch) -> None:
        """Show what the target watch sees (the daemon's background runs it)."""
        self.targets = targets
        self.registry.register(_TargetCollector(targets))

    def render(self) -> bytes:
        return generate_latest(self.registry)
