"""What bench/files_vs_spark.py and bench/tables_vs_spark.py share: a query's measured
batches from Spark's own progress, the check that its output holds every id once, and
the A/B pair runner (alternating order, rows/s ratio B/A per pair and its median), and
its generalisation to more variants against A (:func:`run_rounds`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Batches = list[tuple[int, float]]
"""(rows, seconds) per batch, from ``triggerExecution`` of the query's progress."""


def measured(q: Any) -> Batches:
    """The finished query's batches that read rows, in order (warm-up first)."""
    return [(int(p["numInputRows"]), p["durationMs"]["triggerExecution"] / 1000)
            for p in q.recentProgress if p["numInputRows"]]


def check_ids(what: str, batches: Batches, rows: int, distinct: int) -> None:
    """The output read back holds every row the query read, each id once."""
    expected = sum(n for n, _ in batches)
    if rows != expected or distinct != expected:
        raise SystemExit(f"{what}: {rows} rows, {distinct} ids for {expected} read")


def label(n: int) -> str:
    """100000 -> "100k", 1000000 -> "1M"."""
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def run_pairs(name: str, pairs: int, run: Callable[[str], Batches]) -> float:
    """``pairs`` runs of A and B (``run(variant)``), the order alternating so neither
    side always goes first; each run's first batch is not measured. Prints each pair
    and the summary; returns the median B/A rows/s ratio."""
    ratios, times = [], {"A": list[float](), "B": list[float]()}
    for i in range(pairs):
        rates = {}
        for v in ("A", "B") if i % 2 == 0 else ("B", "A"):
            batches = run(v)[1:]
            rates[v] = sum(n for n, _ in batches) / sum(s for _, s in batches)
            times[v] += [s for _, s in batches]
        ratios.append(rates["B"] / rates["A"])
        print(f"  {name} pair {i + 1}: A {rates['A']:,.0f} rows/s, "
              f"B {rates['B']:,.0f} rows/s, B/A {ratios[-1]:.2f}", flush=True)
    median = statistics.median(ratios)
    print(f"{name}: B/A rows/s per pair [{', '.join(f'{r:.2f}' for r in ratios)}]"
          f" median {median:.2f}; batch p50 A "
          f"{statistics.median(times['A']) * 1000:.0f} ms, B "
          f"{statistics.median(times['B']) * 1000:.0f} ms", flush=True)
    return median


def run_rounds(name: str, rounds: int, run: Callable[[str], Batches],
               variants: tuple[str, ...]) -> dict[str, float]:
    """``rounds`` runs of every variant (``variants[0]`` is A, the reference), the order
    rotating so no variant always goes first; each run's first batch is not measured.
    Prints each round and the summary; returns variant -> the median rows/s ratio to A
    (A itself left out)."""
    ratios: dict[str, list[float]] = {v: [] for v in variants[1:]}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(rounds):
        rates = {}
        shift = i % len(variants)
        for v in variants[shift:] + variants[:shift]:
            batches = run(v)[1:]
            rates[v] = sum(n for n, _ in batches) / sum(s for _, s in batches)
            times[v] += [s for _, s in batches]
        for v in ratios:
            ratios[v].append(rates[v] / rates[variants[0]])
        print(f"  {name} round {i + 1}: " + ", ".join(
            f"{v} {rates[v]:,.0f} rows/s" for v in variants) + "; " + ", ".join(
            f"{v}/{variants[0]} {ratios[v][-1]:.2f}" for v in ratios), flush=True)
    medians = {v: statistics.median(r) for v, r in ratios.items()}
    print(f"{name}: " + "; ".join(
        f"{v}/{variants[0]} per round [{', '.join(f'{r:.2f}' for r in ratios[v])}] median "
        f"{medians[v]:.2f}" for v in ratios) + "; batch p50 " + ", ".join(
        f"{v} {statistics.median(times[v]) * 1000:.0f} ms" for v in variants), flush=True)
    return medians
