"""An Iceberg table per check: pyiceberg's SQL catalog (SQLite) and a local warehouse,
or a warehouse on the suite's S3-API server (moto)."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from twophase.sinks.iceberg import IcebergParticipant


def local_catalog(root: Path) -> dict[str, str]:
    (root / "wh").mkdir(parents=True, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{root}/catalog.db",
            "warehouse": f"file://{root}/wh"}


class IcebergTarget:
    """One fresh table; participants are new objects each time (as a new process)."""

    def __init__(self, catalog: dict[str, str] | None = None, **options: Any) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="twophase-ice-")
        self.catalog = catalog or local_catalog(Path(self._tmp.name))
        self.table = f"conf.t_{uuid.uuid4().hex[:10]}"
        self.options = options

    def participant(self) -> IcebergParticipant:
        return IcebergParticipant(self.table, self.catalog, name="ice", **self.options)

    def load(self) -> Any:
        from pyiceberg.catalog import load_catalog

        props = dict(self.catalog)
        return load_catalog(props.pop("name", "default"), **props).load_table(self.table)

    def rows(self) -> list[dict[str, Any]]:
        tbl = self.load()
        if tbl.current_snapshot() is None:
            return []
        rows: list[dict[str, Any]] = tbl.scan().to_arrow().to_pylist()
        return rows

    def snapshots(self) -> list[Any]:
        return list(self.load().metadata.snapshots)

    def close(self) -> None:
        self._tmp.cleanup()
