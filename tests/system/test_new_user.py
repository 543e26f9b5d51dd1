"""A new user follows docs/user/first-job.md and nothing else, as a user runs it.

Every command and the job's code are the page's marked blocks (``<!-- example:
first-job NAME -->``), changed only where the page tells the user to put their own host
names, paths and credentials. The steps:

1. install: ``python -m venv`` and the page's ``pip install`` into a new, empty
   environment (twophase from this checkout in place of the package index, pyspark at
   the release this suite runs on: 4.x in the default suite, 3.5 in the Spark 3.5 job
   through ``tests/spark35.txt``);
2. the Kafka administrator's part: the page's ``admin.properties`` and its
   ``kafka-topics.sh`` / ``kafka-acls.sh`` commands, run by bash as written through
   Kafka's own tools (:func:`twophase.testing.kafkajars.tool_scripts`: the distribution's
   main classes on the suite's jars); the principal then holds exactly the rows of
   docs/user/security.md's ACL table, no more (a principal no other test grants
   anything, so that nothing but the page's commands gives it a right);
3. run the job with that environment's interpreter (no ``PYSPARK_PYTHON``, no
   ``PYTHONPATH``, nothing of twophase in the environment) into PostgreSQL over TLS
   (``sslmode=verify-full``, the server refusing plaintext), Apache Kafka over SASL_SSL
   (ACLs enforced) and Delta on local disk;
4. ``kill -9`` its driver mid-stream: after a batch committed, while a later batch has
   branches prepared in PostgreSQL (or, if that window is missed, between two batches
   before the last);
5. run the same command again, then the page's check commands;
6. judge: every id exactly once in PostgreSQL (SQL), in Kafka (a ``read_committed``
   consumer and the partition-log judge of :func:`twophase.testing.verify.verify`) and
   in Delta (read back by deltalake); nothing prepared anywhere, every transaction
   decided.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.kafka import secure_kafka
from tests.support.user import INTERNAL
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.acls import RequiredAcl
from twophase.sinks.postgres import PostgresParticipant, gid_prefix, parse_gid
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.kafkajars import tool_scripts
from twophase.testing.localpg import LocalPostgres
from twophase.testing.servers import clean_env
from twophase.testing.verify import verify

__all__ = ["secure_kafka"]

pytestmark = [pytest.mark.real_kafka]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "user" / "first-job.md"
SECURITY = ROOT / "docs" / "user" / "security.md"
PRINCIPAL = "firstjob"  # the page's `app`: a user of secure_kafka that only this test grants
FILES, ROWS = 6, 40  # one input file per micro-batch
COMMITTED = re.compile(r"INFO twophase\.sink: sink orders batch (\d+) committed: (\d+) rows")


def doc_block(name: str) -> str:
    """The code block right after ``<!-- example: first-job NAME -->`` in the page."""
    m = re.search(rf"<!-- example: first-job {re.escape(name)} -->\n```\w+\n(.*?)```",
                  PAGE.read_text(encoding="utf-8"), re.S)
    assert m, f"{PAGE.name} has no block marked '<!-- example: first-job {name} -->'"
    return m.group(1)


def localize(block: str, values: dict[str, str]) -> str:
    """What the user does to a copied block: their own values for the page's
    placeholders. A placeholder the block lacks fails (the page changed under the test)."""
    for placeholder, value in values.items():
        assert placeholder in block, f"{placeholder!r} is no longer in the page's block"
        block = block.replace(placeholder, value)
    return block


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: no Spark interpreter choice, no PYTHONPATH, nothing of twophase's,
    no active virtual environment."""
    env = {k: v for k, v in clean_env().items()
           if k not in (*INTERNAL, "VIRTUAL_ENV") and not k.startswith("TWOPHASE_")}
    env.update(extra)
    return env


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """The user's folder; the new environment (about 1 GB) is removed after the test."""
    yield tmp_path
    shutil.rmtree(tmp_path / ".venv", ignore_errors=True)


def _install(work: Path, pyspark: str) -> tuple[Path, str]:
    """The page's install block in ``work``; the new interpreter and what pip chose."""
    script = localize(doc_block("install"), {
        "python -m venv": f"{shlex.quote(sys.executable)} -m venv",
        "'pyspark==4.1.*'": f"'pyspark=={pyspark}'",
        "'twophase[": f"'{ROOT}[",  # this checkout instead of the package index
    })
    out = subprocess.run(["bash", "-euc", script], cwd=work, env=user_env(),
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, \
        f"install failed:\n{script}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    python = work / ".venv" / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import twophase, pyspark, pyarrow, numpy; "
                            "print(twophase.__file__, pyspark.__version__, "
                            "pyarrow.__version__, numpy.__version__)"],
        cwd="/", env=user_env(), capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()
    site = work / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert found[:2] == [str(site / "site-packages" / "twophase" / "__init__.py"), pyspark], \
        found  # this environment's own twophase, the pyspark asked for
    return python, f"pyspark {found[1]}, pyarrow {found[2]}, numpy {found[3]}"


def _administer(work: Path, kafka: LocalKafka, topic: str) -> None:
    """The Kafka administrator's part of the page, step 2: its ``admin.properties`` and
    its commands, run by bash with Kafka's tools first on PATH; then what the principal
    holds must be the security page's ACL table, row for row."""
    admin = kafka.client_config()
    (work / "admin.properties").write_text(localize(doc_block("admin-config"), {
        'password="..."': f'password="{admin["sasl.password"]}"',
        "/etc/ssl/kafka-ca.pem": admin["ssl.ca.location"],
    }))
    script = localize(doc_block("kafka-admin"), {
        "broker1:9093": admin["bootstrap.servers"],
        "User:app": f"User:{PRINCIPAL}",
        "--replication-factor 3": "--replication-factor 1",  # one broker
    })
    script, n = re.subn(r"(?<=--topic )orders(?=[\s.])", topic, script)
    assert n >= 2, script  # the topic and its staging topic
    tools = tool_scripts(work / "kafka" / "bin")
    env = user_env(PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(["bash", "-euc", script], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, f"the page's Kafka commands failed:\n{script}\n" \
                                f"{out.stdout[-3000:]}{out.stderr[-3000:]}"
    table = {row.split("`")[1].replace("User:app", f"User:{PRINCIPAL}")
             for row in SECURITY.read_text(encoding="utf-8").splitlines()
             if row.startswith("| `--allow-principal")}
    table = {re.sub(r"(?<=--topic )orders(?=[\s.]|$)", topic, row) for row in table}
    assert len(table) >= 10, table  # the table is still where this test reads it
    granted = _acls_of(kafka, f"User:{PRINCIPAL}")
    assert granted == table, {"granted, not in the table": sorted(granted - table),
                              "in the table, not granted": sorted(table - granted)}


def _acls_of(kafka: LocalKafka, principal: str) -> set[str]:
    """Every ACL binding of ``principal`` on the broker (all ALLOW from any host), in the
    security page's ``kafka-acls.sh --add`` spelling."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]  # not in its __all__
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    config: dict[str, str | int | float | bool] = {**kafka.client_config()}
    anything: Any = None  # a filter's None matches every name and host
    admin = AdminClient(config)  # held until the answer: a dropped client cancels it
    found = admin.describe_acls(AclBindingFilter(
        ResourceType.ANY, anything, ResourcePatternType.ANY, principal, anything,
        AclOperation.ANY, AclPermissionType.ANY), request_timeout=15).result(timeout=15)
    assert all(b.permission_type.name == "ALLOW" and b.host == "*" for b in found), found
    return {RequiredAcl(b.restype.name.replace("BROKER", "CLUSTER"), b.name,
                        b.resource_pattern_type.name, b.operation.name, "").describe(principal)
            for b in found}


def _prepared(dsn: str) -> list[str]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return _prepared_on(conn)


def _prepared_on(conn: Any) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)", (gid_prefix("orders"),))]


def _run_and_kill(command: list[str], work: Path, env: dict[str, str], log: Path,
                  dsn: str) -> str:
    """Start the job; once a batch committed, SIGKILL its driver at the first sight of a
    prepared PostgreSQL branch (else after the next batch's commit). Returns which."""
    import psycopg

    with open(log, "w") as err:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=err, stderr=err,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        when = ""
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not when:
                assert proc.poll() is None, \
                    f"the job ended before the kill:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                done = len(COMMITTED.findall(log.read_text(errors="replace")))
                prepared = _prepared_on(conn) if done >= 1 else []
                if prepared:
                    ref = parse_gid(prepared[0])
                    when = (f"with a branch of batch {ref.batch_id if ref else '?'} prepared, "
                            f"after {done} batch(es) committed")
                elif done >= 2:
                    when = f"between batches, after {done} batch(es) committed"
                else:
                    time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        # the driver's JVM follows its Python when its pipe closes; never leave it behind
        for _ in range(100):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    return when


def _kafka_read_committed(config: dict[str, str], topic: str, expect: int) -> Counter[int]:
    """Every id a read_committed consumer sees from the start of every partition: until
    ``expect`` arrived and then 3 s without more (a duplicate would come in them)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**config, "group.id": f"twophase.verify-{uuid.uuid4().hex[:8]}",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(topic, timeout=15).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        ids: Counter[int] = Counter()
        deadline, last = time.monotonic() + 60, time.monotonic()
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                value = msg.value()
                assert value is not None, "a record without a value (the job sends rows)"
                ids[json.loads(value)["id"]] += 1
                last = time.monotonic()
            elif ids.total() >= expect and time.monotonic() - last > 3:
                break
        return ids
    finally:
        consumer.close()


def test_a_new_user_installs_runs_kills_and_recovers_the_documented_job(
    work: Path, tls_pg: LocalPostgres, secure_kafka: LocalKafka
) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    pyspark = importlib.metadata.version("pyspark")
    _, versions = _install(work, pyspark)
    timings["install"] = time.monotonic() - started

    # the Kafka administrator's part (page, step 2): the topics, the documented ACLs
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    table = f"orders_{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    _administer(work, secure_kafka, topic)
    timings["Kafka administration"] = time.monotonic() - t0
    app = secure_kafka.client_config(PRINCIPAL)
    pg_dsn = tls_pg.tls_dsn()
    incoming = work / "data" / "incoming" / "orders"
    incoming.mkdir(parents=True)
    for i in range(FILES):
        ids = pa.array(range(i * ROWS, (i + 1) * ROWS), pa.int64())
        pq.write_table(pa.table({"id": ids, "amount": pa.array([2.5] * ROWS)}),
                       incoming / f"part-{i}.parquet")

    # the user's values in the copied blocks
    store = f"sqlite:///{work}/var/lib/"
    assert tls_pg.ca_cert is not None
    (work / "orders_job.py").write_text(job := localize(doc_block("job"), {
        "postgresql://app@db.internal:5432/shop": tls_pg.dsn,
        "/etc/ssl/db-ca.pem": str(tls_pg.ca_cert),
        '"sasl.username": "app"': f'"sasl.username": "{PRINCIPAL}"',
        'table="orders"': f'table="{table}"',
        'KafkaParticipant("orders"': f'KafkaParticipant("{topic}"',
        "broker1:9093,broker2:9093": app["bootstrap.servers"],
        "/etc/ssl/kafka-ca.pem": app["ssl.ca.location"],
        '"/data/': f'"{work}/data/',
        "sqlite:////var/lib/": store,
    }))
    # the page's DSN is TLS, the server's certificate and host name verified
    [dsn] = [ast.literal_eval(kw.value) for node in ast.walk(ast.parse(job))
             if isinstance(node, ast.Call) for kw in node.keywords if kw.arg == "dsn"]
    assert dsn == pg_dsn, (dsn, pg_dsn)
    run = doc_block("run").strip().splitlines()
    assert run[0].startswith("export KAFKA_PASSWORD="), run
    command = shlex.split(run[-1])
    assert command == [".venv/bin/python", "orders_job.py"], command
    env = user_env(KAFKA_PASSWORD=app["sasl.password"])

    # run, kill -9 mid-stream, run again
    log1, log2 = work / "run1.log", work / "run2.log"
    t0 = time.monotonic()
    when = _run_and_kill(command, work, env, log1, pg_dsn)
    timings["run until the kill"] = time.monotonic() - t0
    before = [int(b) for b, _ in COMMITTED.findall(log1.read_text(errors="replace"))]
    assert 1 <= len(before) < FILES, (when, before)
    t0 = time.monotonic()
    with open(log2, "w") as err:
        again = subprocess.run(command, cwd=work, env=env, stdout=err, stderr=err,
                               timeout=600, check=False)
    timings["run after the kill"] = time.monotonic() - t0
    text2 = log2.read_text(errors="replace")
    assert again.returncode == 0, text2[-4000:]
    assert "Traceback" not in text2, text2[-4000:]
    after = [int(b) for b, _ in COMMITTED.findall(text2)]
    assert sorted(set(before) | set(after)) == list(range(FILES)), (when, before, after)

    # the page's check commands, as the user types them
    for line in localize(doc_block("check"), {"sqlite:////var/lib/": store}).splitlines():
        out = subprocess.run(shlex.split(line), cwd=work, env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert out.returncode == 0, (line, out.stdout, out.stderr)
        if " txns " in line:
            states = Counter(re.findall(r"\b(OPEN|PREPARING|COMMITTING|COMMITTED|ABORTING|"
                                        r"ABORTED)\b", out.stdout))
            assert states["COMMITTED"] == FILES and set(states) <= {"COMMITTED", "ABORTED"}, \
                out.stdout

    # every id exactly once in each system, each read by its own means
    import psycopg
    from deltalake import DeltaTable

    want = Counter(range(FILES * ROWS))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        in_pg = Counter(r[0] for r in conn.execute(f'SELECT id FROM "{table}"'))
    in_kafka = _kafka_read_committed(secure_kafka.client_config(), topic, FILES * ROWS)
    in_delta = Counter(DeltaTable(str(work / "data" / "lake" / "orders"))
                       .to_pyarrow_table(columns=["id"]).column("id").to_pylist())
    for system, got in (("PostgreSQL", in_pg), ("Kafka read_committed", in_kafka),
                        ("Delta", in_delta)):
        assert got == want, (system, when, _diff(got, want))
    # the partition-log judge, leftovers (in_doubt), open Kafka transactions, Delta versions
    parts = [PostgresParticipant(dsn=pg_dsn, table=table),
             KafkaParticipant(topic, secure_kafka.client_config()),
             DeltaParticipant(str(work / "data" / "lake" / "orders"))]
    report = verify(parts, range(FILES * ROWS), sink="orders")
    assert report.ok and all(s.exact for s in report.systems), report.lines()
    [judged] = [s for s in report.systems if s.kind == "kafka"]
    assert "consumer agrees" in judged.note, judged.note
    assert _prepared(pg_dsn) == []
    timings["total"] = time.monotonic() - started
    print(f"\nnew user ({versions}): kill {when}; " +
          ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))


def _diff(got: Counter[Any], want: Counter[Any]) -> dict[str, list[Any]]:
    return {"missing": sorted(k for k in want if k not in got)[:10],
            "duplicated": sorted(k for k, n in got.items() if n > 1)[:10],
            "unexpected": sorted(k for k in got if k not in want)[:10]}
