"""The one place where a client's arrays cross between the host and its compute device.

Host side: the persisted state (:mod:`.state`, numpy arrays), the message's payloads, the
entropy coder, checksums. Device side: the node's state and replicas (:mod:`.resident`,
tensors on the client's device), the model, the Lion step. :class:`Placement` converts between
them, and nothing else in the client moves a tensor across: a CPU client runs exactly the code a
GPU client runs, where these conversions are views instead of copies.

Each crossing is one copy on a GPU: a host array to the device (:meth:`Placement.to_device`),
a tensor to pinned host memory (:meth:`Placement.to_host`, which torch's caching host allocator
reuses). What every node at one version shares (x, the anchor, the counts) crosses once per
version and process, cached on the replica (:meth:`.resident.Replica.on_host`); a node's state
crosses in :meth:`.resident.NodeState.to_host` and :meth:`.resident.NodeState.from_host`, through
the methods here.

Every crossing adds the bytes that cross on a GPU to :attr:`Placement.crossings` (a
:class:`Crossings`), on the CPU too, where nothing is copied: the count is of what crosses, not
of whether a copy was made, so a test on the CPU sees the traffic a GPU client would make. Each
is labelled by its purpose:

========================  ============================================================
``"x-crc"``               x to the host for its checksum, once per replica (its copy is
                          then the persisted x too)
``"x"``, ``"anchor"``,    a replica's x, anchor or counts to the host (persisted, or
``"counts"``              decoded on the host), once per replica
``"m-persist"``           the momentum persisted every message (4·d, or 2·d in bfloat16)
``"e-persist"``,          the error-feedback residual and buffers
``"rest-persist"``        persisted every message
``"drift-persist"``       drift correction's hᵢ persisted every message (4·d)
``"drift"``               drift correction to the device: h each round, and the cut of
                          the last upload's scales (4·d each)
``"delta"``               received bytes to the device (the packed Δ, the packed counts)
``"buffers"``             the buffers a round sends the server
``"load"``                a persisted state to the device (a node not resident)
``"model"``               the user's model to the device (once per client and device)
``"array"``               anything else through :meth:`Placement.to_device` or :meth:`Placement.to_host`
========================  ============================================================

The upload itself (the packed signs, ⌈d/8⌉ bytes) crosses in :func:`flower_dlion.protocol.bits_array`,
not here, and scalars (the loss) and the user's batches cross in :mod:`flower_dlion.params`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

__all__ = ["Crossings", "Placement"]


@dataclass
class Crossings:
    """Bytes that cross between the host and the device (on a GPU), in total and by purpose.

    Attributes
    ----------
    to_device_bytes, to_host_bytes : int
        Bytes to the device and to the host since the last :meth:`take`.
    to_device, to_host : dict[str, int]
        The same bytes by purpose (the labels in the module doc).
    count : int
        How many crossings (each one copy on a GPU).

    """

    to_device_bytes: int = 0
    to_host_bytes: int = 0
    to_device: dict[str, int] = field(default_factory=dict)
    to_host: dict[str, int] = field(default_factory=dict)
    count: int = 0

    def down(self, label: str, nbytes: int) -> None:
        """Count ``nbytes`` to the device for ``label``."""
        self.to_device_bytes += nbytes
        self.to_device[label] = self.to_device.get(label, 0) + nbytes
        self.count += 1

    def up(self, label: str, nbytes: int) -> None:
        """Count ``nbytes`` to the host for ``label``."""
        self.to_host_bytes += nbytes
        self.to_host[label] = self.to_host.get(label, 0) + nbytes
        self.count += 1

    def take(self) -> Crossings:
        """What was counted since the last call (a snapshot); the counters start again from zero."""
        snapshot = Crossings(
            to_device_bytes=self.to_device_bytes,
            to_host_bytes=self.to_host_bytes,
            to_device=self.to_device,
            to_host=self.to_host,
            count=self.count,
        )
        self.to_device_bytes = self.to_host_bytes = self.count = 0
        self.to_device, self.to_host = {}, {}
        return snapshot


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Placement:
    """Moves a client's arrays between the host (numpy) and ``device`` (torch), counting what crosses.

    Parameters
    ----------
    device : torch.device
        The client's compute device.

    Attributes
    ----------
    crossings : Crossings
        The bytes that crossed (on a GPU; counted the same on the CPU) since the last
        ``crossings.take()``.

    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.crossings = Crossings()

    # ------------------------------------------------------------------ arrays
    def model(self, model: nn.Module) -> nn.Module:
        """The user's model on the device (once per client and device)."""
        self.crossings.down("model", sum(_nbytes(t) for t in [*model.parameters(), *model.buffers()]))
        return model.to(self.device)

    def to_device(self, a: np.ndarray, label: str = "array") -> torch.Tensor:
        """A host array as a tensor on the device (the CPU: the same memory), counted under ``label``."""
        if not isinstance(a, np.ndarray):
            raise TypeError(f"to_device takes a host numpy array, got a {type(a).__name__}")
        self.crossings.down(label, a.nbytes)
        t = torch.from_numpy(a if a.flags.writeable else a.copy())
        return t if self.device.type == "cpu" else t.to(self.device)

    def bytes_to_device(self, data: bytes) -> torch.Tensor:
        """Received bytes (a packed Δ, packed counts) as a uint8 tensor on the device."""
        return self.to_device(np.frombuffer(bytearray(data), dtype=np.uint8), "delta")

    def buffers_to_host(self, rest: dict[str, torch.Tensor], names: list[str]) -> np.ndarray:
        """The buffers ``names`` of ``rest``, in that order, as one flat float32 vector on the host."""
        flat = torch.cat([rest[name].detach().reshape(-1).float() for name in names])
        return self.to_host(flat, "buffers")

    def to_host(self, t: torch.Tensor, label: str = "array") -> np.ndarray:
        """A tensor as a host array (the CPU: the same memory; a GPU: one copy into pinned memory).

        Counted under ``label``. bfloat16 comes as its 16 bits (uint16: numpy has no bfloat16).
        """
        t = t.detach()
        self.crossings.up(label, _nbytes(t))
        bits = t.dtype == torch.bfloat16
        if bits:
            t = t.view(torch.int16)
        if t.device.type != "cpu":
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            t = pinned.copy_(t)
        a = t.numpy()
        return a.view(np.uint16) if bits else a
