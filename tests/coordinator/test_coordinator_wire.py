"""One record layout (twophase.client.wire) for the store's branch rows, the service's
answers and documented schemas, and the client's request bodies."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import update

from twophase import protocol as p
from twophase.client import wire
from twophase.coordinator import models
from twophase.coordinator import schema as s
from twophase.coordinator.app import create_app
from twophase.coordinator.store import Store


def _old_encoding(branches: dict[str, p.BranchState]) -> str:
    """The store's branch encoder before it used wire's: null keys left out."""
    out: dict[str, dict[str, Any]] = {}
    for bid, b in branches.items():
        d: dict[str, Any] = {}
        if b.vote is not None:
            d["vote"] = b.vote.value
        if b.handle is not None:
            d["handle"] = dict(b.handle)
        if b.reason is not None:
            d["reason"] = b.reason
        if b.ack is not None:
            d["ack"] = b.ack.value
        out[bid] = d
    return json.dumps(out, separators=(",", ":"))


def test_store_reads_rows_written_by_the_old_branch_encoder(tmp_path: Path) -> None:
    st = Store(f"sqlite:///{tmp_path}/log.db")
    try:
        epoch = st.register("orders").epoch
        res = st.begin(p.Begin("orders", "L", 0, epoch, ("pg", "kafka"), 2, time.time()))
        assert res.txn is not None
        key = res.txn.key
        now = time.time()
        voted = st.apply(key, [p.Vote("pg/0", epoch, True, now, {"gid": "g0"}),
                               p.Vote("kafka/1", epoch, False, now, reason="broker down")])
        old = json.loads(_old_encoding(dict(voted.branches)))
        assert "null" not in json.dumps(old)  # the old layout really omits the empty keys
        with st.engine.begin() as conn:
            for bid, body in old.items():
                conn.execute(update(s.branches).where(s.branches.c.branch == bid)
                             .values(state=json.dumps(body)))
        st.rows._decoded.clear()  # read the rows, not the record kept decoded
        again = st.get(key)
        assert again == voted
        assert again is not None and again.branches["kafka/1"].handle is None
        assert again.branches["pg/0"].handle == {"gid": "g0"}
        # a change writes its branch's row back in wire's layout, and only that row
        acked = st.apply(key, [p.Ack("pg/0", epoch, p.Decision.ABORT, now)])
        with st.engine.connect() as conn:
            rows = conn.execute(s.branches.select().where(s.branches.c.sink == "orders")
                                .order_by(s.branches.c.idx)).all()
        stored = {r.branch: json.loads(r.state) for r in rows}
        assert [r.branch for r in rows] == list(acked.branches)
        assert stored["pg/0"] == wire.encode_branch(acked.branches["pg/0"])
        assert stored["kafka/1"] == old["kafka/1"]  # untouched: as it was written
        st.rows._decoded.clear()
        assert st.get(key) == acked
    finally:
        st.close()


def test_enum_names_match_the_protocol() -> None:
    assert get_args(wire.StateName) == tuple(x.value for x in p.State)
    assert get_args(wire.DecisionName) == tuple(x.value for x in p.Decision)
    assert get_args(wire.BeginKindName) == tuple(x.value for x in p.BeginKind)


def _txn() -> p.Transaction:
    return p.Transaction(
        sink="orders", lineage="L", batch_id=7, attempt=1, epoch=3, partitions=1,
        branches={"pg/0": p.BranchState(vote=p.Decision.COMMIT, handle={"gid": "g"}),
                  "kafka/0": p.BranchState()},
        deadline=100.0, created=1.0,
    )


def test_answers_match_their_documented_schema() -> None:
    t = _txn()
    out = wire.encode_txn(t)
    assert TypeAdapter(wire.TxnOut).validate_python(out) == out
    assert wire.decode_txn(json.loads(json.dumps(out))) == t
    sink = p.SinkRecord(name="orders", epoch=3, lineage="L", last_committed=6)
    res = p.BeginResult(kind=p.BeginKind.NEW, sink=sink, txn=t, recover=(), changed=(t,),
                        new_lineage=False)
    begun = wire.encode_begin(res)
    assert TypeAdapter(wire.BeginOut).validate_python(begun) == begun
    assert wire.decode_begin(json.loads(json.dumps(begun))) == res


def test_a_touched_answer_decodes_into_the_callers_copy() -> None:
    """``decode_touched``: the answer's branches over the copy's, in the copy's order; a
    branch the copy lacks, or a merge that is not coherent, asks for the whole record."""
    base = _txn()
    voted = dataclasses.replace(base, state=p.State.COMMITTING, branches={
        **base.branches, "kafka/0": p.BranchState(vote=p.Decision.COMMIT, handle={"t": "x"})})
    answer = wire.encode_txn(voted, only=["kafka/0"])
    merged = wire.decode_touched(json.loads(json.dumps(answer)), base)
    assert merged == voted and list(merged.branches) == ["pg/0", "kafka/0"]
    stranger = wire.encode_txn(dataclasses.replace(
        base, branches={"s3/0": p.BranchState()}), only=["s3/0"])
    assert wire.decode_touched(stranger, base) is None
    # acknowledged under no decision: no record the machine leaves, so not merged
    acked = dataclasses.replace(base, branches={
        **base.branches, "kafka/0": p.BranchState(ack=p.Decision.COMMIT)})
    assert wire.decode_touched(wire.encode_txn(acked, only=["kafka/0"]), base) is None


def test_openapi_response_schemas_are_wires(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path}/a.db", None, insecure=True, background=False)
    spec = app.openapi()
    schemas = spec["components"]["schemas"]
    assert set(schemas["TxnOut"]["properties"]) == set(wire.TxnOut.__annotations__)
    assert set(schemas["BranchOut"]["properties"]) == set(wire.BranchOut.__annotations__)
    assert set(schemas["BeginOut"]["properties"]) == set(wire.BeginOut.__annotations__)
    assert set(schemas["ErrorOut"]["properties"]) == {"error", "message"}
    votes = spec["paths"]["/v1/txns/{sink}/{lineage}/{checkpoint}/{attempt}/votes"]["post"]
    ok = votes["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/TxnOut"}


_BODIES: list[tuple[type[BaseModel], Any, Any]] = [
    (models.BeginIn, wire.BeginBody,
     wire.begin_body("L-1", 4, 2, ["pg", "kafka"], 3, 60)),
    (models.VotesIn, wire.VotesBody,
     wire.votes_body(2, [wire.VoteIn("pg/0", True, {"gid": "g"}),
                         wire.VoteIn("kafka/0", False, reason="full")])),
    (models.AcksIn, wire.AcksBody, wire.acks_body(2, [("pg/0", p.Decision.COMMIT)])),
    (models.AbandonIn, wire.AbandonBody, wire.abandon_body(2, "gave up")),
    (models.ForceAckIn, wire.ForceAckBody, wire.force_ack_body("pg/0", p.Decision.ABORT)),
    (models.AbortIn, wire.AbortBody, wire.abort_body("job gone")),
]


@pytest.mark.parametrize(("model", "typed", "body"), _BODIES,
                         ids=[m.__name__ for m, _, _ in _BODIES])
def test_client_bodies_pass_the_services_strict_models(
    model: type[BaseModel], typed: Any, body: Any
) -> None:
    assert set(model.model_fields) == set(typed.__annotations__)
    sent = json.loads(json.dumps(body))  # what goes over the wire
    assert model.model_validate(sent).model_dump(exclude_unset=True) == sent
    item = {models.VotesIn: (models.VoteItem, wire.VoteBody),
            models.AcksIn: (models.AckItem, wire.AckBody)}.get(model)
    if item is not None:
        assert set(item[0].model_fields) == set(item[1].__annotations__)


def test_a_bad_outcome_fails_before_sending() -> None:
    with pytest.raises(ValueError, match="MAYBE"):
        wire.acks_body(1, [("pg/0", "MAYBE")])  # type: ignore[list-item]

