"""The exactly-once verifier: what landed in each system, compared with what should have.

Given a sink's participants, the id column and the expected ids, it reads every system
through the participant contract (:meth:`~twophase.participant.Verifiable.read_back`:
PostgreSQL table, files through pyarrow, Kafka rebuilt from its partition logs with
Kafka's transaction rule and cross-checked with a ``read_committed`` consumer) and
reports per system: duplicates, missing ids, unexpected ids, leftovers still prepared
(``pg_prepared_xacts``, staged files, open Kafka branches known to this process), open
Kafka transactions, aborted rows (reported), disagreements between two readers, and a
table's commits beyond one per batch. Used
by the tests, ``twophase demo`` and ``twophase chaos``. It knows no system: a new
participant is verified by implementing ``read_back``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from twophase.participant import Participant, ReadBack, read_back_of

__all__ = ["SystemReport", "VerifyReport", "read_ids", "verify"]


@dataclass
class SystemReport:
    participant: str
    kind: str
    rows: int
    duplicates: int  # rows beyond the first for an id
    missing: int
    unexpected: int
    prepared_leftovers: int
    examples: dict[str, list[Any]] = field(default_factory=dict)
    exact: bool = True  # False when the reader cannot judge exactly-once
    note: str = ""
    aborted: int = 0  # rows discarded by an abort (expected after kills; reported)
    open_transactions: int = 0  # Kafka transactions left open at the end of the log
    mismatch: int = 0  # rows on which a second reader disagrees (Kafka read_committed)
    # Litter of a prepare killed mid-write (files: temp files in the staging folder): never
    # visible to readers and never prepared (the staged name did not appear), so it does not
    # break exactly-once; reported so it is seen.
    temp_leftovers: int = 0
    commits: int | None = None  # table commits twophase made (Iceberg snapshots, Delta versions)
    extra_commits: int = 0  # commits of a batch beyond its first: one per batch is the rule

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected or self.prepared_leftovers
                    or self.open_transactions or self.mismatch or self.extra_commits)


@dataclass
class VerifyReport:
    expected: int
    systems: list[SystemReport]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.systems if s.exact)

    def to_json(self) -> str:
        data = {
            "expected": self.expected,
            "ok": self.ok,
            "systems": [asdict(s) | {"ok": s.ok} for s in self.systems],
        }
        return json.dumps(data, indent=2, default=str)

    def lines(self) -> list[str]:
        out = [f"expected ids: {self.expected}"]
        for s in self.systems:
            verdict = "OK" if s.ok else "FAIL"
            if not s.exact:
                verdict += " (not judged: " + s.note + ")"
            out.append(
                f"  {s.participant:<24} rows={s.rows:<8} duplicates={s.duplicates:<5} "
                f"missing={s.missing:<5} unexpected={s.unexpected:<5} "
                f"prepared_leftovers={s.prepared_leftovers:<3} {verdict}"
            )
            if s.kind == "kafka" or s.aborted or s.open_transactions or s.mismatch:
                out.append(f"  {'':<24} aborted={s.aborted} open_transactions="
                           f"{s.open_transactions} mismatch={s.mismatch} ({s.note})")
            if s.commits is not None or s.extra_commits:
                out.append(f"  {'':<24} table commits={s.commits} extra_commits="
                           f"{s.extra_commits} (one commit per batch is the rule)")
            if s.temp_leftovers:
                out.append(f"  {'':<24} + {s.temp_leftovers} temp file(s) of a prepare killed "
                           "mid-write (never visible, not prepared)")
        return out


def read_ids(p: Participant, column: str) -> tuple[list[Any], int]:
    """The id column as a consumer sees it, and the count of prepared leftovers."""
    back = read_back_of(p, column)
    return list(back.values), back.prepared


def verify(
    participants: Sequence[Participant],
    expected: Iterable[Any],
    *,
    column: str = "id",
    sink: str | None = None,
    backs: Mapping[str, ReadBack] | None = None,
) -> VerifyReport:
    """Compare every participant's committed ids with ``expected``.

    ``sink`` adds the participant's own ``in_doubt(sink)`` leftovers. ``backs``: read-backs
    the caller already made, by participant name (e.g. Kafka judged with the suite's
    tansu's transaction state after a broker crash), used instead of ``read_back``.
    """
    want = Counter(expected)
    systems: list[SystemReport] = []
    for p in participants:
        back = backs[p.name] if backs and p.name in backs else read_back_of(p, column)
        ids, leftovers = back.values, back.prepared
        if sink is not None:
            leftovers = max(leftovers, len(p.in_doubt(sink)))
        got = Counter(ids)
        dups = sorted(k for k, n in got.items() if n > 1)
        missing = sorted(k for k in want if k not in got)
        unexpected = sorted(k for k in got if k not in want)
        systems.append(
            SystemReport(
                participant=p.name,
                kind=p.kind,
                rows=sum(got.values()),
                duplicates=sum(n - 1 for n in got.values() if n > 1),
                missing=len(missing),
                unexpected=len(unexpected),
                prepared_leftovers=leftovers,
                examples={"duplicates": dups[:5], "missing": missing[:5],
                          "unexpected": unexpected[:5]},
                exact=back.exact,
                note=back.note,
                aborted=back.aborted,
                open_transactions=back.open,
                mismatch=back.mismatch,
                temp_leftovers=back.temp,
                commits=back.commits,
                extra_commits=back.extra_commits,
            )
        )
    return VerifyReport(expected=len(want), systems=systems)
