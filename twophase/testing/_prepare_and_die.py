"""Child process for the cross-process conformance checks.

Usage: ``python -m twophase.testing._prepare_and_die JOB.pkl HANDLE.json``. JOB holds a pickled
``(participant, branch, arrow_ipc_stream_bytes)``. The script prepares the branch, writes
the handle (the YES vote) to HANDLE.json, then hits the ``after_prepare`` failpoint, which
the parent sets to ``kill``: the process dies by SIGKILL with the branch prepared, exactly
like an executor killed between its vote and the decision. Exit code 3 means the failpoint
did not fire.
"""

from __future__ import annotations

import json
import os
import pickle
import sys


def main() -> int:
    import pyarrow as pa

    from twophase import failpoints

    job_path, handle_path = sys.argv[1], sys.argv[2]
    with open(job_path, "rb") as f:
        participant, branch, ipc = pickle.load(f)  # noqa: S301 - written by the parent check
    reader = pa.ipc.open_stream(ipc)
    handle = participant.prepare(branch, reader.schema, list(reader))
    with open(handle_path, "w") as f:
        json.dump(dict(handle), f)
        f.flush()
        os.fsync(f.fileno())
    failpoints.hit("after_prepare", participant.name, branch.partition)
    return 3


if __name__ == "__main__":
    sys.exit(main())
