"""Where the embedded coordinator listens and how the tasks reach it (docs/cluster.md):
loopback under a local master, ``coordinator_host=`` overrides, TLS with the coordinator's
own certificate pinned in the tasks, too many partitions refused before any write. Real
local[2] Spark; the multi-host cases are in tests/system/test_cluster.py."""

from __future__ import annotations

import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from twophase import TransactionalSink
from twophase.client.connection import connect
from twophase.errors import CoordinatorUnavailable
from twophase.sinks.files import StagedFileParticipant
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark


def _cert(tmp_path: Path, address: str) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed (Debian's openssl package; scripts/test.sh installs it)"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={address}", "-addext", f"subjectAltName=IP:{address}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def _batch(spark: Any, n: int) -> Any:
    return spark.range(n).selectExpr("id", "cast(id as string) as name")


def test_local_master_listens_on_loopback_and_coordinator_host_overrides(
    spark: Any, tmp_path: Path
) -> None:
    files = StagedFileParticipant(path=str(tmp_path / "a"))
    sink = TransactionalSink("addr", [files], f"sqlite:///{tmp_path / 'a.db'}",
                             lineage="addr-a", partitions=2)
    try:
        sink(_batch(spark, 10), 0)
        assert sink._engine.conn is not None and sink._engine.conn.url.startswith("http://127.0.0.1:")
    finally:
        sink.close()
    other = StagedFileParticipant(path=str(tmp_path / "b"))
    sink = TransactionalSink("addr", [other], f"sqlite:///{tmp_path / 'b.db'}",
                             lineage="addr-b", partitions=2, coordinator_host="127.0.0.2")
    try:
        sink(_batch(spark, 10), 0)
        assert sink._engine.conn is not None and sink._engine.conn.url.startswith("http://127.0.0.2:")
    finally:
        sink.close()
    assert verify([files], range(10)).ok
    assert verify([other], range(10)).ok


def test_tls_embedded_coordinator_tasks_trust_its_own_certificate(
    spark: Any, tmp_path: Path
) -> None:
    cert, key = _cert(tmp_path, "127.0.0.1")
    files = StagedFileParticipant(path=str(tmp_path / "out"))
    sink = TransactionalSink("tls", [files], f"sqlite:///{tmp_path / 'c.db'}",
                             lineage="tls-1", partitions=2, coordinator_tls=(cert, key))
    try:
        sink(_batch(spark, 20), 0)
        sink(_batch(spark, 20).selectExpr("id + 20 as id", "name"), 1)
        assert sink._engine.conn is not None and sink._engine.conn.url.startswith("https://127.0.0.1:")
        url = sink._engine.conn.url
        # a client that does not trust this certificate is turned away
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz", timeout=5)
    finally:
        sink.close()
    assert [r.outcome for r in sink.history] == ["committed", "committed"]
    assert verify([files], range(40)).ok


def test_connection_pickles_with_the_pinned_certificate(tmp_path: Path) -> None:
    cert, key = _cert(tmp_path, "127.0.0.1")
    with connect(f"sqlite:///{tmp_path / 'p.db'}", tls=(cert, key)) as conn:
        shipped = pickle.loads(pickle.dumps(conn))
        assert shipped.ca_pem == Path(cert).read_text()
        assert shipped.client().register("pickled") >= 1
        shipped.close()
        plain = connect(conn.url)  # no certificate: the default trust store refuses
        plain.client().retry_budget = 0.5
        with pytest.raises(CoordinatorUnavailable):
            plain.client().register("nope")
        plain.close()


def test_more_partitions_than_slots_run_in_ordinary_tasks(spark: Any, tmp_path: Path) -> None:
    """local[2] has 2 task slots; a sink whose participants prepare durably runs 5
    partitions on them (ordinary tasks, no barrier stage): every row lands once, in 5
    files, and the batch's report says 5 partitions."""
    import pyarrow.dataset as ds

    out = tmp_path / "out"
    sink = TransactionalSink("slots", [StagedFileParticipant(path=str(out))],
                             f"sqlite:///{tmp_path / 's.db'}", lineage="slots-1",
                             partitions=5)
    sink(_batch(spark, 10), 0)
    sink.close()
    assert sink.history[-1].partitions == 5
    rows = ds.dataset(out, format="parquet").to_table()
    assert rows.num_rows == 10
    assert len(list(out.glob("*.parquet"))) == 5

