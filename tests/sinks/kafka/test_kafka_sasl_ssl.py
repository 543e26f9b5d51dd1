"""The Kafka participant, its marker reader, the partition-log reader, lingering cleanup
and the verifier's judgement on a broker whose clients must use SASL_SSL (TLS verified
against a throw-away CA with host-name checks, SCRAM-SHA-512 or PLAIN) and ACLs enforced,
as the least-privileged principal ``app`` holding exactly the ACLs
:func:`twophase.sinks.kafka.acls.required_acls` lists. Wrong credentials or a wrong CA
are refused before any write, naming the cause and the setting to fix."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.support.kafka import create_topic, grant, grant_app, secure_kafka, unique_topic
from twophase.errors import ParticipantError, TargetProblem
from twophase.participant import BranchStatus
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.log import fetch_partition, read_branch, read_log
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.conformance import (
    SCHEMA,
    _prepare_in_child_and_kill,
    batch_for,
    make_branch,
)

__all__ = ["secure_kafka"]

pytestmark = [pytest.mark.real_kafka]


def _participant(broker: LocalKafka, topic: str, prepare: str,
                 **over: str) -> KafkaParticipant:
    return KafkaParticipant(topic, {**broker.client_config("app"), **over},
                            connect_timeout_s=15, prepare=prepare)


@pytest.mark.parametrize("prepare", ["resumable", "staged"])
def test_participant_commits_aborts_and_is_judged_over_sasl_ssl(
    secure_kafka: LocalKafka, prepare: str
) -> None:
    topic = unique_topic("sec")
    p = _participant(secure_kafka, topic, prepare)
    create_topic(secure_kafka.client_config(), topic, partitions=2)
    if prepare == "staged":
        create_topic(secure_kafka.client_config(), p.staging_topic, partitions=2)
    grant_app(secure_kafka, topic)
    p.probe()
    p.check(SCHEMA)
    sink, lineage = f"sec_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:12]
    kept = make_branch(p, sink=sink, lineage=lineage, partition=0)
    voted = p.prepare(kept, SCHEMA, [batch_for(kept)])
    p.commit(kept, voted)
    dropped = make_branch(p, sink=sink, lineage=lineage, partition=1)
    p.abort(dropped, p.prepare(dropped, SCHEMA, [batch_for(dropped)]))
    aborted = batch_for(dropped).num_rows if prepare != "staged" else 0
    if prepare == "resumable":  # a losing attempt, ended by the driver's sweep (ACLs)
        p.prepare(dropped, SCHEMA, [batch_for(dropped)])
        assert p.end_other_attempts(kept.key, {0: voted}) == 1
        assert p.open_transactions(sink) == []
        aborted *= 2

    assert p.log_readable()
    assert p.status(kept) is BranchStatus.COMMITTED  # the marker, read through SASL_SSL
    tag = dict(p.headers(kept))
    assert read_branch(p.config, topic, tag, {}).committed == batch_for(kept).num_rows
    back = p.read_back("id")  # the verifier: partition logs + a read_committed consumer
    assert sorted(back.values) == sorted(r["id"] for r in batch_for(kept).to_pylist())
    assert back.mismatch == 0 and back.open == 0, back
    assert "consumer agrees" in back.note, back.note
    assert back.aborted == aborted  # a staged abort writes nothing to the topic
    p.close()


def test_lingering_transaction_found_and_aborted_over_sasl_ssl(
    secure_kafka: LocalKafka
) -> None:
    topic = unique_topic("seclinger")
    create_topic(secure_kafka.client_config(), topic)
    grant_app(secure_kafka, topic)
    p = _participant(secure_kafka, topic, "resumable")
    sink = f"seclinger_{uuid.uuid4().hex[:8]}"
    dead = make_branch(p, sink=sink, lineage=uuid.uuid4().hex[:12], partition=0)
    voted = _prepare_in_child_and_kill(p, dead)  # its transaction stays open on the broker
    [open_txn] = p.open_transactions(sink)
    assert open_txn.transactional_id == voted["transactional_id"]
    aborted = p.abort_lingering(sink)
    assert [t.transactional_id for t in aborted] == [open_txn.transactional_id]
    log = read_log(secure_kafka.client_config("app"), topic)
    assert log.open_transactions == 0
    assert sorted(json.loads(v)["id"] for v in log.aborted if v) == sorted(
        r["id"] for r in batch_for(dead).to_pylist())
    p.close()


def test_log_reader_signs_in_with_plain_too(secure_kafka: LocalKafka) -> None:
    topic = unique_topic("secplain")
    create_topic(secure_kafka.client_config(), topic)
    plain = {**secure_kafka.client_config(), "sasl.mechanism": "PLAIN"}
    log = read_log(plain, topic)
    assert [p.high_watermark for p in log.partitions] == [0]


def test_wrong_password_is_refused_before_any_write_naming_the_fix(
    secure_kafka: LocalKafka
) -> None:
    topic = unique_topic("secbad")
    create_topic(secure_kafka.client_config(), topic)
    p = _participant(secure_kafka, topic, "resumable", **{"sasl.password": "wrong"})
    with pytest.raises(TargetProblem, match=r"(?s)SASL authentication.*sasl\.password"):
        p.probe()
    with pytest.raises(ParticipantError, match=r"(?s)SASL authentication.*sasl\.password"):
        p.check(SCHEMA)
    with pytest.raises(ParticipantError, match=r"(?s)SASL authentication.*sasl\.password"):
        read_log(p.config, topic, timeout=5)
    # the log reader's own connection (its SaslAuthenticate) names it too
    with pytest.raises(ParticipantError, match=r"refused SASL SCRAM-SHA-512 sign-in as 'app'"
                                               r".*check sasl.username and sasl.password"):
        fetch_partition("127.0.0.1", secure_kafka.port, topic, 0, timeout=5, config=p.config)
    assert read_log(secure_kafka.client_config(), topic).partitions[0].high_watermark == 0


def test_wrong_ca_is_refused_before_any_write_naming_the_fix(
    secure_kafka: LocalKafka, tmp_path: Path
) -> None:
    from twophase.testing.tlscerts import CertificateAuthority

    other = CertificateAuthority(tmp_path / "other")
    topic = unique_topic("secca")
    create_topic(secure_kafka.client_config(), topic)
    p = _participant(secure_kafka, topic, "resumable", **{"ssl.ca.location": str(other.cert)})
    with pytest.raises(TargetProblem, match=r"(?s)certificate.*ssl\.ca\.location"):
        p.probe()
    with pytest.raises(ParticipantError, match=r"(?s)certificate.*ssl\.ca\.location"):
        read_log(p.config, topic, timeout=5)
    with pytest.raises(ParticipantError, match=r"does not verify against .*other/ca.pem.*"
                                               r"set ssl.ca.location to the CA"):
        fetch_partition("127.0.0.1", secure_kafka.port, topic, 0, timeout=5, config=p.config)


def test_probe_names_a_missing_transactional_id_acl(secure_kafka: LocalKafka) -> None:
    topic = unique_topic("secnotxn")
    create_topic(secure_kafka.client_config(), topic)
    grant(secure_kafka, "nobody", [("TOPIC", topic, "LITERAL", op)
                                   for op in ("WRITE", "READ", "DESCRIBE")])
    p = KafkaParticipant(topic, secure_kafka.client_config("nobody"), connect_timeout_s=10)
    with pytest.raises(TargetProblem, match=r"refused a transactional write: "
                       r"TRANSACTIONAL_ID_AUTHORIZATION_FAILED on transactional.id "
                       r"'twophase.probe.kafka-secnotxn-.*Fix: grant the principal Write "
                       r"and Describe on the transactional ids by prefix.*--transactional-id "
                       r"twophase. --resource-pattern-type prefixed"):
        p.probe()


def test_probe_names_missing_topic_acls(secure_kafka: LocalKafka) -> None:
    topic = unique_topic("secnowrite")
    create_topic(secure_kafka.client_config(), topic)
    grant_app(secure_kafka, unique_topic("other"))  # app's transactional-id and group ACLs
    grant(secure_kafka, "app", [("TOPIC", topic, "LITERAL", "DESCRIBE")])
    p = _participant(secure_kafka, topic, "resumable")
    with pytest.raises(TargetProblem, match=r"does not allow this principal WRITE, READ on "
                       rf"topic '{topic}'.*Fix: grant it: kafka-acls.sh --add "
                       r"--allow-principal User:<you> --operation Write --topic"):
        p.probe()


def test_the_security_page_lists_exactly_the_acls_the_code_needs() -> None:
    from twophase.sinks.kafka.acls import required_acls

    page = (Path(__file__).resolve().parents[3] / "docs/user/security.md").read_text()
    listed = {line.split("`")[1] for line in page.splitlines()
              if line.startswith("| `--allow-principal")}
    assert listed == {a.describe("User:app") for a in required_acls("orders")}


def test_the_scram_client_follows_rfc_7677() -> None:
    """The log reader's SCRAM-SHA-256 exchange on RFC 7677's example (its nonce fixed)."""
    from twophase.sinks.kafka.brokerconn import _Scram

    scram = _Scram("user", "pencil", "SCRAM-SHA-256")
    scram.nonce = b"rOprNGfwEbeRWgbNEkqO"
    scram.bare = b"n=user,r=" + scram.nonce
    assert scram.first_message() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    scram.process_server_first_message(
        b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    assert scram.final_message() == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    scram.process_server_final_message(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    with pytest.raises(ValueError, match="signature does not match"):
        scram.process_server_final_message(b"v=AAAA")
