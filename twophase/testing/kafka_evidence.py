"""What a failed Kafka crash test (or a ``twophase chaos`` run that kills the broker) leaves
to explain itself: the partition logs batch by
batch (producer id, epoch, base offset, branch tag, fate under Kafka's rule), the
coordinator's record of every attempt, and, for a tansu on S3, its stored transaction
state (``meta.json``) and record objects.

Why: a flaky "open transaction" cannot be reasoned about after the fact from a verdict
line; the log's producer ids and epochs, next to the votes' offsets and tansu's own
record of the transactional ids, say which producer left what and who should have
settled it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["evidence", "log_lines", "store_lines", "tansu_s3_lines"]


def _tag(batch: Any) -> str:
    tags = {k: v.decode(errors="replace") for k, v in batch.tag}
    if not tags:
        return "-"
    return f"b{tags.get('twophase.batch', '?')}/p{tags.get('twophase.partition', '?')}"


def _ids(values: Iterable[bytes | None]) -> str:
    ids = []
    for v in values:
        try:
            ids.append(int(json.loads(v or b"{}")["id"]))
        except (ValueError, KeyError, TypeError):
            ids.append(-1)
    return f"ids {min(ids)}..{max(ids)}" if ids else "no ids"


def log_lines(bootstrap: str, topic: str) -> list[str]:
    """Every batch of every partition with its fate under Kafka's rule (as
    ``twophase.sinks.kafka.log.replay`` decides it, batch by batch)."""
    from twophase.sinks.kafka.log import _leaders, fetch_partition

    leaders, cluster = _leaders({"bootstrap.servers": bootstrap}, topic, 30.0)
    out = [f"topic {topic} cluster {cluster}"]
    for pid in sorted(leaders):
        host, port = leaders[pid]
        hwm, batches = fetch_partition(host, port, topic, pid, timeout=30.0, settle_s=5.0)
        out.append(f"partition {pid} high watermark {hwm}, {len(batches)} batches")
        fate: dict[int, str] = {}
        pending: dict[int, list[int]] = {}
        for b in batches:
            if b.control:
                for off in pending.pop(b.producer_id, []):
                    fate[off] = f"{'COMMIT' if b.commit else 'ABORT'}@{b.offset}"
            elif b.transactional:
                pending.setdefault(b.producer_id, []).append(b.offset)
        for offs in pending.values():
            for off in offs:
                fate[off] = "OPEN"
        for b in batches:
            if b.control:
                out.append(f"  {b.offset:>5} pid {b.producer_id} ep {b.producer_epoch} "
                           f"{'COMMIT' if b.commit else 'ABORT'} marker")
            else:
                out.append(f"  {b.offset:>5}..{b.next_offset - 1:<5} pid {b.producer_id} ep "
                           f"{b.producer_epoch} {len(b.values)} rec {_tag(b)} "
                           f"{_ids(b.values)} -> {fate.get(b.offset, 'plain')}")
    return out


def store_lines(store_url: str, sink: str) -> list[str]:
    """Every attempt of ``sink`` in the coordinator, with branch votes, handles, acks and
    the event history."""
    from twophase.coordinator.store import Store

    store = Store(store_url, create=False)
    out = []
    try:
        for row in sorted(store.list(sink=sink, limit=1000),
                          key=lambda r: (r.txn.batch_id, r.txn.attempt)):
            t = row.txn
            out.append(f"batch {t.batch_id} attempt {t.attempt} {t.state.value} "
                       f"reason={t.reason!r}")
            for bid, st in sorted(t.branches.items()):
                h = dict(st.handle or {})
                out.append(f"  {bid}: vote={st.vote} ack={st.ack} offsets="
                           f"{h.get('offsets')} rows={h.get('rows')} "
                           f"already={h.get('already_committed')}")
            for ev in store.history(t.key):
                out.append(f"    event {json.dumps(ev, default=str)[:300]}")
    finally:
        store.close()
    return out


def tansu_s3_lines(client: Any, bucket: str, topic: str, sink: str) -> list[str]:
    """tansu's stored transactions of ``sink``'s transactional ids, its producers'
    sequences, and the topic's record objects with their ``last_modified``."""
    out = []
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        objects += page.get("Contents", [])
    for o in objects:
        key = o["Key"]
        if key.endswith("meta.json"):
            meta = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
            for tid, txn in meta.get("transactions", {}).items():
                if sink in tid:
                    out.append(f"meta {key}: txn {tid}: {json.dumps(txn)[:2000]}")
            pids = {str(t.get("producer")) for tid, t in meta.get("transactions", {}).items()
                    if sink in tid}
            for pid, pd in meta.get("producers", {}).items():
                if pid in pids:
                    out.append(f"meta producer {pid}: {json.dumps(pd)[:1000]}")
        elif f"/topics/{topic}/" in key:
            body = ""
            if key.endswith("watermark.json"):
                body = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
            out.append(f"obj {key.split('/topics/')[1]} {o['LastModified'].isoformat()} "
                       f"{o['Size']}B {body[:300]}")
        elif sink in key:  # the marker groups' committed offsets
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
            out.append(f"obj {key} {o['LastModified'].isoformat()} {body[:300]}")
    return out


def evidence(bootstrap: str, topic: str, store_url: str, sink: str,
             s3: tuple[Any, str] | None = None) -> str:
    """All of the above as one text, each part guarded (a dead broker still gives the
    rest)."""
    parts: list[str] = []
    readers: list[tuple[str, Callable[[], list[str]]]] = [
        ("log", lambda: log_lines(bootstrap, topic)),
        ("coordinator", lambda: store_lines(store_url, sink)),
        ("tansu S3", lambda: tansu_s3_lines(s3[0], s3[1], topic, sink) if s3 else []),
    ]
    for name, fn in readers:
        try:
            parts += [f"== {name}", *fn()]
        except Exception as exc:  # diagnostics must not hide the failure they explain
            parts.append(f"== {name}: cannot read: {type(exc).__name__}: {exc}")
    return "\n".join(parts)
