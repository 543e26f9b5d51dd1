"""Child process for the concurrent staged committers test: commit every staged branch of
a job file in 4 threads, as a driver's Committer (or a concurrent ``twophase resolve``)
does, once the parent's start file exists.

Usage: ``python -m tests.support.kafka_commit_all JOB.pkl START``. JOB holds a pickled
``(participant, [(branch, handle), ...])``. Prints one JSON line: per branch id, "ok" or
the error's text. Exit 0 whatever the outcomes (the parent judges them).
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def main() -> int:
    with open(sys.argv[1], "rb") as f:
        participant, work = pickle.load(f)
    start = Path(sys.argv[2])
    deadline = time.monotonic() + 60
    while not start.exists() and time.monotonic() < deadline:
        time.sleep(0.005)

    def commit(item: tuple[Any, Any]) -> str:
        branch, handle = item
        try:
            participant.commit(branch, handle)
        except Exception as exc:  # judged by the parent: a fenced copy fails, by design
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(commit, work))
    participant.close()
    print(json.dumps({str(b.partition): o for (b, _), o in zip(work, outcomes, strict=True)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
