"""Run the library's tests as if the repository's app were not installed: ``FLOWER_DLION_NO_APP=1``.

With the variable set (to anything but ``""`` or ``0``), ``tests/conftest.py`` calls
:func:`block_app` before any test module is imported: every ``import flower_dlion_app`` (or of a
module in it) then fails with ``ModuleNotFoundError``, as in an environment with the library
alone, so a library test that still needs the app fails to collect or to run::

    FLOWER_DLION_NO_APP=1 .venv/bin/pytest tests/library/test_codec.py tests/library/test_lion.py

``scripts/test.sh`` runs ``tests/library`` this way, and ``tests/app`` without it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["APP", "VARIABLE", "AppBlocker", "block_app", "blocked"]

APP = "flower_dlion_app"
VARIABLE = "FLOWER_DLION_NO_APP"


def blocked() -> bool:
    """Whether :data:`VARIABLE` asks for the app to be blocked (set, and neither empty nor ``0``)."""
    return os.environ.get(VARIABLE, "") not in ("", "0")


class AppBlocker(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that refuses :data:`APP` and its modules (first in the path: before any other)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """Raise ``ModuleNotFoundError`` for the app, None (ask the next finder) for any other module.

        Parameters
        ----------
        fullname : str
            The module's absolute name.
        path : Sequence[str] or None
            The parent package's ``__path__`` (unused).
        target : ModuleType or None
            A module being reloaded (unused).

        Returns
        -------
        None
            For every module that is not the app.

        Raises
        ------
        ModuleNotFoundError
            ``fullname`` is :data:`APP` or one of its modules.

        """
        if fullname == APP or fullname.startswith(APP + "."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: {VARIABLE} is set, the library's tests run without the app",
                name=fullname,
            )
        return None


def block_app() -> None:
    """Make every later import of the app fail; raise if it is imported already.

    Raises
    ------
    RuntimeError
        A module of the app was imported before the block (a plugin or ``conftest.py`` imports it).

    """
    loaded = sorted(name for name in sys.modules if name == APP or name.startswith(APP + "."))
    if loaded:
        raise RuntimeError(f"{VARIABLE}: the app was imported before the block: {loaded}")
    if not any(isinstance(finder, AppBlocker) for finder in sys.meta_path):
        sys.meta_path.insert(0, AppBlocker())
