"""The admin: read-mostly job pages over the unmanaged models, and retry /
cancel / signal actions that go through the belay client."""

from __future__ import annotations

import html
import re

import psycopg
import pytest
from django.contrib.auth.models import User
from django.test import Client

import belay
from tests.helpers import awaiting_own_scope, insert_job, job_row

CHANGELIST = "/admin/belay_django/job/"


@pytest.fixture
def sql(dj):
    with psycopg.connect(dj, autocommit=True) as conn:
        yield conn


@pytest.fixture
def admin(dj) -> Client:
    user = User.objects.create_superuser("admin", "admin@example.com", "secret")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def agent_job(dj) -> int:
    """A failed job with a step journal, events and an error, run by a real worker."""
    registry = belay.Registry()

    @belay.worker(name="t.agent", queue="ai", max_attempts=1, registry=registry)
    def agent(ctx: belay.Context) -> None:
        ctx.step("plan", lambda: {"steps": 3}, cost=belay.Cost(usd=0.25, tokens=1200))
        ctx.emit({"turn": 1, "summary": "thinking"})
        raise ValueError("the model said no")

    job = belay.enqueue(agent, {"topic": "otters"})
    client = belay.Belay(dj)
    try:
        belay.Worker({"ai": 1}, client=client, registry=registry).drain()
    finally:
        client.close()
    return job.id


def text(response) -> str:
    return html.unescape(response.content.decode())


def listed(response) -> list[int]:
    return sorted(int(i) for i in re.findall(r'href="/admin/belay_django/job/(\d+)/change/',
                                             response.content.decode()))


def act(admin: Client, action: str, ids: list[int], **extra: str):
    return admin.post(CHANGELIST, {"action": action, "_selected_action": ids, **extra},
                      follow=True)


def test_the_list_filters_by_queue_state_and_kind(admin, sql):
    a = insert_job(sql, kind="t.mail", queue="mailers")
    b = insert_job(sql, kind="t.mail", queue="mailers", state="failed")
    c = insert_job(sql, kind="t.report", queue="default", state="failed")
    assert listed(admin.get(CHANGELIST)) == [a, b, c]
    assert listed(admin.get(CHANGELIST, {"queue": "mailers"})) == [a, b]
    assert listed(admin.get(CHANGELIST, {"state__exact": "failed"})) == [b, c]
    assert listed(admin.get(CHANGELIST, {"kind": "t.report"})) == [c]
    page = admin.get(CHANGELIST).content.decode()
    for choice in ("?queue=mailers", "?kind=t.report", "?state__exact=failed"):
        assert choice in page  # the filter sidebar offers it


def test_a_jobs_page_shows_its_steps_with_costs_events_and_errors(admin, agent_job):
    response = admin.get(f"{CHANGELIST}{agent_job}/change/")
    assert response.status_code == 200
    page = text(response)
    assert "Step journal" in page and "plan" in page
    assert "$0.2500" in page and "1200" in page  # the step's cost, in USD and tokens
    assert '"steps": 3' in page  # its journaled value
    assert '"summary": "thinking"' in page  # the event
    assert "ValueError: the model said no" in page  # the error
    assert '"topic": "otters"' in page  # the input
    assert "failed" in page and "1/1" in page
    assert 'name="_save"' not in page  # view-only


def test_jobs_are_not_added_edited_or_deleted_in_the_admin(admin, sql):
    job_id = insert_job(sql)
    assert admin.get(f"{CHANGELIST}add/").status_code == 403
    assert admin.post(f"{CHANGELIST}{job_id}/change/", {"state": "succeeded"}).status_code == 403
    assert admin.get(f"{CHANGELIST}{job_id}/delete/").status_code == 403
    assert job_row(sql, job_id)["state"] == "ready"


def test_the_retry_action_retries_through_belay(admin, sql, agent_job):
    ready = insert_job(sql)
    response = act(admin, "retry_jobs", [agent_job, ready])
    page = text(response)
    assert f"Retried 1 job(s): {agent_job}." in page
    assert f"Not retried: {ready}" in page
    row = job_row(sql, agent_job)
    assert row["state"] == "ready" and row["max_attempts"] == 2  # one more attempt


def test_the_cancel_action_cancels_through_belay(admin, sql):
    ready = insert_job(sql)
    done = insert_job(sql, state="succeeded")
    page = text(act(admin, "cancel_jobs", [ready, done]))
    assert f"Cancelled: {ready}." in page
    assert f"Already finished, left as is: {done}." in page
    assert job_row(sql, ready)["state"] == "cancelled"
    assert job_row(sql, done)["state"] == "succeeded"


def test_the_signal_action_asks_then_delivers(admin, sql):
    parked = awaiting_own_scope(sql, "approval", queue="ai")
    form = act(admin, "signal_jobs", [parked])
    assert form.status_code == 200
    assert "Send a signal" in form.content.decode() and 'name="payload"' in form.content.decode()
    assert job_row(sql, parked)["state"] == "awaiting"  # nothing sent yet

    bad = act(admin, "signal_jobs", [parked], apply="1", name="approval", payload="[1]")
    assert "the payload is a JSON object" in bad.content.decode()

    done = act(admin, "signal_jobs", [parked], apply="1", name="approval",
               payload='{"approved": true}')
    assert f"Signal 'approval' delivered to 1 job(s); woke {parked}." in text(done)
    assert job_row(sql, parked)["state"] == "ready"
    [signal] = sql.execute("SELECT scope, name, payload FROM belay_signals").fetchall()
    assert signal == (f"job:{parked}", "approval", {"approved": True})


def test_a_reserved_signal_name_is_refused_with_belays_message(admin, sql):
    parked = awaiting_own_scope(sql, "approval")
    page = text(act(admin, "signal_jobs", [parked], apply="1", name="$steer", payload="{}"))
    assert "Signal not sent" in page and "reserved for belay" in page
    assert job_row(sql, parked)["state"] == "awaiting"


def test_a_staff_user_without_change_permission_only_views(dj, sql):
    from django.contrib.auth.models import Permission

    viewer = User.objects.create_user("viewer", password="secret", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client = Client()
    client.force_login(viewer)
    job_id = insert_job(sql)
    page = client.get(CHANGELIST).content.decode()
    assert f"/admin/belay_django/job/{job_id}/change/" in page
    assert "retry_jobs" not in page
    act(client, "cancel_jobs", [job_id])
    assert job_row(sql, job_id)["state"] == "ready"


def test_the_search_finds_jobs_by_id_and_kind(admin, sql):
    a = insert_job(sql, kind="t.mail")
    b = insert_job(sql, kind="t.report", unique_key="report:7")
    assert listed(admin.get(CHANGELIST, {"q": str(b)})) == [b]
    assert listed(admin.get(CHANGELIST, {"q": "t.mail"})) == [a]
    assert listed(admin.get(CHANGELIST, {"q": "report:7"})) == [b]
