"""The driver applies a decided attempt after its prepare job: the protocol's step 4.

Without the barrier stage (every participant's prepare is durable) the tasks prepare,
vote and end; nothing waits for the decision in a task. Once the job is over the driver
reads the coordinator's record and applies it to every branch that voted YES, from the
handle the vote carried:

- COMMIT: each branch-scope participant's branches are committed in bounded parallel
  (``commit`` is idempotent through the participant's marker), then every once-per-batch
  participant (a table) is committed once with all its branches' handles;
- ABORT: every YES branch is aborted (a branch that never voted is found by name by the
  next attempt's tasks, or by ``twophase resolve``).

A finish (a restart found COMMIT decided) is committed here too, by the same steps: its
tasks only write again what was lost (``twophase.engine.finish.redo_lost``) and hand the
new handles back, which replace the lost ones' (``redone``); every other branch is
committed from its vote's handle.

What was applied is acknowledged in chunks (one request stays far below the service's
body limit, however many branches). A branch whose commit failed stays unacknowledged:
the retry rule finishes the batch again, and the participant's marker makes a second
commit a no-op. This is Spark's DataSource V2 split (tasks write, the driver's committer
commits) and Flink's committer.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Final

from twophase import failpoints
from twophase.options import MARKER_KEEP_BATCHES
from twophase.participant import BranchRef, Handle, Participant, is_empty_branch
from twophase.protocol import BranchStatus, CommitScope, Decision, TxnKey, parse_branch_id

if TYPE_CHECKING:
    from twophase.client.api import CoordinatorClient
    from twophase.client.wire import BranchMetrics
    from twophase.protocol import Transaction

__all__ = ["ACK_CHUNK", "COMMIT_THREADS", "MARKER_KEEP_BATCHES", "PRUNE_EVERY", "SLOW_COMMIT_S",
           "Committer", "send_acks"]

log = logging.getLogger("twophase.sink")

COMMIT_THREADS: Final = 8
"""Branches applied at once from the driver: enough to hide each commit's round trip
(``COMMIT PREPARED``, a rename, a multipart completion), few enough for a database's
connection limit (each thread opens its own connection per participant)."""

ACK_CHUNK: Final = 1000
"""Acknowledgements per request (a request of 1,000 acks is ~60 KiB)."""

PRUNE_EVERY: Final = 100  # batches between two prunes (one DELETE per participant)

SLOW_COMMIT_S: Final = 30.0
"""A branch's commit or abort still running after this long is logged as a warning, with
where it waits, and again every as long: a stalled commit is never silent (issue 31, a
10-minute wait inside librdkafka with nothing in the log)."""

_Work = tuple[Participant, BranchRef, Handle]


def send_acks(
    client: CoordinatorClient, key: TxnKey, epoch: int, acks: Sequence[tuple[str, Decision]],
    into: Transaction, metrics: Mapping[str, BranchMetrics] | None = None,
) -> Transaction | None:
    """Acknowledge ``acks`` in chunks of :data:`ACK_CHUNK`; each answer carries only its
    chunk's branches, merged into ``into`` (the caller's copy of the record). ``metrics``:
    what applying each branch took, for the coordinator's histograms. The record after
    the last chunk (None when there was nothing to send)."""
    txn = into
    for i in range(0, len(acks), ACK_CHUNK):
        chunk = acks[i:i + ACK_CHUNK]
        mine = {b: metrics[b] for b, _ in chunk if b in metrics} if metrics else None
        txn = client.ack(key, epoch, chunk, mine, into=txn)
    return txn if acks else None


class Committer:
    """Applies decisions from the driver, for one sink: :data:`COMMIT_THREADS` lanes, each
    with its own copies of the participants (a participant object holds one connection),
    kept across batches so a batch's commits reuse the connections of the one before.
    ``keep``: the batches whose markers :meth:`prune` keeps (the sink's
    ``marker_keep_batches``, checked by ``twophase.options.check_marker_window``)."""

    def __init__(self, participants: Sequence[Participant],
                 keep: int = MARKER_KEEP_BATCHES) -> None:
        self.participants = tuple(participants)
        self.keep = keep
        self._by_name = {p.name: p for p in self.participants}
        self._lanes: list[dict[str, Participant]] = [{} for _ in range(COMMIT_THREADS)]
        self._pool: ThreadPoolExecutor | None = None
        self._pruner: ThreadPoolExecutor | None = None
        self._pruning: dict[str, Participant] = {}
        self._running: dict[int, tuple[str, float]] = {}  # thread id -> (what, since)
        # the last batch applied without error, and its redone handles
        self._last: tuple[Transaction, Mapping[str, Handle] | None] | None = None
        self.slow_commit_s = SLOW_COMMIT_S
        self._watch: threading.Thread | None = None
        # made with the watch, not here: the sink is pickled before its first batch
        # under Spark Connect, and an Event holds a lock
        self._stop: threading.Event | None = None

    def apply(
        self, client: CoordinatorClient, epoch: int, txn: Transaction,
        redone: Mapping[str, Handle] | None = None,
    ) -> tuple[Transaction, str]:
        """Apply ``txn``'s decision to its YES branches (see the module docstring);
        ``redone``: under COMMIT, the handles of branches a finish's tasks wrote again
        (branch id -> handle), committed in place of the lost ones the votes carry.
        Returns the record afterwards and the first failure's cause ("" when none)."""
        decision = txn.decision
        if decision is None:
            return txn, ""
        handles = _handles(txn, redone)
        work: list[_Work] = []
        settled: list[tuple[str, Decision]] = []
        for bid, st in txn.branches.items():
            if st.ack is not None or st.vote != Decision.COMMIT:
                continue  # applied already, or nothing prepared to wait for
            name, partition = parse_branch_id(bid)
            part = self._by_name[name]
            if decision == Decision.COMMIT and part.commit_scope == CommitScope.BATCH:
                continue  # the table's one commit for the batch, below
            if is_empty_branch(handles[bid]):
                settled.append((bid, decision))  # voted with no rows: nothing to apply
                continue
            ref = BranchRef(*txn.key, participant=name, partition=partition)
            work.append((part, ref, handles[bid]))
        done, error = self._apply_all(work, decision)
        acks = settled + [(b, decision) for b in done]
        took: dict[str, BranchMetrics] = {b: {"commit_s": s} for b, s in done.items()}
        failpoints.hit("before_ack")
        after = send_acks(client, txn.key, epoch, acks, into=txn, metrics=took) or txn
        if decision == Decision.COMMIT:
            after, batch_error = self._commit_batches(client, epoch, after, handles)
            error = error or batch_error
        if not error:
            self.end_other_attempts(after, redone)
            self._last = (after, redone)
        return after, error

    def _commit_batches(
        self, client: CoordinatorClient, epoch: int, txn: Transaction,
        handles: Mapping[str, Handle],
    ) -> tuple[Transaction, str]:
        """Under COMMIT, commit each once-per-batch participant (a table) with every
        branch's handle (``handles``: the votes', a redone branch's new one) at once and
        acknowledge its branches. Returns the record after the acks and the first
        commit's error ("" when none failed): a commit that fails leaves the branches
        unacknowledged, and the retry rule finishes the batch again (the table's marker
        makes a second commit a no-op)."""
        error = ""
        for part in self.participants:
            if part.commit_scope != CommitScope.BATCH:
                continue
            mine = {bid: st for bid, st in txn.branches.items()
                    if parse_branch_id(bid)[0] == part.name}
            if all(st.ack is not None for st in mine.values()):
                continue
            batch = {parse_branch_id(bid)[1]: handles[bid] for bid in mine
                     if not is_empty_branch(handles[bid])}
            try:
                failpoints.hit("before_batch_commit", part.name)
                if batch:  # every branch empty: nothing was written, nothing to commit
                    part.commit_batch(txn.key, batch)
                failpoints.hit("after_batch_commit", part.name)
            except Exception as exc:
                cause = f"{part.describe()}: batch commit failed: {type(exc).__name__}: {exc}"
                log.warning("sink %s batch %d: %s; finishing it again", txn.sink,
                            txn.batch_id, cause)
                error = error or cause
                continue
            txn = send_acks(client, txn.key, epoch,
                            [(bid, Decision.COMMIT) for bid, st in mine.items()
                             if st.ack is None], into=txn) or txn
        return txn, error

    def end_other_attempts(self, txn: Transaction,
                           redone: Mapping[str, Handle] | None = None) -> int:
        """Once ``txn``'s decision is applied: each participant ends what other attempts
        of its branches left open that no recorded vote (or ``redone`` handle) carries (a
        speculative or retried task's,
        :meth:`~twophase.participant.Participant.end_other_attempts`), before the next
        batch begins. A failure is logged: the prune and the target's own timeout end it
        later. Returns how many were ended."""
        lane = self._lanes[0]
        ended = 0
        handles = _handles(txn, redone)
        for part in self.participants:
            kept = {parse_branch_id(bid)[1]: handles[bid]
                    for bid, st in txn.branches.items()
                    if parse_branch_id(bid)[0] == part.name and st.vote == Decision.COMMIT}
            mine = lane.get(part.name)
            if mine is None:
                mine = lane[part.name] = pickle.loads(pickle.dumps(part))  # noqa: S301
            try:
                ended += mine.end_other_attempts(txn.key, kept)
            except Exception as exc:  # readers wait until the prune or the timeout
                log.warning("sink %s batch %d: %s could not end what other attempts left "
                            "open (ended later by the prune or the target's timeout): %s",
                            txn.sink, txn.batch_id, part.describe(), exc)
        if ended:
            log.info("sink %s batch %d: ended %d transaction(s) other attempts left open",
                     txn.sink, txn.batch_id, ended)
        return ended

    def prune(self, sink: str, lineage: str, batch_id: int, *,
              keep: int | None = None, every: int = PRUNE_EVERY) -> Future[int] | None:
        """After ``batch_id`` committed, every ``every`` batches: delete the participants'
        markers of batches below ``batch_id - keep`` (default :attr:`keep`) in a
        background thread (the batch
        does not wait; a participant refusing, e.g. no DELETE right, is logged with the
        fix). Returns the background work, or None when this batch prunes nothing."""
        keep = self.keep if keep is None else keep
        if batch_id < keep or batch_id % every:
            return None
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(1, thread_name_prefix="twophase-prune")
        return self._pruner.submit(self._prune, sink, lineage, batch_id - keep)

    def _prune(self, sink: str, lineage: str, below: int) -> int:
        pruned = 0
        for part in self.participants:
            mine = self._pruning.get(part.name)
            if mine is None:
                mine = self._pruning[part.name] = pickle.loads(pickle.dumps(part))  # noqa: S301
            try:
                pruned += mine.prune_markers(sink, lineage, below)
            except Exception as exc:  # the markers stay: correct, only larger
                log.warning("sink %s: %s kept its markers of batches below %d: %s (grant "
                            "the sink's user DELETE on its marker table to prune them; "
                            "Kafka: Delete on the staging topic)",
                            sink, part.describe(), below, exc)
        if pruned:
            log.info("sink %s: pruned %d marker row(s) or staged record(s) of batches "
                     "below %d", sink, pruned, below)
        return pruned

    def sweep(self, txn: Transaction) -> int:
        """Before the query fails on ``txn``'s batch (no attempt left), abort what any of
        its ABORT-decided attempts left prepared that no vote recorded (a task that failed
        after preparing), found by name: nothing is left holding locks. Returns how many
        branches were aborted."""
        lane = self._lanes[0]
        swept = 0
        for attempt in range(1, txn.attempt + 1):
            for part in self.participants:
                mine = lane.get(part.name)
                if mine is None:
                    mine = lane[part.name] = pickle.loads(pickle.dumps(part))  # noqa: S301
                for partition in range(txn.partitions):
                    ref = BranchRef(txn.sink, txn.lineage, txn.batch_id, attempt,
                                    part.name, partition)
                    try:
                        if mine.status(ref) == BranchStatus.PREPARED:
                            mine.abort(ref, None)
                            swept += 1
                    except Exception as exc:  # the failure being raised says the rest
                        log.warning("sink %s batch %d: %s partition %d left as it is: %s",
                                    txn.sink, txn.batch_id, part.describe(), partition, exc)
        return swept

    def close(self) -> None:
        """Sweep once more for what other attempts of the last batch left open (a copy
        Spark was still killing when that batch's sweep ran: nothing sweeps after the
        last batch of a stopped query), then close every lane's participant copies and
        the threads."""
        last, self._last = self._last, None
        if last is not None:
            self.end_other_attempts(*last)
        if self._stop is not None:
            self._stop.set()
        if self._watch is not None:
            self._watch.join(5)
            self._watch = None
        for pool in (self._pool, self._pruner):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._pruner = None
        for lane in [*self._lanes, self._pruning]:
            for p in lane.values():
                p.close()
            lane.clear()

    def _apply_all(self, work: list[_Work], decision: Decision
                   ) -> tuple[dict[str, float], str]:
        """Apply ``decision`` to every branch of ``work``, one lane per thread. Returns
        the branch ids applied (with the seconds each took) and the first failure."""
        if not work:
            return {}, ""
        if self._watch is None or not self._watch.is_alive():
            self._stop = threading.Event()
            self._watch = threading.Thread(target=self._watch_slow, args=(self._stop,),
                                           daemon=True,
                                           name="twophase-commit-watch")
            self._watch.start()
        lanes = min(COMMIT_THREADS, len(work))
        chunks = [work[i::lanes] for i in range(lanes)]
        if lanes == 1:
            results = [self._apply_lane(0, chunks[0], decision)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMMIT_THREADS,
                                                thread_name_prefix="twophase-commit")
            results = list(self._pool.map(
                lambda i: self._apply_lane(i, chunks[i], decision), range(lanes)))
        done = {b: s for applied, _ in results for b, s in applied.items()}
        error = next((e for _, e in results if e), "")
        return done, error

    def _apply_lane(self, lane: int, items: list[_Work], decision: Decision
                    ) -> tuple[dict[str, float], str]:
        own = self._lanes[lane]
        done: dict[str, float] = {}
        error = ""
        for part, ref, handle in items:
            mine = own.get(part.name)
            if mine is None:  # a fresh copy: opens its own connection when first used
                mine = own[part.name] = pickle.loads(pickle.dumps(part))  # noqa: S301
            since = time.monotonic()
            self._running[threading.get_ident()] = (
                f"sink {ref.sink} batch {ref.batch_id}: {part.describe()} partition "
                f"{ref.partition}: {decision.value.lower()}", since)
            try:
                failpoints.hit("before_commit", part.name, ref.partition)
                if decision == Decision.COMMIT:
                    mine.commit(ref, handle)
                else:
                    mine.abort(ref, handle)
                failpoints.hit("after_commit", part.name, ref.partition)
            except Exception as exc:
                mine.close()  # its connection may be broken: the next use opens another
                cause = (f"{part.describe()} partition {ref.partition}: "
                         f"{decision.value.lower()} failed: {type(exc).__name__}: {exc}")
                log.warning("sink %s batch %d: %s; the batch is finished again", ref.sink,
                            ref.batch_id, cause)
                error = error or cause
                continue
            finally:
                self._running.pop(threading.get_ident(), None)
            done[ref.branch_id] = time.monotonic() - since
        return done, error

    def _watch_slow(self, stop: threading.Event) -> None:
        """Log every commit running longer than :attr:`slow_commit_s`, with where its
        thread waits, and again each as long until it ends (until ``stop``)."""
        every = self.slow_commit_s
        logged: dict[tuple[int, float], float] = {}
        while not stop.wait(min(5.0, every / 4)):
            now = time.monotonic()
            running = dict(self._running)
            logged = {k: v for k, v in logged.items() if running.get(k[0], ("", 0))[1] == k[1]}
            for ident, (what, since) in running.items():
                if now - since < every or now - logged.get((ident, since), since) < every:
                    continue
                logged[(ident, since)] = now
                log.warning("%s still running after %.0fs, waiting in %s", what,
                            now - since, _where(ident))


def _handles(txn: Transaction, redone: Mapping[str, Handle] | None) -> dict[str, Handle]:
    """Each branch's handle to commit (branch id -> handle): its vote's, or the one a
    finish's redo wrote in place of a lost branch."""
    return {bid: dict((redone or {}).get(bid) or st.handle or {})
            for bid, st in txn.branches.items()}


def _where(ident: int, depth: int = 3) -> str:
    """Thread ``ident``'s innermost ``depth`` frames of this package's code ("function
    (file:line)"), the stdlib's waits skipped."""
    frame = sys._current_frames().get(ident)
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        if f"{os.sep}twophase{os.sep}" in code.co_filename:
            out.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:"
                       f"{frame.f_lineno})")
        frame = frame.f_back
    return " < ".join(out) or "(thread gone)"
