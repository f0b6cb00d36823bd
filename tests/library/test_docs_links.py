"""Every relative link in the Markdown docs leads somewhere: the file exists, and so does the heading it names.

Checks README.md, CHANGELOG.md, docs/ (with docs/notes/) and the examples' READMEs: each
``[text](target)`` whose target is not a URL must name an existing file (relative to the page),
and a ``#anchor`` must be a heading of that page as GitHub renders its id (lower case, punctuation
other than ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2`` … for repeats).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    p
    for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/*/README.md")]
    if p.exists()
)
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings (and of its explicit ``<a id=…>`` / ``<a name=…>`` anchors)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(page.read_text()):
        out.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The page's relative links that lead nowhere, as ``"line: target (why)"``."""
    out = []
    for i, line in enumerate(_prose(page.read_text()), 1):
        for target in LINK.findall(line.replace("`", "")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, …
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            if not dest.exists():
                out.append(f"{i}: {target} (no file {shown})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{i}: {target} (no heading #{anchor} in {shown})")
    return out


def test_a_missing_file_or_heading_is_found(tmp_path: Path) -> None:
    # Prepare
    page = tmp_path / "page.md"
    page.write_text("# A b\n[x](#a-b) [y](#nope) [z](NOPE.md)\n```\n[in code](#not-checked)\n```\n")
    # Execute, Assert
    missing = tmp_path / "NOPE.md"
    assert broken_links(page) == [f"2: #nope (no heading #nope in {page})", f"2: NOPE.md (no file {missing})"]


def test_headings_get_githubs_ids() -> None:
    # Assert: hand-checked against GitHub's rendering
    assert slug("Reliability: what is checked where") == "reliability-what-is-checked-where"
    assert slug("The round's metrics") == "the-rounds-metrics"
    assert slug("`DistributedLion` × FedAvg (2 nodes)") == "distributedlion--fedavg-2-nodes"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    # Assert
    assert broken_links(page) == []
