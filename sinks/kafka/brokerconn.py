"""One connection to a Kafka broker for the partition-log reader (:mod:`.log`), secured
as the user's librdkafka settings say: TLS (``ssl``/``sasl_ssl``) and SASL ``PLAIN`` or
``SCRAM-SHA-256``/``SCRAM-SHA-512`` (``sasl_plaintext``/``sasl_ssl``).

Why by hand: the log reader sends raw Fetch requests (librdkafka never shows control
batches), so it needs its own socket; on a secured cluster that socket must present the
same identity and verify the broker the same way the participant's producers do, or the
verifier could not judge a topic there and a redo would trust the marker alone.
Mechanisms librdkafka has and this does not (GSSAPI, OAUTHBEARER) are named by
:func:`unsupported`, so callers can say so rather than fail obscurely.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import socket
import ssl
import struct
from collections.abc import Mapping

from twophase.errors import ParticipantError

__all__ = ["connect", "recv_exact", "request_header", "unsupported"]

_SASL_HANDSHAKE, _SASL_AUTHENTICATE = 17, 36
_CLIENT_ID = b"twophase-log-reader"
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_PROTOCOLS = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")


def _setting(config: Mapping[str, object], key: str, default: str = "") -> str:
    value = config.get(key)
    return default if value is None else str(value)


def _protocol(config: Mapping[str, object]) -> str:
    return _setting(config, "security.protocol", "plaintext").strip().lower()


def _mechanism(config: Mapping[str, object]) -> str:
    return (_setting(config, "sasl.mechanism") or _setting(config, "sasl.mechanisms")
            or "GSSAPI").strip().upper()


def unsupported(config: Mapping[str, object]) -> str | None:
    """Why the log reader cannot connect with these settings, or None when it can."""
    protocol = _protocol(config)
    if protocol not in _PROTOCOLS:
        return f"security.protocol={protocol!r} is not one of {', '.join(_PROTOCOLS)}"
    if protocol.startswith("sasl") and _mechanism(config) not in _MECHANISMS:
        return (f"sasl.mechanism={_mechanism(config)!r}: the log reader signs in with "
                f"{', '.join(_MECHANISMS)} only")
    if protocol.endswith("ssl") and (config.get("ssl.certificate.pem")
                                     or config.get("ssl.key.pem")):
        return ("ssl.certificate.pem/ssl.key.pem: the log reader reads a client "
                "certificate from files only (ssl.certificate.location, ssl.key.location)")
    return None


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _string(s: bytes) -> bytes:
    return struct.pack(">h", len(s)) + s


def request_header(api_key: int, version: int, correlation: int) -> bytes:
    """Request header v1 (no tagged fields): what non-flexible request versions use."""
    return struct.pack(">hhi", api_key, version, correlation) + _string(_CLIENT_ID)


def _roundtrip(sock: socket.socket, body: bytes, correlation: int) -> bytes:
    sock.sendall(struct.pack(">i", len(body)) + body)
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    answer = recv_exact(sock, size)
    if struct.unpack_from(">i", answer)[0] != correlation:
        raise ParticipantError("Kafka log reader: SASL answer out of order")
    return answer[4:]


def _tls_context(config: Mapping[str, object]) -> ssl.SSLContext:
    """librdkafka's meaning of the ssl.* settings: the CA file (or PEM text; the system's
    trust store when neither is set), host-name check unless
    ``ssl.endpoint.identification.algorithm=none``, verification unless
    ``enable.ssl.certificate.verification=false``, and a client certificate from files."""
    ca = _setting(config, "ssl.ca.location")
    pem = _setting(config, "ssl.ca.pem")
    folder = bool(ca) and os.path.isdir(ca)
    ctx = ssl.create_default_context(
        cafile=ca if ca and ca != "probe" and not folder else None,
        capath=ca if folder else None, cadata=pem or None)
    if _setting(config, "ssl.endpoint.identification.algorithm", "https").lower() == "none":
        ctx.check_hostname = False
    if _setting(config, "enable.ssl.certificate.verification", "true").lower() in (
            "false", "0", "no"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    cert = _setting(config, "ssl.certificate.location")
    if cert:
        ctx.load_cert_chain(cert, _setting(config, "ssl.key.location") or None,
                            _setting(config, "ssl.key.password") or None)
    return ctx


class _Scram:
    """The client side of SCRAM (RFC 5802) as Kafka uses it: no channel binding, the
    user name escaped. Written here rather than borrowed: kafka-python moved its SCRAM
    client between releases."""

    def __init__(self, user: str, password: str, mechanism: str) -> None:
        self.hash = hashlib.sha256 if mechanism == "SCRAM-SHA-256" else hashlib.sha512
        self.user = user.replace("=", "=3D").replace(",", "=2C").encode()
        self.password = password.encode()
        self.nonce = base64.b64encode(os.urandom(24)).decode().encode()
        self.bare = b"n=" + self.user + b",r=" + self.nonce
        self.auth = b""
        self.server_signature = b""

    def first_message(self) -> bytes:
        return b"n,," + self.bare

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self.hash).digest()

    def process_server_first_message(self, server_first: bytes) -> None:
        fields = dict(item.split(b"=", 1) for item in server_first.split(b","))
        nonce, salt, rounds = fields[b"r"], base64.b64decode(fields[b"s"]), int(fields[b"i"])
        if not nonce.startswith(self.nonce) or not 0 < rounds <= 1_000_000:
            raise ValueError("the server's SCRAM nonce or iteration count is invalid")
        salted = hashlib.pbkdf2_hmac(self.hash().name, self.password, salt, rounds)
        without_proof = b"c=biws,r=" + nonce
        self.auth = self.bare + b"," + server_first + b"," + without_proof
        client_key = self._hmac(salted, b"Client Key")
        signature = self._hmac(self.hash(client_key).digest(), self.auth)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self.final = without_proof + b",p=" + base64.b64encode(proof)
        self.server_signature = self._hmac(self._hmac(salted, b"Server Key"), self.auth)

    def final_message(self) -> bytes:
        return self.final

    def process_server_final_message(self, server_final: bytes) -> None:
        fields = dict(item.split(b"=", 1) for item in server_final.split(b","))
        if b"e" in fields:
            raise ValueError(fields[b"e"].decode(errors="replace"))
        if not hmac.compare_digest(base64.b64decode(fields.get(b"v", b"")),
                                   self.server_signature):
            raise ValueError("the server's signature does not match")


def _sasl(sock: socket.socket, config: Mapping[str, object], where: str) -> None:
    """SaslHandshake v1, then SaslAuthenticate v1 rounds for the mechanism."""
    mechanism = _mechanism(config)
    user = _setting(config, "sasl.username")
    password = _setting(config, "sasl.password")
    answer = _roundtrip(sock, request_header(_SASL_HANDSHAKE, 1, 1)
                        + _string(mechanism.encode()), 1)
    (error,) = struct.unpack_from(">h", answer)
    if error:
        raise ParticipantError(
            f"Kafka at {where} does not accept SASL mechanism {mechanism} (error code "
            f"{error}): set sasl.mechanism to one the broker's sasl.enabled.mechanisms lists")
    if mechanism == "PLAIN":
        rounds: list[bytes] = [b"\0" + user.encode() + b"\0" + password.encode()]
        scram: _Scram | None = None
    else:
        scram = _Scram(user, password, mechanism)
        rounds = [scram.first_message()]
    correlation = 2
    while rounds:
        payload = rounds.pop(0)
        answer = _roundtrip(sock, request_header(_SASL_AUTHENTICATE, 1, correlation)
                            + struct.pack(">i", len(payload)) + payload, correlation)
        (error,) = struct.unpack_from(">h", answer)
        (mlen,) = struct.unpack_from(">h", answer, 2)
        message = answer[4:4 + mlen].decode(errors="replace") if mlen >= 0 else ""
        pos = 4 + max(mlen, 0)
        (blen,) = struct.unpack_from(">i", answer, pos)
        server = answer[pos + 4:pos + 4 + max(blen, 0)]
        if error:
            raise ParticipantError(
                f"Kafka at {where} refused SASL {mechanism} sign-in as {user!r} (error code "
                f"{error}: {message or 'authentication failed'}): check sasl.username and "
                "sasl.password, and that the broker has this user's credentials for "
                f"{mechanism}")
        correlation += 1
        if scram is None:
            continue
        try:
            if correlation == 3:
                scram.process_server_first_message(server)
                rounds.append(scram.final_message())
            else:
                scram.process_server_final_message(server)
        except (ValueError, KeyError) as exc:
            raise ParticipantError(
                f"Kafka at {where}: the broker's SCRAM answer does not verify ({exc}): "
                f"is it the cluster holding {user!r}'s credentials?") from exc


def connect(host: str, port: int, config: Mapping[str, object], timeout: float) -> socket.socket:
    """A connected socket to ``host:port``, TLS-wrapped and SASL-signed-in as ``config``
    says. Errors name the setting to fix; a refused TCP connect is an ``OSError``."""
    reason = unsupported(config)
    if reason is not None:
        raise ParticipantError(f"Kafka log reader cannot connect to {host}:{port}: {reason}")
    protocol = _protocol(config)
    where = f"{host}:{port}"
    sock: socket.socket = socket.create_connection((host, port), timeout=timeout)
    try:
        if protocol.endswith("ssl"):
            try:
                sock = _tls_context(config).wrap_socket(sock, server_hostname=host)
            except ssl.SSLCertVerificationError as exc:
                ca = _setting(config, "ssl.ca.location") or "the system's trust store"
                raise ParticipantError(
                    f"Kafka at {where}: its TLS certificate does not verify against {ca} "
                    f"({exc.verify_message}): set ssl.ca.location to the CA that signed the "
                    "broker's certificate (and connect by a name the certificate lists)"
                ) from exc
            except ssl.SSLError as exc:
                raise ParticipantError(
                    f"Kafka at {where}: TLS handshake failed ({exc}): is the listener "
                    "SSL/SASL_SSL, and security.protocol set to match?") from exc
        if protocol.startswith("sasl"):
            _sasl(sock, config, where)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    return sock
