"""A job with a data token cannot make the daemon (or an operator's resolve) send an
operator's secret anywhere: secrets go to the (sink, participant, descriptor) an
operator granted, and each hand-out is logged without the value.

Played with real processes: ``twophase serve`` holding the operator's Kafka and
PostgreSQL passwords for sink ``orders``, a listener standing in for the attacker's host
(it speaks enough Kafka SASL/PLAIN and PostgreSQL to be sent a password), HTTP requests
with the jobs' data tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.security.attacker import Listener
from tests.security.conftest import (
    EVIL,
    KAFKA_PASSWORD,
    OPERATOR,
    ORDERS,
    PG_PASSWORD,
    SECRET_ENV,
    Daemon,
    kafka_descriptor,
    pg_descriptor,
)
from twophase.testing.servers import clean_env


def _register(daemon: Daemon, sink: str, token: str, *descriptors: dict[str, object]) -> None:
    r = daemon.call("POST", f"/v1/sinks/{sink}/register", token,
                    json={"participants": list(descriptors)})
    assert r.status_code == 200, r.text


def _watch(daemon: Daemon, listener: Listener, secret: str, needle: str) -> None:
    """Until the daemon logged ``needle`` or the listener got ``secret`` (5 s at most:
    the target watch runs every 0.3 s)."""
    end = time.monotonic() + 5
    while time.monotonic() < end and not listener.got(secret) \
            and needle not in daemon.log_text():
        time.sleep(0.1)


def test_data_token_cannot_route_a_secret_to_its_own_host(daemon: Daemon) -> None:
    """The first finding: sink ``evil`` names its participant like ``orders``' Kafka
    participant and points it at the attacker's host; the target watch must not sign
    in there with ``orders``' password."""
    with Listener("kafka") as attacker:
        _register(daemon, "evil", EVIL, kafka_descriptor("kafka-orders", attacker.address))
        _watch(daemon, attacker, KAFKA_PASSWORD, "evil")
        time.sleep(1.0)  # several more rounds of the watch
        assert not attacker.got(KAFKA_PASSWORD)
    assert daemon.wait_log("secret withheld")
    assert KAFKA_PASSWORD not in daemon.log_text()


def test_operator_dry_run_of_a_data_token_sink_sends_nothing_and_answers(daemon: Daemon
                                                                         ) -> None:
    """The operator's dry-run resolve (HTTP) of a sink a data token registered neither
    sends the secret on nor answers 500."""
    with Listener("postgres") as attacker:
        _register(daemon, "evil", EVIL, pg_descriptor("pg-orders", attacker.address))
        r = daemon.call("POST", "/v1/admin/sinks/evil/resolve", OPERATOR,
                        json={"dry_run": True})
        assert r.status_code < 500, r.text
        assert r.status_code == 422 and "grant" in r.json()["message"], r.text
        assert not attacker.got(PG_PASSWORD)


def test_operator_cli_dry_run_of_a_data_token_sink_sends_nothing(daemon: Daemon) -> None:
    """``twophase resolve --dry-run`` with the secrets in the operator's environment
    does not send them to a descriptor a data token stored."""
    with Listener("postgres") as attacker:
        _register(daemon, "evil", EVIL, pg_descriptor("pg-orders", attacker.address))
        env = clean_env(**SECRET_ENV, TWOPHASE_TOKEN=OPERATOR)
        env.pop("TWOPHASE_SECRET_GRANTS_FILE", None)
        proc = subprocess.run(
            [sys.executable, "-m", "twophase.cli", "resolve", "evil", "--dry-run",
             "--coordinator", daemon.url], env=env, capture_output=True, text=True,
            timeout=60, cwd=os.getcwd())
        assert not attacker.got(PG_PASSWORD)
        assert proc.returncode == 1 and "grant" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_granted_target_gets_the_secret_and_a_changed_one_does_not(daemon: Daemon) -> None:
    """The operator grants sink ``orders``' Kafka participant as registered: the daemon
    signs in there and logs the hand-out (never the value); when the job's token
    re-registers it pointing elsewhere, the grant no longer applies."""
    from twophase.grants import grant_line

    with Listener("kafka") as broker, Listener("kafka") as elsewhere:
        good = kafka_descriptor("kafka-orders", broker.address)
        _register(daemon, "orders", ORDERS, good)
        stored = daemon.call("GET", "/v1/sinks/orders/participants", OPERATOR).json()
        daemon.grants.write_text(grant_line("orders", stored["participants"][0]) + "\n")
        _watch(daemon, broker, KAFKA_PASSWORD, "never logged")
        assert broker.got(KAFKA_PASSWORD)
        assert daemon.wait_log("secret handed out")
        _register(daemon, "orders", ORDERS, kafka_descriptor("kafka-orders",
                                                             elsewhere.address))
        time.sleep(1.5)
        assert elsewhere.connections == 0 and not elsewhere.got(KAFKA_PASSWORD)
    log = daemon.log_text()
    assert broker.address in log and KAFKA_PASSWORD not in log


def test_a_failing_target_in_a_dry_run_is_a_502_not_a_500(daemon: Daemon) -> None:
    """A granted participant whose target breaks off mid-sign-in: the operator's dry run
    answers 502 naming the participant (the daemon never answers 500)."""
    from twophase.grants import grant_line

    with Listener("postgres") as db:
        _register(daemon, "orders", ORDERS, pg_descriptor("pg-orders", db.address))
        stored = daemon.call("GET", "/v1/sinks/orders/participants", OPERATOR).json()
        daemon.grants.write_text(grant_line("orders", stored["participants"][0]) + "\n")
        r = daemon.call("POST", "/v1/admin/sinks/orders/resolve", OPERATOR,
                        json={"dry_run": True})
        assert db.got(PG_PASSWORD)  # granted: it went where the operator said
    assert r.status_code == 502 and "pg-orders" in r.json()["message"], r.text
    assert PG_PASSWORD not in r.text
