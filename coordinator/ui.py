"""The operators' console at ``/ui``: server-rendered HTML and a little JavaScript.

``/ui`` is a shell with no data in it (open, like ``/healthz``): it says how to sign in
and keeps the bearer token in the tab's ``sessionStorage`` (``/ui#token=...`` signs in
directly; the fragment never reaches a server or a log). Every two seconds the script
fetches ``/ui/view`` with the token, an HTML fragment rendered here from the store: the
sinks and their health, the open (undecided and in-doubt) transactions with the recovery
rule's proposed action per branch, and a timeline of recent batches with their phases.
Buttons call the same admin API as ``twophase force`` and ``twophase resolve``, with the
token; the page holds no state the coordinator does not. No CDN, no build step.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse

from twophase import protocol as p
from twophase.coordinator.metrics import Metrics
from twophase.coordinator.store import Store
from twophase.coordinator.targets import TargetState
from twophase.errors import TransactionNotFound
from twophase.names import NAME_PATTERN
from twophase.protocol import BranchStatus, Decision, TxnKey, recovery_action

__all__ = ["StoreDecisions", "ui_routes"]

REFRESH_MS: Final = 2000


class StoreDecisions:
    """:class:`twophase.engine.resolve.Decisions` over the service's own store (the console's
    resolve runs in the service, with no HTTP round trip to itself)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def list(
        self, sink: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[p.Transaction]:
        return [r.txn for r in self.store.list(sink=sink, state=state, limit=limit)]

    def get(self, key: TxnKey) -> p.Transaction:
        txn = self.store.get(key)
        if txn is None:
            raise TransactionNotFound.for_key(key)
        return txn

    def admin_abort(self, key: TxnKey, reason: str) -> p.Transaction:
        return self.store.apply(key, [p.AdminAbort(reason=reason, now=self.store.clock())])

    def force_ack(
        self, key: TxnKey, branch: str, outcome: Decision, reason: str | None = None
    ) -> p.Transaction:
        return self.store.force(key, branch, outcome, reason)


def ui_routes(store: Store, metrics: Metrics) -> APIRouter:
    r = APIRouter(tags=["console"])

    @r.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    def shell() -> HTMLResponse:
        """The console's page: sign-in help and the script (no data; no token needed)."""
        return HTMLResponse(_SHELL, headers=_NO_STORE)

    @r.get("/ui/view", response_class=HTMLResponse)
    def view(
        sink: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 40,
    ) -> HTMLResponse:
        """The console's content as an HTML fragment (token needed)."""
        now = store.clock()
        sinks = [s for s in store.sinks_overview(now) if sink is None or s["name"] == sink]
        open_ = sorted(
            (r.txn for st in _OPEN for r in store.list(sink=sink, state=st, limit=200)),
            key=lambda t: (t.created, t.attempt), reverse=True,
        )
        recent = [r.txn for r in store.list(sink=sink, limit=limit)]
        body = (
            _sinks_html(sinks)
            + _targets_html([t for t in (metrics.targets.states() if metrics.targets else [])
                             if sink is None or t.sink == sink], now)
            + _open_html(open_, now)
            + _timeline_html(recent, metrics, now)
            + f'<p class="muted">rendered {html.escape(_clock(now))} UTC</p>'
        )
        return HTMLResponse(body, headers=_NO_STORE)

    return r


_NO_STORE: Final = {"Cache-Control": "no-store"}
_OPEN: Final = tuple(st.value for st in p.State if not st.finished)


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def _dur(secs: float | None) -> str:
    if secs is None:
        return "-"
    secs = max(0.0, secs)
    if secs < 1:
        return f"{secs * 1000:.0f} ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.1f} {unit}"
    return f"{secs:.1f} s"


def _txn_path(key: TxnKey) -> str:
    return f"/v1/admin/txns/{key.sink}/{key.lineage}/{key.batch_id}/{key.attempt}"


def _txn_label(key: TxnKey) -> str:
    return f"{key.sink} · batch {key.batch_id} · attempt {key.attempt}"


def _sinks_html(sinks: Sequence[dict[str, Any]]) -> str:
    rows = []
    for s in sinks:
        if s["alerts"]:
            health, cls = "ALERT", "bad"
        elif s["in_doubt"]:
            health, cls = "in doubt", "warn"
        else:
            health, cls = "ok", "ok"
        name = _e(s["name"])
        rows.append(
            f'<tr data-sink="{name}"><td>{name}</td><td class="{cls}">{health}</td>'
            f'<td>{_e(s["last_committed"] if s["last_committed"] is not None else "-")}</td>'
            f'<td>{s["epoch"]}</td><td>{s["undecided"]}</td><td>{s["in_doubt"]}</td>'
            f'<td>{_dur(s["oldest_in_doubt_age"])}</td><td>{s["alerts"]}</td>'
            f'<td>{_e(", ".join(s["participants"]) or "(none recorded)")}</td>'
            f'<td><button data-act="resolve" data-sink="{name}" data-dry="1">dry run</button> '
            f'<button data-act="resolve" data-sink="{name}">resolve</button></td></tr>'
        )
    if not rows:
        return '<h2>Sinks</h2><p class="muted">no sink has registered yet</p>'
    return (
        "<h2>Sinks</h2><table id=sinks><tr><th>sink</th><th>health</th>"
        "<th>last committed</th><th>epoch</th><th>undecided</th><th>in doubt</th>"
        "<th>oldest in doubt</th><th>alerts</th><th>participants</th><th></th></tr>"
        + "".join(rows) + "</table>"
    )


def _targets_html(states: Sequence[TargetState], now: float) -> str:
    """What the sinks' targets hold open (the target watch's last ask): a Kafka
    transaction a crash left open stalls read_committed readers; resolve aborts it."""
    if not states:
        return ""
    rows = []
    for t in states:
        if t.backlog is None:
            what, cls = f"cannot ask: {_e(t.error)}", "warn"
        else:
            b = t.backlog
            lag = sum(b.unstable.values())
            cls = "bad" if b.open_transactions else "ok"
            where = ", ".join(f"{k}: {v}" for k, v in b.unstable.items() if v)
            what = (f"{b.open_transactions} open transaction(s), oldest "
                    f"{_dur(b.oldest_open_age_s)}; {lag} record(s) past the last stable "
                    "offset" + (f" ({_e(where)})" if lag else ""))
        rows.append(f'<tr data-target="{_e(t.sink)}/{_e(t.participant)}"><td>{_e(t.sink)}</td>'
                    f'<td>{_e(t.participant)}</td><td class="{cls}">{what}</td>'
                    f'<td>{_dur(max(0.0, now - t.at))} ago</td></tr>')
    return ("<h2>Open on the targets</h2><table id=targets><tr><th>sink</th>"
            "<th>participant</th><th>held open</th><th>asked</th></tr>"
            + "".join(rows) + "</table>")


def _proposal(txn: p.Transaction, bid: str, b: p.BranchState) -> str:
    """The recovery rule's action for one branch, as far as the coordinator can tell
    (the participant's own status decides: resolve asks it)."""
    if b.ack is not None:
        return f"settled ({b.ack.value})"
    decision = txn.decision
    if b.vote is None:
        if decision is None:
            return "abort (presumed): nothing prepared was reported; resolve finds leftovers"
        return "nothing was prepared (no vote); resolve finds leftovers by name"
    if b.vote == Decision.ABORT:
        return "nothing (voted NO); ack ABORT"
    prepared = recovery_action(txn.effective_decision, BranchStatus.PREPARED).value
    if decision == Decision.COMMIT:
        return f"{prepared} if prepared, redo if lost; then ack COMMIT"
    return f"{prepared} if prepared; then ack ABORT"


def _open_html(txns: Sequence[p.Transaction], now: float) -> str:
    if not txns:
        return '<h2>In doubt</h2><p class="muted" id=no-open>no open transaction</p>'
    out = ["<h2>In doubt</h2><table id=open><tr><th>transaction</th><th>state</th>"
           "<th>age</th><th>branch</th><th>vote</th><th>ack</th>"
           "<th>proposed action (recovery rule)</th><th></th></tr>"]
    for t in txns:
        key = t.key
        pending = [bid for bid, b in sorted(t.branches.items()) if b.ack is None]
        if t.decision is None:
            left = t.deadline - now
            when = f"deadline in {_dur(left)}" if left > 0 else "deadline passed"
            button = (f'<button data-act="abort" data-path="{_e(_txn_path(key))}" '
                      f'data-label="{_e(_txn_label(key))}">abort</button>')
        else:
            when = f"decided {_dur(now - (t.decided_at or now))} ago"
            button = (f'<button data-act="force" data-path="{_e(_txn_path(key))}" '
                      f'data-outcome="{t.decision.value}" data-branches="{_e(",".join(pending))}" '
                      f'data-label="{_e(_txn_label(key))}">force ack {t.decision.value}</button>')
        branches = sorted(t.branches.items())
        span = max(1, len(branches))
        state_cls = "warn" if t.decision is not None else "muted"
        for i, (bid, b) in enumerate(branches):
            head = ""
            if i == 0:
                head = (f'<td rowspan="{span}" class="txn">{_e(_txn_label(key))}<br>'
                        f'<span class="muted">{_e(key.lineage)}</span></td>'
                        f'<td rowspan="{span}" class="{state_cls}">{t.state.value}<br>'
                        f'<span class="muted">{_e(when)}</span></td>'
                        f'<td rowspan="{span}">{_dur(now - t.created)}</td>')
            tail = f'<td rowspan="{span}">{button}</td>' if i == 0 else ""
            out.append(
                f'<tr data-txn="{_e(_txn_path(key))}">{head}<td>{_e(bid)}</td>'
                f'<td>{b.vote.value if b.vote else "-"}</td>'
                f'<td>{b.ack.value if b.ack else "-"}</td>'
                f"<td>{_e(_proposal(t, bid, b))}</td>{tail}</tr>"
            )
    out.append("</table>")
    return "".join(out)


def _timeline_html(txns: Sequence[p.Transaction], metrics: Metrics, now: float) -> str:
    if not txns:
        return '<h2>Recent batches</h2><p class="muted">none yet</p>'
    spans = []
    for t in txns:
        vote = (t.decided_at - t.created) if t.decided_at is not None else None
        ack = (t.finished_at - t.decided_at) if t.finished_at and t.decided_at else None
        spans.append((t, vote, ack))
    longest = max([(v or 0) + (a or 0) for _, v, a in spans] + [1e-3])
    out = ['<h2>Recent batches</h2><table id=timeline><tr><th>batch</th><th>started</th>'
           "<th>outcome</th><th>vote phase</th><th>ack phase</th><th>phases</th>"
           "<th>rows</th><th>slowest prepare / vote wait / commit</th></tr>"]
    for t, vote, ack in spans:
        m = metrics.recent(t.key)
        outcome = t.state.value if t.state.finished else f"{t.state.value} (open)"
        cls = {"COMMITTED": "ok", "ABORTED": "bad"}.get(t.state.value, "warn")
        bar_v = 100 * (vote or 0) / longest
        bar_a = 100 * (ack or 0) / longest
        exec_ = " / ".join(_dur(m.get(k)) for k in ("prepare_s", "wait_s", "commit_s"))
        out.append(
            f"<tr><td>{_e(_txn_label(t.key))}</td><td>{_clock(t.created)}</td>"
            f'<td class="{cls}" title="{_e(t.reason or "")}">{outcome}</td>'
            f"<td>{_dur(vote)}</td><td>{_dur(ack)}</td>"
            f'<td class="bars"><span class="bv" style="width:{bar_v:.1f}%"></span>'
            f'<span class="ba" style="width:{bar_a:.1f}%"></span></td>'
            f'<td>{int(m["rows"]) if "rows" in m else "-"}</td>'
            f"<td>{exec_ if m else '-'}</td></tr>"
        )
    out.append("</table><p class=muted>vote phase: begin to decision; ack phase: decision "
               "to the last acknowledgement; executor figures as sent with votes and acks "
               "to this coordinator process.</p>")
    return "".join(out)


_SHELL: Final = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>twophase console</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;
padding:.25em .5em;text-align:left;vertical-align:top}th{background:#f4f4f4}
.ok{color:#17702f}.warn{color:#9a6100;font-weight:600}.bad{color:#b00020;font-weight:600}
.muted{color:#777}.bars{width:20%}.bars span{display:inline-block;height:.8em}
.bv{background:#4a7bd0}.ba{background:#e0a030}#msg{min-height:1.4em;font-weight:600}
#signin{max-width:46em;padding:1em;border:1px solid #ccc;background:#fafafa}
header{display:flex;gap:1em;align-items:baseline;flex-wrap:wrap}
code{background:#f0f0f0;padding:0 .2em}button{cursor:pointer}
</style></head><body>
<header><h1>twophase console</h1><span id="status" class="muted"></span>
<span id="who"></span></header>
<div id="signin" hidden>
<h2>Sign in</h2>
<p>Every read and every action of this console needs an <b>operator</b> token: an
<code>operator</code> line of the daemon's <code>--token-file</code>, or its
<code>--token</code> (<code>TWOPHASE_TOKEN</code>); the jobs' data token is refused here.
An embedded coordinator (a <code>sqlite:///</code> or <code>postgresql://</code> store in
the Spark driver) makes a random one: <code>twophase demo</code> prints this page's address
with it (<code>/ui#token=...</code>), and <code>TransactionalSink.console_url</code> gives
it.</p>
<p>The token stays in this browser tab (session storage) and is sent only as
<code>Authorization: Bearer</code> to this coordinator.</p>
<form id="signin-form"><input id="token" type="password" size="40"
autocomplete="off" placeholder="bearer token"> <button type="submit">sign in</button></form>
<p id="signin-error" class="bad"></p>
</div>
<div id="main" hidden>
<p>Reason for actions: <input id="reason" size="50"
placeholder="why (kept in the transaction's history)"></p>
<div id="msg"></div>
<div id="view"></div>
</div>
<script>
"use strict";
const KEY = "twophase-token";
const $ = (id) => document.getElementById(id);
if (location.hash.startsWith("#token=")) {
  sessionStorage.setItem(KEY, decodeURIComponent(location.hash.slice(7)));
  history.replaceState(null, "", location.pathname + location.search);
}
const token = () => sessionStorage.getItem(KEY);
function signin(why) {
  $("main").hidden = true; $("signin").hidden = false;
  $("signin-error").textContent = why || ""; $("who").textContent = "";
}
function say(text, bad) { $("msg").textContent = text; $("msg").className = bad ? "bad" : "ok"; }
async function call(method, path, body) {
  const r = await fetch(path, {method, headers: {"Authorization": "Bearer " + token(),
    "Content-Type": "application/json"}, body: body ? JSON.stringify(body) : undefined});
  if (r.status === 401 || r.status === 403) {
    const e = await r.clone().json().catch(() => ({}));
    sessionStorage.removeItem(KEY);
    signin((r.status === 403 ? "this token may not use the console (an operator token is " +
      "needed): " : "the token was refused: ") + (e.message || ("HTTP " + r.status)));
  }
  return r;
}
async function refresh() {
  if (!token()) { signin(""); return; }
  try {
    const r = await call("GET", "/ui/view" + location.search);
    if (r.status === 401 || r.status === 403) return;
    if (!r.ok) { $("status").textContent = "refresh failed: HTTP " + r.status; return; }
    $("view").innerHTML = await r.text();
    $("signin").hidden = true; $("main").hidden = false;
    $("who").innerHTML = '<button id="signout">sign out</button>';
    $("status").textContent = "live, updated " + new Date().toLocaleTimeString();
  } catch (e) { $("status").textContent = "coordinator unreachable: " + e; }
}
$("signin-form").addEventListener("submit", (ev) => {
  ev.preventDefault(); sessionStorage.setItem(KEY, $("token").value.trim());
  $("token").value = ""; refresh();
});
document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button");
  if (!b) return;
  if (b.id === "signout") { sessionStorage.removeItem(KEY); signin("signed out"); return; }
  const act = b.dataset.act;
  if (!act) return;
  const reason = $("reason").value.trim();
  const dry = act === "resolve" && b.dataset.dry === "1";
  if (!reason && !dry) { say("give a reason first (it is kept in the history)", true); return; }
  let what;
  if (act === "force") what = "force-ack " + b.dataset.outcome + " for every unacknowledged " +
    "branch of " + b.dataset.label + "? Only when you settled those branches yourself.";
  else if (act === "abort") what = "write ABORT for " + b.dataset.label + "?";
  else if (!dry) what = "resolve sink " + b.dataset.sink + " now (commit/abort its leftovers " +
    "by the recovery rule)?";
  if (what && !confirm(what)) return;
  b.disabled = true;
  try {
    let r, text;
    if (act === "force") {
      for (const branch of b.dataset.branches.split(",").filter(Boolean)) {
        r = await call("POST", b.dataset.path + "/force-ack",
                       {branch, outcome: b.dataset.outcome, reason});
        if (!r.ok) break;
      }
      text = "forced " + b.dataset.label;
    } else if (act === "abort") {
      r = await call("POST", b.dataset.path + "/abort", {reason});
      text = "aborted " + b.dataset.label;
    } else {
      r = await call("POST", "/v1/admin/sinks/" + b.dataset.sink + "/resolve", {dry_run: dry});
      if (r && r.ok) {
        const rep = await r.json();
        text = (dry ? "would do: " : "did: ") + (rep.actions.map((a) => a.action + " " +
          a.txn + " " + a.branch).join("; ") || "nothing") +
          (rep.unresolved.length ? "; UNRESOLVED: " + rep.unresolved.map((a) => a.action +
          " " + a.txn + " " + a.branch).join("; ") : "");
      }
    }
    if (r && !r.ok) { const e = await r.json().catch(() => ({})); say("refused: " +
      (e.message || ("HTTP " + r.status)), true); }
    else if (r) say(text, false);
  } finally { b.disabled = false; refresh(); }
});
refresh();
setInterval(refresh, REFRESH_MS);
</script></body></html>
""".replace("REFRESH_MS", str(REFRESH_MS))
