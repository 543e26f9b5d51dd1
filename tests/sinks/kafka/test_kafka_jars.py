"""Where the suite's Apache Kafka comes from (twophase/testing/kafkajars.py): a missing
Maven with nothing cached is a clear error naming the fix, never a hang or a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from twophase.testing import kafkajars


def test_without_maven_and_cache_the_error_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    monkeypatch.delenv(kafkajars.ENV_LIBS, raising=False)
    with pytest.raises(kafkajars.KafkaJarsUnavailable,
                       match=r"mvn is not installed: install Maven \(Debian: apt-get install "
                             r"maven\) and Java 17"):
        kafkajars.kafka_libs()


def test_a_libs_folder_without_kafka_is_refused(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kafkajars.ENV_LIBS, str(tmp_path))
    with pytest.raises(kafkajars.KafkaJarsUnavailable, match=r"holds no kafka_2\.13"):
        kafkajars.kafka_libs()


def test_the_cache_is_keyed_by_version_and_pom() -> None:
    """The suite's broker is the pom's version, resolved into a folder named for it."""
    libs = kafkajars.kafka_libs()  # the cache scripts/test.sh filled
    assert libs.parent.name.startswith(f"kafka-{kafkajars.KAFKA_VERSION}-")
    assert (libs / f"kafka_2.13-{kafkajars.KAFKA_VERSION}.jar").exists()
    assert kafkajars.KAFKA_VERSION.startswith("4.")
