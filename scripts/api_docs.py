"""Build the API reference of the library from its docstrings (pdoc), and check its links.

    .venv/bin/python scripts/api_docs.py [--out site/api]

Writes one HTML page per public module (:data:`MODULES`) under ``--out`` with pdoc (numpy
docstrings), then checks every link between the pages: each relative ``href`` names a page
that was written and, with ``#id``, an element of that page with that id. Exits 1, listing
them, when a link leads nowhere; ``tests/library/test_api_docs.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from html.parser import HTMLParser
from pathlib import Path

MODULES = (
    "flower_dlion",  # DistributedLion, DLionClient, ClientSettings, DLionResult, RunStopped, cosine_decay
    "flower_dlion.strategies.dlion",
    "flower_dlion.clients.dlion",
    "flower_dlion.strategies.common",  # ServerModelStrategy: what DistributedLion inherits (start, sampling)
    "flower_dlion.strategies.run_loop",
    "flower_dlion.strategies.run_stops",
    "flower_dlion.testing",  # LocalGrid: your app's tests, in process
    "flower_dlion.lion",
    "flower_dlion.codec",
    "flower_dlion.params",
    "flower_dlion.quantizers",
    "flower_dlion.stochastic",
)


class _Links(HTMLParser):
    """The ids and the hrefs of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if key in ("id", "name") and value:
                self.ids.add(value)
            elif key == "href" and value and tag == "a":
                self.hrefs.append(value)


def build(out: Path) -> list[Path]:
    """Write the pages under ``out``; return them."""
    import pdoc
    import pdoc.render

    package = importlib.import_module("flower_dlion")
    for name in package.__all__:  # the lazily imported public names, resolved for pdoc
        getattr(package, name)
    pdoc.render.configure(docformat="numpy", show_source=False)
    pdoc.pdoc(*MODULES, output_directory=out)
    return sorted(out.rglob("*.html"))


def broken_links(out: Path) -> list[str]:
    """Every relative link of the pages under ``out`` that leads nowhere, as ``"page: href"``."""
    parsed: dict[Path, _Links] = {}
    for page in sorted(out.rglob("*.html")):
        parsed[page.resolve()] = links = _Links()
        links.feed(page.read_text())
    bad = []
    for page, links in parsed.items():
        for href in links.hrefs:
            if href.startswith(("http://", "https://", "mailto:", "javascript:")):
                continue
            path, _, anchor = href.partition("#")
            target = (page.parent / path).resolve() if path else page
            if target not in parsed or (anchor and anchor not in parsed[target].ids):
                bad.append(f"{page.relative_to(out.resolve())}: {href}")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Build, check, print the count and the broken links; 1 if there are any."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("site/api"))
    args = parser.parse_args(argv)
    pages = build(args.out)
    bad = broken_links(args.out)
    print(f"[api-docs] {len(pages)} pages in {args.out}; {len(bad)} broken links")
    for line in bad:
        print(f"  {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
