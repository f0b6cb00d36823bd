"""The API reference (``scripts/api_docs.py``: pdoc over the library's docstrings) builds; its links lead somewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("pdoc")
_spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
assert _spec is not None and _spec.loader is not None
api_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(api_docs)


def test_the_api_reference_builds_with_every_public_name_and_no_broken_link(tmp_path: Path) -> None:
    # Execute
    pages = api_docs.build(tmp_path)
    # Assert: a page per module; the top page documents every public name; no link leads nowhere
    assert len(pages) == len(api_docs.MODULES) + 1  # and index.html
    top = (tmp_path / "flower_dlion.html").read_text()
    for name in ("DistributedLion", "DLionClient", "ClientSettings", "DLionResult", "RunStopped", "cosine_decay"):
        assert f'id="{name}"' in top, name
    assert api_docs.broken_links(tmp_path) == []


def test_a_link_to_a_missing_page_or_id_is_found(tmp_path: Path) -> None:
    # Prepare
    page = '<h1 id="top">A</h1><a href="#top">ok</a><a href="#gone">x</a><a href="b.html">y</a>'
    (tmp_path / "a.html").write_text(page)
    # Execute, Assert
    assert api_docs.broken_links(tmp_path) == ["a.html: #gone", "a.html: b.html"]
