"""Every ```python block in docs/ runs, in order, per page, against a real database."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_doc_page_code_runs(page, empty_db_url, monkeypatch, restore_default):
    monkeypatch.setenv("BELAY_DATABASE_URL", empty_db_url)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(BLOCK.findall(page.read_text()), 1):
        code = compile(block, f"{page.name} block {number}", "exec", dont_inherit=True)
        exec(code, namespace)


def test_there_are_doc_pages_with_code():
    assert any(p.name == "client.md" for p in PAGES)
