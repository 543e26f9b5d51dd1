"""``--kafka-config FILE``: every subcommand that makes Kafka clients takes librdkafka
settings from one properties file (``$TWOPHASE_KAFKA_CONFIG``), ``sasl.password`` from
``$TWOPHASE_KAFKA_SASL_PASSWORD``. ``twophase resolve`` settles a dead job's Kafka
branches on the suite's SASL_SSL broker with ACLs enforced, as the least-privileged
principal, by hand and from the recorded descriptors; a wrong password or a bad file is
refused naming the cause and the fix, before anything changes."""

from __future__ import annotations

import argparse
import json
import os
import re
import uuid
from pathlib import Path

import pytest

from tests.support.kafka import create_topic, grant_app, unique_topic
from twophase.cli import build_parser, main
from twophase.client.connection import connect
from twophase.client.wire import VoteIn
from twophase.coordinator.store import Store
from twophase.grants import grant_line
from twophase.participant import BranchRef
from twophase.protocol import Decision, State, TxnKey
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.config import KAFKA_CONFIG_ENV, KAFKA_PASSWORD_ENV
from twophase.sinks.kafka.log import read_log
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.conformance import SCHEMA, _prepare_in_child_and_kill, batch_for

pytestmark = [pytest.mark.real_kafka]

LINEAGE = "L-kafka-config"


def _properties(broker: LocalKafka, path: Path) -> Path:
    """The settings of ``app`` without its password, as an operator keeps them."""
    cfg = broker.client_config("app")
    path.write_text("# the suite's SASL_SSL broker\n"
                    f"security.protocol = {cfg['security.protocol']}\n"
                    f"sasl.mechanism: {cfg['sasl.mechanism']}\n"
                    f"sasl.username={cfg['sasl.username']}\n"
                    f"ssl.ca.location={cfg['ssl.ca.location']}\n")
    return path


def _dead_job(secure_kafka: LocalKafka, topic: str, coordinator: str, sink: str) -> int:
    """Batch 0: two staged branches voted COMMIT, one copied, the job dead before the
    other's copy and both acks (COMMITTING: resolve reads the first's marker and copies
    the second from its staged records). Batch 1: a resumable branch prepared
    by a task SIGKILLed before its batch reached the coordinator (its Kafka transaction
    left open on the broker: resolve finds and aborts it). Returns the committed rows."""
    config = secure_kafka.client_config("app")
    p = KafkaParticipant(topic, config, connect_timeout_s=15)
    p.check(SCHEMA)
    rows = 0
    with connect(coordinator) as conn:
        client = conn.client()
        epoch = client.register(sink, [p.descriptor()])
        client.begin(sink, LINEAGE, 0, epoch, [p.name], 2, 60)
        votes, handles = [], {}
        for partition in (0, 1):
            ref = BranchRef(sink, LINEAGE, 0, 1, p.name, partition)
            handles[ref] = p.prepare(ref, SCHEMA, [batch_for(ref)])
            votes.append(VoteIn(ref.branch_id, True, handles[ref]))
            rows += batch_for(ref).num_rows
        assert client.vote(TxnKey(sink, LINEAGE, 0, 1), epoch, votes).decision \
            == Decision.COMMIT
        for ref, handle in handles.items():
            if ref.partition == 0:  # the job died after this copy, before the other's
                p.commit(ref, handle)
        dead = KafkaParticipant(topic, config, connect_timeout_s=15)
        _prepare_in_child_and_kill(dead, BranchRef(sink, LINEAGE, 1, 1, p.name, 0))
        dead.close()
    p.close()
    return rows


def _states(coordinator: str, sink: str) -> dict[int, State]:
    store = Store(coordinator, create=False)
    try:
        return {r.txn.batch_id: r.txn.state for r in store.list(sink=sink)}
    finally:
        store.close()


def test_resolve_settles_kafka_over_sasl_ssl_with_a_config_file(
    secure_kafka: LocalKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic, sink = unique_topic("clisec"), f"clisec_{uuid.uuid4().hex[:8]}"
    for t in (topic, f"{topic}.twophase-staged"):
        create_topic(secure_kafka.client_config(), t, partitions=2)
    grant_app(secure_kafka, topic)
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    rows = _dead_job(secure_kafka, topic, coordinator, sink)
    props = _properties(secure_kafka, tmp_path / "client.properties")
    for var in list(os.environ):
        if var.startswith(("TWOPHASE_SECRET_", "TWOPHASE_KAFKA_")):
            monkeypatch.delenv(var)
    by_hand = ["resolve", sink, "--coordinator", coordinator, "--kafka-bootstrap",
               secure_kafka.bootstrap, "--kafka-topic", topic, "--kafka-config", str(props)]

    monkeypatch.setenv(KAFKA_PASSWORD_ENV, "wrong")
    assert main(by_hand) == 1
    err = capsys.readouterr().err
    assert "SASL authentication failed" in err and "sasl.password" in err, err
    assert f"--kafka-config {props}, sasl.password from ${KAFKA_PASSWORD_ENV}" in err, err
    assert _states(coordinator, sink) == {0: State.COMMITTING}  # untouched

    # from the recorded descriptor, whose password is a secret the record left out: no
    # secret goes to it (nor --kafka-config's password) before an operator granted it;
    # then without --kafka-config it is asked of TWOPHASE_SECRET_..., with it of the
    # variable
    assert secure_kafka.security is not None
    monkeypatch.setenv(KAFKA_PASSWORD_ENV, secure_kafka.security.users["app"])
    for args in ([], ["--kafka-config", str(props)]):
        assert main(["resolve", sink, "--coordinator", coordinator, "--dry-run", *args]) == 1
        assert "no operator granted this descriptor" in capsys.readouterr().err
    store = Store(coordinator, read_only=True)
    grants = tmp_path / "grants"
    grants.write_text("".join(grant_line(sink, d) + "\n" for d in store.participants(sink)))
    store.close()
    monkeypatch.setenv("TWOPHASE_SECRET_GRANTS_FILE", str(grants))
    assert main(["resolve", sink, "--coordinator", coordinator, "--dry-run"]) == 1
    assert "TWOPHASE_SECRET_KAFKA_" in capsys.readouterr().err
    assert main(["resolve", sink, "--coordinator", coordinator, "--kafka-config", str(props),
                 "--dry-run", "--json"]) == 0, capsys.readouterr()
    capsys.readouterr()

    assert main([*by_hand, "--json"]) == 0, capsys.readouterr()
    report = json.loads(capsys.readouterr().out)
    done = sorted((a["txn"].split("/")[2] if "/" in a["txn"] else "kafka", a["action"])
                  for a in report["actions"])
    # partition 0's marker reads COMMITTED over SASL_SSL; partition 1 is PREPARED (its
    # staged records are there) and copied; the dead task's transaction found on the
    # brokers (ListTransactions) and aborted
    assert done == [("0", "ack"), ("0", "commit"), ("kafka", "abort")], report
    assert _states(coordinator, sink) == {0: State.COMMITTED}

    # the verifier's judges, over SASL_SSL: the partition logs, and a read_committed reader
    log = read_log(secure_kafka.client_config("app"), topic)
    assert len(log.committed) == rows and log.open_transactions == 0, log
    assert len(log.aborted) == 6  # the dead task's records, aborted by resolve
    judge = KafkaParticipant(topic, secure_kafka.client_config("app"), connect_timeout_s=15)
    back = judge.read_back("id")
    judge.close()
    assert back.mismatch == 0 and back.open == 0 and "consumer agrees" in back.note, back
    assert len(back.values) == rows


@pytest.mark.parametrize("command", ["resolve", "demo", "chaos"])
def test_a_bad_kafka_config_is_refused_naming_the_file_and_the_fix(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    with connect(coordinator):  # an existing store: resolve gets as far as the file
        pass
    args = {"resolve": ["resolve", "s", "--coordinator", coordinator, "--kafka-bootstrap",
                        "127.0.0.1:1"],
            "demo": ["demo", "--workdir", str(tmp_path / "w"), "--kafka-bootstrap",
                     "127.0.0.1:1"],
            "chaos": ["chaos", "--workdir", str(tmp_path / "w"), "--kafka-bootstrap",
                      "127.0.0.1:1"]}[command]
    monkeypatch.delenv(KAFKA_PASSWORD_ENV, raising=False)
    missing = tmp_path / "missing.properties"
    no_password = tmp_path / "nopw.properties"
    no_password.write_text("security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\n"
                           "sasl.username=app\n")
    not_kv = tmp_path / "notkv.properties"
    not_kv.write_text("security.protocol=SASL_SSL\nsasl.username app\n")
    cases = [
        (missing, rf"cannot read the Kafka settings {missing} \(--kafka-config\): No such "
                  r"file or directory\. Fix: pass --kafka-config the path of a readable file"),
        (tmp_path, rf"cannot read the Kafka settings {tmp_path} \(--kafka-config\): Is a "
                   r"directory\. Fix:"),
        (not_kv, r"notkv.properties line 2 \(--kafka-config\) is not key=value: "
                 r"'sasl.username app'\. Fix:"),
        (no_password, r"signs in with SASL SCRAM-SHA-512 but no sasl.password is given\. "
                      rf"Fix: set \${KAFKA_PASSWORD_ENV} to the password of sasl.username "
                      r"'app'"),
    ]
    for path, message in cases:
        monkeypatch.setenv(KAFKA_CONFIG_ENV, str(path))  # the flag's default, as the flag
        assert main(args) in (1, 2)
        out = capsys.readouterr()
        assert re.search(message, " ".join((out.err + out.out).split())), (path, out)


def test_every_command_that_reaches_kafka_has_the_same_flag_and_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KAFKA_CONFIG_ENV, "/etc/twophase/kafka.properties")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    reaching = {name for name, parser in sub.choices.items()
                if any(o.startswith("--kafka-") for a in parser._actions
                       for o in a.option_strings if o != "--kafka-config")}
    assert reaching == {"resolve", "demo", "chaos"}
    for name in reaching:
        [action] = [a for a in sub.choices[name]._actions if "--kafka-config" in a.option_strings]
        assert action.default == "/etc/twophase/kafka.properties", name
