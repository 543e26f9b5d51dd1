"""A chaos run's report: the figures it summarises (durations, options with secrets
blanked) and the text ``twophase chaos`` prints from it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["redacted", "render", "summary"]


def redacted(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """Storage options for the report, secrets blanked (the report is shared, the job
    config is the user's)."""
    if options is None:
        return None
    return {k: ("***" if "secret" in k or "token" in k else v) for k, v in options.items()}


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, median, 90th percentile and maximum of durations (None without any)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    xs = sorted(values)
    return {
        "n": len(xs),
        "p50": round(statistics.median(xs), 3),
        "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3),
        "max": round(xs[-1], 3),
    }


def render(report: dict[str, Any]) -> list[str]:
    """The human-readable report printed by ``twophase chaos``."""
    rec = report["recovery_seconds"]
    lines = [
        f"chaos: {report['kills']} kills (seed {report['seed']}, "
        f"{report['coordinator_mode']} coordinator), {report['runs']} job runs, "
        f"{report['batches']} batches / {report['rows']} rows, {report['duration_s']:.0f}s",
        "kills by victim: " + ", ".join(f"{k}={v}" for k, v in
                                        sorted(report["by_victim"].items())),
        "kills by protocol step reached:",
    ]
    for victim, steps in sorted(report["by_victim_step"].items()):
        for step, n in sorted(steps.items()):
            lines.append(f"  {victim:<12} {step:<32} {n}")
    if report.get("kafka_vote_to_endtxn"):
        lines.append(f"kills between a Kafka vote and its EndTxn (failpoints): "
                     f"{report['kafka_vote_to_endtxn']}")
    if report["missed"]:
        lines.append("planned kills that did not land (job ended first): "
                     + ", ".join(f"{k}={v}" for k, v in sorted(report["missed"].items())))
    lines.append(f"job runs that gave up on a batch and were restarted: "
                 f"{report['job_failures']}")
    if rec["n"]:
        lines.append(f"time to recover (kill -> next committed batch): p50 {rec['p50']:.1f}s, "
                     f"p90 {rec['p90']:.1f}s, max {rec['max']:.1f}s (n={rec['n']})")
    down = report.get("broker_down_seconds") or {"n": 0}
    if down["n"]:
        lines.append(f"broker down per kill (SIGKILL -> restart): p50 {down['p50']:.1f}s, "
                     f"max {down['max']:.1f}s (n={down['n']})")
    if report.get("broker_kills_by_target"):
        lines.append("broker kills by what the node led: " + ", ".join(
            f"{k}={v}" for k, v in sorted(report["broker_kills_by_target"].items())))
    lines.append(f"coordinator transactions left unsettled: {report['coordinator_unsettled']}")
    lines.append("verification per system:")
    lines += ["  " + x for x in report["verify_lines"]]
    verdict = "PASSED" if report["ok"] else "FAILED"
    lines.append(f"exactly-once: {verdict}   (report: {report.get('json_path', '-')})")
    return lines
