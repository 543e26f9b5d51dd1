"""Child process for the staged Kafka kill test: commit a staged branch and die by SIGKILL
after the copy is produced and flushed, before ``commit_transaction``.

Usage: ``python -m tests.support.kafka_copy_and_die JOB.pkl``. JOB holds a pickled
``(participant, branch, handle)``. Exit code 3 means the commit got past the kill point.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Any


def main() -> int:
    from twophase.sinks.kafka import staged

    with open(sys.argv[1], "rb") as f:
        participant, branch, handle = pickle.load(f)

    def die(*_: Any) -> None:  # the records are in the open transaction: die before its end
        os.kill(os.getpid(), signal.SIGKILL)

    staged._end = die  # type: ignore[assignment]
    participant.commit(branch, handle)
    return 3


if __name__ == "__main__":
    sys.exit(main())
