"""The conformance suite (twophase/testing/conformance.py) against every durable participant."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.dataset as ds
import pytest

from twophase.participant import Participant
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.conformance import Harness, applicable_checks


class PgTarget:
    """A fresh table (and its own marker table) in the test server."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.table = f"conf_{uuid.uuid4().hex[:12]}"
        self.markers = f"{self.table}_markers"

    def participant(self) -> Participant:
        return PostgresParticipant(
            self.dsn, self.table, marker_table=self.markers, connect_timeout=5
        )

    def rows(self) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(f'SELECT id, label, amount FROM "{self.table}"')
            return [dict(zip(("id", "label", "amount"), r, strict=True)) for r in cur]

    def close(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            leftovers = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'tp:%%'"
                " AND gid LIKE %s", (f"%:postgres-{self.table}:%",)
            ).fetchall()
            for (gid,) in leftovers:
                conn.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(gid))
            conn.execute(f'DROP TABLE IF EXISTS "{self.table}", "{self.markers}"')
        assert not leftovers, f"check left prepared transactions behind: {leftovers}"


class FileTarget:
    def __init__(self, root: Path, fmt: str) -> None:
        self.path = root / f"out_{uuid.uuid4().hex[:8]}"
        self.fmt = fmt

    def participant(self) -> Participant:
        return StagedFileParticipant(str(self.path), self.fmt)

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        files = [str(p) for p in sorted(self.path.glob(f"part-*.{self.fmt}"))]
        if self.fmt == "jsonl":  # pyarrow's JSON reader refuses empty files: parse lines
            return [json.loads(line) for f in files for line in Path(f).read_text().splitlines()]
        dataset = ds.dataset(str(self.path), format="parquet")
        assert sorted(dataset.files) == files, "the dataset reader sees uncommitted files"
        if not files:
            return []
        return dataset.to_table(columns=["id", "label", "amount"]).to_pylist()

    def close(self) -> None:
        staging = self.path / "_twophase_staging"
        leftovers = [p.name for p in staging.glob("*")] if staging.exists() else []
        assert not leftovers, f"check left staged files behind: {leftovers}"


@pytest.fixture(scope="module")
def harnesses(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Harness]:
    root = tmp_path_factory.mktemp("conformance")
    return {
        "postgres": Harness(id="postgres", new_target=lambda: PgTarget(pg_dsn)),
        "files-parquet": Harness(
            id="files-parquet", new_target=lambda: FileTarget(root, "parquet")
        ),
        "files-jsonl": Harness(id="files-jsonl", new_target=lambda: FileTarget(root, "jsonl")),
    }


_DURABLE = Harness(id="durable", new_target=lambda: None)  # type: ignore[arg-type,return-value]
CASES = [
    pytest.param(kind, check, id=f"{kind}-{check.__name__.removeprefix('check_')}")
    for kind in ("postgres", "files-parquet", "files-jsonl")
    for check in applicable_checks(_DURABLE)
]


@pytest.mark.parametrize(("kind", "check"), CASES)
def test_conformance(
    harnesses: dict[str, Harness], kind: str, check: Callable[[Harness], None]
) -> None:
    check(harnesses[kind])


def test_every_check_runs_for_durable_participants() -> None:
    assert len(applicable_checks(_DURABLE)) == len(CASES) // 3 >= 13


