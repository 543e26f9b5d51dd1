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


def test_spark_kafka_connector_without_maven_and_cache_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spark's Kafka source (twophase/testing/sparkkafka.py) fails the same clear way."""
    from twophase.testing import sparkkafka

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    monkeypatch.delenv(sparkkafka.ENV_JARS, raising=False)
    with pytest.raises(kafkajars.KafkaJarsUnavailable,
                       match=r"Spark's Kafka connector .* mvn is not installed: install Maven"):
        sparkkafka.spark_kafka_jars()
    monkeypatch.setenv(sparkkafka.ENV_JARS, str(tmp_path))
    with pytest.raises(kafkajars.KafkaJarsUnavailable, match=r"lacks one of spark-sql-kafka"):
        sparkkafka.spark_kafka_jars()


def test_spark_kafka_connector_cache_holds_the_jars_spark_lacks() -> None:
    """The cache scripts/test.sh filled: the connector of the pom's version and the three
    jars Spark does not ship, nothing else (Spark's own Scala, Hadoop, logging serve)."""
    from twophase.testing import sparkkafka

    names = sorted(j.name.rsplit("-", 1)[0] for j in sparkkafka.spark_kafka_jars())
    assert names == ["commons-pool2", "kafka-clients", "spark-sql-kafka-0-10_2.13",
                     "spark-token-provider-kafka-0-10_2.13"]
    assert sparkkafka.spark_kafka_conf()["spark.jars"].count(".jar") == 4
