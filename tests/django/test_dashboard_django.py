"""The dashboard mounted in Django: ``path("belay/", include("belay_django.urls"))``.

Staff only by default, read-only unless BELAY_DASHBOARD allows actions, and
every action a POST under Django's own CSRF protection. This module is its
own URLconf (ROOT_URLCONF is pointed here per test).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, override_settings
from django.urls import include, path

import belay
from belay_django import dashboard
from tests.helpers import insert_job, job_row, signal_rows

urlpatterns = [path("belay/", include("belay_django.urls"))]


def may_act(request: Any, action: str, args: dict[str, Any]) -> object:
    """An AUTHORIZER: superusers may do anything, others may only signal."""
    if request.user.is_superuser or action == "signal":
        return None
    return f"{request.user.username} may not {action}"


def anyone_logged_in(request: Any) -> bool:
    return bool(request.user.is_authenticated)


@pytest.fixture
def sql(dj: str) -> Iterator[psycopg.Connection[Any]]:
    with override_settings(ROOT_URLCONF=__name__), \
            psycopg.connect(dj, autocommit=True) as conn:
        yield conn


def login(*, staff: bool = True, superuser: bool = False, name: str = "ops") -> Client:
    user = User.objects.create_user(name, password="pw", is_staff=staff,
                                    is_superuser=superuser)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def csrf_of(client: Client, url: str) -> str:
    page = client.get(url).content.decode()
    found = re.search(r'data-csrf="([^"]+)"', page)
    assert found, "the page carries no CSRF token"
    return found[1]


def post(client: Client, url: str, body: Any = None, csrf: str | None = None) -> Any:
    extra = {} if csrf is None else {"HTTP_X_CSRFTOKEN": csrf}
    return client.post(url, json.dumps(body or {}), content_type="application/json", **extra)


def test_anonymous_visitors_go_to_the_login_page_and_the_api_refuses_them(sql):
    client = Client()
    page = client.get("/belay/jobs")
    assert page.status_code == 302 and page["Location"].endswith("?next=/belay/jobs")
    api = client.get("/belay/api/overview")
    assert api.status_code == 403 and "staff" in api.json()["error"]


def test_a_user_who_is_not_staff_is_refused(sql):
    reply = login(staff=False).get("/belay/")
    assert reply.status_code == 403 and b"staff" in reply.content


def test_staff_see_the_queues_jobs_and_a_jobs_journal(dj, sql):
    registry = belay.Registry()

    @belay.worker(name="t.agent", queue="ai", registry=registry)
    def agent(ctx: belay.Context) -> dict[str, int]:
        ctx.step("plan", lambda: {"steps": 3}, cost=belay.Cost(usd=0.25, tokens=1200))
        ctx.emit({"turn": 1, "summary": "thinking"})
        return {"done": 1}

    job = belay.enqueue(agent, {"topic": "otters"})
    worker_client = belay.Belay(dj)
    try:
        belay.Worker({"ai": 1}, client=worker_client, registry=registry).drain()
    finally:
        worker_client.close()
    client = login()
    overview = client.get("/belay/")
    assert overview.status_code == 200
    text = overview.content.decode()
    assert '<section class="tile" data-queue="ai">' in text
    assert 'href="/belay/static/dashboard.css"' in text and 'data-base="/belay"' in text
    assert f'href="/belay/jobs/{job.id}"' in text
    assert overview["Content-Security-Policy"].startswith("default-src 'self'")
    assert overview["X-Frame-Options"] == "DENY"
    page = html.unescape(client.get(f"/belay/jobs/{job.id}").content.decode())
    assert '<td class="kind">plan</td>' in page and "$0.2500" in page
    assert '"summary": "thinking"' in page and '{"topic": "otters"}' in page
    assert "data-action" not in page and "BELAY_DASHBOARD" in page  # read-only
    api = client.get(f"/belay/api/jobs/{job.id}").json()
    assert api["journal_cost"] == {"usd": 0.25, "tokens": 1200}
    assert client.get("/belay/static/dashboard.js").status_code == 200
    listed = client.get("/belay/api/jobs", {"queue": "ai"}).json()
    assert [j["id"] for j in listed["jobs"]] == [job.id]


def test_read_only_by_default_every_post_is_refused(sql):
    ready = insert_job(sql)
    client = login()
    csrf = csrf_of(client, f"/belay/jobs/{ready}")
    reply = post(client, f"/belay/api/jobs/{ready}/cancel", csrf=csrf)
    assert reply.status_code == 403
    assert "BELAY_DASHBOARD = {'MUTATIONS': True}" in reply.json()["error"]
    assert job_row(sql, ready)["state"] == "ready"


def test_with_mutations_staff_act_and_csrf_is_enforced(sql):
    ready = insert_job(sql)
    client = login()
    with override_settings(BELAY_DASHBOARD={"MUTATIONS": True}):
        page = client.get(f"/belay/jobs/{ready}").content.decode()
        assert 'data-auth="session"' in page and 'data-action="cancel"' in page
        assert 'id="token-form"' not in page
        forged = post(client, f"/belay/api/jobs/{ready}/cancel")  # no CSRF token
        assert forged.status_code == 403 and b"CSRF" in forged.content
        assert job_row(sql, ready)["state"] == "ready"
        wrong = post(client, f"/belay/api/jobs/{ready}/cancel", csrf="x" * 64)
        assert wrong.status_code == 403 and job_row(sql, ready)["state"] == "ready"
        csrf = csrf_of(client, f"/belay/jobs/{ready}")
        done = post(client, f"/belay/api/jobs/{ready}/cancel", csrf=csrf)
        assert done.status_code == 200 and done.json()["status"] == "cancelled"
        assert job_row(sql, ready)["state"] == "cancelled"
        # Still staff only: a non-staff user with a valid CSRF token is refused.
        other = login(staff=False, name="guest")
        refused = post(other, f"/belay/api/jobs/{ready}/retry", csrf=csrf)
        assert refused.status_code == 403 and job_row(sql, ready)["state"] == "cancelled"


def test_an_authorizer_gets_the_request_and_its_refusal_is_shown(sql):
    ready = insert_job(sql)
    with override_settings(BELAY_DASHBOARD={"AUTHORIZER": f"{__name__}.may_act"}):
        staff = login()
        csrf = csrf_of(staff, f"/belay/jobs/{ready}")
        refused = post(staff, f"/belay/api/jobs/{ready}/cancel", csrf=csrf)
        assert refused.status_code == 403
        assert refused.json()["error"] == ("cancel_job refused by the authorizer: "
                                           "ops may not cancel_job")
        assert job_row(sql, ready)["state"] == "ready"
        signalled = post(staff, f"/belay/api/jobs/{ready}/signal", {"name": "go"}, csrf=csrf)
        assert signalled.status_code == 200
        assert [r["name"] for r in signal_rows(sql)] == ["go"]
        boss = login(superuser=True, name="boss")
        done = post(boss, f"/belay/api/jobs/{ready}/cancel",
                    csrf=csrf_of(boss, f"/belay/jobs/{ready}"))
        assert done.status_code == 200 and job_row(sql, ready)["state"] == "cancelled"


def test_the_permission_setting_decides_who_sees_it(sql):
    guest = login(staff=False, name="guest")
    assert guest.get("/belay/").status_code == 403
    with override_settings(BELAY_DASHBOARD={"PERMISSION": anyone_logged_in}):
        assert guest.get("/belay/").status_code == 200
        assert Client().get("/belay/").status_code == 302


@pytest.mark.parametrize(("raw", "says"), [
    ([], "is a dict like"),
    ({"MUTATION": True}, "unknown key(s) 'MUTATION'"),
    ({"MUTATIONS": "yes"}, "['MUTATIONS'] is True or False"),
    ({"AUTHORIZER": "no_such_module.fn"}, "['AUTHORIZER']: cannot import"),
    ({"PERMISSION": 42}, "['PERMISSION'] is a function"),
])
def test_bad_settings_name_the_key_and_the_fix(raw, says):
    with pytest.raises(ImproperlyConfigured) as caught:
        dashboard.parse(raw)
    assert says in str(caught.value)


def test_good_settings_parse():
    conf = dashboard.parse({"MUTATIONS": True, "AUTHORIZER": f"{__name__}.may_act",
                            "PERMISSION": anyone_logged_in})
    assert conf.mutations is True and conf.authorizer is may_act
    assert conf.permission is anyone_logged_in
    assert dashboard.parse(None).permission is dashboard.is_staff


def test_in_a_browser_staff_cancel_a_job_with_djangos_csrf_token(sql):
    """The page's script sends the CSRF token Django checks (X-CSRFToken), on
    the session cookie of a logged-in staff user: Django served by waitress,
    driven by chromium."""
    import os

    from django.core.wsgi import get_wsgi_application

    from belay.dashboard.server import Server

    chromium = "/usr/bin/chromium"
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        missing = "playwright is not installed: pip install -e '.[dev]'"
    else:
        missing = ("" if os.path.exists(chromium)
                   else f"{chromium} is missing: apt-get install chromium")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} (CI is set, so the browser tests must run)")
        pytest.skip(missing)
    from tests.test_dashboard_browser import ARGS

    ready = insert_job(sql, kind="agent.run")
    user = User.objects.create_user("ops", password="pw", is_staff=True)
    django_client = Client()
    django_client.force_login(user)
    session = django_client.cookies["sessionid"].value
    dialogs: list[str] = []
    with override_settings(BELAY_DASHBOARD={"MUTATIONS": True},
                           ALLOWED_HOSTS=["127.0.0.1"]), \
            Server(get_wsgi_application()) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=ARGS)
        try:
            context = browser.new_context()
            context.add_cookies([{"name": "sessionid", "value": session, "url": server.url}])
            page = context.new_page()
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(f"{server.url}/belay/jobs/{ready}")
            expect(page.locator("#job-state .badge")).to_have_text("ready")
            cancel = page.locator('button[data-action="cancel"]')
            cancel.click()
            cancel.click()
            expect(page.locator("#action-status")).to_have_text("cancel: cancelled")
            expect(page.locator("#job-state .badge")).to_have_text("cancelled", timeout=15_000)
        finally:
            browser.close()
    assert job_row(sql, ready)["state"] == "cancelled"
    assert dialogs == []


@pytest.mark.parametrize("path", [
    "/belay/api/jobs?kind=%ED%A0%80",   # bytes that are not UTF-8: Django would make them U+FFFD
    "/belay/api/jobs?kind=a%00",
    "/belay/api/jobs?before_id=%C2%B2",  # '²': isdigit() says yes, int() says no
    "/belay/api/jobs/%D9%A3",            # '٣' must not read as job 3
])
def test_hostile_query_values_and_paths_are_400s_through_django_too(sql, path):
    answer = login().get(path)
    assert answer.status_code == 400, (path, answer.status_code, answer.content[:200])
