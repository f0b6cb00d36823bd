"""What :class:`~flower_dlion.strategies.dlion.DistributedLion` keeps: between rounds, and within one.

:class:`ServerState` is what the server keeps besides x (and all a checkpoint needs of it); a
:class:`Broadcast` is one applied Δ kept encoded for clients that fall behind; :class:`Round` is
what the strategy sent in the round in progress, and :class:`ValidReply` one reply that passed
its checks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..anchored_counts import AnchoredHistory
from ..uploads import Parsed

__all__ = ["Broadcast", "Round", "ServerState", "ValidReply"]


@dataclass
class Broadcast:
    """One applied Δ, kept encoded so that lagging clients can replay it (the chain downlink)."""

    version: int  # x's version after applying it
    num_levels: int
    lr: float
    weight_decay: float
    payload: bytes
    scales: tuple[float, ...] | None = None  # one per tensor; None: scale 1


@dataclass
class ServerState:
    """What the server keeps between rounds besides x, and all a checkpoint needs of it.

    ``to_dict`` / ``from_dict`` are the checkpoint's conversion (torch-saveable values only).
    """

    version: int = 0  # Δs applied to x since the start
    broadcasts: deque[Broadcast] = field(default_factory=deque)  # the last Δs, encoded, for lagging clients
    version_of: dict[int, int] = field(default_factory=dict)  # partition → its replica's version (last valid reply)
    server_error: torch.Tensor | None = None  # error feedback of a quantized broadcast
    outer_momentum: torch.Tensor | None = None  # M of the server's Nesterov momentum on Δ (server_momentum > 0)
    synced_momentum: torch.Tensor | None = None  # the median of the last sync round's momenta, to send next
    seed_failed: set[int] = field(default_factory=set)  # partitions whose x₀ from the seed did not match
    x0_checksum: int = 0  # of x₀ and the rest of the model, for clients that build x₀ from the seed
    anchored: AnchoredHistory | None = None  # the anchored downlink's anchor, counts and kept history
    context_of: dict[int, int] = field(default_factory=dict)  # partition → version whose last two Δs it holds

    def to_dict(self) -> dict[str, Any]:
        """The state as plain values (copies)."""
        return {
            "version": self.version,
            "broadcasts": [vars(b).copy() for b in self.broadcasts],
            "version_of": dict(self.version_of),
            "server_error": None if self.server_error is None else self.server_error.clone(),
            "outer_momentum": None if self.outer_momentum is None else self.outer_momentum.clone(),
            "synced_momentum": None if self.synced_momentum is None else self.synced_momentum.clone(),
            "seed_failed": sorted(self.seed_failed),
            "x0_checksum": self.x0_checksum,
            "anchored": None if self.anchored is None else self.anchored.to_dict(),
            "context_of": dict(self.context_of),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> ServerState:
        """Inverse of :meth:`to_dict`."""
        return cls(
            version=int(state["version"]),
            broadcasts=deque(Broadcast(**b) for b in state["broadcasts"]),
            version_of={int(p): int(v) for p, v in state["version_of"].items()},
            server_error=state["server_error"],
            outer_momentum=state.get("outer_momentum"),  # absent from checkpoints before it existed
            synced_momentum=state["synced_momentum"],
            seed_failed=set(state["seed_failed"]),
            x0_checksum=int(state["x0_checksum"]),
            anchored=None if state["anchored"] is None else AnchoredHistory.from_dict(state["anchored"]),
            context_of={int(p): int(v) for p, v in state["context_of"].items()},
        )


@dataclass
class Round:
    """What the strategy sent in the round in progress (made by ``configure_train``, read by ``aggregate_train``)."""

    server_round: int
    base_version: int
    base_checksum: int
    sent: dict[int, str] = field(default_factory=dict)  # node id → kind sent
    seeded: set[int] = field(default_factory=set)  # nodes told to build x₀ from the seed
    chain_lengths: dict[int, int] = field(default_factory=dict)  # node id → number of Δs sent
    momentum_sync: bool = False  # clients upload their momentum this round
    buffer_sync: bool = False  # clients upload their buffers this round
    bytes_down: int = 0
    bytes_down_fp32: int = 0
    lr: float = 0.0  # the round's learning rate, lr · lr_schedule(server_round)
    participants: list[int] = field(default_factory=list)  # secure aggregation: the keys masking together
    crcs: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # id(payload) → (payload, its CRC-32)


@dataclass(frozen=True)
class Unmasked:
    """What secure aggregation's unmasking gives: the counts' bit planes and, in a buffer round, the moments' mean."""

    planes: np.ndarray  # (b, ⌈d/8⌉) uint8: bit j of each coordinate's count of +1 signs
    buffers: np.ndarray | None = None  # the mean of the replies' bounds.buffer_moments, float64


@dataclass
class ValidReply:
    """One client reply that passed its checks, parsed."""

    node_id: int
    upload: Parsed  # its U: the packed signs or encoded levels as received (decoded levels, scales)
    momentum: torch.Tensor | None  # momentum-sync round: the client's momentum of the synced layers
    buffers: torch.Tensor | None  # buffer round: the client's buffers, flat float32
    values: dict[str, float]
    masked_buffers: bytes | None = None  # secure buffer round: the buffers' moments, fixed point, masked
