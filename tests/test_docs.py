"""Every ```python block in docs/ runs, in order, per page, against a real database."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))
#: A block that opens with ``# requires: module`` runs only where the module
#: imports: the agent-framework extras need Python >= 3.11, and CI also runs 3.10.
REQUIRES = re.compile(r"\A# requires: ([\w.]+)")


def _runnable(block: str) -> bool:
    needs = REQUIRES.match(block)
    if needs is None or importlib.util.find_spec(needs.group(1)) is not None:
        return True
    if os.environ.get("CI") and sys.version_info >= (3, 11):
        raise AssertionError(f"{needs.group(1)} is not installed: a CI run on Python "
                             ">= 3.11 runs every doc block (pip install -e '.[dev]')")
    return False


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_doc_page_code_runs(page, empty_db_url, monkeypatch, restore_default):
    monkeypatch.setenv("BELAY_DATABASE_URL", empty_db_url)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(BLOCK.findall(page.read_text()), 1):
        if not _runnable(block):
            continue
        code = compile(block, f"{page.name} block {number}", "exec", dont_inherit=True)
        exec(code, namespace)


def test_there_are_doc_pages_with_code():
    assert any(p.name == "client.md" for p in PAGES)
