"""The server's side of the vote: n packed sign payloads → bit-sliced counts → Δ's levels, never unpacked.

:func:`aggregate_packed` is the accelerated twin of :func:`flower_dlion.lion.aggregate` (the
definition) for 1-bit sign payloads; :mod:`flower_dlion.strategies.server_delta` chooses between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .. import accel
from ..formats import TRIT5, as_uint8, level_format, packed_size
from .levels import _levels_from_planes, encode_levels, planes_to_counts

__all__ = [
    "PackedAggregate",
    "aggregate_counts",
    "aggregate_packed",
    "count_ones",
    "count_planes",
    "majority_masks",
]


def count_ones(payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int) -> torch.Tensor:
    """Per-coordinate number of 1 bits (votes for +1) over packed sign payloads (int32).

    Counted bit-sliced (:func:`count_planes`), never unpacked to an n × d array: memory is
    O(d) besides the payloads. The vote sum is ``S = 2·count_ones(...) − n``.
    """
    if not payloads:
        return torch.zeros(d, dtype=torch.int32)
    if (fast := accel.choose("count_ones", _device_of(payloads), d)) is not None:
        return fast(payloads, d)
    return planes_to_counts(count_planes(payloads, d), d)


def _device_of(payloads: Sequence[torch.Tensor | bytes | np.ndarray]) -> torch.device:
    """Where the payloads are: the CPU for bytes and numpy arrays, else the first GPU tensor's device."""
    for p in payloads:
        if isinstance(p, torch.Tensor) and p.device.type != "cpu":
            return p.device
    return torch.device("cpu")


def _words(packed: torch.Tensor | bytes | np.ndarray, nbytes: int, nwords: int) -> torch.Tensor:
    """Packed bytes as ``nwords`` int64 words (zero-padded to a whole word: a copy only then)."""
    p = as_uint8(packed)
    if p.numel() != nbytes:
        raise ValueError(f"expected {nbytes} packed bytes, got {p.numel()}")
    if nbytes % 8 or p.data_ptr() % 8:
        q = p.new_zeros(8 * nwords)
        q[:nbytes] = p
        p = q
    return p.view(torch.int64)


def count_planes(
    payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int, *, chunk_words: int = 1 << 16
) -> torch.Tensor:
    """Per-coordinate count of 1 bits over packed payloads, bit-sliced: ``(B, ⌈d/8⌉)`` uint8.

    Plane j holds bit j of each coordinate's count, packed like the payloads, so the
    planes *are* the ``planesB`` encoding of the counts (B = ⌊log₂ n⌋ + 1 bit planes).
    The payloads are never unpacked: 64 coordinates are counted at once with carry-save
    adders over int64 words (the counter plane of weight 2ᵏ and two new planes of that
    weight → the new counter plane and one carry plane of weight 2ᵏ⁺¹; five bitwise
    operations), a chunk of words at a time (``chunk_words`` words) so that the counters
    stay in cache. Extra memory is O(B·d/8) for the planes plus O(B·chunk) — never n × d.
    The fused kernels (:mod:`flower_dlion.accel`) read every payload word once.
    """
    n = len(payloads)
    nbytes = packed_size(d)
    nwords = (nbytes + 7) // 8
    num_planes = max(1, n.bit_length())
    if n and (fast := accel.choose("count_planes", _device_of(payloads), d)) is not None:
        return fast(payloads, d, chunk_words=chunk_words)
    device = as_uint8(payloads[0]).device if n else torch.device("cpu")
    planes = torch.zeros(num_planes + 1, nwords, dtype=torch.int64, device=device)  # +1: an always-zero spill
    words = [_words(p, nbytes, nwords) for p in payloads]
    if device.type != "cpu":
        chunk_words = max(nwords, 1)  # a GPU gains nothing from cache-sized chunks, only launches
    size = min(chunk_words, max(nwords, 1))
    spare = [torch.empty(size, dtype=torch.int64, device=device) for _ in range(2 * num_planes + 8)]
    for start in range(0, nwords, chunk_words):
        stop = min(start + chunk_words, nwords)
        counter = _CarrySaveCounter(planes[:, start:stop], [t[: stop - start] for t in spare])
        for w in words:
            counter.add(0, w[start:stop])
        counter.flush()
    return planes[:num_planes].view(torch.uint8)[:, :nbytes]


class _CarrySaveCounter:
    """Bit-sliced counters over one chunk of words: ``acc[k]`` is the plane of weight 2ᵏ."""

    def __init__(self, acc: torch.Tensor, spare: list[torch.Tensor]) -> None:
        self.acc = acc  # (B + 1, chunk) int64 view into the result
        self.free = spare  # scratch planes
        self.owned = {t.data_ptr() for t in spare}
        self.pending: list[torch.Tensor | None] = [None] * (acc.shape[0] + 1)

    def _release(self, *planes: torch.Tensor) -> None:
        self.free.extend(t for t in planes if t.data_ptr() in self.owned)  # never a payload's memory

    def add(self, k: int, x: torch.Tensor) -> None:
        """Add plane ``x`` of weight 2ᵏ; two pending planes go through a carry-save adder."""
        y = self.pending[k]
        if y is None:
            self.pending[k] = x
            return
        self.pending[k] = None
        acc = self.acc[k]
        u, t, carry = self.free.pop(), self.free.pop(), self.free.pop()
        torch.bitwise_xor(x, y, out=u)  # u = x ⊕ y
        torch.bitwise_and(x, y, out=carry)
        torch.bitwise_and(acc, u, out=t)
        carry.bitwise_or_(t)  # carry = majority(acc, x, y), weight 2ᵏ⁺¹
        acc.bitwise_xor_(u)  # acc ← acc ⊕ x ⊕ y
        self._release(u, t, x, y)
        self.add(k + 1, carry)

    def flush(self) -> None:
        """Half-add the plane left pending at each weight (its carry moves up)."""
        for k in range(self.acc.shape[0]):
            y = self.pending[k]
            if y is not None:
                self.pending[k] = None
                carry = self.free.pop()
                torch.bitwise_and(self.acc[k], y, out=carry)
                self.acc[k].bitwise_xor_(y)
                self._release(y)
                self.add(k + 1, carry)


def majority_masks(planes: torch.Tensor, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed masks (gt, tie) of count > n/2 and count = n/2, compared bit-sliced from the top plane down."""
    threshold = n // 2  # count > n/2 ⇔ count > ⌊n/2⌋ ; a tie needs n even and count = n/2
    nbytes = packed_size(d)
    gt = torch.zeros(nbytes, dtype=torch.uint8, device=planes.device)
    eq = torch.full((nbytes,), 255, dtype=torch.uint8, device=planes.device)
    for j in reversed(range(planes.shape[0])):
        bit = planes[j]
        if (threshold >> j) & 1:
            eq &= bit  # equal so far only if this bit is 1 too
        else:
            gt |= eq & bit  # first bit where count has 1 and the threshold 0
            eq &= ~bit
    if n % 2:
        eq.zero_()  # no ties with an odd number of voters
    return gt, eq


class PackedAggregate(NamedTuple):
    """Δ aggregated from n packed sign payloads (:func:`aggregate_packed`)."""

    levels: torch.Tensor  # Δ's levels k, uint8 (int32 above 256 levels): Δ = (2k − (L−1)) / (L−1)
    num_levels: int  # L
    encoded: bytes  # the broadcast: encode_levels(levels, num_levels)
    ties: int  # coordinates where S = Σᵢ δᵢ is 0
    sum_abs: int  # Σ |S| over the d coordinates, exact


def aggregate_packed(payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int, how: str) -> PackedAggregate:
    """Vote or mean of n packed sign payloads, straight from their bit-sliced counts: ``lion.aggregate``'s twin.

    The accelerated twin of the definition :func:`flower_dlion.lion.aggregate` for 1-bit sign
    payloads (``k = 1``): with c the per-coordinate count of +1 votes (S = 2c − n), the levels
    equal ``lion.aggregate(S, n, how).levels`` bit for bit (as integers: uint8 here, int32
    there), ``encoded`` is :func:`encode_levels` of them, ``ties`` = #{S = 0} and ``sum_abs`` =
    Σ|S| — but no d-sized integer array is formed on the way: the count planes
    (:func:`count_planes`) and the masks of :func:`majority_masks` are packed, the levels are
    bytes. :func:`flower_dlion.strategies.server_delta.choose_aggregator` picks it, once per strategy, for
    the sign upload with an exact broadcast (the default); tests/library/test_aggregation_home.py holds
    it equal to the definition.

    - vote, n odd: Δ = sign(S), 2 levels; the mask "S > 0" *is* their ``sign1`` encoding.
    - vote, n even: 3 levels; the masks "S = 0" and "S > 0" are the levels' bit planes 0 and 1.
    - mean: Δ = S/n, n + 1 levels k = c; the count planes *are* their ``planesB`` encoding
      (``trit5`` for n = 2 is encoded from the levels).

    The levels come out of these planes as a client decodes a broadcast (the kernel of
    :func:`decode_levels`); the ties and Σ|S| from popcounts of the count planes under the
    masks: with Cₘ = Σⱼ 2ʲ·popcount(planeⱼ ∧ m) and #m the number of coordinates in a mask m,
    Σ|S| = (2·C_gt − n·#gt) + (n·#lt − 2·C_lt), where #lt = d − #gt − #tie and
    C_lt = C_all − C_gt − (n/2)·#tie.

    Example::

        >>> a = pack_signs(torch.tensor([1.0, -1.0, 1.0]))
        >>> b = pack_signs(torch.tensor([1.0, 1.0, -1.0]))
        >>> agg = aggregate_packed([a, b], 3, "vote")
        >>> agg.levels.tolist(), agg.num_levels, agg.ties, agg.sum_abs
        ([2, 1, 1], 3, 2, 2)
    """
    n = len(payloads)
    if n < 1:
        raise ValueError("aggregate_packed needs at least one payload")
    return aggregate_counts(count_planes(payloads, d).cpu(), n, d, how)


def aggregate_counts(planes: torch.Tensor, n: int, d: int, how: str) -> PackedAggregate:
    """:func:`aggregate_packed` from the counts themselves: ``planes`` (B, ⌈d/8⌉) uint8 on the CPU.

    Plane j packs bit j of every coordinate's count c of +1 votes among ``n`` (as
    :func:`count_planes` gives them, or as secure aggregation unmasks them: the bit planes of
    Σᵢ yᵢ mod 2ᵇ, :mod:`flower_dlion.secure.masking`); B ≥ ⌈log₂(n+1)⌉ and every c ≤ n. The
    result is :func:`aggregate_packed`'s for the payloads those counts came from, bit for bit.
    """
    if n < 1:
        raise ValueError("aggregate_counts needs at least one vote")
    if how not in ("vote", "mean"):
        raise ValueError(f"how must be 'vote' or 'mean', got {how!r}")
    planes = planes.clone()
    if d % 8:  # bits past d (a payload's spare bits) count for nothing
        planes[:, -1] &= (0xFF00 >> (d % 8)) & 0xFF
    gt, tie = majority_masks(planes, n, d)
    if how == "vote":
        level_planes, num_levels = (gt[None], 2) if n % 2 else (torch.stack([tie, gt]), 3)
    else:
        level_planes, num_levels = planes.contiguous(), n + 1
    levels = _levels_from_planes(level_planes, d, torch.uint8 if num_levels <= 256 else torch.int32)
    if level_format(num_levels)[0] == TRIT5:
        encoded = encode_levels(levels, num_levels).numpy().tobytes()
    else:
        encoded = level_planes.numpy().tobytes()
    num_gt, num_tie = _popcount(gt), _popcount(tie)
    c_all = sum(_popcount(plane) << j for j, plane in enumerate(planes))
    c_gt = sum(_popcount(plane & gt) << j for j, plane in enumerate(planes))
    c_lt = c_all - c_gt - (n // 2) * num_tie  # a tie has c = n/2
    num_lt = d - num_gt - num_tie
    sum_abs = (2 * c_gt - n * num_gt) + (n * num_lt - 2 * c_lt)
    return PackedAggregate(levels, num_levels, encoded, num_tie, sum_abs)


_POPCOUNT8 = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.uint8)


def _popcount(mask: torch.Tensor) -> int:
    """The number of 1 bits in a uint8 tensor on the CPU."""
    a = mask.numpy()
    if not hasattr(np, "bitwise_count"):  # numpy < 2: a table
        return int(np.take(_POPCOUNT8, a).sum(dtype=np.int64))
    whole = a.size - a.size % 8
    return int(np.bitwise_count(a[:whole].view(np.uint64)).sum(dtype=np.int64)) + int(np.bitwise_count(a[whole:]).sum())
