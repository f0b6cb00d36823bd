"""What a node checks before it keeps anything a train message brings: each part's CRC, and x's.

The server sends, with every train message (:mod:`flower_dlion.strategies.downlink`):

* ``payload-crc``: the CRC-32 of each part of the payload, in the order the node reads them
  (the float32 model or anchor, then each Δ of the chain or each count segment). A part is
  checked before it is decoded: a flipped byte in the packed levels, the entropy-coded counts,
  a chain update or the full model is refused before anything is applied.
* ``x-checksum`` (:attr:`~flower_dlion.round_records.RoundConfig.checksum`): the CRC-32 of the
  server's x at the message's version. The node's replica after the message must have it;
  whatever else went wrong (a changed decay, scale or rate, a replica that was wrong before
  the message) is found here, before the replica is used, stored or answered with.

Either mismatch raises :class:`~flower_dlion.protocol.ClientStateError` naming the node and
the round: the node replies with that error (a resync request), keeps its state as it was,
and the server sends it the full model (or x₀'s seed and the Δs since) in its next message.
Messages without these keys (an older server) are not checked.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from ..lion import MAX_DECAY
from ..protocol import ClientStateError
from .resident import NodeState, ReplicaPool
from .state import crc32

__all__ = ["check_part", "check_segment", "check_steps", "verified"]


def check_part(round_config: Any, index: int, data: bytes | np.ndarray, what: str, env: Any) -> int:
    """Check part ``index`` of a message's payload against its ``payload-crc``; return its CRC-32.

    ``what`` names the part in the error ("Δ 2 of 3", "the full model", "count segment 1 of 2");
    ``env`` is the message's :class:`~.replica.Apply` (the node and the round).

    Raises
    ------
    ClientStateError
        The part's CRC-32 is not the server's, or the server's list has no entry for it.

    """
    crc = zlib.crc32(data) if isinstance(data, bytes) else crc32(data)  # an array: x's checksum, as replies carry
    sent = round_config.get("payload-crc")
    if sent is None:  # an older server: nothing to check against
        return crc
    where = f"node {env.node_id}, round {env.round.server_round}"
    if not 0 <= index < len(sent):
        raise ClientStateError(
            f"{where}: the message's payload-crc has {len(sent)} entries, none for {what}: "
            "refused, nothing applied (a resync request)"
        )
    if crc != sent[index]:
        raise ClientStateError(
            f"{where}: {what} fails its checksum (CRC-32 {crc}, the server's {sent[index]}): "
            "refused, nothing applied (a resync request)"
        )
    return crc


def verified(node: NodeState, expected: int | None, server_round: int, node_id: int, pool: ReplicaPool) -> NodeState:
    """``node`` if its replica's CRC-32 is the server's ``expected`` (None: not checked).

    Raises
    ------
    ClientStateError
        The replica differs: it is dropped from ``pool`` (never used, stored or answered with).

    """
    if expected is None or node.replica.checksum == expected:
        return node
    pool.discard(node.replica)
    raise ClientStateError(
        f"node {node_id}, round {server_round}: its replica at version {node.version} has checksum "
        f"{node.replica.checksum}, the server's x has {expected}: not kept (a resync request)"
    )


def check_steps(round_config: dict, node_id: int) -> list[tuple[int, float, float]]:
    """(levels, lr, weight decay) of each received Δ, each in range, or ClientStateError."""
    steps = list(zip(round_config["num-levels"], round_config["lr"], round_config["weight-decay"], strict=True))
    for num_levels, lr, wd in steps:
        if not (isinstance(num_levels, int) and 2 <= num_levels <= 1 << 16):
            raise ClientStateError(f"node {node_id}: a Δ with {num_levels!r} levels (2 to 65536 allowed): refused")
        if not (math.isfinite(lr) and math.isfinite(wd) and lr >= 0 and wd >= 0 and lr * wd <= MAX_DECAY):
            raise ClientStateError(
                f"node {node_id}: a Δ with lr {lr!r} and weight decay {wd!r} (finite, >= 0, lr·wd <= {MAX_DECAY} "
                "allowed): refused"
            )
    return steps


def check_segment(decay: float, step: float, versions: int, env: Any) -> None:
    """Refuse a count segment whose decay or step is out of range (ClientStateError naming them).

    A segment ``versions`` rounds past its anchor has ``decay = γ^versions`` with
    ``γ = 1 − lr·wd·K ≥ 1 −`` :data:`~flower_dlion.lion.MAX_DECAY` (the server's options refuse
    more), so ``(1 − MAX_DECAY)^versions ≤ decay ≤ 1``; the step ``η = lr·K`` is finite and >= 0.
    ``env``: the message's :class:`~.replica.Apply` (the node and the round).
    """
    floor = (1.0 - MAX_DECAY) ** max(versions, 1)
    if not (math.isfinite(decay) and math.isfinite(step) and floor <= decay <= 1.0 and step >= 0.0 and versions >= 1):
        raise ClientStateError(
            f"node {env.node_id}, round {env.round.server_round}: a segment with decay {decay!r} and step {step!r}, "
            f"{versions} round(s) past its anchor ({1.0 - MAX_DECAY:g}**{versions} <= decay <= 1, step >= 0): "
            "refused, nothing applied (a resync request)"
        )
