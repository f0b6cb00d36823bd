"""The anchored downlink: a replica k rounds behind catches up with about log k bits per value.

Imports torch, numpy and the package's codec and coder only (never flwr). With a vote, every
round's Δ is an integer vector Lₜ ∈ {−1, 0, +1}ᵈ times a constant q (K local steps: q = K).
Instead of applying ``x ← x − lr·(Δ + wd·x)`` round by round, the server and every replica
keep an **anchor** xₐ (float32), taken at version a, and the integer **counts** C = Σₜ Lₜ of
the rounds since, and compute x by one function (:func:`flower_dlion.lion.anchored`)::

    x_v = γ₁^(v−a)·xₐ − η·C_v        γ₁ = 1 − lr·wd·q,  η = lr·q

Every ``anchor_every`` rounds the anchor moves to x (xₐ ← x_v, a ← v, C ← 0), so the decay
reaches the Δs of an epoch at its end instead of each round. A replica at version h needs
only C_now − C_h to be current (and, across an anchor, the counts at each anchor it crossed):
one :class:`Segment` per anchor epoch, entropy-coded (:mod:`flower_dlion.entropy`). Its size
grows like the entropy of a sum of k votes, about log₂ √k bits, not k·log₂ 3.

A segment of a single Δ goes as that Δ's packed levels (``levels`` 2 or 3: 1 or 1.6 bits a value,
the size of its entropy code, decoded ~30× faster). A replica that holds the two Δs before its
version (it received them one by one) may ask for the next Δ coded with them as context instead
(9 contexts: ~1.2–1.4 bits a value, but an ANS decode of every value: worth it only on a slow link,
see :mod:`flower_dlion.clients.link`).

What the server keeps (:class:`AnchoredHistory`) is bounded by ``max_bytes``: the packed Δ of
each kept version (0.2 bytes a value) and C at every :data:`SNAPSHOT_EVERY`-th version and at
each anchor (2 bytes a value each, 4 beyond ±32 767); the oldest go first: about 0.33 bytes a value
per version, so the default budget (8 float32 models) serves replicas up to ~100 versions back. A
replica whose version is no longer covered gets x₀ from the seed plus the counts, or the anchor
(float32) plus the counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import accel, codec, entropy
from .lion import anchored

__all__ = [
    "AnchoredForm",
    "AnchoredHistory",
    "Epoch",
    "Segment",
    "apply_segments",
    "context_of",
    "decode_segment",
    "levels_to_signs",
    "next_context",
    "step_counts",
]

SNAPSHOT_EVERY = 16  # C is kept at every 16th version; the packed Δs since give any version in between
CONTEXTS = 9  # (Δ_v, Δ_{v−1}) at a coordinate: 3·(Δ_v + 1) + (Δ_{v−1} + 1)


def levels_to_signs(levels: torch.Tensor, num_levels: int) -> torch.Tensor:
    """A vote's levels (2: {0, 1}; 3: {0, 1, 2}) as L ∈ {−1, 0, +1}, int32."""
    levels = levels.to(torch.int32)
    if num_levels == 2:
        return levels.mul(2).sub_(1)
    if num_levels == 3:
        return levels.sub(1)
    raise ValueError(f"the anchored downlink takes a vote (2 or 3 levels), got {num_levels} levels")


def context_of(signs: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """The context after a Δ: ``3·(L + 1) + (previous context // 3)`` (uint8, 0–8)."""
    return ((signs.astype(np.int16) + 1) * 3 + previous // 3).astype(np.uint8)


def next_context(levels: np.ndarray, num_levels: int, previous: np.ndarray) -> np.ndarray:
    """:func:`context_of` from a vote's levels (L + 1 = 2·level for 2 levels, level for 3), in two uint8 passes."""
    out = previous // 3
    out += levels.astype(np.uint8, copy=False) * np.uint8(6 if num_levels == 2 else 3)
    return out


@dataclass
class Epoch:
    """The rounds between two anchors: its anchor's version, per-round decay γ₁ and step η."""

    start: int
    decay: float  # γ₁ = 1 − lr·wd·q
    step: float  # η = lr·q
    end: int | None = None  # the version of the next anchor; None: the current epoch

    def decay_at(self, version: int) -> float:
        """γ of x at ``version``: γ₁^(version − start)."""
        return self.decay ** (version - self.start)


@dataclass
class Segment:
    """One part of a catch-up: add the decoded counts to C, giving ``end``; then maybe a new anchor."""

    end: int  # version reached
    decay: float  # γ of x at ``end``
    step: float  # η
    refresh: bool  # ``end`` is an anchor: xₐ ← x, C ← 0
    context: bool  # a single Δ coded with the two before it as context
    payload: bytes
    levels: int = 0  # 2 or 3: a single Δ as its packed levels (codec.encode_levels); 0: entropy-coded counts


@dataclass
class AnchoredForm:
    """What a replica needs of the anchored form: xₐ, its version, C, and the context it holds."""

    anchor: torch.Tensor  # float32 (d,)
    anchor_version: int
    counts: torch.Tensor  # int32 (d,)
    version: int
    recent: np.ndarray | None = None  # context (the two last Δs) at ``recent_version``
    recent_version: int = -1
    depth: int = 0  # how many of the two last Δs ``recent`` holds (2: usable as context)


def decode_segment(seg: Segment, d: int, ends: list[int], recent: np.ndarray | None) -> np.ndarray:
    """The count difference a segment carries (int32, host): its entropy code, or its one Δ's packed levels.

    ``recent``: the context the replica holds (for a segment coded with it). Raises
    :class:`flower_dlion.entropy.CodingError` for a payload that does not decode and
    ``ValueError`` for levels that cannot occur.
    """
    if seg.levels:
        if seg.levels not in (2, 3) or seg.context:
            raise ValueError(f"a packed segment of {seg.levels} levels{' with context' if seg.context else ''}")
        levels = codec.decode_levels(codec.as_uint8(seg.payload), seg.levels, d, torch.uint8)
        return levels_to_signs(levels, seg.levels).numpy()
    return entropy.decode(seg.payload, d, ends, recent if seg.context else None, CONTEXTS)


def step_counts(
    anchor: torch.Tensor,
    counts: torch.Tensor,
    packed: torch.Tensor,
    num_levels: int,
    decay: float,
    step: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Δ given as packed levels on the replica's device: ``C' = C + L`` and ``x' = γ·xₐ − η·C'``.

    Exactly ``anchored(anchor, counts + L, decay, step)`` with ``L = levels_to_signs(levels)``,
    bit for bit; ``anchor`` and ``counts`` are read, not changed. ``out``: (counts', x') buffers
    to write into (a client reuses the buffers of a replica it no longer needs: a fresh 4-byte
    tensor per value costs page faults, about as much as the arithmetic); counts' may be
    ``counts`` itself (C updated in place: the server's). ``scratch``: a float buffer like x for
    η·C'. ``levels``: the packed levels already decoded (uint8 or int32; the server has them),
    which the composition then does not decode again. A level that cannot occur (a trit5 byte
    above 242) raises ``ValueError`` (the inputs are untouched; the outputs are then no replica).
    Where :mod:`flower_dlion.accel` has a fused pass (numba on the CPU, from 2²⁰ values), it runs.
    """
    d = counts.numel()
    fusable = anchor.dtype == torch.float32 and counts.dtype == torch.int32 and anchor.is_contiguous()
    if fusable and counts.is_contiguous() and (fast := accel.choose("step_counts", counts.device, d)) is not None:
        done = fast(anchor, counts, packed, num_levels, decay, step, out=out, scratch=scratch, anchored=anchored)
        if done is not None:  # one pass; None: the kernel would round otherwise than ``anchored`` here
            return done
    if levels is None or levels.dtype not in (torch.uint8, torch.int32):
        levels = codec.decode_levels(packed, num_levels, d, torch.uint8)
    new_counts, x = out if out is not None else (torch.empty_like(counts), torch.empty_like(anchor))
    if num_levels == 2:  # L = 2·bit − 1
        torch.add(counts, levels, alpha=2, out=new_counts)
    elif num_levels == 3:  # L = level − 1
        torch.add(counts, levels, out=new_counts)
    else:
        raise ValueError(f"the anchored downlink takes a vote (2 or 3 levels), got {num_levels} levels")
    new_counts.sub_(1)
    torch.mul(anchor, decay, out=x)  # the three roundings of lion.anchored: γ·xₐ, η·C, their difference
    scaled = new_counts.to(anchor.dtype) if scratch is None else scratch.copy_(new_counts)
    return new_counts, x.sub_(scaled.mul_(step))


def apply_segments(
    replica: AnchoredForm, segments: list[Segment], ends: list[int], limit: int
) -> tuple[AnchoredForm, torch.Tensor]:
    """The replica after ``segments`` and its x; ``replica`` is left as it was (the reference; host tensors).

    Raises :class:`flower_dlion.entropy.CodingError` for a payload that does not decode and
    ``ValueError`` for counts beyond ``limit`` (more than one per round of the epoch).
    """
    d = replica.counts.numel()
    counts = replica.counts.numpy().astype(np.int32)  # a copy: the replica is left as it was
    anchor, anchor_version, version = replica.anchor, replica.anchor_version, replica.version
    recent, recent_version, depth = replica.recent, replica.recent_version, replica.depth
    x = None
    for seg in segments:
        if seg.context and (recent is None or recent_version != version or depth < 2):
            raise ValueError(f"a Δ coded with the context of version {version}, which this replica does not hold")
        got = decode_segment(seg, d, ends, recent)
        bound = 1 if seg.end - version == 1 else 1 << 30  # one Δ: ±1; any: far from int32's overflow below
        if got.size and (int(got.min()) < -bound or int(got.max()) > bound):
            raise ValueError(f"a segment holds counts in [{got.min()}, {got.max()}], beyond ±{bound}")
        if seg.levels and seg.end - version != 1:
            raise ValueError(f"a packed Δ from version {version} to {seg.end}: one Δ is one version")
        counts += got
        if got.size and int(np.abs(counts).max()) > limit:
            raise ValueError(f"counts reach {int(np.abs(counts).max())}, more than {limit} rounds of an epoch")
        if seg.end - version == 1:  # one Δ: the context moves on
            prev = recent if recent is not None and recent_version == version else np.full(d, 4, np.uint8)
            depth = min(depth + 1, 2) if recent is not None and recent_version == version else 1
            recent, recent_version = context_of(got, prev), seg.end
        else:
            recent, recent_version, depth = None, -1, 0
        version = seg.end
        x = anchored(anchor, torch.from_numpy(counts), seg.decay, seg.step)
        if seg.refresh:
            anchor, anchor_version = x.clone(), version  # x may be trained on: the anchor is its own copy
            counts[:] = 0
    assert x is not None, "no segments"
    return AnchoredForm(anchor, anchor_version, torch.from_numpy(counts), version, recent, recent_version, depth), x


def _compact(counts: np.ndarray) -> np.ndarray:
    """A copy of C in 2 bytes a value where it fits (an epoch of up to 32 767 rounds of single steps), else 4."""
    return counts.astype(np.int16 if int(np.abs(counts).max(initial=0)) < 1 << 15 else np.int32)


@dataclass
class AnchoredHistory:
    """The server's side: xₐ, C, the epochs, and what it keeps to serve replicas that missed rounds.

    Parameters
    ----------
    anchor : torch.Tensor
        x₀ (float32), the first anchor, at version 0.
    decay, step : float
        γ₁ = 1 − lr·wd·q and η = lr·q of the first epoch.
    anchor_every : int
        Rounds between anchors.
    ends : list[int]
        The coder's block ends (:func:`flower_dlion.entropy.blocks_of` of the tensor sizes).
    max_bytes : int
        Memory for kept Δs and counts; beyond it the oldest go.

    """

    anchor: torch.Tensor
    decay: float
    step: float
    anchor_every: int
    ends: list[int]
    max_bytes: int
    version: int = 0
    counts: torch.Tensor | None = None  # C since the anchor, int32
    epochs: list[Epoch] = field(default_factory=list)
    deltas: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # version → (levels, packed Δ)
    snapshots: dict[int, np.ndarray] = field(default_factory=dict)  # version → C there; at an anchor: the C it ended

    context: np.ndarray | None = None  # (Δ_v, Δ_{v−1}) at the current version
    previous_context: np.ndarray | None = None  # the same at version − 1
    _cache: dict[tuple[int, bool], list[Segment] | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        d = self.anchor.numel()
        if self.counts is None:
            self.counts = torch.zeros(d, dtype=torch.int32)
        if not self.epochs:
            self.epochs = [Epoch(0, self.decay, self.step)]

    @property
    def epoch(self) -> Epoch:
        """The current epoch."""
        return self.epochs[-1]

    def x(self) -> torch.Tensor:
        """The server's x at the current version."""
        assert self.counts is not None
        return anchored(self.anchor, self.counts, self.epoch.decay_at(self.version), self.epoch.step)

    def apply_levels(
        self, levels: torch.Tensor, num_levels: int, packed: bytes, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One round of a vote's ``levels`` (``packed``: their encoding): C += L, a new version, maybe a new anchor.

        Returns x, written into ``out`` (the strategy's x; None: a new tensor): :meth:`x` of the new
        C, bit for bit, in one pass where :func:`step_counts` has a fused one.
        """
        assert self.counts is not None
        self.version += 1
        self._cache.clear()
        self.deltas[self.version] = (num_levels, packed)
        self.previous_context = self.context
        prev = self.context if self.context is not None else np.full(levels.numel(), 4, np.uint8)
        self.context = next_context(levels.numpy(), num_levels, prev)
        out = torch.empty_like(self.anchor) if out is None else out
        decay, step = self.epoch.decay_at(self.version), self.epoch.step
        _, x = step_counts(self.anchor, self.counts, codec.as_uint8(packed), num_levels, decay, step,
                           out=(self.counts, out), levels=levels)  # fmt: skip
        epoch = self.epoch
        if self.version - epoch.start >= self.anchor_every:  # a new anchor at x
            self.snapshots[self.version] = _compact(self.counts.numpy())
            epoch.end = self.version
            self.anchor = x.clone()
            self.counts.zero_()
            self.epochs.append(Epoch(self.version, self.decay, self.step))
        elif self.version % SNAPSHOT_EVERY == 0:
            self.snapshots[self.version] = _compact(self.counts.numpy())
        self._trim()
        return x

    def _trim(self) -> None:
        """Drop the oldest kept Δs and counts beyond ``max_bytes``."""
        while (self.deltas or self.snapshots) and self.memory() > self.max_bytes:
            oldest_delta = min(self.deltas, default=self.version + 1)
            oldest_snap = min(self.snapshots, default=self.version + 1)
            if oldest_delta <= oldest_snap:
                del self.deltas[oldest_delta]
            else:
                del self.snapshots[oldest_snap]

    def memory(self) -> int:
        """Bytes of kept Δs and counts (besides xₐ, C and the two contexts)."""
        return sum(len(p) for _, p in self.deltas.values()) + sum(s.nbytes for s in self.snapshots.values())

    # ------------------------------------------------------------------ serving a replica
    def _epoch_of(self, version: int) -> Epoch:
        for epoch in reversed(self.epochs):
            if epoch.start <= version:
                return epoch
        raise ValueError(f"version {version} before the first epoch")

    def counts_at(self, version: int) -> np.ndarray | None:
        """C at ``version`` (counts since that version's anchor), or None when no longer kept.

        From the nearest version whose C is known (the anchor: 0, a snapshot, the epoch's end,
        now), adding or taking away the kept Δs in between.
        """
        assert self.counts is not None
        epoch = self._epoch_of(version)
        d = self.anchor.numel()
        known = {epoch.start: None}  # version → C there (None: zeros)
        known |= {v: c for v, c in self.snapshots.items() if epoch.start < v and (epoch.end is None or v <= epoch.end)}
        if epoch.end is None:
            known[self.version] = self.counts.numpy()
        for base in sorted(known, key=lambda v: abs(v - version)):
            lo, hi = sorted((base, version))
            if all(v in self.deltas for v in range(lo + 1, hi + 1)):
                out = np.zeros(d, np.int32) if known[base] is None else known[base].astype(np.int32)
                sign = 1 if base <= version else -1
                for v in range(lo + 1, hi + 1):
                    num_levels, packed = self.deltas[v]
                    out += sign * levels_to_signs(codec.decode_levels(packed, num_levels, d), num_levels).numpy()
                return out
        return None

    def segments(self, have: int, context: bool = False) -> list[Segment] | None:
        """The catch-up from version ``have`` to now, coded; None when it can no longer be made.

        ``context``: the replica holds the two Δs before ``have`` (a one-round catch-up is then
        coded with them). Cached until the next :meth:`apply`.
        """
        key = (have, context and have == self.version - 1)
        if key not in self._cache:
            self._cache[key] = self._segments(have, key[1])
        return self._cache[key]

    def _segments(self, have: int, with_context: bool) -> list[Segment] | None:
        if not 0 <= have < self.version:
            return None
        if have == self.version - 1 and not with_context and self.version in self.deltas:  # the last Δ, packed
            epoch = self._epoch_of(have)  # ended at this version if the anchor moved: the segment refreshes it
            return [self._segment(np.empty(0, np.int32), epoch, self.version, epoch.end is not None, False, have)]
        base = self.counts_at(have)
        if base is None:
            return None
        out, epoch, since = [], self._epoch_of(have), have
        while epoch.end is not None:  # past epochs: to their anchor
            end = self.snapshots.get(epoch.end)  # C at the end of that epoch, just before its anchor
            if end is None:
                return None
            out.append(self._segment(end - base, epoch, epoch.end, True, False, since))
            base, since = np.zeros_like(base), epoch.end
            epoch = self.epochs[self.epochs.index(epoch) + 1]
        if self.version > epoch.start:
            assert self.counts is not None
            use_context = with_context and self.previous_context is not None
            out.append(self._segment(self.counts.numpy() - base, epoch, self.version, False, use_context, since))
        return out

    def _segment(self, counts: np.ndarray, epoch: Epoch, end: int, refresh: bool, context: bool, since: int) -> Segment:
        """One segment to ``end`` from version ``since``: a single Δ without context as its packed levels."""
        if end - since == 1 and not context and end in self.deltas:
            num_levels, packed = self.deltas[end]
            return Segment(end, epoch.decay_at(end), epoch.step, refresh, False, packed, num_levels)
        ctx = self.previous_context if context else None
        payload = entropy.encode(counts, self.ends, ctx, CONTEXTS)
        return Segment(end, epoch.decay_at(end), epoch.step, refresh, context, payload)

    # ------------------------------------------------------------------ checkpoints
    def to_dict(self) -> dict[str, Any]:
        """The history as plain values (copies), for a checkpoint."""
        assert self.counts is not None
        return {
            "anchor": self.anchor.clone(),
            "decay": self.decay,
            "step": self.step,
            "anchor_every": self.anchor_every,
            "ends": list(self.ends),
            "max_bytes": self.max_bytes,
            "version": self.version,
            "counts": self.counts.clone(),
            "epochs": [vars(e).copy() for e in self.epochs],
            "deltas": {v: (n, bytes(p)) for v, (n, p) in self.deltas.items()},
            "snapshots": {v: torch.from_numpy(s.copy()) for v, s in self.snapshots.items()},
            "context": None if self.context is None else torch.from_numpy(self.context.copy()),
            "previous_context": None if self.previous_context is None else torch.from_numpy(self.previous_context),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> AnchoredHistory:
        """Inverse of :meth:`to_dict`."""

        def arr(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy().copy()

        return cls(
            anchor=state["anchor"].clone(),
            decay=float(state["decay"]),
            step=float(state["step"]),
            anchor_every=int(state["anchor_every"]),
            ends=[int(e) for e in state["ends"]],
            max_bytes=int(state["max_bytes"]),
            version=int(state["version"]),
            counts=state["counts"].clone(),
            epochs=[Epoch(**e) for e in state["epochs"]],
            deltas={int(v): (int(n), bytes(p)) for v, (n, p) in state["deltas"].items()},
            snapshots={int(v): s.numpy().copy() for v, s in state["snapshots"].items()},
            context=arr(state["context"]),
            previous_context=arr(state["previous_context"]),
        )
