"""The attacker's host: a loopback listener that speaks just enough Kafka (ApiVersions,
SaslHandshake, SaslAuthenticate) and PostgreSQL (SSL refused, cleartext password
asked) to draw a client's password out, and records every byte it received.

A test registers a participant pointing at it and asserts the daemon's secret never
arrives; before the trust boundary was fixed it arrived within a second.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

__all__ = ["Listener"]


def _i16(x: int) -> bytes:
    return struct.pack(">h", x)


def _i32(x: int) -> bytes:
    return struct.pack(">i", x)


def _str16(b: bytes) -> bytes:
    return _i16(len(b)) + b


def _recv(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


class Listener:
    """``protocol`` is ``"kafka"`` or ``"postgres"``; :attr:`received` every byte sent
    to it, :attr:`connections` how many connections it accepted."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.received = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self.address = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def got(self, secret: str) -> bool:
        with self._lock:
            return secret.encode() in self.received

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            serve = self._kafka if self.protocol == "kafka" else self._postgres
            threading.Thread(target=self._guarded, args=(serve, conn), daemon=True).start()

    def _guarded(self, serve: object, conn: socket.socket) -> None:
        conn.settimeout(10)
        with contextlib.suppress(EOFError, OSError, struct.error), conn:
            serve(conn)  # type: ignore[operator]

    def _keep(self, data: bytes) -> None:
        with self._lock:
            self.received.extend(data)

    def _kafka(self, conn: socket.socket) -> None:
        apis = [(18, 0, 0), (17, 0, 1), (36, 0, 0), (3, 0, 1)]
        while True:
            (size,) = struct.unpack(">i", _recv(conn, 4))
            req = _recv(conn, size)
            self._keep(req)
            key, version, corr = struct.unpack_from(">hhi", req)
            if key == 18:  # ApiVersions: v0 only, then SASL
                body = _i16(35 if version > 0 else 0) + _i32(len(apis)) + b"".join(
                    _i16(a) + _i16(lo) + _i16(hi) for a, lo, hi in apis)
            elif key == 17:  # SaslHandshake: PLAIN it is
                body = _i16(0) + _i32(1) + _str16(b"PLAIN")
            elif key == 36:  # SaslAuthenticate: the password is in req by now
                body = _i16(58) + _str16(b"no") + _i32(0)
            else:
                return
            msg = _i32(corr) + body
            conn.sendall(_i32(len(msg)) + msg)

    def _postgres(self, conn: socket.socket) -> None:
        while True:
            (size,) = struct.unpack(">i", _recv(conn, 4))
            body = _recv(conn, size - 4)
            self._keep(body)
            if body[:4] in (struct.pack(">i", 80877103), struct.pack(">i", 80877104)):
                conn.sendall(b"N")  # SSLRequest / GSSENCRequest: not here
                continue
            break  # the startup message: ask for the password in clear text
        conn.sendall(b"R" + _i32(8) + _i32(3))
        kind = _recv(conn, 1)
        (size,) = struct.unpack(">i", _recv(conn, 4))
        self._keep(kind + _recv(conn, size - 4))
