"""docs/django.md: its Python blocks are files of a Django project, so they
are checked here (tests/test_docs.py runs only ```python blocks): they
compile, the settings they show are accepted, and what the page lists
(check ids, belay_worker options) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from belay_django import conf

PAGE = Path(__file__).resolve().parents[2] / "docs" / "django.md"
BLOCKS = re.findall(r"^```py\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)


def test_the_page_has_no_block_tests_test_docs_would_run_without_django():
    assert "```python" not in PAGE.read_text()
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_every_block_compiles(number):
    compile(BLOCKS[number], f"django.md py block {number + 1}", "exec")


def test_the_settings_shown_are_accepted(dj):
    settings_blocks = [b for b in BLOCKS if "BELAY = {" in b or "TASKS = {" in b]
    assert len(settings_blocks) == 2
    namespace: dict[str, object] = {}
    for block in settings_blocks:
        exec(block, namespace)
    parsed = conf.parse(namespace["BELAY"], namespace["DATABASES"])
    assert parsed.queues == {"default": 10, "mailers": 5} and parsed.notify is True
    tasks = pytest.importorskip("belay_django.tasks")
    [(alias, params)] = namespace["TASKS"].items()
    assert tasks.BelayBackend(alias, params).max_attempts == 5


def test_every_check_id_on_the_page_exists():
    source = "\n".join(p.read_text() for p in (PAGE.parents[1] / "belay_django").rglob("*.py"))
    ids = set(re.findall(r"belay_django\.(E\d{3})", PAGE.read_text()))
    ids |= {f"E{n}" for n in re.findall(r"/ `E(\d{3})`", PAGE.read_text())}
    assert ids >= {"E001", "E002", "E003", "E010", "E012", "E013"}
    for check_id in ids:
        assert f'"belay_django.{check_id}"' in source, check_id


def test_every_belay_worker_option_is_on_the_page(dj):
    from belay_django.management.commands.belay_worker import Command

    parser = Command().create_parser("manage.py", "belay_worker")
    ours = {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and action.dest in (
                "queues", "notify", "lease_ttl", "poll_interval", "busy_poll",
                "sweep_interval", "shutdown_grace", "node_id", "log_level")}
    page = PAGE.read_text()
    for flag in ours:
        assert f"`{flag}" in page or f", `{flag}`" in page, flag
