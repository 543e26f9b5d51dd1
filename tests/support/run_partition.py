"""Child process: run one partition of a pickled plan, as a Spark task would, and with
``--apply`` then the driver's commit of the attempt (``Committer.apply``, a finish's
redone handle in place of the lost one).

Usage: ``python run_partition.py PLAN.pkl PARTITION ROWS.arrow [--apply]``. Exit code 0
when it finished, 4 when it raised a ``TwophaseError`` (its message on stderr). Used
with failpoints (``TWOPHASE_FAILPOINTS``) to stop a task or the driver at a protocol
step while the test acts on the same batch from elsewhere.
"""

from __future__ import annotations

import pickle
import sys


def main() -> int:
    import pyarrow as pa

    from twophase.client.api import CoordinatorClient
    from twophase.engine.commit import Committer
    from twophase.engine.plan import redone_handles
    from twophase.engine.task import run_partition
    from twophase.errors import TwophaseError

    plan_path, partition, rows_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(plan_path, "rb") as f:
        plan = pickle.load(f)
    with pa.memory_map(rows_path) as source:
        reader = pa.ipc.open_stream(source)
        batches = list(reader)
    try:
        out = run_partition(plan, partition, reader.schema, batches)
        if "--apply" in sys.argv[4:]:
            client = CoordinatorClient(plan.coordinator_url, plan.token)
            committer = Committer(plan.participants)
            _, error = committer.apply(client, plan.epoch, client.get(plan.key),
                                       redone_handles([out.as_dict()]))
            if error:
                print(error, file=sys.stderr)
                return 4
    except TwophaseError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
