"""What :class:`~flower_dlion.strategies.dlion.DistributedLion` keeps: between rounds, and within one.

:class:`ServerState` is what the server keeps besides x (and all a checkpoint needs of it); a
:class:`Broadcast` is one applied Δ kept encoded for clients that fall behind; :class:`Round` is
what the strategy sent in the round in progress, :class:`RoundCounts` what it counted, and
:class:`ValidReply` one reply that passed its checks. A refused reply may show that its node's
replica is lost or differs from the server's (:meth:`ServerState.on_rejected`: the full model next time).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..anchored_counts import AnchoredHistory
from ..protocol import CLIENT_STATE_ERROR, SEED_MISMATCH, RejectedReply, WriteFailure
from ..uploads import Parsed

__all__ = ["Broadcast", "Round", "RoundCounts", "ServerState", "ValidReply"]

STATE_LOST = ("has no replica", ": replica at version")  # a client's errors (clients/replica.py) for a state it lacks


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
class RoundCounts:
    """What the round in progress counted, for its metrics (a fresh one each round).

    Attributes
    ----------
    resyncs : int
        Replies that showed a replica checksum or version mismatch (``checksum-mismatches``).
    state_resets : int
        Nodes found without their state since the last round (``state-resets``): by their hello
        (the downlink finds them), or by their reply (no replica, or an older one: a virtual client
        served where its state files are not).
    clipped : int
        ef-sign scales cut to the median (``clipped-scales``).
    write_failures : dict[int, tuple[int, WriteFailure]]
        Nodes whose reply (valid or not) reports that they could not write their state, with
        their partition and the failure (``state-write-failures``; :mod:`.state_writes`).

    """

    resyncs: int = 0
    state_resets: int = 0
    clipped: int = 0
    write_failures: dict[int, tuple[int, WriteFailure]] = field(default_factory=dict)


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
    drift_limits: tuple[float, ...] | None = None  # where the last applied round cut the ef-sign scales, to send next
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
            "drift_limits": self.drift_limits,
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
            drift_limits=state.get("drift_limits"),  # absent from checkpoints before it existed
        )

    def on_rejected(self, pid: int, err: RejectedReply, reason: str, counts: RoundCounts, *, seeded: bool) -> bool:
        """A refused reply of partition ``pid``'s node, sampled this round: what it says about the node's replica.

        The replica is forgotten (the full model next time) when the check found its version or
        checksum unlike the server's (``err.resync``, counted in ``counts.resyncs``) or the client
        says that its replica cannot serve (:data:`~flower_dlion.protocol.CLIENT_STATE_ERROR` in
        ``reason``, its error; "" for a reply that is no error); a node without its state is
        counted in ``counts.state_resets``. Returns True when the node, told to build x₀ from the
        seed (``seeded``), built another: the full model from now on.
        """
        if not (err.resync or CLIENT_STATE_ERROR in reason):
            return False
        self.version_of.pop(pid, None)
        counts.resyncs += int(err.resync)
        counts.state_resets += any(lost in reason for lost in STATE_LOST)  # e.g. on a machine without its files
        if seeded and SEED_MISMATCH in reason:
            self.seed_failed.add(pid)
            return True
        return False


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

    def check_base(self, values: dict[str, float]) -> None:
        """Check that a reply's replica is the round's base: its metrics ``version`` and ``checksum``.

        Raises
        ------
        RejectedReply
            With ``resync=True`` (the node gets the full model next round), naming what differs.

        """
        if values["version"] != self.base_version:
            raise RejectedReply(
                f"replica at version {values['version']}, expected {self.base_version}: full resync next round",
                resync=True,
            )
        if values["checksum"] != self.base_checksum:
            raise RejectedReply(
                f"replica checksum {values['checksum']} differs from the server's {self.base_checksum}: "
                "full resync next round",
                resync=True,
            )


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
