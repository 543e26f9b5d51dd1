"""Shared fixtures: real parts only.

- ``pg``: one private PostgreSQL server for the whole session (started here, stopped here).
- ``tls_pg``: a second one that takes TLS connections only, started by the first test
  that asks for it, kept for the session.
- ``mariadb`` (a SQLAlchemy URL), ``mariadb_server``: one private MariaDB server
  (Debian's mariadb-server) for the whole session.
- ``spark``: one local[2] SparkSession for the whole session.
- ``kafka_bootstrap``: a Kafka-protocol broker (tansu, memory storage) on loopback
  (``tests/support/kafka.py``).
- ``s3``, ``s3_bucket``: an S3-API server (moto) on loopback (``tests/support/s3.py``).
Nothing here depends on a server that was running before the suite.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from twophase.testing.localmariadb import LocalMariaDB  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402

# Every JVM the suite starts (Spark drivers and executors, Kafka brokers and tools, the
# standalone cluster's daemons) runs short: C1 only and the serial collector spend the two
# cores on the tests instead of on C2 compilation and GC threads (about 30% less time for
# a Spark kill test, A/B on 2 cores, docs/testing.md). `java` reads JDK_JAVA_OPTIONS
# before its command line, so a flag a JVM is started with still wins; set the variable
# yourself (even empty) to run the suite's JVMs as they run in production.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("JDK_JAVA_OPTIONS", JVM_OPTIONS)

# kafka_bootstrap / kafka_bootstrap, s3 / s3_bucket and cluster fixtures for every
# test module
pytest_plugins = ["tests.support.kafka", "tests.support.s3", "tests.support.cluster"]


# The longest files of the default run, longest first (measured per-test durations,
# docs/testing.md). They are handed out first so that, with two workers
# (scripts/test.sh: pytest-xdist, whole files per worker, in this order), no long file
# starts last while the other worker has nothing left; every other file keeps its place.
LONG_FILES_FIRST: tuple[str, ...] = (
    "tests/system/test_cluster.py",
    "tests/chaos/test_chaos_matrix.py",
    "tests/system/test_wheel.py",
    "tests/system/test_new_user.py",
    "tests/chaos/test_chaos_cli.py",
    "tests/spark/test_native_tables_kill.py",
    "tests/system/test_error_catalogue.py",
    "tests/spark/test_spark_sink.py",
    "tests/sinks/test_spark_reads_tables.py",
    "tests/spark/test_s3_spark.py",
    "tests/sinks/delta/test_delta_spark.py",
    "tests/spark/test_native_s3.py",
    "tests/sinks/iceberg/test_iceberg_spark.py",
    "tests/spark/test_spark_modes.py",
    "tests/sinks/sql/test_sql_spark.py",
    "tests/chaos/test_kafka_server_faults.py",
    "tests/spark/test_spark_connect.py",
    "tests/spark/test_kafka_source.py",
    "tests/spark/test_datasource.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def pg() -> Iterator[LocalPostgres]:
    server = LocalPostgres(max_prepared_transactions=100, fsync=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg: LocalPostgres) -> str:
    return pg.dsn


@pytest.fixture(scope="session")
def tls_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL that refuses plaintext TCP (``ssl=on``, a certificate for 127.0.0.1
    signed by a throw-away CA): the secured-targets Spark job and the new user's job
    connect to it with ``sslmode=verify-full`` (:meth:`LocalPostgres.tls_dsn`)."""
    server = LocalPostgres(max_prepared_transactions=20, fsync=False, tls=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[LocalMariaDB]:
    server = LocalMariaDB()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mariadb(mariadb_server: LocalMariaDB) -> str:
    """A SQLAlchemy URL (``mysql+pymysql://``) of the suite's private MariaDB server."""
    return mariadb_server.url


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    # No PYSPARK_PYTHON: the suite meets Spark's interpreter as users do (the sink picks
    # the driver's in local mode, twophase.spark.preflight).
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # keep Spark on loopback
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("twophase-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
