"""Prometheus metrics of one coordinator service (own registry, so that several embedded
servers in one process never collide).

Counters and histograms are observed by this process as it changes transactions; gauges
(transactions by state, in-doubt count, age of the oldest in-doubt transaction, alerts) are
read from the store at scrape time, so they are right for every replica sharing the log.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from twophase import protocol as p
from twophase.coordinator.store import Store

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30, 60, 300)


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


class Metrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
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
        self.registry.register(_StoreCollector(store))

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
