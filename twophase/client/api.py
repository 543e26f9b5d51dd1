"""Client of the coordinator's HTTP API, used by the Spark driver and the executors.

Every call is idempotent on the server (the protocol answers a repeated message with the
same reply), so connection failures and 5xx answers are retried with capped exponential
backoff (tenacity) for up to ``retry_budget`` seconds: a coordinator restart is ridden
through. A 4xx answer is a refusal and raises at once with the server's message, as the same
error class the server raised. Request bodies are built and answers decoded by
:mod:`twophase.client.wire`; turning a ``coordinator=`` setting into a connection (and starting
an embedded coordinator) is :mod:`twophase.client.connection`'s job.
"""

from __future__ import annotations

import builtins
import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import quote

import httpx
import tenacity

from twophase import protocol
from twophase.client import wire
from twophase.client.wire import VoteIn
from twophase.errors import (
    CoordinatorUnavailable,
    InvalidRequest,
    TwophaseError,
    error_class,
)
from twophase.protocol import TxnKey

__all__ = ["CoordinatorClient", "pinned", "read_token_file"]

TOKEN_ENV: Final = "TWOPHASE_TOKEN"  # noqa: S105 - a variable name, not a secret
TOKEN_FILE_ENV: Final = "TWOPHASE_CLIENT_TOKEN_FILE"  # noqa: S105 - a variable name
CA_ENV: Final = "TWOPHASE_CA_CERT"
POLL_SLICE: Final = 30.0
FIRST_CONTACT_BUDGET: Final = 5.0  # seconds register() retries a refused/unresolvable URL

log = logging.getLogger("twophase.client")


def read_token_file(path: str) -> str:
    """The one bearer token in ``path`` (blank lines and ``#`` comments skipped): what a
    mounted secret holds, rewritten in place to rotate it."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [ln.split("#", 1)[0].strip() for ln in fh.read().splitlines()]
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read the token file {path}: {exc.strerror or exc}; pass a readable file "
            f"holding the bearer token alone (token_file=, ${TOKEN_FILE_ENV})"
        ) from exc
    words = [ln for ln in lines if ln]
    if len(words) != 1 or len(words[0].split()) != 1:
        raise InvalidRequest(
            f"token file {path}: expected one bearer token alone on one line, found "
            f"{len(words)} non-blank line(s){' with spaces' if words else ''}; the daemon's "
            "'ROLE TOKEN' file is not a client's token file: give the job only its token"
        )
    return words[0]


def pinned(ca_pem: str | None) -> ssl.SSLContext | None:
    """Verify TLS against exactly this certificate (an embedded coordinator's own,
    self-signed one, shipped to the tasks with the plan); None: the default trust."""
    if ca_pem is None:
        return None
    return ssl.create_default_context(cadata=ca_pem)


class _Retryable(TwophaseError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}", status=status)


def _seg(x: str | int) -> str:
    return quote(str(x), safe="")


class CoordinatorClient:
    """Thread-safe; one pooled HTTP connection set per instance. Cheap to construct.

    The token: ``token``, else the one in ``token_file``, else ``$TWOPHASE_CLIENT_TOKEN_FILE``'s,
    else ``$TWOPHASE_TOKEN``. With a token file, an answer 401 re-reads the file and, when
    the token in it changed, sends the call again with it: a rotated token reaches a
    running job without a restart."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        token_file: str | None = None,
        timeout: float = 30.0,
        retry_budget: float = 120.0,
        verify: bool | str | ssl.SSLContext | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidRequest(
                f"coordinator URL must start with http:// or https://, got {url!r}"
            )
        self.url = url.rstrip("/")
        if token is None and token_file is None:
            token_file = os.environ.get(TOKEN_FILE_ENV) or None
        self.token_file = token_file
        if token is None and token_file is not None:
            token = read_token_file(token_file)
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._token_lock = threading.Lock()
        self.timeout = timeout
        self.retry_budget = retry_budget
        headers = {"Accept": "application/json"}
        if verify is None:
            verify = os.environ.get(CA_ENV) or True
        kwargs: dict[str, Any] = {}
        if self.url.startswith("https://"):
            # a CA bundle's path as an SSL context (httpx deprecates verify=<str>)
            kwargs["verify"] = (ssl.create_default_context(cafile=verify)
                                if isinstance(verify, str) else verify)
        else:
            kwargs["verify"] = False  # no TLS: skip building an SSL context (it is slow)
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            **kwargs,
        )

    # ----------------------------------------------------------------- transport

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        read_timeout: float | None = None,
        connect_budget: float | None = None,
    ) -> Any:
        """One call, retried through connection failures and 5xx for ``retry_budget``
        seconds (a failure to connect at all: ``connect_budget`` seconds, when given)."""
        timeout = httpx.USE_CLIENT_DEFAULT
        if read_timeout is not None:
            timeout = httpx.Timeout(read_timeout, connect=min(self.timeout, 10.0))  # type: ignore[assignment]

        def send(token: str | None) -> httpx.Response:
            auth = {"Authorization": f"Bearer {token}"} if token else None
            return self._http.request(method, path, json=body, params=params,
                                      timeout=timeout, headers=auth)

        def once() -> Any:
            token = self.token
            resp = send(token)
            if resp.status_code == 401 and self._reload_token(token):
                resp = send(self.token)  # the token file was rotated: once more with it
            if resp.status_code >= 500:
                raise _Retryable(resp.status_code, resp.text)
            if resp.status_code >= 400:
                raise _refusal(resp)
            return resp.json()

        started = time.monotonic()
        try:  # the common case: one attempt, no retry machinery to build
            return once()
        except (httpx.TransportError, _Retryable) as exc:
            first = exc
        cannot_connect = connect_budget is not None and isinstance(first, httpx.ConnectError)
        budget = min(self.retry_budget, connect_budget or self.retry_budget)
        log.warning(
            "coordinator %s: %s %s failed (%s); retrying for up to %gs",
            self.url, method, path, _cause(first),
            budget if cannot_connect else self.retry_budget,
        )

        def stop(state: tenacity.RetryCallState) -> bool:
            elapsed = time.monotonic() - started
            exc = state.outcome.exception() if state.outcome is not None else None
            if isinstance(exc, httpx.ConnectError) and connect_budget is not None:
                return elapsed >= budget
            return elapsed >= self.retry_budget

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((httpx.TransportError, _Retryable)),
            wait=tenacity.wait_exponential(multiplier=0.05, max=2.0)
            + tenacity.wait_random(0, 0.05),
            stop=stop,
            reraise=True,
        )
        try:
            return retrying(once)
        except (httpx.TransportError, _Retryable) as exc:
            waited = time.monotonic() - started
            if isinstance(exc, httpx.ConnectError) and connect_budget is not None:
                raise CoordinatorUnavailable(
                    f"coordinator {self.url} unavailable: cannot connect ({method} {path}, "
                    f"tried for {waited:.0f}s): {_cause(exc)}. Check the coordinator= URL "
                    "(host and port) and that the coordinator is running "
                    "(twophase serve --store ...), or use a store URL such as "
                    "sqlite:///path.db for an embedded coordinator",
                    code="unavailable",
                ) from exc
            raise CoordinatorUnavailable(
                f"coordinator {self.url} unavailable for {waited:.0f}s (retry budget "
                f"{self.retry_budget:g}s: the sink's retry_budget_s) ({method} {path}): "
                f"{_cause(exc)}",
                status=getattr(exc, "status", None),
                code="unavailable",
            ) from exc

    def _reload_token(self, refused: str | None) -> bool:
        """After ``refused`` got a 401: re-read the token file; True when the token to
        send now differs (another thread may have re-read it already)."""
        if self.token_file is None:
            return False
        with self._token_lock:
            if self.token == refused:
                try:
                    fresh = read_token_file(self.token_file)
                except InvalidRequest as exc:
                    log.warning("coordinator %s refused the token; %s", self.url, exc)
                    return False
                if fresh != refused:
                    log.warning("coordinator %s: token re-read from %s", self.url,
                                self.token_file)
                self.token = fresh
            return self.token != refused

    @staticmethod
    def _txn_path(key: TxnKey) -> str:
        sink, lineage, checkpoint, attempt = key
        return f"/v1/txns/{_seg(sink)}/{_seg(lineage)}/{int(checkpoint)}/{int(attempt)}"

    def _txn(self, method: str, key: TxnKey, action: str = "", body: Any = None, *,
             into: protocol.Transaction | None = None, admin: bool = False,
             params: Mapping[str, Any] | None = None, read_timeout: float | None = None,
             ) -> protocol.Transaction:
        """One call on transaction ``key`` (``action``: its verb, e.g. ``/votes``) whose
        answer is the record, decoded in one place. With ``into`` (the caller's copy) the
        answer holds only the branches the call named, decoded into ``into``
        (:func:`twophase.client.wire.decode_touched`); where the two disagree (another
        writer moved a branch the copy still shows) the whole record is read instead."""
        path = self._txn_path(key)
        if admin:
            path = "/v1/admin" + path[3:]
        out = self._request(method, path + action, body=body, params=params,
                            read_timeout=read_timeout)
        if into is None:
            return wire.decode_txn(out)
        merged = wire.decode_touched(out, into)
        return merged if merged is not None else self._txn("GET", key)

    # ----------------------------------------------------------------- calls

    def register(
        self, sink: str, descriptors: Sequence[wire.DescriptorOut] | None = None
    ) -> int:
        """A new writer epoch for ``sink``; every older writer is fenced from now on.
        ``descriptors`` (the participants' :meth:`~twophase.participant.Participant.
        descriptor`) are recorded so that ``twophase resolve`` can rebuild them. The
        first contact: a URL nobody answers at fails within seconds."""
        body = wire.register_body(descriptors) if descriptors is not None else None
        out = self._request("POST", f"/v1/sinks/{_seg(sink)}/register", body=body,
                            connect_budget=FIRST_CONTACT_BUDGET)
        return int(wire.decode_sink(out).epoch)

    def sinks(self) -> builtins.list[wire.SinkSummaryOut]:
        """Every sink with its last committed batch, in-doubt count and age, alerts."""
        out = self._request("GET", "/v1/sinks")
        sinks: builtins.list[wire.SinkSummaryOut] = out["sinks"]
        return sinks

    def participants(self, sink: str) -> builtins.list[wire.DescriptorOut]:
        """The sink's participant descriptors, as recorded at its last register."""
        out = self._request("GET", f"/v1/sinks/{_seg(sink)}/participants")
        return [wire.decode_descriptor(d, f"participants[{i}]")
                for i, d in enumerate(_list(out, "participants"))]

    def begin(
        self,
        sink: str,
        lineage: str,
        batch_id: int,
        epoch: int,
        participants: Sequence[str],
        partitions: int,
        vote_timeout: float = 300.0,
    ) -> protocol.BeginResult:
        out = self._request(
            "POST",
            f"/v1/sinks/{_seg(sink)}/begin",
            body=wire.begin_body(lineage, batch_id, epoch, participants, partitions,
                                 vote_timeout),
        )
        return wire.decode_begin(out)

    def vote(self, key: TxnKey, epoch: int, votes: Sequence[VoteIn], *,
             brief: bool = False, into: protocol.Transaction | None = None,
             touched: bool = False) -> protocol.Transaction:
        """Record ``votes``; the answer is the record afterwards. ``brief``: without its
        branches (empty), state and decision only. ``into``: the caller's copy of the
        record: the coordinator answers with only the branches voted on here (O(votes)
        bytes, not O(branches)), decoded into ``into`` (``wire.decode_touched``).
        ``touched`` without ``into``: that answer as it is, a partial record whose
        branches are only those voted on here (for a caller that needs no others: a
        task). An older coordinator may answer with every branch: a superset."""
        body = wire.votes_body(epoch, votes, brief=brief, touched=touched or into is not None)
        return self._txn("POST", key, "/votes", body, into=into)

    def await_decision(
        self, key: TxnKey, timeout: float, *, until: str = "decided", brief: bool = False
    ) -> protocol.Transaction:
        """Wait up to ``timeout`` seconds for the decision (``until="finished"``: for every
        acknowledgement); returns the transaction, undecided if the time ran out.
        ``brief``: without its branches (state and decision only; an older coordinator
        may still send them)."""
        import time

        end = time.monotonic() + max(0.0, timeout)
        while True:
            left = max(0.0, end - time.monotonic())
            slice_ = min(left, POLL_SLICE)
            txn = self._txn(
                "GET", key, "/decision",
                params={"timeout": f"{slice_:.3f}", "until": until,
                        **({"brief": "true"} if brief else {})},
                read_timeout=slice_ + self.timeout,
            )
            done = txn.state.decided if until == "decided" else txn.state.finished
            if done or time.monotonic() >= end:
                return txn

    def ack(
        self,
        key: TxnKey,
        epoch: int,
        acks: Sequence[tuple[str, protocol.Decision]],
        metrics: Mapping[str, wire.BranchMetrics] | None = None,
        *,
        brief: bool = False,
        into: protocol.Transaction | None = None,
    ) -> protocol.Transaction:
        """Record ``acks``; ``brief`` and ``into`` as for :meth:`vote`."""
        body = wire.acks_body(epoch, acks, metrics, brief=brief, touched=into is not None)
        return self._txn("POST", key, "/acks", body, into=into)

    def abandon(self, key: TxnKey, epoch: int, reason: str) -> protocol.Transaction:
        return self._txn("POST", key, "/abandon", wire.abandon_body(epoch, reason))

    def get(self, key: TxnKey) -> protocol.Transaction:
        return self._txn("GET", key)

    def get_raw(self, key: TxnKey, *, history: bool = False) -> dict[str, Any]:
        """The server's JSON for one transaction (with ``alert``; ``history`` on demand)."""
        out: dict[str, Any] = self._request(
            "GET", self._txn_path(key), params={"history": "true" if history else "false"}
        )
        return out

    def list(
        self, sink: str | None = None, state: str | None = None, limit: int = 100
    ) -> builtins.list[protocol.Transaction]:
        return [wire.decode_txn(t) for t in self.list_raw(sink, state, limit)]

    def committing(self, sink: str) -> builtins.list[protocol.Transaction]:
        """``sink``'s COMMIT-decided, unfinished transactions (a data-token route)."""
        out = self._request("GET", f"/v1/sinks/{quote(sink, safe='')}/committing")
        return [wire.decode_txn(t) for t in out["txns"]]

    def list_raw(
        self, sink: str | None = None, state: str | None = None, limit: int = 100
    ) -> builtins.list[dict[str, Any]]:
        """Listing as the server sends it (each transaction also has ``alert``)."""
        params: dict[str, Any] = {"limit": limit}
        if sink is not None:
            params["sink"] = sink
        if state is not None:
            params["state"] = state
        out = self._request("GET", "/v1/txns", params=params)
        txns: builtins.list[dict[str, Any]] = out["txns"]
        return txns

    def force_ack(
        self, key: TxnKey, branch: str, outcome: protocol.Decision, reason: str | None = None
    ) -> protocol.Transaction:
        body = wire.force_ack_body(branch, outcome, reason)
        return self._txn("POST", key, "/force-ack", body, admin=True)

    def admin_abort(self, key: TxnKey, reason: str) -> protocol.Transaction:
        """Operator: ABORT an undecided transaction whose writer is gone."""
        return self._txn("POST", key, "/abort", wire.abort_body(reason), admin=True)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self._request("GET", "/healthz")
        return out

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cause(exc: BaseException) -> str:
    """``ConnectError: [Errno 111] Connection refused`` rather than a bare message."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, _Retryable) else str(exc)


def _list(out: Any, key: str) -> builtins.list[Any]:
    if not isinstance(out, dict) or not isinstance(out.get(key), list):
        raise wire.WireError(f"answer: expected an object with a list {key!r}")
    items: builtins.list[Any] = out[key]
    return items


def _refusal(resp: httpx.Response) -> TwophaseError:
    """The error an HTTP error body names, as the same class the server raised."""
    try:
        data = resp.json()
        code = str(data.get("error", "error"))
        message = str(data.get("message", resp.text))
    except ValueError:
        code, message = "error", resp.text[:500]
    text = f"coordinator refused ({resp.status_code} {code}): {message}"
    return error_class(code)(text, status=resp.status_code, code=code)
