"""The layers of the package: the accelerated twins (``flower_dlion.accel``) import nothing above them.

The codec and the anchored downlink choose a twin (:func:`flower_dlion.accel.choose`) and call it;
a twin returns its result and never calls them back. So a module of ``flower_dlion/accel/`` imports,
of this package, only other modules of ``accel`` and the formats' shared definitions
(:mod:`flower_dlion.formats`), which import nothing of it. Read from the source with :mod:`ast`
(relative imports and imports inside functions included), nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flower_dlion"
ACCEL_FILES = sorted((PACKAGE / "accel").glob("*.py"))
FORMATS = "flower_dlion.formats"


def imports_of(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import of a ``flower_dlion`` module in ``source``, relative ones resolved.

    ``package`` is the package the file sits in (``flower_dlion.accel``). ``from X import a, b`` counts
    as X and as ``X.a``, ``X.b`` (either may be a module), but ``from flower_dlion import a`` (``from ..
    import a`` in accel) only as ``flower_dlion.a``; ``import X.Y`` counts as X.Y.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: up level − 1 packages from the file's own
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source_name = f"{base}.{node.module}" if node.module else base
            else:
                source_name = node.module or ""
            if source_name != "flower_dlion":  # ``from .. import codec``: the names are the modules
                found.append((node.lineno, source_name))
            found += [(node.lineno, f"{source_name}.{alias.name}") for alias in node.names if alias.name != "*"]
    return [(line, name) for line, name in found if name == "flower_dlion" or name.startswith("flower_dlion.")]


def _imports_of_file(path: Path) -> list[tuple[int, str]]:
    """:func:`imports_of` a file of the package."""
    package = ".".join(path.parent.relative_to(PACKAGE.parent).parts)
    return imports_of(path.read_text(encoding="utf-8"), package)


def _allowed_in_accel(name: str) -> bool:
    """Whether an accel module may import ``name``: another accel module, or the formats' definitions."""
    return any(name == top or name.startswith(top + ".") for top in ("flower_dlion.accel", FORMATS))


def test_the_import_reader_resolves_relative_imports() -> None:
    # Prepare: what a twin must not write, as if in a file of accel
    source = "from .. import codec\nfrom ..codec import x\nfrom ..anchored_counts import y\nfrom . import threads\n"
    source += "import flower_dlion.lion\nfrom ..formats import POW3\n\ndef f():\n    from .. import lion\n"
    # Execute
    found = imports_of(source, "flower_dlion.accel")
    # Assert: each resolved to the package's absolute names, the one inside a function too; only accel's
    # own modules and the formats allowed
    names = {name for _, name in found}
    assert {"flower_dlion.codec", "flower_dlion.codec.x", "flower_dlion.anchored_counts", "flower_dlion.lion"} <= names
    assert {"flower_dlion.accel.threads", "flower_dlion.formats", "flower_dlion.formats.POW3"} <= names
    assert sorted(n for n in names if not _allowed_in_accel(n)) == [
        "flower_dlion.anchored_counts", "flower_dlion.anchored_counts.y", "flower_dlion.codec", "flower_dlion.codec.x",
        "flower_dlion.lion",
    ]  # fmt: skip


@pytest.mark.parametrize("path", ACCEL_FILES, ids=lambda p: p.name)
def test_accel_imports_only_accel_and_the_formats(path: Path) -> None:
    # Execute
    above = [(line, name) for line, name in _imports_of_file(path) if not _allowed_in_accel(name)]
    # Assert: nothing of the codec, the downlink, the Lion math or any other module above accel
    assert not above, f"{path.relative_to(PACKAGE.parent)} imports from above accel: {above}"


def test_accel_loads_no_module_by_name() -> None:
    # Assert: no import hidden from the reader above (importlib.import_module, __import__)
    for path in ACCEL_FILES:
        source = path.read_text(encoding="utf-8")
        assert "import_module" not in source and "__import__" not in source, path.name


def test_the_formats_module_imports_nothing_of_the_package() -> None:
    # Assert: the shared definitions are the bottom of the package (torch and numpy only)
    path = PACKAGE / "formats.py"
    assert path.is_file()
    assert _imports_of_file(path) == []


# ---------------------------------------------------------------- the library and the repository's app
LIBRARY_FILES = sorted(PACKAGE.rglob("*.py"))
APP = PACKAGE.parent / "flower_dlion_app"


def _imports_anything(path: Path) -> list[tuple[int, str]]:
    """Every import in a file, absolute names (``flower_dlion_app`` included), for the test below."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or ""))
    return found


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_never_imports_the_repository_app(path: Path) -> None:
    # Execute: absolute imports (a relative one cannot leave the package)
    app = [(line, name) for line, name in _imports_anything(path) if name.split(".")[0] == "flower_dlion_app"]
    # Assert
    assert not app, f"{path.relative_to(PACKAGE.parent)} imports the repository's app: {app}"
