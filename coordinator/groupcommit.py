"""Group commit: many concurrent write requests, one database transaction, one fsync.

A request is a plain *job*: a callable run inside a write transaction. One writer thread
takes every job queued meanwhile and runs them in one transaction, each in its own
SAVEPOINT, so a job that raises undoes only its own writes and gets its own error. After
the one commit, the ``after_commit`` hook runs for each job (the store wakes long-polls
there) and only then is the job answered: nobody hears of a change before it is durable.

A job that lost a compare-and-set (:class:`~twophase.coordinator.db.Conflict`), broke a
unique constraint (a concurrent insert) or hit a transient error is run again on its own,
with backoff, as is every job of a group whose commit failed. ``grouped=False`` runs each
job in its own transaction (the classic retry loop) instead.

This module knows nothing of the protocol: results and hook are opaque to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import anyio.to_thread
from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError, OperationalError

from twophase.coordinator.db import Conflict, Database, run, transient
from twophase.errors import StoreError

__all__ = ["GroupCommitWriter", "GroupStats", "Job"]

log = logging.getLogger("twophase.coordinator.groupcommit")

R = TypeVar("R")

MAX_RETRIES: Final = 50


@dataclass(eq=False)
class Job:
    """One request waiting for the writer thread."""

    fn: Callable[[Connection], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    retry: bool = False  # a CAS conflict or a failed group commit: run again on its own
    notify: Callable[[], None] | None = None  # wakes an event-loop caller


@dataclass
class GroupStats:
    """How well group commit is batching (for the benchmark and tests)."""

    groups: int = 0
    jobs: int = 0
    largest: int = 0


class GroupCommitWriter:
    """Runs jobs against ``db``; one writer thread, started on the first grouped job."""

    def __init__(
        self,
        db: Database,
        *,
        after_commit: Callable[[Any], None] | None = None,
        grouped: bool = True,
        max_group: int = 512,
    ) -> None:
        self.db = db
        self.after_commit = after_commit
        self.grouped = grouped
        self.max_group = max_group
        self.stats = GroupStats()
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self._thread_start = threading.Lock()

    # ----------------------------------------------------------------- callers

    def write(self, fn: Callable[[Connection], R]) -> R:
        """Run ``fn`` in a write transaction; return its result once durable."""
        if self.grouped:
            job = Job(fn)
            self.enqueue(job)
            job.done.wait()
            if job.error is not None:
                raise job.error
            if not job.retry:
                return job.result  # type: ignore[no-any-return]
        return self._write_alone(fn)

    async def write_async(self, fn: Callable[[Connection], R]) -> R:
        """:meth:`write` for an event loop: a grouped job is awaited without holding a
        worker thread (the HTTP hot path); anything else runs in a worker thread."""
        if not self.grouped:
            return await anyio.to_thread.run_sync(self.write, fn)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, fut)

        job = Job(fn, notify=wake)
        self.enqueue(job)
        await fut
        if job.error is not None:
            raise job.error
        if not job.retry:
            return job.result  # type: ignore[no-any-return]
        return await anyio.to_thread.run_sync(self._write_alone, fn)

    def enqueue(self, job: Job) -> None:
        if self.thread is None:
            with self._thread_start:
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self._loop, name="twophase-store-writer", daemon=True
                    )
                    self.thread.start()
        self.queue.put(job)

    def close(self) -> None:
        """Stop the writer thread once it has answered every queued job."""
        with self._thread_start:
            thread, self.thread = self.thread, None
        if thread is not None:
            self.queue.put(None)
            thread.join(timeout=30)

    # ----------------------------------------------------------------- the writer thread

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_group:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                batch.append(nxt)
            try:
                self._run_group(batch)
                for job in batch:  # durable now: run the hook, then answer
                    if job.error is None and not job.retry:
                        try:
                            self._after_commit(job.result)
                        except BaseException as exc:  # e.g. a failpoint: that request only
                            job.error = exc
            finally:
                for job in batch:
                    job.done.set()
                    if job.notify is not None:
                        job.notify()

    def _run_group(self, batch: Sequence[Job]) -> None:
        """Each job in its own SAVEPOINT of one transaction; a failing job undoes only itself."""
        try:
            with self.db.write() as conn:
                for job in batch:
                    run(conn, "SAVEPOINT twophase_job", ())
                    try:
                        job.result = job.fn(conn)
                    except BaseException as exc:
                        run(conn, "ROLLBACK TO twophase_job", ())
                        if _retryable(exc):
                            job.retry = True
                        else:
                            job.error = exc  # handed to that request alone
                    run(conn, "RELEASE twophase_job", ())
        except Exception:  # BEGIN or COMMIT failed: nothing of the group is durable
            log.warning("group commit failed; retrying its requests one by one",
                        exc_info=True)
            for job in batch:
                job.result, job.error, job.retry = None, None, True
            return
        st = self.stats
        st.groups += 1
        st.jobs += len(batch)
        st.largest = max(st.largest, len(batch))

    # ----------------------------------------------------------------- one job alone

    def _write_alone(self, fn: Callable[[Connection], R]) -> R:
        """Run ``fn`` in its own write transaction; retry on a lost race or a transient
        error; then the hook, in the caller's thread."""
        for attempt in range(MAX_RETRIES):
            try:
                with self.db.write() as conn:
                    result = fn(conn)
                break
            except (Conflict, IntegrityError) as exc:
                if attempt == MAX_RETRIES - 1:
                    raise StoreError(f"gave up after {MAX_RETRIES} conflicting writes") from exc
                time.sleep(min(0.001 * 2**attempt, 0.05))
            except OperationalError as exc:
                # a dropped connection or a deadlock: the transaction did not commit
                if attempt == MAX_RETRIES - 1 or not transient(exc):
                    raise
                time.sleep(min(0.01 * 2**attempt, 0.5))
        self._after_commit(result)
        return result

    def _after_commit(self, result: Any) -> None:
        if self.after_commit is not None:
            self.after_commit(result)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, (Conflict, IntegrityError)) or (
        isinstance(exc, OperationalError) and transient(exc)
    )


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
