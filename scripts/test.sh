#!/usr/bin/env bash
# The whole test suite, from nothing: a fresh virtual environment, the project with every
# extra, Debian's PostgreSQL server, a Java runtime and Maven (Apache Kafka's jars) when
# missing, then ruff, mypy, import-linter (the layers) and pytest. Extra arguments go to pytest
# (e.g. `bash scripts/test.sh -k protocol`; `bash scripts/test.sh -m slow` runs the long tests,
# docs/testing.md; `bash scripts/test.sh -m "cluster and not slow"` runs only the
# multi-host cluster tests, which need root for their network namespaces). Without
# arguments it then runs the Spark 3.5 job (scripts/test-spark35.sh, tests/spark35.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${TWOPHASE_VENV:-.venv}"
PY="${PYTHON:-python3}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@"
}

# PostgreSQL server binaries (the suite starts its own private server with them).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "== installing Debian's postgresql (initdb not found)"
  apt_install postgresql
fi
# MariaDB for the SQL participant's tests (twophase/testing/localmariadb.py starts its own
# private server; a server the package may start is never used).
if ! command -v mariadbd >/dev/null 2>&1 && ! [ -x /usr/sbin/mariadbd ]; then
  echo "== installing Debian's mariadb-server (mariadbd not found)"
  apt_install mariadb-server
fi
# Java for Spark (Spark 4 needs 17 or newer).
if ! command -v java >/dev/null 2>&1; then
  echo "== installing a Java runtime (java not found)"
  apt_install openjdk-17-jre-headless
fi
java -version 2>&1 | head -1
# Maven resolves Apache Kafka's broker jars (the Kafka tests run a private Apache Kafka 4.x:
# twophase/testing/kafka-broker.pom.xml, resolved once into ~/.cache/twophase).
if ! command -v mvn >/dev/null 2>&1; then
  echo "== installing Debian's maven (mvn not found)"
  apt_install maven
fi
# iproute2 (ip, tc) for the cluster tests and the network fault tests (they create their
# own network namespaces, veth pairs and a bridge; they, and the tmpfs of the ENOSPC
# test, need root); openssl for the TLS tests' self-signed certificates.
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
  echo "== installing Debian's iproute2 (ip/tc not found)"
  apt_install iproute2
fi
if ! command -v openssl >/dev/null 2>&1; then
  echo "== installing openssl"
  apt_install openssl
fi
# Debian's Chromium for the console's browser test (driven by Playwright for Python with
# executable_path=/usr/bin/chromium; Playwright's own browser download is never used).
if [ ! -x /usr/bin/chromium ]; then
  echo "== installing Debian's chromium (the console's browser test)"
  apt_install chromium
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
echo "== installing twophase[all,dev]"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[all,dev]"

# ---- issue 32: Spark's own Delta and Iceberg connectors -------------------------------
# tests/sinks/test_spark_reads_tables.py reads the tables twophase writes with Spark's
# Delta and Iceberg connectors: Maven resolves their jars from Maven Central
# (tools/spark-connectors/pom.xml) and pip makes the reader's own pyspark environment (the
# connectors lag pyspark's newest release), both once into ${TWOPHASE_CACHE:-~/.cache/twophase}.
if ! command -v mvn >/dev/null 2>&1; then
  echo "== installing Debian's maven (mvn not found: the Spark connectors' jars)"
  apt_install maven
fi
echo "== Spark's Delta and Iceberg connectors and the reader's Spark (cached after the first run)"
"$VENV/bin/python" -m tests.support.spark_connectors
# ---- end issue 32 ----------------------------------------------------------------------
echo "== Apache Kafka's jars (Maven Central, cached after the first run)"
"$VENV/bin/python" -m twophase.testing.kafkajars
# Spark's own Kafka source for the Kafka-in pipeline (tests/spark/test_kafka_source.py,
# `twophase demo --kafka`): twophase/testing/spark-kafka.pom.xml, resolved once the same way.
echo "== Spark's Kafka connector (Maven Central, cached after the first run)"
"$VENV/bin/python" -m twophase.testing.sparkkafka
# Hadoop's S3A (hadoop-aws and the AWS SDK's s3 modules) for the native path of an s3://
# files participant (tests/spark/test_native_s3.py): twophase/testing/s3a.pom.xml, the same way.
echo "== Hadoop's S3A file system (Maven Central, cached after the first run)"
"$VENV/bin/python" -m twophase.testing.s3ajars

echo "== ruff"
"$VENV/bin/ruff" check .
echo "== mypy"
"$VENV/bin/mypy"
echo "== import-linter (layers of DESIGN.md; fails on any upward import)"
"$VENV/bin/lint-imports"
# Two workers (pytest-xdist), each with its own servers, Spark session and temporary
# folders; whole files go to a worker (--dist loadfile: a module's fixtures are built
# once), in collection order (tests/conftest.py puts the longest files first). Most of
# the suite waits on JVMs, servers and subprocess jobs, so two workers overlap that
# waiting on two cores. TWOPHASE_TEST_WORKERS=0 runs in this process; `-n 0` among the
# arguments does the same for one run (docs/testing.md).
workers="${TWOPHASE_TEST_WORKERS:-2}"
echo "== pytest ($workers workers)"
set +e
"$VENV/bin/python" -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
# The Spark 3.5 job: the subset of tests/spark35.txt on pyspark 3.5, in its own cached
# virtual environment (scripts/test-spark35.sh). Part of the whole-suite run (no pytest
# arguments given); TWOPHASE_SPARK35_JOB=0 leaves it out.
if [ "$#" = 0 ] && [ "${TWOPHASE_SPARK35_JOB:-1}" != 0 ]; then
  echo "== the Spark 3.5 job (scripts/test-spark35.sh)"
  set +e
  PYTHON="$PY" bash scripts/test-spark35.sh
  rc35=$?
  set -e
  if [ "$rc" = 0 ]; then rc="$rc35"; fi
fi
exit "$rc"
