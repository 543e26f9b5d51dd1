"""Settle a sink whose job is gone: the recovery rule, run by an operator.

Leftover PostgreSQL prepared transactions hold locks and block VACUUM; staged files take
space. They must never be left behind silently. For every unfinished transaction of the
sink, and for every prepared leftover the participants find by name, this applies the
same rule as the Spark glue (ARCHITECTURE.md, "Recovery: one rule"), then acknowledges
to the coordinator. A lost Kafka branch under a COMMIT decision cannot be redone without
the data: it is reported, and restarting the query from its checkpoint redoes it. A
participant that commits once per batch (a table) is committed for the whole batch at
once, with every branch's voted handle, never one branch alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from twophase.errors import InvalidRequest, ParticipantError, TransactionNotFound
from twophase.grants import Grants, secrets_for
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Participant,
    is_empty_branch,
    rebuild,
)
from twophase.protocol import (
    CommitScope,
    Decision,
    RecoveryAction,
    State,
    Transaction,
    TxnKey,
    parse_branch_id,
    recovery_action,
)

__all__ = ["Action", "Decisions", "ResolveReport", "participants_from", "resolve_sink"]

REASON = "resolved by operator: writer gone"


class Decisions(Protocol):
    """What resolving needs of the coordinator: the HTTP client
    (:class:`twophase.client.api.CoordinatorClient`), or the service's own store."""

    def list(
        self, sink: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[Transaction]: ...

    def get(self, key: TxnKey) -> Transaction: ...

    def admin_abort(self, key: TxnKey, reason: str) -> Transaction: ...

    def force_ack(
        self, key: TxnKey, branch: str, outcome: Decision, reason: str | None = None
    ) -> Transaction: ...


def participants_from(
    descriptors: Sequence[Mapping[str, Any]],
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    *,
    sink: str,
    grants: Grants | None = None,
    overlay: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    overlay_secrets: Collection[str] = (),
) -> list[Participant]:
    """The sink's participants rebuilt from the descriptors its coordinator recorded;
    ``secrets`` per participant name (default: from the environment), handed only to
    the descriptors an operator granted for ``sink`` (:mod:`twophase.grants`; default:
    ``$TWOPHASE_SECRET_GRANTS_FILE``). ``overlay`` lays an operator's settings over a
    descriptor after the grant is checked on the recorded one; ``overlay_secrets``:
    the secret settings it adds, which need the grant too."""
    if not descriptors:
        raise InvalidRequest(
            "the coordinator has no participant descriptors for this sink (it was last "
            "registered before descriptors were recorded, or its participants have no "
            "descriptor()): name the participants by hand (twophase resolve --participant, "
            "--pg-dsn, --files-path, --kafka-bootstrap)"
        )
    grants = grants if grants is not None else Grants()
    out = []
    for d in descriptors:
        laid = overlay(d) if overlay is not None else d
        given = None if secrets is None else secrets.get(str(d.get("name")), {})
        found = secrets_for(sink, d, grants, given,
                            also=overlay_secrets if laid is not d else ())
        out.append(rebuild(laid, found))
    return out


@dataclass
class Action:
    txn: str
    branch: str
    status: str
    action: str  # "commit", "abort", "ack", "redo-needed", "nothing"


@dataclass
class ResolveReport:
    actions: list[Action] = field(default_factory=list)
    unresolved: list[Action] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unresolved

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "actions": [asdict(a) for a in self.actions],
                "unresolved": [asdict(a) for a in self.unresolved]}


_WAITING = (State.COMMITTING, State.ABORTING)


def _txn_name(key: TxnKey) -> str:
    return f"{key.sink}/{key.lineage}/{key.batch_id}/attempt-{key.attempt}"


def resolve_sink(
    client: Decisions,
    sink: str,
    participants: Sequence[Participant],
    *,
    dry_run: bool = False,
    limit: int = 10_000,
) -> ResolveReport:
    by_name = {p.name: p for p in participants}
    report = ResolveReport()
    open_txns = [t for t in client.list(sink=sink, limit=limit) if not t.state.finished]
    seen: set[tuple[TxnKey, str]] = set()  # branches settled above: not again as leftovers
    for txn in open_txns:
        if txn.decision is None:
            if not dry_run:
                txn = client.admin_abort(txn.key, REASON)
            report.actions.append(Action(_txn_name(txn.key), "*", "undecided", "abort"))
        decision = txn.effective_decision
        for table in participants:
            if table.commit_scope == CommitScope.BATCH:
                seen |= _settle_batch(client, table, txn, decision, dry_run, report)
        for bid, st in txn.branches.items():
            participant_name, partition = parse_branch_id(bid)
            part = by_name.get(participant_name)
            if part is None:
                report.unresolved.append(
                    Action(_txn_name(txn.key), bid, "unknown", "name this participant to resolve")
                )
                continue
            if (txn.key, bid) in seen:  # a batch participant's branch, settled above
                continue
            ref = BranchRef(*txn.key, participant_name, partition)
            status = part.voted_status(ref, dict(st.handle) if st.handle else None)
            act = _settle(part, ref, status, decision, st.handle, dry_run)
            seen.add((txn.key, bid))
            entry = Action(_txn_name(txn.key), bid, status.value, act)
            if act == "redo-needed":
                report.unresolved.append(entry)
                continue
            report.actions.append(entry)
            waits = decision == Decision.COMMIT or st.vote == Decision.COMMIT
            if st.ack is None and waits and not dry_run and txn.state in _WAITING:
                client.force_ack(txn.key, bid, decision, REASON)
    # Leftovers the coordinator may not know about (prepared, then the vote was lost).
    for part in participants:
        for ref in part.in_doubt(sink):
            if (ref.key, ref.branch_id) in seen:  # a dry run left it prepared: listed above
                continue
            try:
                txn = client.get(ref.key)
                decision = txn.effective_decision
            except TransactionNotFound:  # no record: presumed abort
                decision = Decision.ABORT
            # Any other error propagates: a branch must never be aborted because the
            # coordinator could not be asked (its decision may be COMMIT).
            if part.commit_scope == CommitScope.BATCH and decision == Decision.COMMIT:
                # never one branch of a batch alone: the whole batch, from the record
                seen |= _settle_batch(client, part, txn, decision, dry_run, report)
                continue
            act = _settle(part, ref, BranchStatus.PREPARED, decision, None, dry_run)
            report.actions.append(
                Action(_txn_name(ref.key), ref.branch_id, "PREPARED", act)
            )
    # Open Kafka transactions a crash left (no branch to name: found on the brokers),
    # aborted so read_committed readers are not stalled until the broker's timeout; a
    # Kafka prepare is not durable, so such a branch is redone, never committed.
    for part in participants:
        finder = getattr(part, "open_transactions" if dry_run else "abort_lingering", None)
        try:
            found = finder(sink) if finder is not None else ()
        except ParticipantError as exc:  # the rest is settled; this part is not
            report.unresolved.append(Action("kafka transactions", part.name, "unknown",
                                            f"cannot list them: {exc}"))
            continue
        for t in found:
            report.actions.append(Action(f"kafka transaction {t.transactional_id}",
                                         part.name, f"OPEN {t.age_s:.0f}s", "abort"))
    return report


def _settle_batch(
    client: Decisions,
    part: Participant,
    txn: Transaction,
    decision: Decision,
    dry_run: bool,
    report: ResolveReport,
) -> set[tuple[TxnKey, str]]:
    """The recovery rule for a participant that commits once per batch: under COMMIT,
    its prepared branches are committed together (``commit_batch`` with every branch's
    voted handle), never one alone; under ABORT each prepared branch is aborted. Returns
    the branches it settled."""
    mine = {bid: st for bid, st in txn.branches.items() if parse_branch_id(bid)[0] == part.name}
    name = _txn_name(txn.key)
    statuses: dict[str, BranchStatus] = {}
    for bid, st in mine.items():
        if is_empty_branch(st.handle):
            continue
        ref = BranchRef(*txn.key, part.name, parse_branch_id(bid)[1])
        statuses[bid] = part.voted_status(ref, dict(st.handle) if st.handle else None)
    actions = {bid: recovery_action(decision, status, part.commit_scope)
               for bid, status in statuses.items()}
    if RecoveryAction.REDO in actions.values():  # files gone: only a replay can redo them
        for bid, action in actions.items():
            report.unresolved.append(Action(
                name, bid, statuses[bid].value,
                "redo-needed" if action == RecoveryAction.REDO else "commit-batch-waits"))
        return set()
    if RecoveryAction.COMMIT_BATCH in actions.values() and not dry_run:
        part.commit_batch(txn.key, {parse_branch_id(bid)[1]: dict(mine[bid].handle or {})
                                    for bid in statuses})
    for bid, st in mine.items():
        action = actions.get(bid, RecoveryAction.NOTHING)
        if action == RecoveryAction.ABORT and not dry_run:
            part.abort(BranchRef(*txn.key, part.name, parse_branch_id(bid)[1]),
                       dict(st.handle) if st.handle else None)
        shown = {RecoveryAction.COMMIT_BATCH: "commit-batch", RecoveryAction.ABORT: "abort"}
        report.actions.append(Action(
            name, bid, statuses[bid].value if bid in statuses else "EMPTY",
            shown.get(action, "ack" if decision == Decision.COMMIT else "nothing")))
        waits = decision == Decision.COMMIT or st.vote == Decision.COMMIT
        if st.ack is None and waits and not dry_run and txn.state in _WAITING:
            client.force_ack(txn.key, bid, decision, REASON)
    return {(txn.key, bid) for bid in mine}


def _settle(
    part: Participant,
    ref: BranchRef,
    status: BranchStatus,
    decision: Decision,
    handle: Mapping[str, str] | None,
    dry_run: bool,
) -> str:
    """Apply the recovery rule to one branch; returns the action's name for the report
    (a lost branch under COMMIT cannot be redone here: the data is gone with the job)."""
    h = dict(handle) if handle else None
    if is_empty_branch(h):  # voted with no rows: nothing was prepared anywhere
        return "ack" if decision == Decision.COMMIT else "nothing"
    action = recovery_action(decision, status)
    if action == RecoveryAction.COMMIT:
        if not dry_run:
            part.commit(ref, h)
        return "commit"
    if action == RecoveryAction.ABORT:
        if not dry_run:
            part.abort(ref, h)
        return "abort"
    if action == RecoveryAction.REDO:
        return "redo-needed"
    return "ack" if decision == Decision.COMMIT else "nothing"
