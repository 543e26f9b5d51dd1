"""Hadoop's S3A file system (``hadoop-aws`` and the AWS SDK v2 modules it loads), its jars
resolved once through Maven and cached, for the native data path of an ``s3://`` files
participant (:mod:`twophase.sinks.s3native`).

As for Spark's Kafka connector (:mod:`.sparkkafka`): Maven runs once (``scripts/test.sh``,
or the first use) and a session is given the local jars as ``spark.jars``, instead of
``spark.jars.packages`` reaching the network at every session start. ``s3a.pom.xml``
(beside this module) names hadoop-aws at the Hadoop version pyspark ships, the SDK's
``s3``, ``s3-transfer-manager`` and ``apache-client`` modules instead of its 600 MB
``bundle``; what Spark ships itself (netty, slf4j, httpclient 4) is left out. The folder
is keyed by the pom's content.

``$TWOPHASE_S3A_JARS`` names a ready folder of those jars instead (offline).
"""

from __future__ import annotations

import re
from pathlib import Path

from twophase.testing.kafkajars import cached_jars, pom_property

__all__ = ["ENV_JARS", "HADOOP_AWS_VERSION", "POM", "s3a_conf", "s3a_jars"]

ENV_JARS = "TWOPHASE_S3A_JARS"
POM = Path(__file__).with_name("s3a.pom.xml")
_NEEDED = ("hadoop-aws", "s3", "s3-transfer-manager", "apache-client", "aws-core", "sdk-core")
# Spark's own (its netty and httpclient 4 newer): never a second copy on the classpath
_SPARK_SHIPS = re.compile(r"^(netty-[a-z0-9-]+-4\.[0-9.]+Final|slf4j-api-.*|httpclient-4.*|"
                          r"httpcore-4.*|commons-logging-.*|commons-codec-.*)\.jar$")


HADOOP_AWS_VERSION = pom_property(POM, "hadoop.version")


def _ready(folder: Path) -> bool:
    return all(any(folder.glob(f"{name}-[0-9]*.jar")) for name in _NEEDED)


def s3a_jars(timeout: float = 600.0) -> list[Path]:
    """S3A's jars: ``$TWOPHASE_S3A_JARS``, else the cache, resolved with ``mvn`` the
    first time; without those Spark ships itself."""
    jars = cached_jars(POM, f"s3a-{HADOOP_AWS_VERSION}", "jars", env=ENV_JARS,
                       ready=_ready, lacks=f"lacks one of {', '.join(_NEEDED)}",
                       what=f"hadoop-aws {HADOOP_AWS_VERSION}'s jars", timeout=timeout)
    return sorted(j for j in jars.glob("*.jar") if not _SPARK_SHIPS.match(j.name))


def s3a_conf() -> dict[str, str]:
    """The Spark settings that make ``s3a://`` paths writable in a new session."""
    return {"spark.jars": ",".join(str(j) for j in s3a_jars())}


if __name__ == "__main__":  # `python -m twophase.testing.s3ajars`: resolve now (CI)
    print(*s3a_jars(), sep="\n")
