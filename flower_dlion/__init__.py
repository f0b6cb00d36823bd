"""flower-dlion: Distributed Lion for Flower, 1 bit per parameter up, a packed Δ down.

The public API is two classes, one per side of a Flower app:

* :class:`DistributedLion`, the ``Strategy`` your ``ServerApp`` starts (as Flower's ``FedAvg``);
* :class:`DLionClient`, which your ``ClientApp``'s train handler calls with its batches;

and :func:`cosine_decay`, a learning-rate schedule for ``DistributedLion(lr_schedule=...)``;
``DistributedLion.start`` returns a :class:`DLionResult` (Flower's ``Result`` with the run's
byte totals); :class:`RunStopped` is what it raises when the run cannot learn (no valid
reply for ``max_failed_rounds`` rounds in a row, or no node answered the hello).

The bit codec (:mod:`flower_dlion.codec`) and the Lion math (:mod:`flower_dlion.lion`) import
only torch and numpy; :mod:`flower_dlion.params` maps any ``nn.Module`` onto the flat vector x.
The two classes are imported on first use, so that importing the codec alone never imports flwr.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .clients.dlion import ClientSettings, DLionClient
    from .lion import cosine_decay
    from .strategies.dlion import DistributedLion
    from .strategies.run_loop import DLionResult
    from .strategies.run_stops import RunStopped

__all__ = [
    "ClientSettings",
    "DLionClient",
    "DLionResult",
    "DistributedLion",
    "RunStopped",
    "__version__",
    "cosine_decay",
]

__version__ = "0.2.0"

_LAZY = {
    "ClientSettings": ".clients.dlion",
    "DLionClient": ".clients.dlion",
    "DLionResult": ".strategies.run_loop",
    "DistributedLion": ".strategies.dlion",
    "RunStopped": ".strategies.run_stops",
    "cosine_decay": ".lion",
}


def __getattr__(name: str) -> Any:
    """Import the public classes on first use (PEP 562)."""
    if name in _LAZY:
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name], __name__), name)  # found next time
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
