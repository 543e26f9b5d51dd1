"""The console in a real browser: Debian's headless Chromium driven by Playwright.

A stuck batch (decided COMMIT, its writer gone before any acknowledgement) is on the
page after signing in; the operator gives a reason, forces it through the page and
confirms; the coordinator's own record shows it COMMITTED with the reason in the
history. Without the token, or with the jobs' data token, the page shows how to sign
in (and why it refused) and nothing else. Needs
``apt-get install chromium`` and ``pip install playwright`` (scripts/test.sh does both;
Playwright's own browser download is not used).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.coordinator.embedded import EmbeddedServer
from twophase.protocol import State, TxnKey

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SINK, LINEAGE = "orders", "L-browser"
KEY = TxnKey(SINK, LINEAGE, 7, 1)
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(f"sqlite:///{tmp_path / 'c.db'}", token="console-token") as srv:
        yield srv


@pytest.fixture
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _stuck(server: EmbeddedServer) -> None:
    with CoordinatorClient(server.url, server.token) as client:
        epoch = client.register(SINK, [
            {"kind": "files", "name": "lake", "target": "/data/lake",
             "options": {"path": "/data/lake", "format": "parquet"}},
            {"kind": "postgres", "name": "pg", "target": "public.orders",
             "options": {"dsn": "host=db", "schema": "public", "table": "orders"}},
        ])
        for batch in range(KEY.batch_id):  # some history for the timeline
            client.begin(SINK, LINEAGE, batch, epoch, ["lake", "pg"], 1, 60)
            key = TxnKey(SINK, LINEAGE, batch, 1)
            client.vote(key, epoch, [VoteIn("lake/0", True, {}), VoteIn("pg/0", True, {})])
            client.force_ack(key, "lake/0", client.get(key).effective_decision, "setup")
            client.force_ack(key, "pg/0", client.get(key).effective_decision, "setup")
        client.begin(SINK, LINEAGE, KEY.batch_id, epoch, ["lake", "pg"], 2, 60)
        client.vote(KEY, epoch, [VoteIn(f"{p}/{n}", True, {"gid": f"g{n}"})
                                 for p in ("lake", "pg") for n in (0, 1)])
        assert client.get(KEY).state == State.COMMITTING


def test_force_a_stuck_batch_through_the_page(server: EmbeddedServer, browser: object) -> None:
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    _stuck(server)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(server.url + "/ui")
        # no token: the sign-in help, and no data
        expect(page.locator("#signin")).to_be_visible()
        expect(page.locator("#signin")).to_contain_text("--token")
        assert LINEAGE not in page.content()
        page.fill("#token", "not-the-token")
        page.click("#signin-form button")
        expect(page.locator("#signin-error")).to_contain_text("refused")
        # the jobs' data token may not use the console: the reason is on the form
        page.fill("#token", server.data_token)
        page.click("#signin-form button")
        expect(page.locator("#signin-error")).to_contain_text(
            "an operator token is needed")
        expect(page.locator("#signin-error")).to_contain_text("this is a data token")
        assert LINEAGE not in page.content()

        page.fill("#token", server.token)
        page.click("#signin-form button")
        row = page.locator(f'#open tr[data-txn="/v1/admin/txns/{SINK}/{LINEAGE}/7/1"]')
        expect(row.first).to_contain_text("COMMITTING")
        expect(row.first).to_contain_text("commit if prepared")
        expect(page.locator("#sinks")).to_contain_text("in doubt")
        expect(page.locator("#timeline")).to_contain_text("batch 6")

        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / "console-stuck.png"), full_page=True)
        # an action without a reason is refused by the page itself
        page.click("#open button[data-act=force]")
        expect(page.locator("#msg")).to_contain_text("give a reason")
        page.fill("#reason", "branches committed by hand after the job died")
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
        page.click("#open button[data-act=force]")
        expect(page.locator("#msg")).to_contain_text("forced")
        expect(page.locator("#no-open")).to_be_visible()  # live refresh: nothing open
        expect(page.locator("#sinks")).to_contain_text("ok")
        assert dialogs and "force-ack COMMIT" in dialogs[0]
        page.screenshot(path=str(SHOTS / "console-after-force.png"), full_page=True)
    finally:
        page.close()

    with CoordinatorClient(server.url, server.token) as client:
        txn = client.get(KEY)
        history = client.get_raw(KEY, history=True)["history"]
    assert txn.state == State.COMMITTED
    reasons = {h["detail"]["reason"] for h in history if h["kind"] == "force_ack"}
    assert reasons == {"branches committed by hand after the job died"}


def test_the_token_in_the_address_signs_in(server: EmbeddedServer, browser: object) -> None:
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    _stuck(server)
    page = browser.new_page()
    try:
        page.goto(f"{server.url}/ui#token={server.token}")
        expect(page.locator("#open")).to_contain_text("COMMITTING")
        assert "token" not in page.url  # taken out of the address bar at once
    finally:
        page.close()
