"""How the sink splits a batch when participants ask: by their shared key columns, or as
one branch (complete mode). Built as a user builds the sink; nothing connects."""

from __future__ import annotations

from pathlib import Path

import pytest

from twophase import TransactionalSink
from twophase.errors import InvalidRequest
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant

DSN = "postgresql://u@127.0.0.1:1/db"


def _sink(*parts: object, partitions: int | None = None) -> TransactionalSink:
    return TransactionalSink("s", list(parts), "sqlite:///unused.db",  # type: ignore[arg-type]
                             partitions=partitions)


def test_default_split_is_every_column(tmp_path: Path) -> None:
    sink = _sink(PostgresParticipant(DSN, "t"), StagedFileParticipant(str(tmp_path)),
                 partitions=4)
    assert sink.settings.split_columns == () and sink.settings.partitions == 4


def test_upsert_key_is_the_split_and_shared_keys_intersect(tmp_path: Path) -> None:
    a = PostgresParticipant(DSN, "a", mode="upsert", key=["day", "shop"])
    b = PostgresParticipant(DSN, "b", mode="upsert", key=["shop", "sku"])
    sink = _sink(a, StagedFileParticipant(str(tmp_path)), partitions=3)
    assert sink.settings.split_columns == ("day", "shop") and sink.settings.partitions == 3
    sink = _sink(a, b, partitions=None)
    assert sink.settings.split_columns == ("shop",)  # (day, shop), (shop, sku) share shop
    c = PostgresParticipant(DSN, "c", mode="upsert", key="region")
    assert _sink(a, c).settings.partitions == 1  # nothing shared: one branch
    with pytest.raises(InvalidRequest, match="share no column"):
        _sink(a, c, partitions=2)


def test_complete_mode_is_one_branch() -> None:
    p = PostgresParticipant(DSN, "t", mode="complete")
    assert _sink(p).settings.partitions == 1
    assert _sink(p, partitions=1).settings.partitions == 1
    with pytest.raises(InvalidRequest, match=r"partitions=4 but postgres participant "
                       r"'postgres-t' .* writes each batch as one branch"):
        _sink(p, partitions=4)
