"""Spark's own Kafka source (``spark-sql-kafka-0-10``), its jars resolved once through
Maven and cached, for the Kafka-in pipeline (:mod:`.kafkasource`).

Why a pinned local folder and not ``spark.jars.packages``: Spark's Ivy resolution runs at
every session start and reaches the network then; here Maven runs once (``scripts/test.sh``,
or the first use) and every session is given the local jars as ``spark.jars``.
``spark-kafka.pom.xml`` (beside this module) names the connector; only the jars Spark
does not ship itself are copied (the connector, its token provider, the Kafka client and
commons-pool2). The folder is keyed by the pom's content.

``$TWOPHASE_SPARK_KAFKA_JARS`` names a ready folder of those jars instead (offline).
"""

from __future__ import annotations

from pathlib import Path

from twophase.testing.kafkajars import cached_jars, pom_property

__all__ = ["ENV_JARS", "POM", "SPARK_KAFKA_VERSION", "spark_kafka_conf", "spark_kafka_jars"]

ENV_JARS = "TWOPHASE_SPARK_KAFKA_JARS"
POM = Path(__file__).with_name("spark-kafka.pom.xml")
_JARS = ("spark-sql-kafka-0-10_2.13", "spark-token-provider-kafka-0-10_2.13",
         "kafka-clients", "commons-pool2")


SPARK_KAFKA_VERSION = pom_property(POM, "spark.kafka.version")


def _ready(folder: Path) -> bool:
    return all(any(folder.glob(f"{name}-*.jar")) for name in _JARS)


def spark_kafka_jars(timeout: float = 600.0) -> list[Path]:
    """The connector's jars: ``$TWOPHASE_SPARK_KAFKA_JARS``, else the cache, resolved
    with ``mvn`` the first time."""
    return sorted(cached_jars(
        POM, f"spark-kafka-{SPARK_KAFKA_VERSION}", "jars", env=ENV_JARS, ready=_ready,
        lacks=f"lacks one of {', '.join(_JARS)}", artifacts=_JARS, timeout=timeout,
        what=f"Spark's Kafka connector {SPARK_KAFKA_VERSION}'s jars").glob("*.jar"))


def spark_kafka_conf() -> dict[str, str]:
    """The Spark settings that make ``format("kafka")`` available to a new session."""
    return {"spark.jars": ",".join(str(j) for j in spark_kafka_jars())}


if __name__ == "__main__":  # `python -m twophase.testing.sparkkafka`: resolve now (CI)
    print(*spark_kafka_jars(), sep="\n")
