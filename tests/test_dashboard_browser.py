"""The dashboard in a real browser: Debian's chromium driven by Playwright,
against ``belay dashboard`` running as a subprocess on a free loopback port.

Live updates (a job enqueued after the page loaded appears, a state change
shows, without a reload), the job view (journal, events, the DAG as SVG),
XSS payloads that never run (no dialog, no stray element, the text shown
literally, no CSP violation), and the token flow that cancels a job.

Skipped when /usr/bin/chromium is missing, unless CI is set: then it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import belay
from tests.helpers import insert_job, job_row
from tests.test_dashboard import (
    P_IMG,
    P_SCRIPT,
    P_SVG,
    TOKEN,
    agent_workflow,
    hostile_job,
    run_dashboard,
    spending_jobs,
)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 15_000  # a poll every 2 s: several chances


def _unavailable(reason: str, *, module: bool = False) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so the browser tests must run)", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError:  # pragma: no cover - playwright is a dev dependency
    _unavailable("playwright is not installed: pip install -e '.[dev]'", module=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.path.exists(CHROMIUM):
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield instance
        finally:
            instance.close()


class Watch:
    """What a page did that it must not: dialogs opened, console errors (a CSP
    violation is one), loads after the first."""

    def __init__(self, page: Page) -> None:
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.loads = 0
        page.on("dialog", self._dialog)
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("load", self._load)

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def _load(self, _: Any) -> None:
        self.loads += 1


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def dashboard(db_url: str, tmp_path: Path) -> Iterator[str]:
    """``belay dashboard`` with a token file, on a free port; yields its URL."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with run_dashboard(db_url, "--token-file", str(token_file)) as (url, _, _):
        yield url


def polled(page: Page, times: int = 2) -> None:
    """Wait until the page's script has applied ``times`` more polls."""
    seen = int(page.evaluate("() => Number(document.body.dataset.polls || 0)"))
    page.wait_for_function(
        f"() => Number(document.body.dataset.polls || 0) >= {seen + times}", timeout=WAIT_MS)


def test_the_overview_shows_tiles_and_jobs_enqueued_after_it_loaded(page, dashboard, client):
    client.put_queue("agents", limit=4, rate={"allowed": 30, "period": 60})
    first = client.enqueue("report.build", {"n": 1}, queue="agents")
    watch = Watch(page)
    page.goto(dashboard + "/")
    tile = page.locator('section.tile[data-queue="agents"]')
    expect(tile).to_be_visible()
    expect(tile.locator("a.count.st-ready b")).to_have_text("1")
    expect(tile).to_contain_text("30 / 60s")
    expect(page.locator(f'#recent tr[data-id="{first.id}"]')).to_be_visible()
    expect(page.locator("#live")).to_have_class("live on", timeout=WAIT_MS)

    late = client.enqueue("mail.send", {"to": "a@example.com"}, queue="late")
    client.enqueue("report.build", {"n": 2}, queue="agents")
    expect(page.locator(f'#recent tr[data-id="{late.id}"]')).to_be_visible(timeout=WAIT_MS)
    expect(page.locator('section.tile[data-queue="late"]')).to_be_visible()
    expect(tile.locator("a.count.st-ready b")).to_have_text("2")
    assert watch.loads == 1, "the page reloaded"
    assert watch.dialogs == [] and watch.errors == []


def test_a_count_over_the_cap_shows_with_a_plus_after_a_live_update(page, dashboard, client,
                                                                   sql_conn):
    client.enqueue("mail.send", {"to": "a@example.com"}, queue="bulk")
    page.goto(dashboard + "/")
    tile = page.locator('section.tile[data-queue="bulk"]')
    expect(tile.locator("a.count.st-succeeded b")).to_have_text("0")
    sql_conn.execute("INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
                     "SELECT 'mail.send', 'bulk', 'succeeded', now(), now() "
                     "FROM generate_series(1, %s)", (belay.STATS_CAP + 3,))
    # Drawn by the page's script on its next poll, as the server draws it.
    expect(tile.locator("a.count.st-succeeded b")).to_have_text("10,000+", timeout=WAIT_MS)
    expect(tile.locator("a.count.st-ready b")).to_have_text("1")
    expect(tile).to_contain_text("10,002+ jobs")


def test_a_jobs_state_and_new_events_show_without_a_reload(page, dashboard, client, sql_conn):
    job = client.enqueue("agent.run", {"topic": "otters"})
    watch = Watch(page)
    page.goto(f"{dashboard}/jobs/{job.id}")
    expect(page.locator("#job-state .badge")).to_have_text("ready")
    expect(page.locator("#events tr")).to_have_count(0)

    sql_conn.execute("INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
                     "VALUES (%s, 1, '{\"turn\": 1, \"summary\": \"thinking\"}', now())",
                     (job.id,))
    client.cancel_job(job.id)
    expect(page.locator("#job-state .badge")).to_have_text("cancelled", timeout=WAIT_MS)
    expect(page.locator("#job-state .badge")).to_have_class("badge st-cancelled")
    expect(page.locator("#events tr")).to_have_count(1)
    expect(page.locator("#events")).to_contain_text('"summary": "thinking"')
    expect(page.locator('[data-field="finished_at"]')).not_to_have_text("—")
    assert watch.loads == 1 and watch.errors == []


def test_the_job_view_shows_the_journal_events_and_the_workflow_graph(page, dashboard, client):
    members = agent_workflow(client)
    watch = Watch(page)
    page.goto(f"{dashboard}/jobs/{members['gather']}")
    polled(page)  # what the script rendered from the JSON, not only the server's HTML
    expect(page.locator("#steps tr")).to_have_count(2)
    expect(page.locator("#steps tr").first).to_contain_text("search")
    expect(page.locator("#steps tr").first).to_contain_text("$0.0021")
    expect(page.locator("#journal-usd")).to_have_text("$0.0205")
    expect(page.locator("#journal-tokens")).to_have_text("6970")
    expect(page.locator("#events tr")).to_have_count(2)
    nodes = page.locator("#dag svg g.node")
    expect(nodes).to_have_count(5)
    expect(page.locator('#dag g.node[data-name="check"]')).to_have_class("node st-failed")
    expect(page.locator('#dag g.node[data-name="publish"]')).to_have_class("node st-held")
    expect(page.locator("#dag path.edge")).to_have_count(6)
    # A node is a link to its member's job.
    page.locator('#dag g.node[data-name="check"]').click()
    expect(page).to_have_url(f"{dashboard}/jobs/{members['check']}")
    expect(page.locator("#errors")).to_contain_text("ValueError: claim 3 has no source")
    assert watch.errors == []


def test_xss_payloads_never_run_and_show_as_text(page, dashboard, client):
    job_id = hostile_job(client)
    job = client.get_job(job_id)
    assert job is not None and job.workflow_id == P_IMG
    watch = Watch(page)
    for path in ("/", f"/jobs?kind={_q(P_IMG)}", f"/jobs/{job_id}",
                 f"/workflow?id={_q(P_IMG)}"):
        page.goto(dashboard + path)
        polled(page)  # the live re-render too
        assert page.locator("img").count() == 0, path
        assert page.locator("script").count() == 1, path  # ours, from static/
        assert page.locator("body svg").count() == page.locator("svg.dag").count(), path
    page.goto(f"{dashboard}/jobs/{job_id}")
    polled(page)
    expect(page.locator("h1 .kind")).to_have_text(P_IMG)
    expect(page.locator("#steps tr td.kind")).to_have_text(P_SCRIPT)
    expect(page.locator("#errors")).to_contain_text(P_SCRIPT)
    expect(page.locator("#events")).to_contain_text(P_IMG)
    expect(page.locator('[data-field="queue"]')).to_have_text(P_SVG)
    expect(page.locator("#dag g.node text.name")).to_have_text(P_SVG[:21] + "…")
    assert watch.dialogs == [], watch.dialogs
    assert watch.errors == [], watch.errors


def test_with_the_token_the_cancel_button_cancels_the_job(page, dashboard, client, sql_conn):
    job_id = insert_job(sql_conn, kind="agent.run")
    watch = Watch(page)
    page.goto(f"{dashboard}/jobs/{job_id}")
    cancel = page.locator('button[data-action="cancel"]')
    cancel.click()
    expect(cancel).to_have_text("Confirm cancel")
    cancel.click()
    form = page.locator("#token-form")
    expect(form).to_be_visible()
    page.fill("#token-input", "not-the-token")
    page.locator("#token-form button").click()
    expect(page.locator("#action-status")).to_contain_text("wrong token")
    expect(form).to_be_visible()
    assert job_row(sql_conn, job_id)["state"] == "ready"

    page.fill("#token-input", TOKEN)
    page.locator("#token-form button").click()
    expect(page.locator("#action-status")).to_have_text("cancel: cancelled")
    assert job_row(sql_conn, job_id)["state"] == "cancelled"
    expect(page.locator("#job-state .badge")).to_have_text("cancelled", timeout=WAIT_MS)

    # The token stays for the session: a retry needs no prompt.
    page.locator('button[data-action="retry"]').click()
    expect(page.locator("#action-status")).to_have_text("retried: the job is ready again")
    assert job_row(sql_conn, job_id)["state"] == "ready"
    expect(form).to_be_hidden()
    assert watch.dialogs == [] and watch.errors == [
        "Failed to load resource: the server responded with a status of 401 (Unauthorized)"]


def test_signal_and_steer_from_the_page(page, dashboard, client, sql_conn):
    job_id = insert_job(sql_conn, kind="agent.run")
    page.goto(f"{dashboard}/jobs/{job_id}")
    page.evaluate(f"() => sessionStorage.setItem("
                  f"'belay-dashboard-token ' + location.host, '{TOKEN}')")
    page.fill("#signal-name", "approve")
    page.fill("#signal-payload", '{"by": "ops"}')
    page.locator("#signal-form button").click()
    expect(page.locator("#action-status")).to_have_text("signal approve delivered")
    page.fill("#steer-text", "keep it short")
    page.locator("#steer-form button").click()
    expect(page.locator("#action-status")).to_have_text("steering delivered")
    rows = sql_conn.execute("SELECT name, payload FROM belay_signals WHERE scope = %s "
                            "ORDER BY name", (f"job:{job_id}",)).fetchall()
    assert rows == [("$steer", {"instruction": "keep it short"}), ("approve", {"by": "ops"})]
    page.fill("#signal-name", "x")
    page.fill("#signal-payload", "{not json")
    page.locator("#signal-form button").click()
    expect(page.locator("#action-status")).to_contain_text("the payload is not JSON")


def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def test_the_read_only_dashboard_offers_no_actions(page, db_url, client):
    job = client.enqueue("agent.run", {})
    with run_dashboard(db_url) as (url, _, _):
        page.goto(f"{url}/jobs/{job.id}")
        expect(page.locator(".readonly")).to_contain_text("read-only")
        expect(page.locator("button[data-action]")).to_have_count(0)
        expect(page.locator("#token-form")).to_have_count(0)


def test_the_spend_page_draws_its_chart_and_shows_meta_values_as_text(page, dashboard, client,
                                                                       clock):
    """No script builds the chart: the inline SVG the server rendered passes the
    Content-Security-Policy, and a markup meta value is a table cell's text."""
    spending_jobs(client, clock)
    watch = Watch(page)
    window = "since=2026-02-28T00:00:00Z&until=2026-03-08T00:00:00Z"
    page.goto(f"{dashboard}/spend?by=meta:customer&{window}")
    chart = page.locator("svg#spend-chart")
    expect(chart).to_be_visible()
    assert chart.locator("rect.bar").count() == 8
    tallest = chart.locator('rect.bar[data-key="2026-03-02"]').bounding_box()
    assert tallest is not None and tallest["height"] > 50
    expect(page.locator("#spend-groups tbody td.key").first).to_have_text("7")
    expect(page.locator("#spend-groups tbody")).to_contain_text(P_SCRIPT)
    expect(page.locator("#spend-total")).to_contain_text("$3.875")
    assert page.locator("script").count() == 1 and page.locator("img").count() == 0
    page.locator("#spend-form input[name=since]").fill("24h")
    page.locator("#spend-form button[type=submit]").click()
    expect(page.locator("h1")).to_contain_text("by meta:customer")
    page.goto(f"{dashboard}/spend?tree=1")
    expect(page.locator("#spend-total")).to_contain_text("$0.75")
    assert watch.dialogs == [] and watch.errors == [], (watch.dialogs, watch.errors)
