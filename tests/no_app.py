"""Run the library's tests as if the repository's app were not installed: ``FLOWER_DLION_NO_APP=1``.

With the variable set (to anything but ``""`` or ``0``), ``tests/conftest.py`` calls
:func:`block_app` before any test module is imported: every ``import flower_dlion_app`` (or of a
module in it) then fails with ``ModuleNotFoundError``, as in an environment with the library
alone, so a library test that still needs the app fails to collect or to run::

    FLOWER_DLION_NO_APP=1 .venv/bin/pytest tests/test_codec.py tests/test_lion.py

``scripts/test.sh`` collects every library test file this way (``--collect-only``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["APP", "APP_TESTS", "TESTS", "VARIABLE", "AppBlocker", "block_app", "blocked", "library_tests"]

APP = "flower_dlion_app"
VARIABLE = "FLOWER_DLION_NO_APP"
APP_TESTS = frozenset(  # until the tests are split into tests/library/ and tests/app/: the app's test files
    {
        "test_app_client_api.py",
        "test_app_client_state.py",
        "test_app_divergence.py",
        "test_app_downlink.py",
        "test_app_examples.py",
        "test_app_frozen_base.py",
        "test_app_fuzz.py",
        "test_app_layers.py",
        "test_app_lr_schedule.py",
        "test_app_node_gates.py",
        "test_app_packaging.py",
        "test_app_public_surface.py",
        "test_app_run_stops.py",
        "test_app_scale_blocks.py",
        "test_app_secure.py",
        "test_app_server_round_cost.py",
        "test_app_state_disk.py",
        "test_app_stochastic_signs.py",
        "test_baselines.py",
        "test_beyond.py",
        "test_bounds.py",
        "test_data_config.py",
        "test_deployment.py",
        "test_example_shakespeare_lm.py",
        "test_faults.py",
        "test_federation.py",
        "test_integrity.py",
        "test_noniid.py",
        "test_ray_cluster.py",
        "test_scaffold.py",
        "test_second_model.py",
        "test_secure_attacks.py",
        "test_shakespeare.py",
        "test_shakespeare_app.py",
        "test_simulation.py",
        "test_study.py",
        "test_study_outputs.py",
        "test_text_models.py",
    }
)

TESTS = Path(__file__).resolve().parent  # tests/


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


def library_tests(folder: Path = TESTS) -> list[str]:
    """The library's test files in ``folder``: every ``test_*.py`` but :data:`APP_TESTS`, sorted.

    Parameters
    ----------
    folder : Path (default: :data:`TESTS`)
        Where the test files are.

    Returns
    -------
    list of str
        Their paths, relative to the current folder where they are under it (``tests/test_codec.py``).

    """
    found = sorted(p for p in folder.glob("test_*.py") if p.name not in APP_TESTS)
    return [str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(p) for p in found]


if __name__ == "__main__":  # scripts/test.sh: the files to collect with the app blocked
    print("\n".join(library_tests()))
