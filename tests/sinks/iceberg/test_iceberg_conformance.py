"""IcebergParticipant through the participant conformance kit (crash checks included)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.sinks.iceberg.iceberg_support import IcebergTarget
from twophase.testing.conformance import Harness, applicable_checks

HARNESS = Harness(id="iceberg", new_target=IcebergTarget)


@pytest.mark.parametrize("check", applicable_checks(HARNESS), ids=lambda c: c.__name__)
def test_conformance(check: Callable[[Harness], None]) -> None:
    check(HARNESS)
