"""Whether this node runs its app's own code, or another copy of a package with the same name.

Flower puts the run's app directory first on ``sys.path`` before it loads the ClientApp. A package
of the same name can still come from elsewhere: an editable install of another app (its import hook
runs before ``sys.path``), or a module already imported by a long-lived process that a SuperLink
left running serves this run with. :func:`foreign_code` compares where the model's module was
loaded from with the first ``sys.path`` entry that holds its top-level package; the DLionClient
refuses the hello when they differ, with :data:`flower_dlion.protocol.OTHER_APP`'s advice.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["foreign_code"]


def foreign_code(model_fn: Callable[..., object]) -> str | None:
    """Why the code of ``model_fn`` is not the run's app's (None: it is, or there is nothing to compare).

    The module of ``model_fn`` is compared, byte for byte, with the file of the same module under
    the first ``sys.path`` entry that holds its top-level package (the same files reached by
    another route, e.g. an editable install of this very app, pass). The reason names both files.
    """
    module = inspect.getmodule(model_fn)
    loaded = getattr(module, "__file__", None)
    if module is None or loaded is None or module.__name__ == "__main__":
        return None
    parts = module.__name__.split(".")
    for entry in sys.path:
        root = Path(entry or ".")
        if not ((root / parts[0] / "__init__.py").is_file() or (root / f"{parts[0]}.py").is_file()):
            continue
        here = Path(loaded)  # a/b/c.py or a/b/c/__init__.py for module a.b.c
        relative = Path(*parts) / "__init__.py" if here.name == "__init__.py" else Path(*parts).with_suffix(".py")
        expected = root / relative
        if expected.is_file() and expected.read_bytes() == here.read_bytes():
            return None
        return f"its model's module {module.__name__} was loaded from {loaded}, but this run's app holds {expected}"
    return None
