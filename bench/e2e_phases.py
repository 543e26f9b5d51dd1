"""``bench/e2e.py``'s phase line: where B's batch time goes, beside A's job."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from twophase.engine.report import BATCH_PHASES


def phase_line(title: str, runs: Mapping[str, Sequence[Any]], a50: float) -> str:
    """B's batch split by phase (p50 over the measured batches of every run, ms), measured
    by the sink itself (``BatchReport.phases``), beside A's whole batch and A's job split
    the same way (the job, its slowest task, the rest: Spark's part)."""
    batches = [ph for r in runs["B"] for ph in r.phases[1:]]
    a_jobs = [ph for r in runs["A"] for ph in r.phases[1:]]
    if not batches or not a_jobs:
        return ""

    def p50(key: str, of: list[dict[str, float]] = batches) -> float:
        return 1000 * statistics.median(ph.get(key, 0.0) for ph in of)

    def spark_part(of: list[dict[str, float]]) -> float:
        return 1000 * statistics.median(
            ph.get("job_s", 0.0) - ph.get("task_s", 0.0) for ph in of)

    def batch_p50(name: str) -> float:  # as the log line and BatchReport give it
        return 1000 * statistics.median(sum(ph.get(k, 0.0) for k in BATCH_PHASES[name])
                                        for ph in batches)

    job_spark = spark_part(batches)
    return (f"{title}: A's job p50 (ms) {p50('job_s', a_jobs):.1f} [Spark's part "
            f"{spark_part(a_jobs):.1f}; slowest task {p50('task_s', a_jobs):.1f}]\n"
            f"{title}: B's phases p50 (ms): frame {p50('frame_s'):.1f}, split "
            f"{p50('split_s'):.1f}, setup {p50('setup_s'):.1f}, begin "
            f"{p50('begin_s'):.1f}, plan {p50('plan_s'):.1f}, job {p50('job_s'):.1f} "
            f"[Spark's part {job_spark:.1f}; slowest task {p50('task_s'):.1f} = prepare "
            f"{p50('prepare_s'):.1f}], "
            f"decide {p50('decide_s'):.1f}, driver's commit "
            f"{p50('driver_commit_s'):.1f}, settle {p50('settle_s'):.1f}, driver "
            f"{p50('driver_s'):.1f}; A's whole batch p50 {1000 * a50:.1f}\n"
            f"{title}: B's report p50 (ms, the tasks' and the driver's work): prepare "
            f"{batch_p50('prepare_s'):.1f}, wait {batch_p50('wait_s'):.1f}, commit "
            f"{batch_p50('commit_s'):.1f}\n"
            + mean_line(title, runs))


def mean_line(title: str, runs: Mapping[str, Sequence[Any]]) -> str:
    """B minus A by phase in means over the measured batches (ms), which add up where
    p50s do not: B's batch mean is the sum of its phases' means, A's is its job's (the
    job's DataFrame, Spark's part and the slowest task), so every millisecond of the
    added mean is named (the phases B has and A has not, the job's two parts)."""
    b_ph = [ph for r in runs["B"] for ph in r.phases[1:]]
    a_ph = [ph for r in runs["A"] for ph in r.phases[1:]]
    b_t = [t for r in runs["B"] for t in r.times[1:]]
    a_t = [t for r in runs["A"] for t in r.times[1:]]

    def mean(key: str, of: list[dict[str, float]]) -> float:
        return 1000 * statistics.fmean(ph.get(key, 0.0) for ph in of)

    def spark(of: list[dict[str, float]]) -> float:
        return mean("job_s", of) - mean("task_s", of)

    own = ("frame_s", "split_s", "setup_s", "begin_s", "plan_s", "settle_s", "decide_s",
           "driver_commit_s", "driver_s")
    parts = {k[:-2]: mean(k, b_ph) for k in own if mean(k, b_ph) >= 0.05}
    parts["job: Spark's part"] = spark(b_ph) - spark(a_ph)
    parts["job: slowest task"] = mean("task_s", b_ph) - mean("task_s", a_ph)
    b_mean, a_mean = 1000 * statistics.fmean(b_t), 1000 * statistics.fmean(a_t)
    named = sum(parts.values())
    parts["outside the phases (B's batch minus its phases, minus A's outside its job)"] = (
        (b_mean - a_mean) - named)
    cells = ", ".join(f"{k} {v:+.1f}" for k, v in parts.items())
    return (f"{title}: added mean {b_mean - a_mean:+.1f} ms (A {a_mean:.1f}, B {b_mean:.1f})"
            f" = {cells}")
