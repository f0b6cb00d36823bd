"""Bringing a client's replica to the server's version: the full model, x₀ from a seed, or the missed Δs.

What a train message says about x (``protocol.CONFIG`` ``kind``):

* ``"full"``: the whole model (x, and the rest of the model: frozen parameters and buffers);
* ``"deltas"``: the encoded Δs from ``base-version`` to ``version``, applied in order as the
  server applied them, ``x ← x − lr·(Δ + wd·x)`` (:func:`quantizers.apply_delta_`); Δs the
  replica already has (its reply was lost) are skipped;
* ``"counts"`` (the anchored downlink, :mod:`flower_dlion.downlink`): entropy-coded count
  segments from ``base-version`` (one per anchor crossed), ``x = γ·xₐ − η·C``; with the anchored
  downlink a ``"full"`` message carries the anchor xₐ (at ``anchor-version``) and the segments
  since it;
* ``"none"``: the replica is current;
* with ``init-seed`` (a node without state, ``init = "seed"``): build x₀ from the seed, check
  it against the server's checksum, then apply the Δs since version 0.

Anything that does not fit the replica, or is out of range (a level above L − 1, a
non-finite or negative scale, a learning rate or decay that would not shrink x, a non-finite
model), raises :class:`ClientStateError` naming the problem; the state is then left as it was
(nothing is stored) and the server sends the full model next time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from flwr.app import RecordDict

from .. import codec, downlink, entropy, quantizers
from ..params import ModelSpec, layout_fingerprint, state_checksum
from ..protocol import BROADCAST, CODED_STYPE, CONFIG, LEVELS_STYPE, REST, SEED_MISMATCH
from .state import ClientStateError, ReplicaState

__all__ = ["SCALE_LIMIT", "SeedFn", "apply_message"]

SCALE_LIMIT = 1e6  # a Δ's per-tensor scale is in steps of lr: no Lion update is a million steps

SeedFn = Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor]]]  # seed → (x₀, rest₀) on the device


def apply_message(
    content: RecordDict,
    state: ReplicaState | None,
    spec: ModelSpec,
    device: torch.device,
    node_id: int,
    seed_fn: SeedFn | None = None,
) -> ReplicaState:
    """The replica at the version the server sent (``state`` is updated in place where it can be)."""
    round_config = content[CONFIG]
    kind, version, d = round_config["kind"], int(round_config["version"]), spec.d
    if kind == "full" or (state is None and "init-seed" in round_config):
        _check_layout(round_config, spec, node_id)
    if kind == "counts" or (kind == "full" and "anchor-version" in round_config):
        return _apply_anchored(content, state, spec, device, node_id, seed_fn)
    if kind == "full":
        x = _full_x(content, d, node_id).to(device)
        rest = _received_rest(content, spec, device, node_id)
        if state is None:
            return ReplicaState(x, torch.zeros(d, device=device), version, rest=rest)
        return ReplicaState(x, state.m, version, state.error, rest=rest)  # a resync keeps its momentum
    if state is None and "init-seed" in round_config:
        state = _seeded_state(round_config, spec, device, node_id, seed_fn)
    if state is None:
        raise ClientStateError(
            f"node {node_id} has no replica (new node, or its state was lost) but received kind={kind!r}; "
            "the server must send the full model"
        )
    base = int(round_config["base-version"])
    if kind == "none" and state.version != base:
        raise ClientStateError(f"node {node_id}: replica at version {state.version}, server's is {base}")
    if not base <= state.version <= version:
        raise ClientStateError(
            f"node {node_id}: replica at version {state.version}, update goes from version {base} to {version}"
        )
    if kind == "deltas":
        _apply_deltas(content, state, spec, device, node_id, skip=state.version - base)
    elif kind != "none":
        raise ClientStateError(f"node {node_id}: unknown update kind {kind!r}")
    state.version = version
    return state


def _apply_anchored(
    content: RecordDict,
    state: ReplicaState | None,
    spec: ModelSpec,
    device: torch.device,
    node_id: int,
    seed_fn: SeedFn | None,
) -> ReplicaState:
    """The anchored downlink: the base (own state, x₀ from the seed, or the anchor sent), then the count segments."""
    round_config = content[CONFIG]
    kind, version, d = round_config["kind"], int(round_config["version"]), spec.d
    m, error, rest = torch.zeros(d, device=device), None, {}
    if state is not None:
        m, error, rest = state.m, state.error, state.rest
    if kind == "full":  # the anchor, then the counts since it
        anchor = _full_x(content, d, node_id)
        rest = _received_rest(content, spec, device, node_id)
        base = downlink.Replica(anchor.to(device), int(round_config["anchor-version"]), _zeros(d, device), 0)
        base.version = base.anchor_version
    elif "init-seed" in round_config:  # a new node, or one whose replica the server no longer trusts
        seeded = _seeded_state(round_config, spec, device, node_id, seed_fn)
        base = downlink.Replica(seeded.x, 0, _zeros(d, device), 0)
        rest = rest if state is not None else seeded.rest
    elif state is None or state.anchor is None or state.counts is None:
        raise ClientStateError(
            f"node {node_id} has no replica (new node, or its state was lost) but received kind={kind!r}; "
            "the server must send the full model"
        )
    else:
        base = downlink.Replica(
            state.anchor, state.anchor_version, state.counts, state.version,
            None if state.recent is None else state.recent.cpu().numpy(), state.recent_version, state.depth,
        )  # fmt: skip
        sent_from = int(round_config["base-version"])
        if state.version != sent_from and state.previous == sent_from and state.version == version:
            return state  # it applied these counts before (its reply was lost): already current
        if state.version != sent_from and state.previous == sent_from and state.undo:
            try:  # its last catch-up's reply was lost: back to where the server thinks it is
                base = _undo(base, state, spec)
            except ValueError as err:
                raise ClientStateError(f"node {node_id}: its last catch-up cannot be taken back ({err})") from err
        elif state.version != sent_from:
            raise ClientStateError(
                f"node {node_id}: replica at version {state.version}, the counts are from version {sent_from}"
            )
    x, previous, undo = None, -1, b""
    if "segment-end" in round_config:
        segments = _segments(content, round_config, node_id)
        limit = int(round_config["anchor-every"]) * int(round_config.get("local-steps", 1))
        before = base
        try:
            base, x = downlink.apply_segments(base, segments, entropy.blocks_of(spec.sizes), limit)
        except ValueError as err:  # CodingError too
            raise ClientStateError(f"node {node_id}, round {round_config['server-round']}: {err}: refused") from err
        if len(segments) == 1 and not segments[0].refresh:  # what it takes to go back, should the reply be lost
            previous, undo = before.version, b"C" + segments[0].payload
            if segments[0].context:  # its decoder needs a context the replica no longer holds: keep the trits
                trits = (base.counts - before.counts + 1).to(torch.uint8).cpu()  # uint8: the fast trit packer
                undo = b"T" + codec.encode_levels(trits, 3).numpy().tobytes()
    if base.version != version:
        raise ClientStateError(f"node {node_id}: the counts reach version {base.version}, the server's is {version}")
    if x is None:  # a full message at the anchor's version: x is the anchor
        x = base.anchor.clone()
    recent = None if base.recent is None else torch.from_numpy(base.recent).to(device)
    return ReplicaState(
        x, m, version, error, rest=rest, anchor=base.anchor, counts=base.counts, recent=recent,
        anchor_version=base.anchor_version, recent_version=base.recent_version, depth=base.depth,
        previous=previous, undo=undo,
    )  # fmt: skip


def _undo(replica: downlink.Replica, state: ReplicaState, spec: ModelSpec) -> downlink.Replica:
    """The replica as it was before its last catch-up (same anchor): C minus that catch-up's counts."""
    d, kind, data = spec.d, state.undo[:1], state.undo[1:]
    if kind == b"C":  # the coded counts as received
        taken = torch.from_numpy(entropy.decode(data, d, entropy.blocks_of(spec.sizes)))
    else:  # b"T": one Δ as packed trits
        taken = codec.decode_levels(data, 3, d).sub_(1)
    counts = replica.counts - taken.to(replica.counts.device, torch.int32)
    return downlink.Replica(replica.anchor, replica.anchor_version, counts, state.previous)


def _zeros(d: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(d, dtype=torch.int32, device=device)


def _full_x(content: RecordDict, d: int, node_id: int) -> torch.Tensor:
    """The float32 model (or anchor) of a full message, checked."""
    payload = content[BROADCAST]["payload"].numpy()
    if payload.shape != (d,) or payload.dtype != np.float32:
        raise ClientStateError(
            f"node {node_id}: full model has {payload.shape} {payload.dtype}, expected ({d},) float32"
        )
    if not np.isfinite(payload).all():
        raise ClientStateError(f"node {node_id}: the full model has non-finite values: refused")
    return torch.from_numpy(payload.copy())


def _segments(content: RecordDict, round_config: dict, node_id: int) -> list[downlink.Segment]:
    """The count segments of an anchored message, with their decay and step checked."""
    if BROADCAST not in content or "counts" not in content[BROADCAST]:
        raise ClientStateError(f"node {node_id}: an anchored message without its counts")
    arr = content[BROADCAST]["counts"]
    if arr.stype != CODED_STYPE:
        raise ClientStateError(f"node {node_id}: counts stype {arr.stype!r}, expected {CODED_STYPE!r}")
    data = arr.data
    keys = ("segment-end", "segment-decay", "segment-step", "segment-refresh", "segment-context", "segment-bytes")
    rows = list(zip(*(round_config[k] for k in keys), strict=True))
    if sum(int(r[-1]) for r in rows) != len(data) or not rows:
        raise ClientStateError(f"node {node_id}: counts payload has {len(data)} bytes, its segments say otherwise")
    out, offset = [], 0
    for end, decay, step, refresh, context, nbytes in rows:
        if not (math.isfinite(decay) and math.isfinite(step) and 0.0 < decay <= 1.0 and step >= 0.0):
            raise ClientStateError(
                f"node {node_id}: a segment with decay {decay!r} and step {step!r} (0 < decay <= 1, step >= 0): refused"
            )
        out.append(downlink.Segment(int(end), float(decay), float(step), bool(refresh), bool(context),
                                    bytes(data[offset : offset + nbytes])))  # fmt: skip
        offset += nbytes
    return out


def _check_layout(round_config: dict, spec: ModelSpec, node_id: int) -> None:
    ours = layout_fingerprint(spec.layout)
    if round_config.get("layout", ours) != ours:
        raise ClientStateError(f"node {node_id}: server model layout {round_config['layout']} != client's {ours}")


def _received_rest(content: RecordDict, spec: ModelSpec, device: torch.device, node_id: int) -> dict[str, torch.Tensor]:
    """The frozen parameters and buffers of a full model, checked against the spec."""
    if not spec.rest:
        return {}
    record = content[REST] if REST in content else None
    names = [e.name for e in spec.rest]
    if record is None or list(record.keys()) != names:
        got = [] if record is None else list(record.keys())
        raise ClientStateError(
            f"node {node_id}: full model's frozen parameters and buffers are {got}, expected {names}"
        )
    rest = {}
    for e in spec.rest:
        a = record[e.name].numpy()
        if a.shape != e.shape:
            raise ClientStateError(f"node {node_id}: {e.name!r} has shape {a.shape}, the model's is {e.shape}")
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise ClientStateError(f"node {node_id}: {e.name!r} has non-finite values")
        rest[e.name] = torch.from_numpy(a.copy()).to(device)
    return rest


def _seeded_state(
    round_config: dict, spec: ModelSpec, device: torch.device, node_id: int, seed_fn: SeedFn | None
) -> ReplicaState:
    """x₀ (and the rest) built from the server's seed, checked against the server's checksum."""
    if seed_fn is None:
        raise ClientStateError(f"node {node_id}: the server sent a seed, but this client cannot build x₀ from one")
    x0, rest0 = seed_fn(int(round_config["init-seed"]))
    mine = state_checksum(x0, rest0)
    if x0.numel() != spec.d or mine != int(round_config["init-checksum"]):
        raise ClientStateError(
            f"node {node_id}: {SEED_MISMATCH} {round_config['init-seed']} has checksum {mine}, the server's is "
            f"{round_config['init-checksum']} (a different torch version?); the server will send the full model"
        )
    return ReplicaState(
        x0.to(device), torch.zeros(spec.d, device=device), 0, rest={k: v.to(device) for k, v in rest0.items()}
    )


def _apply_deltas(
    content: RecordDict, state: ReplicaState, spec: ModelSpec, device: torch.device, node_id: int, *, skip: int
) -> None:
    """X ← x − lr·(Δ + wd·x) for each received Δ after the first ``skip`` (those x already has)."""
    round_config, d = content[CONFIG], spec.d
    sizes = scale_sizes(spec.sizes, round_config, node_id)
    arr = content[BROADCAST]["payload"]
    if arr.stype != LEVELS_STYPE:
        raise ClientStateError(f"node {node_id}: update stype {arr.stype!r}, expected {LEVELS_STYPE!r}")
    buf = codec.as_uint8(arr.data).to(device)  # packed bytes go to the device
    scales = list(round_config.get("scales", []))
    steps = _check_steps(round_config, node_id)
    if scales and len(scales) != len(steps) * len(sizes):
        raise ClientStateError(f"node {node_id}: {len(scales)} scales for {len(steps)} Δs of {len(sizes)} scales each")
    if not all(isinstance(s, float | int) and 0.0 <= s <= SCALE_LIMIT for s in scales):  # also refuses nan
        bad = next(s for s in scales if not (isinstance(s, float | int) and 0.0 <= s <= SCALE_LIMIT))
        raise ClientStateError(f"node {node_id}: a Δ scale is {bad!r}, outside [0, {SCALE_LIMIT:g}]: refused")
    offset = 0
    for i, (num_levels, lr, wd) in enumerate(steps):
        size = codec.encoded_size(d, num_levels)
        narrow = num_levels <= 256 and not scales  # bytes: a quarter of int32's memory; apply_levels_ reads them
        try:
            levels = codec.decode_levels(
                buf[offset : offset + size], num_levels, d, torch.uint8 if narrow else torch.int32
            )
        except ValueError as err:
            raise ClientStateError(f"node {node_id}: Δ {i + 1} of {len(steps)} does not decode: {err}") from err
        s = None
        if scales:
            s = torch.tensor(scales[i * len(sizes) : (i + 1) * len(sizes)], dtype=torch.float32, device=device)
        if i >= skip:  # x ← x − lr·(Δ + wd·x), as the server applied it
            quantizers.apply_delta_(state.x, levels, num_levels, s, sizes, lr, wd)
        offset += size
    if offset != buf.numel():
        raise ClientStateError(f"node {node_id}: update has {buf.numel()} bytes, its Δs use {offset}")


def scale_sizes(sizes: list[int], round_config: dict, node_id: int) -> list[int]:
    """The values under each scale of an upload or a Δ: the tensors cut into ``scale-block`` blocks (0: whole)."""
    block = round_config.get("scale-block", 0)
    if not (isinstance(block, int) and not isinstance(block, bool) and 0 <= block <= 1 << 31):
        raise ClientStateError(f"node {node_id}: scale-block {block!r} (an int in [0, 2**31] allowed): refused")
    return quantizers.scale_blocks(sizes, block)


def _check_steps(round_config: dict, node_id: int) -> list[tuple[int, float, float]]:
    """(levels, lr, weight decay) of each received Δ, each in range, or ClientStateError."""
    steps = list(zip(round_config["num-levels"], round_config["lr"], round_config["weight-decay"], strict=True))
    for num_levels, lr, wd in steps:
        if not (isinstance(num_levels, int) and 2 <= num_levels <= 1 << 16):
            raise ClientStateError(f"node {node_id}: a Δ with {num_levels!r} levels (2 to 65536 allowed): refused")
        if not (math.isfinite(lr) and math.isfinite(wd) and lr >= 0 and wd >= 0 and lr * wd < 1):
            raise ClientStateError(
                f"node {node_id}: a Δ with lr {lr!r} and weight decay {wd!r} (finite, >= 0, lr·wd < 1 allowed): refused"
            )
    return steps
