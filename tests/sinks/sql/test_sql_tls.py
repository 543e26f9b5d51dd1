"""The SQL participant on MariaDB over TLS, as a deployment connects: the server requires
secure transport, PyMySQL verifies its certificate against the CA and checks the host
name (``?ssl_ca=...&ssl_check_hostname=true``). A branch commits and reads back exactly;
a client without TLS is refused by the server, and a URL trusting another CA by the
probe, named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from twophase.errors import TargetProblem
from twophase.sinks.sql import SqlAlchemyParticipant
from twophase.testing.conformance import SCHEMA, batch_for, make_branch
from twophase.testing.localmariadb import LocalMariaDB
from twophase.testing.tlscerts import CertificateAuthority


@pytest.fixture(scope="module")
def tls_mariadb() -> Iterator[LocalMariaDB]:
    server = LocalMariaDB(tls=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_branch_commits_over_tls_and_plaintext_or_wrong_ca_is_refused(
    tls_mariadb: LocalMariaDB, tmp_path: Path
) -> None:
    p = SqlAlchemyParticipant(tls_mariadb.tls_url(), "tls_orders")
    p.probe()
    p.check(SCHEMA)
    b = make_branch(p, sink="tls", partition=0)
    p.commit(b, p.prepare(b, SCHEMA, [batch_for(b)]))
    assert sorted(p.read_back("id").values) == sorted(r["id"] for r in
                                                      batch_for(b).to_pylist())
    p.close()

    # the server refuses a client without TLS (PyMySQL without ssl_ca still encrypts when
    # the server offers TLS, but verifies nothing: the CA is what makes it safe)
    import pymysql

    # (MariaDB 10.11 answers it "Access denied"; the same user over TLS got in above)
    with pytest.raises(pymysql.err.OperationalError,
                       match=r"insecure transport|Access denied for user 'root'"):
        pymysql.connect(host=tls_mariadb.host, port=tls_mariadb.port, user="root",
                        ssl_disabled=True)
    other = CertificateAuthority(tmp_path / "other")
    wrong = SqlAlchemyParticipant(
        tls_mariadb.tls_url().replace(str(tls_mariadb.ca_cert), str(other.cert)), "tls_orders")
    with pytest.raises(TargetProblem, match=r"cannot connect.*certificate verify failed"):
        wrong.probe()
    wrong.close()
