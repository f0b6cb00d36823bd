"""The generated copies of :data:`~.keys.GROUPS`: ``pyproject.toml``'s run-config table and docs/APP.md's tables."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from flower_dlion_app.config.keys import GROUPS

__all__ = ["generated_files", "guide_table", "main", "pyproject_table"]

ROOT = Path(__file__).resolve().parents[2]
_TABLE = "[tool.flwr.app.config]"
_DOC_BEGIN, _DOC_END = "<!-- BEGIN GENERATED run-config -->", "<!-- END GENERATED run-config -->"


def _toml(value: Any) -> str:
    """A default as TOML writes it (the run config holds booleans, integers, floats and strings only)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def pyproject_table() -> str:
    """``[tool.flwr.app.config]`` as ``pyproject.toml`` holds it: the groups' defaults, each group under a comment."""
    lines = [
        _TABLE,
        "# Generated from flower_dlion_app/config/keys.py (GROUPS): python -m flower_dlion_app.config --write",
    ]
    for name, group in GROUPS.items():
        lines.append(f"# {name}: {group.about}")
        lines += [f"{key} = {_toml(k.default)}" for key, k in group.keys.items()]
    return "\n".join(lines) + "\n"


def guide_table() -> str:
    """The run-config reference of docs/APP.md: one table per group (key, default, meaning)."""
    parts = [_DOC_BEGIN]
    for name, group in GROUPS.items():
        parts += ["", f"**{name}**: {group.about}", "", "| key | default | meaning |", "|---|---|---|"]
        parts += [f"| `{key}` | {_markdown(k.default)} | {k.meaning} |" for key, k in group.keys.items()]
    return "\n".join([*parts, "", _DOC_END])


def _markdown(value: Any) -> str:
    """A default as docs/APP.md shows it: strings in code quotes, numbers as they are."""
    return f"`{_toml(value)}`" if isinstance(value, str) else _toml(value)


def _replaced(text: str, pattern: str, new: str, where: str) -> str:
    """``text`` with the one match of ``pattern`` (a generated part) replaced by ``new``."""
    found = re.search(pattern, text, flags=re.S)
    if found is None:
        raise ValueError(f"{where}: no generated run-config part found")
    return text[: found.start()] + new + text[found.end() :]


def generated_files(root: Path = ROOT) -> dict[Path, str]:
    """``pyproject.toml`` and ``docs/APP.md`` under ``root`` as :data:`GROUPS` makes them."""
    pyproject, guide = root / "pyproject.toml", root / "docs" / "APP.md"
    table = re.escape(_TABLE) + r"\n.*?(?=\n\[|\Z)"
    guide_part = re.escape(_DOC_BEGIN) + ".*?" + re.escape(_DOC_END)
    return {
        pyproject: _replaced(pyproject.read_text(), table, pyproject_table().rstrip("\n"), str(pyproject)),
        guide: _replaced(guide.read_text(), guide_part, guide_table(), str(guide)),
    }


def main() -> None:
    """``python -m flower_dlion_app.config [--write]``: print the pyproject table, or rewrite both generated parts."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite pyproject.toml's table and docs/APP.md's")
    if not parser.parse_args().write:
        print(pyproject_table(), end="")
        return
    for path, text in generated_files().items():
        path.write_text(text)
        print(f"[config] wrote {path}")
