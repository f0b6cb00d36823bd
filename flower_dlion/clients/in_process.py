"""What a client holds in its process (models, node states, replicas), found again by its copies.

Flower's Ray backend ships a ``ClientApp`` defined in a script (``__main__``: notebooks,
tutorials) with every message, and Ray pickles such objects by value: each message would get a
fresh :class:`~.dlion.DLionClient`, with nothing resident, and reload every state from its file.
A client's copy finds what its process holds instead: by the token of the client it copies, or,
where the process built a client of its own at import (an app in a module, whose hello handler
is a copy of the driver's), by its ``model_fn``, the very object. The registry keeps an entry
only while a client or a copy uses it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from .link import DecodeCost

__all__ = ["PROCESS_LOCAL", "ProcessLocal", "find", "register"]

PROCESS_LOCAL = ("_devices", "_choices", "_decode_cost", "_told")  # a client's attributes that belong to its process


@dataclass(eq=False)
class ProcessLocal:
    """What a client holds in this process, shared by its copies here."""

    model_fn: Any
    devices: dict = field(default_factory=dict)
    choices: dict = field(default_factory=dict)
    decode_cost: DecodeCost = field(default_factory=DecodeCost)
    told: set = field(default_factory=set)

    def shared(self) -> tuple[dict, dict, DecodeCost, set]:
        """The client's process-local attributes, in :data:`PROCESS_LOCAL`'s order."""
        return self.devices, self.choices, self.decode_cost, self.told


_IN_PROCESS: weakref.WeakValueDictionary[str, ProcessLocal] = weakref.WeakValueDictionary()


def register(token: str, model_fn: Any, devices: dict, choices: dict, decode_cost: DecodeCost) -> ProcessLocal:
    """Record what a new client (``token``) holds in this process; the client keeps the result alive."""
    local = _IN_PROCESS[token] = ProcessLocal(model_fn, devices, choices, decode_cost)
    return local


def find(token: str, model_fn: Any) -> tuple[ProcessLocal, bool]:
    """What a copy of client ``token`` finds in this process, and whether it was there (else a new, empty one)."""
    local = _IN_PROCESS.get(token)
    if local is None:
        same = [h for h in _IN_PROCESS.values() if h.model_fn is model_fn]
        local = same[0] if len(same) == 1 else None
    if local is not None:
        return local, True
    local = _IN_PROCESS[token] = ProcessLocal(model_fn)
    return local, False
