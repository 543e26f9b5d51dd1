"""The conformance kit against SqlAlchemyParticipant on MariaDB (XA) and PostgreSQL.

``mariadb-hashed`` names its participant so that the readable xid passes MySQL's 64-byte
gtrid limit: every check then runs through hashed xids and the xid table.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.sinks.sql.sql_support import SqlTarget, pg_url
from twophase.testing.conformance import (
    ALL_CHECKS,
    CROSS_PROCESS_CHECKS,
    Harness,
    applicable_checks,
)

CHECKS = list(ALL_CHECKS) + list(CROSS_PROCESS_CHECKS)
LONG = "sql-participant-with-a-long-name-that-forces-hashed-xids"


def _harness(kind: str, request: pytest.FixtureRequest) -> Harness:
    if kind == "mariadb":
        url = request.getfixturevalue("mariadb")
        return Harness(id=kind, new_target=lambda: SqlTarget(url))
    if kind == "mariadb-hashed":
        url = request.getfixturevalue("mariadb")
        return Harness(id=kind, new_target=lambda: SqlTarget(url, name=LONG))
    url = pg_url(request.getfixturevalue("pg_dsn"))
    return Harness(id=kind, new_target=lambda: SqlTarget(url))


@pytest.mark.parametrize("kind", ["mariadb", "mariadb-hashed", "postgresql"])
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(kind: str, check: Callable[[Harness], None],
                     request: pytest.FixtureRequest) -> None:
    harness = _harness(kind, request)
    assert check in applicable_checks(harness)
    check(harness)
