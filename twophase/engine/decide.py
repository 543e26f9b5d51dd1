"""The driver hands the tasks' votes to the coordinator: the protocol's step 3 ("decide").

In ``prepare`` mode no task talks to the coordinator about its vote: each returns its
votes with the job's result, and once the job is over the driver sends them all, in
chunks of :data:`VOTE_CHUNK` (one request per chunk, however many branches: the
coordinator's work per batch grows with the branches, not with their square, and no
request nears the service's body limit). Each answer carries only the branches its chunk
voted on, merged into the driver's copy of the record (``CoordinatorClient.vote``'s
``into``), so the bytes back are O(branches) a batch too. Spark keeps one result per
partition of a task it ran twice, so each branch's vote is one task attempt's; the vote
table (``twophase.protocol.VOTE_CASES``) settles anything else.

An attempt still undecided afterwards (the job failed, so some partitions' votes never
came back) is abandoned: ABORT. Presumed abort makes that safe: what those tasks prepared
is found by name by the next attempt's tasks, or by ``twophase resolve``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from twophase.client.wire import VoteIn
from twophase.protocol import Transaction, TxnKey

if TYPE_CHECKING:
    from twophase.client.api import CoordinatorClient

__all__ = ["VOTE_CHUNK", "decide", "votes_of"]

VOTE_CHUNK: Final = 1000
"""Votes per request (a vote with its handle is ~300 bytes: ~0.3 MiB a request)."""


def votes_of(outcomes: Iterable[Mapping[str, Any]]) -> list[VoteIn]:
    """Every task's votes, from the job's result (the wire's vote bodies)."""
    return [
        VoteIn(branch=v["branch"], yes=v["yes"], handle=v.get("handle"),
               reason=v.get("reason"), metrics=v.get("metrics"), digest=v.get("digest"),
               task=v.get("task"))
        for o in outcomes for v in json.loads(o.get("votes") or "[]")
    ]


def decide(
    client: CoordinatorClient, txn: Transaction | TxnKey, epoch: int, votes: list[VoteIn],
    job_error: str,
) -> Transaction:
    """Send ``votes`` for ``txn`` in chunks; abandon the attempt if it is still undecided
    (``job_error`` says why). Returns the record with its decision. ``txn``: the driver's
    copy of the record, or only its key where the driver has none (the data source
    door's committer): the first chunk's answer is then the whole record, and no
    request reads it first. A record decided already (a finish: no votes) is returned
    as it is."""
    key, after = (txn.key, txn) if isinstance(txn, Transaction) else (txn, None)
    # every YES first: a NO then decides ABORT with each prepared branch on record, so
    # the driver aborts them all (a YES after the NO would be late, recorded nowhere)
    votes = sorted(votes, key=lambda v: not v.yes)
    for i in range(0, len(votes), VOTE_CHUNK):
        after = client.vote(key, epoch, votes[i:i + VOTE_CHUNK], into=after)
    if after is None or (not votes and after.decision is None):
        after = client.get(key)  # tasks of an earlier run may have settled it
    if after.decision is None:
        reason = (f"Spark job failed: {job_error}" if job_error
                  else "the prepare job ended without every branch's vote")
        after = client.abandon(key, epoch, reason)
    return after

