"""The two-phase-commit protocol: every rule that decides, as pure functions.

Nothing here does I/O or reads a clock: time arrives as ``now`` (seconds, any epoch)
inside each event. The coordinator's store loads a :class:`Transaction`, feeds it one
event through :func:`handle`, and writes the result back with a compare-and-set on the
row's ``version``; the HTTP layer only translates. The driver and the tasks ask the same
package what to do next. Modules:

- :mod:`.records`: states, decisions, transactions, sink rows, branch ids;
- :mod:`.machine`: events, the complete transition table, the vote table, :func:`handle`;
- :mod:`.attempts`: :func:`register`, :func:`begin` (a table of cases), :func:`committed`;
- :mod:`.recovery`: the recovery rule, :func:`recovery_action`;
- :mod:`.retry`: the driver's next step after an attempt, :func:`next_step`.

The property tests in ``tests/protocol/test_protocol_properties.py`` drive this package directly.
"""

from twophase.errors import IllegalTransition, ProtocolError, StaleEpoch, UnknownBranch
from twophase.protocol.attempts import (
    BEGIN_CASES,
    Begin,
    BeginCase,
    BeginKind,
    BeginResult,
    begin,
    committed,
    register,
)
from twophase.protocol.machine import (
    TRANSITIONS,
    VOTE_CASES,
    Abandon,
    Ack,
    AdminAbort,
    Allow,
    Event,
    Expire,
    ForceAck,
    Kind,
    Refuse,
    Rule,
    Vote,
    VoteCase,
    VoteOutcome,
    handle,
    handle_all,
    kind_of,
    vote_case,
)
from twophase.protocol.records import (
    BranchState,
    Decision,
    SinkRecord,
    State,
    Transaction,
    TxnKey,
    branch_id,
    parse_branch_id,
)
from twophase.protocol.recovery import (
    BranchStatus,
    CommitScope,
    RecoveryAction,
    recovery_action,
)
from twophase.protocol.retry import Step, StepKind, next_step, permanent

__all__ = [
    "BEGIN_CASES",
    "TRANSITIONS",
    "VOTE_CASES",
    "Abandon",
    "Ack",
    "AdminAbort",
    "Allow",
    "Begin",
    "BeginCase",
    "BeginKind",
    "BeginResult",
    "BranchState",
    "BranchStatus",
    "CommitScope",
    "Decision",
    "Event",
    "Expire",
    "ForceAck",
    "IllegalTransition",
    "Kind",
    "ProtocolError",
    "RecoveryAction",
    "Refuse",
    "Rule",
    "SinkRecord",
    "StaleEpoch",
    "State",
    "Step",
    "StepKind",
    "Transaction",
    "TxnKey",
    "UnknownBranch",
    "Vote",
    "VoteCase",
    "VoteOutcome",
    "begin",
    "branch_id",
    "committed",
    "handle",
    "handle_all",
    "kind_of",
    "next_step",
    "parse_branch_id",
    "permanent",
    "recovery_action",
    "register",
    "vote_case",
]
