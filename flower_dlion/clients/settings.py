"""How a D-Lion client runs on its node: :class:`ClientSettings` (device, where the state goes, limits).

Checked when they are made (``ValueError`` naming the setting, the value and what is allowed);
:func:`resolve_device` turns ``device`` into a torch device, or says this node has no CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol import ClientStateError
from ..round_records import MAX_BATCHES

__all__ = ["MAX_BATCHES", "ClientSettings", "DeviceMemoryError", "positive", "resolve_device"]


@dataclass(frozen=True)
class ClientSettings:
    """Where a node computes and keeps its state.

    Parameters
    ----------
    device : str (default: "auto")
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``.
    state_dir : str | None (default: None)
        A folder for state files (``<state_dir>/<run>/<node>/slot-<i>.state``): the node's state
        survives a SuperNode restart and a resumed ServerApp finds it; on a Ray cluster, shared
        storage lets a virtual client find its state on any machine. None:
        ``$FLOWER_DLION_STATE_DIR``, else a folder in the temporary directory (with
        ``state_in_context=True``: no files).
    state_in_context : bool | None (default: None)
        Keep the state in ``context.state`` (which Flower serializes with every message and the
        simulation keeps for every client it ever touched: ~9 bytes a parameter each) instead of
        files: it then follows a virtual client to any machine of a Ray cluster without shared
        storage. None or False: files (:mod:`.state_home`), whose memory does not grow with the
        number of clients.
    momentum_dtype : {"float32", "bfloat16"} (default: "float32")
        How m is stored between rounds (bfloat16: half the bytes; computed in float32).
    max_resident : int | None (default: None)
        How many nodes' states (m, e: 4–8 bytes a parameter each) this process keeps on the
        device between their messages. None: as many as fit in a quarter of the device's memory
        (the host's for the CPU); 0: none (every message starts from the persisted copy).
    link_mbps : float | None (default: None)
        The node's downlink in Mbit/s, for one choice: whether it asks for each Δ coded with the
        two before it as context (~20 % fewer bytes down, an entropy decode of every value on the
        host), which it does while that saves time (:mod:`.link`). None: the node config's
        ``link-mbps`` if it has one, else the client never asks.
    max_batches : int (default: 1000)
        The most batches one round may take (``local-steps × accumulate``): a server that asks
        for more is refused (:class:`~flower_dlion.round_records.RoundConfig`), so none can keep the node busy
        for ever.

    """

    device: str = "auto"
    state_dir: str | None = None
    state_in_context: bool | None = None
    momentum_dtype: str = "float32"
    max_resident: int | None = None
    link_mbps: float | None = None
    max_batches: int = MAX_BATCHES

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        if self.momentum_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"momentum_dtype must be 'float32' or 'bfloat16', got {self.momentum_dtype!r}")
        if self.state_in_context not in (None, True, False):
            raise ValueError(f"state_in_context must be True, False or None (auto), got {self.state_in_context!r}")
        if self.max_resident is not None and not (
            isinstance(self.max_resident, int) and not isinstance(self.max_resident, bool) and self.max_resident >= 0
        ):
            raise ValueError(f"max_resident must be an int >= 0 or None (auto), got {self.max_resident!r}")
        if self.link_mbps is not None and not positive(self.link_mbps):
            raise ValueError(f"link_mbps must be a finite number > 0 (Mbit/s) or None, got {self.link_mbps!r}")
        if not (isinstance(self.max_batches, int) and not isinstance(self.max_batches, bool) and self.max_batches >= 1):
            raise ValueError(f"max_batches must be an int >= 1, got {self.max_batches!r}")


def positive(value: object) -> bool:
    """Whether ``value`` is a finite number > 0 (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < float(value) < float("inf")


class DeviceMemoryError(RuntimeError):
    """The client's device ran out of memory; the message says how large the model is and what to set."""


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ClientStateError(f"device {name!r} requested but torch.cuda.is_available() is False on this node")
    return torch.device(name)
