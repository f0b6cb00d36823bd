"""Bringing a node to the server's version: the full model, x₀ from a seed, or the Δs it missed.

What a train message says about x (``protocol.CONFIG`` ``kind``):

* ``"full"``: the whole model (x, and the rest of the model: its buffers; frozen parameters never travel);
* ``"deltas"``: the encoded Δs from ``base-version`` to ``version``, applied in order as the
  server applied them, ``x ← x − lr·(Δ + wd·x)`` (:func:`quantizers.apply_delta_`); Δs the
  replica already has (its reply was lost) are skipped;
* ``"counts"`` (the anchored downlink, :mod:`flower_dlion.anchored_counts`): count segments from
  ``base-version`` (one per anchor crossed; one Δ as its packed levels, or entropy-coded
  counts), ``x = γ·xₐ − η·C``; with the anchored downlink a ``"full"`` message carries the
  anchor xₐ (at ``anchor-version``) and the segments since it;
* ``"none"``: the replica is current;
* with ``init-seed`` (a node without state, ``init = "seed"``): build x₀ from the seed, check
  it against the server's checksum, then apply the Δs since version 0.

A message applied to a replica makes a new :class:`~.resident.Replica` (replicas are never
changed in place). The process's :class:`~.resident.ReplicaPool` remembers what made it: a
second node that receives the same message at the same version gets the same replica without
decoding or computing it again. The one Δ of an in-sync node is applied on the device in one
step (:func:`anchored_counts.step_counts`: its packed levels go to the device, the counts and x come
out); catch-ups and context-coded Δs are decoded on the host (the entropy coder) and cross once.

Anything that does not fit the replica or is out of range (a level above L − 1, a bad scale, rate
or decay, a non-finite model) raises :class:`ClientStateError` naming the problem; the node's
state is left as it was and the server sends the full model next time.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import RecordDict

from .. import codec, entropy, quantizers
from ..anchored_counts import AnchoredForm, Segment, apply_segments, decode_segment, step_counts
from ..params import ModelSpec, state_checksum
from ..protocol import CONFIG, LEVELS_STYPE, SEED_MISMATCH, SERVER_UPDATE
from ..round_records import RoundConfig
from .integrity import check_layout, check_part, check_steps, count_segments, full_x, received_rest, verified
from .link import ContextChoice
from .placement import Placement
from .resident import NodeState, Replica, ReplicaPool
from .state import ClientStateError, crc32

__all__ = ["SCALE_LIMIT", "Apply", "ApplyFn", "SeedFn", "apply_message", "downlink"]

SCALE_LIMIT = 1e6  # a Δ's per-tensor scale is in steps of lr: no Lion update is a million steps

SeedFn = Callable[[int], tuple[np.ndarray, dict[str, np.ndarray]]]  # seed → (x₀, rest₀) on the host
ApplyFn = Callable[[RecordDict, "NodeState | None", "Apply"], NodeState]  # (content, node, env) → the node after


@dataclass
class Apply:
    """What applying a message needs besides the message itself."""

    placement: Placement  # where the replica lives
    pool: ReplicaPool  # the replicas of this process
    spec: ModelSpec  # the model
    node_id: int  # for messages
    round: RoundConfig  # the round's options, read and checked from the message (RoundConfig.parse)
    seed_fn: SeedFn | None = None  # builds x₀ from a seed
    context: ContextChoice | None = None  # keeps the coder context (the client may ask for Δs coded with it)

    @property
    def d(self) -> int:
        """Length of x."""
        return self.spec.d

    def zeros(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero vector of length d on the device."""
        return torch.zeros(self.d, dtype=dtype, device=self.placement.device)


def apply_message(content: RecordDict, node: NodeState | None, env: Apply) -> NodeState:
    """The node at the version the server sent: ``node``'s own state with a new replica, or a new node.

    Each part of the payload is checked against its CRC-32 before it is decoded, and the new
    replica against the server's checksum of x before it is returned (:mod:`.integrity`).
    """
    round_config = content[CONFIG]
    apply = downlink(round_config)
    if round_config["kind"] == "full" or (node is None and "init-seed" in round_config):
        check_layout(round_config, env.spec, env.node_id)
    after = apply(content, node, env)
    return verified(
        after, expected=env.round.checksum, server_round=env.round.server_round, node_id=env.node_id, pool=env.pool
    )


def downlink(round_config: dict) -> ApplyFn:
    """How a message brings x, chosen once from its ``kind``: the anchored downlink, the full model, or the chain."""
    kind = round_config["kind"]
    if kind == "counts" or (kind == "full" and "anchor-version" in round_config):
        return _apply_anchored
    return _apply_full if kind == "full" else _apply_chain


def _apply_full(content: RecordDict, node: NodeState | None, env: Apply) -> NodeState:
    """The whole model: a replica of it (found, or made once), its buffers; a resync keeps the node's momentum."""
    x, checksum = full_x(content, env)
    replica = env.pool.find((env.round.version, checksum, 0, 0))
    if replica is None:
        replica = Replica(version=env.round.version, x=env.placement.to_device(x), checksum=checksum, host={"x": x})
        replica = env.pool.add(replica)
    rest = received_rest(content, env)
    if node is None:
        return NodeState(replica=replica, m=env.zeros(), rest=rest)
    return NodeState(replica=replica, m=node.m, error=node.error, drift=node.drift, rest=rest)


def _apply_chain(content: RecordDict, node: NodeState | None, env: Apply) -> NodeState:
    """The chain downlink: the Δs the node missed (``"deltas"``) or none (``"none"``), after x₀ from a seed if sent."""
    round_config = content[CONFIG]
    kind, version = round_config["kind"], env.round.version
    if "init-seed" in round_config:  # a new node, or one whose replica the server no longer trusts (x₀, then Δs)
        base, rest = _seeded(round_config, env, anchored=False)
        if node is None:
            node = NodeState(replica=base, m=env.zeros(), rest=rest)
        else:  # a resync keeps the node's momentum and buffers
            node = NodeState(replica=base, m=node.m, error=node.error, drift=node.drift, rest=node.rest)
    if node is None:
        raise ClientStateError(
            f"node {env.node_id} has no replica (new node, or its state was lost) but received kind={kind!r}; "
            "the server must send the full model"
        )
    base_version = int(round_config["base-version"])
    if kind == "none" and node.version != base_version:
        raise ClientStateError(f"node {env.node_id}: replica at version {node.version}, server's is {base_version}")
    if not base_version <= node.version <= version:
        raise ClientStateError(
            f"node {env.node_id}: replica at version {node.version}, "
            f"update goes from version {base_version} to {version}"
        )
    if kind == "deltas":
        replica = _apply_deltas(content, node.replica, env, skip=node.version - base_version)
    elif kind == "none":
        replica = node.replica
    else:
        raise ClientStateError(f"node {env.node_id}: unknown update kind {kind!r}")
    return NodeState(replica=replica, m=node.m, error=node.error, drift=node.drift, rest=node.rest)


# --------------------------------------------------------------------------- the anchored downlink
def _apply_anchored(content: RecordDict, node: NodeState | None, env: Apply) -> NodeState:
    """The anchored downlink: the base (own replica, x₀ from the seed, or the anchor sent), then the count segments."""
    round_config = content[CONFIG]
    kind, version, node_id = round_config["kind"], env.round.version, env.node_id
    m, error, rest = (env.zeros(), None, {}) if node is None else (node.m, node.error, node.rest)
    if kind == "full":  # the anchor, then the counts since it
        anchor, checksum = full_x(content, env)  # its CRC-32 checked and computed once
        rest = received_rest(content, env)
        base = _anchor_replica(anchor, int(round_config["anchor-version"]), env, checksum)
    elif "init-seed" in round_config:  # a new node, or one whose replica the server no longer trusts
        base, rest0 = _seeded(round_config, env, anchored=True)
        rest = rest if node is not None else rest0
    elif node is None or node.replica.anchor is None:
        raise ClientStateError(
            f"node {node_id} has no replica (new node, or its state was lost) but received kind={kind!r}; "
            "the server must send the full model"
        )
    else:
        base = node.replica
        sent_from = int(round_config["base-version"])
        if node.version != sent_from and node.previous == sent_from and node.version == version:
            return node  # it applied these counts before (its reply was lost): already current
        if node.version != sent_from and node.previous == sent_from and node.undo:
            try:  # its last catch-up's reply was lost: back to where the server thinks it is
                base = _undo(base, node, env)
            except ValueError as err:
                raise ClientStateError(f"node {node_id}: its last catch-up cannot be taken back ({err})") from err
        elif node.version != sent_from:
            raise ClientStateError(
                f"node {node_id}: replica at version {node.version}, the counts are from version {sent_from}"
            )
    previous, undo, replica = -1, b"", base
    if "segment-end" in round_config:
        segments = count_segments(content, round_config, env, first=int(kind == "full"), anchor=base.anchor_version)
        limit = int(round_config["anchor-every"]) * env.round.local_steps
        try:
            replica, undo = _advance(base, segments, limit, env)
        except ValueError as err:  # CodingError too
            raise ClientStateError(f"node {node_id}, round {env.round.server_round}: {err}: refused") from err
        if undo:
            previous = base.version
    if replica.version != version:
        raise ClientStateError(f"node {node_id}: the counts reach version {replica.version}, the server's is {version}")
    return NodeState(replica=replica, m=m, error=error, rest=rest, previous=previous, undo=undo)


def _anchor_replica(anchor: np.ndarray, anchor_version: int, env: Apply, checksum: int | None = None) -> Replica:
    """The replica at an anchor sent in full (its CRC-32 if known): x = xₐ, C = 0."""
    checksum = crc32(anchor) if checksum is None else checksum
    ident = (anchor_version, checksum, anchor_version, checksum)
    found = env.pool.find(ident)
    if found is not None:
        return found
    on_device = env.pool.anchor(anchor_version, checksum)
    if on_device is None:
        on_device = env.placement.to_device(anchor)
    replica = Replica(
        version=anchor_version,
        x=on_device.clone(),
        checksum=checksum,
        anchor=on_device,
        anchor_version=anchor_version,
        anchor_checksum=checksum,
        counts=env.zeros(torch.int32),
        host={"x": anchor, "anchor": anchor},
    )
    return env.pool.add(replica)


def _advance(base: Replica, segments: list[Segment], limit: int, env: Apply) -> tuple[Replica, bytes]:
    """The replica after ``segments`` (made once per process) and the record that undoes a one-segment catch-up."""
    keep_context = env.context is not None and env.context.keeps
    key = ("segments", base.ident, keep_context, tuple(_fingerprint(s) for s in segments))
    made = env.pool.made(key)
    if made is not None:
        return made
    t0 = time.perf_counter()
    seg = segments[0]
    if len(segments) == 1 and seg.levels and not keep_context:
        replica, undo = _step(base, seg, limit, env)
    else:
        replica, undo = _decode_on_host(base, segments, limit, env, keep_context)
    if env.context is not None and len(segments) == 1 and seg.end == base.version + 1:
        env.context.observe(seg, time.perf_counter() - t0, env.d)
    return env.pool.add(replica, key, undo), undo


def _fingerprint(seg: Segment) -> tuple:
    payload = (len(seg.payload), zlib.crc32(seg.payload))
    return (seg.end, seg.decay, seg.step, seg.refresh, seg.context, seg.levels, *payload)


def _step(base: Replica, seg: Segment, limit: int, env: Apply) -> tuple[Replica, bytes]:
    """One Δ as packed levels, applied on the device: C' = C + L and x' = γ·xₐ − η·C' in one step."""
    assert base.anchor is not None and base.counts is not None
    if seg.end != base.version + 1 or seg.end - base.anchor_version > limit:
        raise ValueError(f"a packed Δ to version {seg.end} from version {base.version} (anchor {base.anchor_version})")
    packed = env.placement.bytes_to_device(seg.payload)
    out, scratch = (env.pool.buffer(base.counts), env.pool.buffer(base.x)), env.pool.buffer(base.x)
    try:
        counts, x = step_counts(
            base.anchor, base.counts, packed, seg.levels, seg.decay, seg.step, out=out, scratch=scratch
        )
    finally:
        env.pool.give(scratch)
    anchor, anchor_version, anchor_checksum = base.anchor, base.anchor_version, base.anchor_checksum
    replica = Replica.of(x, seg.end, env.placement)
    if seg.refresh:  # x becomes the anchor: C ← 0
        anchor, anchor_version, anchor_checksum = x.clone(), seg.end, replica.checksum
        counts.zero_()
        replica.host["anchor"] = replica.host["x"]
    elif "anchor" in base.host:
        replica.host["anchor"] = base.host["anchor"]
    replica.anchor, replica.anchor_version, replica.anchor_checksum = anchor, anchor_version, anchor_checksum
    replica.counts, replica.step = counts, seg.step
    replica.decay = 1.0 if seg.refresh else seg.decay  # x = γ·xₐ − η·C: at a new anchor, γ = 1 and C = 0
    undo = b"" if seg.refresh else b"L" + bytes([seg.levels]) + seg.payload
    return replica, undo


def _decode_on_host(
    base: Replica, segments: list[Segment], limit: int, env: Apply, keep_context: bool
) -> tuple[Replica, bytes]:
    """Segments decoded on the host (:func:`apply_segments`, the reference); the result crosses once."""
    assert base.anchor is not None and base.counts is not None
    place = env.placement
    anchor_host = base.on_host("anchor", place)
    counts_host = base.on_host("counts", place)
    recent = base.recent if base.depth else None
    start = AnchoredForm(
        anchor=torch.from_numpy(anchor_host),
        anchor_version=base.anchor_version,
        counts=torch.from_numpy(counts_host),
        version=base.version,
        recent=recent,
        recent_version=base.version if recent is not None else -1,
        depth=base.depth if recent is not None else 0,
    )
    after, x = apply_segments(start, segments, entropy.blocks_of(env.spec.sizes), limit)
    x_host = x.numpy()  # new arrays: on the CPU the device tensors below are these
    if after.anchor is start.anchor:
        anchor, anchor_checksum, anchor_on_host = base.anchor, base.anchor_checksum, anchor_host
    else:
        anchor_on_host = after.anchor.numpy()
        anchor, anchor_checksum = place.to_device(anchor_on_host), crc32(anchor_on_host)
    counts_after = after.counts.numpy()
    replica = Replica(
        version=after.version,
        x=place.to_device(x_host),
        checksum=crc32(x_host),
        anchor=anchor,
        anchor_version=after.anchor_version,
        anchor_checksum=anchor_checksum,
        counts=place.to_device(counts_after),
        decay=1.0 if segments[-1].refresh else segments[-1].decay,
        step=segments[-1].step,
        recent=after.recent if keep_context else None,
        depth=after.depth if keep_context else 0,
        host={"x": x_host, "anchor": anchor_on_host, "counts": counts_after},
    )
    undo = b""
    seg = segments[0]
    if len(segments) == 1 and not seg.refresh:  # what it takes to go back, should the reply be lost
        if seg.levels:
            undo = b"L" + bytes([seg.levels]) + seg.payload
        elif not seg.context:
            undo = b"C" + seg.payload
        else:  # its decoder needs a context the replica no longer holds: keep the Δ as packed trits
            trits = torch.from_numpy(counts_after - counts_host.astype(np.int32) + 1).to(torch.uint8)
            undo = b"L" + bytes([3]) + codec.encode_levels(trits, 3).numpy().tobytes()
    return replica, undo


def _undo(replica: Replica, node: NodeState, env: Apply) -> Replica:
    """The replica as it was before the node's last catch-up (same anchor): C minus that catch-up's counts.

    Only its anchor and counts are used (the segments that follow compute x).
    """
    assert replica.anchor is not None
    d, kind, data = env.d, node.undo[:1], node.undo[1:]
    if kind == b"C":  # the coded counts as received
        taken = entropy.decode(data, d, entropy.blocks_of(env.spec.sizes))
    else:  # b"L": one Δ as its packed levels (2 or 3)
        levels = Segment(end=0, decay=1.0, step=0.0, refresh=False, context=False, payload=data[1:], levels=data[0])
        taken = decode_segment(levels, d, [d], None)
    counts = replica.on_host("counts", env.placement).astype(np.int32) - taken
    return Replica(
        version=node.previous,
        x=replica.anchor,
        checksum=-1,
        anchor=replica.anchor,
        anchor_version=replica.anchor_version,
        anchor_checksum=replica.anchor_checksum,
        counts=env.placement.to_device(counts),
        host={"anchor": replica.on_host("anchor", env.placement), "counts": counts},
    )


# --------------------------------------------------------------------------- the chain and the seed
def _apply_deltas(content: RecordDict, base: Replica, env: Apply, *, skip: int) -> Replica:
    """X ← x − lr·(Δ + wd·x) for each received Δ after the first ``skip`` (those x already has), into a new replica."""
    round_config, d, node_id = content[CONFIG], env.d, env.node_id
    sizes = quantizers.scale_blocks(env.spec.sizes, env.round.scale_block)
    arr = content[SERVER_UPDATE]["payload"]
    if arr.stype != LEVELS_STYPE:
        raise ClientStateError(f"node {node_id}: update stype {arr.stype!r}, expected {LEVELS_STYPE!r}")
    data = arr.data
    scales = list(round_config.get("scales", []))
    steps = check_steps(round_config, node_id)
    if scales and len(scales) != len(steps) * len(sizes):
        raise ClientStateError(f"node {node_id}: {len(scales)} scales for {len(steps)} Δs of {len(sizes)} scales each")
    if not all(isinstance(s, float | int) and 0.0 <= s <= SCALE_LIMIT for s in scales):  # also refuses nan
        bad = next(s for s in scales if not (isinstance(s, float | int) and 0.0 <= s <= SCALE_LIMIT))
        raise ClientStateError(f"node {node_id}: a Δ scale is {bad!r}, outside [0, {SCALE_LIMIT:g}]: refused")
    version = env.round.version
    if version - int(round_config["base-version"]) != len(steps):
        base_version = round_config["base-version"]
        raise ClientStateError(f"node {node_id}: {len(steps)} Δs from version {base_version} to {version}")
    ends = np.cumsum([0] + [codec.encoded_size(d, n) for n, _, _ in steps]).tolist()
    if ends[-1] != len(data):
        raise ClientStateError(f"node {node_id}: update has {len(data)} bytes, its Δs use {ends[-1]}")
    for i in range(len(steps)):  # each Δ's bytes, before any is decoded
        check_part(round_config, i, data[ends[i] : ends[i + 1]], f"Δ {i + 1} of {len(steps)}", env)
    key = ("deltas", base.ident, skip, tuple(steps), tuple(scales), tuple(sizes), len(data), zlib.crc32(data))
    made = env.pool.made(key)
    if made is not None:
        return made[0]
    buf = env.placement.bytes_to_device(data)  # packed bytes go to the device
    x = env.pool.buffer(base.x).copy_(base.x)
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
            s = torch.tensor(scales[i * len(sizes) : (i + 1) * len(sizes)], dtype=torch.float32, device=x.device)
        if i >= skip:  # x ← x − lr·(Δ + wd·x), as the server applied it
            quantizers.apply_delta_(x, levels, num_levels, s, sizes, lr, wd)
        offset += size
    return env.pool.add(Replica.of(x, version, env.placement), key, b"")


def _seeded(round_config: dict, env: Apply, *, anchored: bool) -> tuple[Replica, dict[str, torch.Tensor]]:
    """The replica at x₀ built from the server's seed (checked against the server's checksum), and the rest₀."""
    node_id = env.node_id
    if env.seed_fn is None:
        raise ClientStateError(f"node {node_id}: the server sent a seed, but this client cannot build x₀ from one")
    seed = int(round_config["init-seed"])
    x0, rest0 = env.seed_fn(seed)
    mine = state_checksum(x0, rest0)
    if x0.size != env.d or mine != int(round_config["init-checksum"]):
        raise ClientStateError(
            f"node {node_id}: {SEED_MISMATCH} {round_config['init-seed']} has checksum {mine}, the server's is "
            f"{round_config['init-checksum']} (a different torch version?); the server will send the full model"
        )
    rest = {k: env.placement.to_device(v.copy()) for k, v in rest0.items()}
    if anchored:
        return _anchor_replica(x0, 0, env), rest
    checksum = crc32(x0)
    replica = env.pool.find((0, checksum, 0, 0))
    if replica is None:
        replica = Replica(version=0, x=env.placement.to_device(x0.copy()), checksum=checksum, host={"x": x0})
        replica = env.pool.add(replica)
    return replica, rest
