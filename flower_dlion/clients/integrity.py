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
import torch
from flwr.app import RecordDict

from ..anchored_counts import Segment
from ..lion import MAX_DECAY
from ..params import ModelSpec, layout_fingerprint
from ..protocol import CODED_STYPE, CONFIG, REST, SERVER_UPDATE, ClientStateError
from .resident import NodeState, ReplicaPool
from .state import crc32

__all__ = [
    "check_layout",
    "check_part",
    "check_segment",
    "check_steps",
    "count_segments",
    "full_x",
    "received_rest",
    "verified",
]


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


# --------------------------------------------------------------------------- the message's parts, read and checked
def full_x(content: RecordDict, env: Any) -> tuple[np.ndarray, int]:
    """The float32 model (or anchor) of a full message, checked (a host array), and its CRC-32."""
    d, node_id = env.d, env.node_id
    payload = content[SERVER_UPDATE]["payload"].numpy()
    if payload.shape != (d,) or payload.dtype != np.float32:
        raise ClientStateError(
            f"node {node_id}: full model has {payload.shape} {payload.dtype}, expected ({d},) float32"
        )
    if not np.isfinite(payload).all():
        raise ClientStateError(f"node {node_id}: the full model has non-finite values: refused")
    return payload, check_part(content[CONFIG], 0, payload, "the full model", env)


def count_segments(content: RecordDict, round_config: dict, env: Any, first: int, anchor: int) -> list[Segment]:
    """The count segments of an anchored message from a replica anchored at version ``anchor``, checked.

    Their CRC-32s (parts ``first``, …), decay, step and levels.
    """
    node_id = env.node_id
    if SERVER_UPDATE not in content or "counts" not in content[SERVER_UPDATE]:
        raise ClientStateError(f"node {node_id}: an anchored message without its counts")
    arr = content[SERVER_UPDATE]["counts"]
    if arr.stype != CODED_STYPE:
        raise ClientStateError(f"node {node_id}: counts stype {arr.stype!r}, expected {CODED_STYPE!r}")
    data = arr.data
    keys = ("segment-end", "segment-decay", "segment-step", "segment-refresh", "segment-context", "segment-bytes")
    rows = list(zip(*(round_config[k] for k in keys), strict=True))
    levels = list(round_config.get("segment-levels", [0] * len(rows)))
    if len(levels) != len(rows) or any(n not in (0, 2, 3) for n in levels):
        raise ClientStateError(f"node {node_id}: segment levels {levels} (0, 2 or 3 for each of {len(rows)}): refused")
    if sum(int(r[-1]) for r in rows) != len(data) or not rows:
        raise ClientStateError(f"node {node_id}: counts payload has {len(data)} bytes, its segments say otherwise")
    out, offset = [], 0
    for i, ((end, decay, step, refresh, context, nbytes), num_levels) in enumerate(zip(rows, levels, strict=True)):
        check_segment(decay, step, int(end) - anchor, env)
        anchor = int(end) if refresh else anchor
        payload = bytes(data[offset : offset + nbytes])
        check_part(round_config, first + i, payload, f"count segment {i + 1} of {len(rows)}", env)
        out.append(
            Segment(
                end=int(end),
                decay=float(decay),
                step=float(step),
                refresh=bool(refresh),
                context=bool(context),
                payload=payload,
                levels=int(num_levels),
            )
        )
        offset += nbytes
    return out


def check_layout(round_config: dict, spec: ModelSpec, node_id: int) -> None:
    """Refuse a model whose layout (the server's fingerprint, where it sends one) is not this client's."""
    ours = layout_fingerprint(spec.layout)
    if round_config.get("layout", ours) != ours:
        raise ClientStateError(f"node {node_id}: server model layout {round_config['layout']} != client's {ours}")


def received_rest(content: RecordDict, env: Any) -> dict[str, torch.Tensor]:
    """The buffers of a full model, checked against the spec, on the device."""
    spec, node_id = env.spec, env.node_id
    if not spec.rest:
        return {}
    record = content[REST] if REST in content else None
    names = [e.name for e in spec.rest]
    if record is None or list(record.keys()) != names:
        got = [] if record is None else list(record.keys())
        raise ClientStateError(f"node {node_id}: full model's buffers are {got}, expected {names}")
    rest = {}
    for e in spec.rest:
        a = record[e.name].numpy()
        if a.shape != e.shape:
            raise ClientStateError(f"node {node_id}: {e.name!r} has shape {a.shape}, the model's is {e.shape}")
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise ClientStateError(f"node {node_id}: {e.name!r} has non-finite values")
        rest[e.name] = env.placement.to_device(a)
    return rest
