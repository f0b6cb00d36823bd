"""CPU kernels (numba) for the server's vote count: n packed sign payloads → bit-sliced counts.

Optional, like :mod:`flower_dlion.accel.numba_pack`: :mod:`flower_dlion.accel.cpu` calls
them when numba is installed, the codec's torch reference runs otherwise (bit-identical).

A chunk of payload words at a time, eight payloads per pass through a tree of seven
carry-save adders (Harley–Seal) into the counter planes of weight 1, 2 and 4; the carry plane
of weight 8 goes up once per eight payloads. Up to eight payloads are counted in one pass
with the counters in registers. Small helpers on contiguous 1-D slices keep the loops simple
enough for LLVM to vectorize them. Why fused: the reference's bit-sliced count is five torch
operations per pair of payloads on 512 kB chunks; here each payload word is read once.

Safety: the kernels read the payloads through raw addresses (``addresses``, int64), so that
n payloads need no n × d array and no copy; the caller (:class:`flower_dlion.accel.cpu.Payloads`)
checks every payload's length and keeps the arrays alive during the call.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["CHUNK_WORDS", "count_ones", "count_planes", "scratch"]

CHUNK_WORDS = 1024  # int64 words counted per chunk (8 kB per plane: the counters stay in L2)
# coordinate l of a packed word is bit 8·(l//8) + 7 − l%8 (byte l//8, little-endian; MSB first in the byte)
_LANE_SHIFT = np.array([8 * (lane >> 3) + 7 - (lane & 7) for lane in range(64)], dtype=np.uint64)

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)


def pointer_to(dtype: types.Type) -> object:
    """An intrinsic: an address (int64) as a pointer to ``dtype``, for :func:`numba.carray` (shared with the team)."""

    @intrinsic
    def at(typingctx: object, address: types.Type) -> tuple:
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context: object, builder: ir.IRBuilder, signature: object, a: tuple) -> object:
            return builder.inttoptr(a[0], context.get_value_type(types.CPointer(dtype)))

        return sig, codegen

    return at


_u64_at = pointer_to(types.uint64)


@_jit
def _payload(addresses: np.ndarray, p: int, start: int, m: int) -> np.ndarray:
    """Words ``start … start+m−1`` of payload ``p`` (no copy)."""
    return numba.carray(_u64_at(addresses[p] + 8 * start), m)


@_jit
def _full_add(acc: np.ndarray, x: np.ndarray, y: np.ndarray, carry: np.ndarray) -> None:
    """Full (carry-save) adder: acc ← acc ⊕ x ⊕ y, carry = majority(acc, x, y).

    ``carry`` must not be ``x`` or ``y``: LLVM vectorizes this loop only for distinct arrays.
    """
    for i in range(acc.size):
        a, u = acc[i], x[i] ^ y[i]
        carry[i] = (x[i] & y[i]) | (a & u)
        acc[i] = a ^ u


@_jit
def _half_add(acc: np.ndarray, y: np.ndarray, carry: np.ndarray) -> None:
    """Half adder: acc ← acc ⊕ y, carry = acc ∧ y."""
    for i in range(acc.size):
        a = acc[i]
        carry[i] = a & y[i]
        acc[i] = a ^ y[i]


@_jit
def _carry_up(acc: np.ndarray, pending: np.ndarray, has: np.ndarray, k: int, carry: np.ndarray, m: int) -> None:
    """Add the carry plane ``carry[0, :m]`` of weight 2ᵏ: keep it pending, or add it to the pending one, go up.

    ``carry`` is two buffers used in turn (each adder writes its carry into the other one).
    Rows are sliced as ``x[k, :m]`` (contiguous to numba; ``x[:, :m][k]`` is not, and is
    not vectorized).
    """
    planes, src = acc.shape[0], 0
    while k < planes and has[k]:  # two planes of weight 2ᵏ meet: one more carry of weight 2ᵏ⁺¹
        _full_add(acc[k, :m], pending[k, :m], carry[src, :m], carry[1 - src, :m])
        has[k], src, k = False, 1 - src, k + 1
    if k < planes:  # (a carry above the top plane is always 0: counts are < 2^planes)
        pending[k, :m] = carry[src, :m]
        has[k] = True


@_jit
def _emit_counts(acc: np.ndarray, m: int, counts: np.ndarray) -> None:
    """Per-coordinate counts (int32) of the first ``m`` words: coordinate 64·i + l is bit 8·(l//8) + 7 − l%8.

    Plane by plane, the 64 lanes of a word innermost (a fixed shift per lane): that loop is
    vectorized, where one coordinate at a time with the planes innermost is not.
    """
    for i in range(m):
        out, w = counts[64 * i : 64 * i + 64], acc[0, i]
        for lane in range(64):
            out[lane] = np.int32((w >> _LANE_SHIFT[lane]) & np.uint64(1))
        for j in range(1, acc.shape[0]):
            w, bit = acc[j, i], np.int32(1 << j)
            for lane in range(64):
                out[lane] |= np.int32((w >> _LANE_SHIFT[lane]) & np.uint64(1)) * bit


@_jit
def _add8(
    a0: np.ndarray,
    a1: np.ndarray,
    a2: np.ndarray,
    eights: np.ndarray,
    x0: np.ndarray,
    x1: np.ndarray,
    x2: np.ndarray,
    x3: np.ndarray,
    x4: np.ndarray,
    x5: np.ndarray,
    x6: np.ndarray,
    x7: np.ndarray,
) -> None:
    """Add eight payload planes to the counter planes of weight 1, 2, 4; the carry of weight 8 goes to ``eights``.

    A tree of seven carry-save adders (Harley–Seal), all in registers: one pass over the
    chunk reads each payload word once and each counter plane once.
    """
    for i in range(a0.size):
        ones, u = a0[i], x0[i] ^ x1[i]
        t1, ones = (x0[i] & x1[i]) | (ones & u), ones ^ u  # 1s + x0 + x1 → ones, twos t1
        u = x2[i] ^ x3[i]
        t2, ones = (x2[i] & x3[i]) | (ones & u), ones ^ u
        twos, u = a1[i], t1 ^ t2
        f1, twos = (t1 & t2) | (twos & u), twos ^ u  # 2s + t1 + t2 → twos, fours f1
        u = x4[i] ^ x5[i]
        t1, ones = (x4[i] & x5[i]) | (ones & u), ones ^ u
        u = x6[i] ^ x7[i]
        t2, ones = (x6[i] & x7[i]) | (ones & u), ones ^ u
        u = t1 ^ t2
        f2, twos = (t1 & t2) | (twos & u), twos ^ u
        fours, u = a2[i], f1 ^ f2
        eights[i], fours = (f1 & f2) | (fours & u), fours ^ u  # 4s + f1 + f2 → fours, eights
        a0[i], a1[i], a2[i] = ones, twos, fours


@_jit
def _add4(
    a0: np.ndarray,
    a1: np.ndarray,
    a2: np.ndarray,
    eights: np.ndarray,
    x0: np.ndarray,
    x1: np.ndarray,
    x2: np.ndarray,
    x3: np.ndarray,
) -> None:
    """Like :func:`_add8` for four payload planes."""
    for i in range(a0.size):
        ones, u = a0[i], x0[i] ^ x1[i]
        t1, ones = (x0[i] & x1[i]) | (ones & u), ones ^ u
        u = x2[i] ^ x3[i]
        t2, ones = (x2[i] & x3[i]) | (ones & u), ones ^ u
        twos, u = a1[i], t1 ^ t2
        f, twos = (t1 & t2) | (twos & u), twos ^ u
        fours = a2[i]
        eights[i], fours = fours & f, fours ^ f  # 4s + f → fours, eights
        a0[i], a1[i], a2[i] = ones, twos, fours


@_jit
def _add2(a0: np.ndarray, a1: np.ndarray, a2: np.ndarray, eights: np.ndarray, x0: np.ndarray, x1: np.ndarray) -> None:
    """Like :func:`_add8` for two payload planes (the twos carry rippled up)."""
    for i in range(a0.size):
        ones, u = a0[i], x0[i] ^ x1[i]
        t, ones = (x0[i] & x1[i]) | (ones & u), ones ^ u
        twos = a1[i]
        f, twos = twos & t, twos ^ t
        fours = a2[i]
        eights[i], fours = fours & f, fours ^ f
        a0[i], a1[i], a2[i] = ones, twos, fours


@_jit
def _add1(a0: np.ndarray, a1: np.ndarray, a2: np.ndarray, eights: np.ndarray, x: np.ndarray) -> None:
    """Like :func:`_add8` for one payload plane (a ripple of half adders)."""
    for i in range(a0.size):
        ones = a0[i]
        t, ones = ones & x[i], ones ^ x[i]
        twos = a1[i]
        f, twos = twos & t, twos ^ t
        fours = a2[i]
        eights[i], fours = fours & f, fours ^ f
        a0[i], a1[i], a2[i] = ones, twos, fours


@_jit
def _count_chunk(
    addresses: np.ndarray, start: int, m: int, acc: np.ndarray, pending: np.ndarray, has: np.ndarray, carry: np.ndarray
) -> None:
    """Bit-sliced counts of words ``start … start+m−1`` over all payloads into ``acc[:, :m]`` (plane j = bit j).

    Payloads go eight at a time (then 4, 2, 1) into the planes of weight 1, 2 and 4
    (``acc`` has at least three); each carry plane of weight 8 joins the planes above
    through :func:`_carry_up`, which happens once per eight payloads.
    """
    n = addresses.size
    acc[:, :m] = 0
    a0, a1, a2, eights = acc[0, :m], acc[1, :m], acc[2, :m], carry[0, :m]
    done = 0
    while n - done >= 8:
        x0, x1 = _payload(addresses, done, start, m), _payload(addresses, done + 1, start, m)
        x2, x3 = _payload(addresses, done + 2, start, m), _payload(addresses, done + 3, start, m)
        x4, x5 = _payload(addresses, done + 4, start, m), _payload(addresses, done + 5, start, m)
        x6, x7 = _payload(addresses, done + 6, start, m), _payload(addresses, done + 7, start, m)
        _add8(a0, a1, a2, eights, x0, x1, x2, x3, x4, x5, x6, x7)
        done += 8
        _carry_up(acc, pending, has, 3, carry, m)
    for size in (4, 2, 1):
        if n - done >= size:
            if size == 4:
                x0, x1 = _payload(addresses, done, start, m), _payload(addresses, done + 1, start, m)
                x2, x3 = _payload(addresses, done + 2, start, m), _payload(addresses, done + 3, start, m)
                _add4(a0, a1, a2, eights, x0, x1, x2, x3)
            elif size == 2:
                _add2(a0, a1, a2, eights, _payload(addresses, done, start, m), _payload(addresses, done + 1, start, m))
            else:
                _add1(a0, a1, a2, eights, _payload(addresses, done, start, m))
            done += size
            if done >= 8:  # below 8 payloads no carry of weight 8 can occur
                _carry_up(acc, pending, has, 3, carry, m)
    for k in range(3, acc.shape[0]):  # half-add the planes left pending, lowest weight first
        if has[k]:
            has[k] = False
            _half_add(acc[k, :m], pending[k, :m], carry[0, :m])
            _carry_up(acc, pending, has, k + 1, carry, m)


@_jit
def _tree8(
    x0: np.uint64,
    x1: np.uint64,
    x2: np.uint64,
    x3: np.uint64,
    x4: np.uint64,
    x5: np.uint64,
    x6: np.uint64,
    x7: np.uint64,
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """The bit-sliced count (weights 1, 2, 4, 8) of eight words: :func:`_add8` from zero counters."""
    ones, t1 = x0 ^ x1, x0 & x1  # x0 + x1 → ones, twos t1
    u = x2 ^ x3
    t2, ones = (x2 & x3) | (ones & u), ones ^ u
    twos, f1 = t1 ^ t2, t1 & t2  # t1 + t2 → twos, fours f1
    u = x4 ^ x5
    t1, ones = (x4 & x5) | (ones & u), ones ^ u
    u = x6 ^ x7
    t2, ones = (x6 & x7) | (ones & u), ones ^ u
    u = t1 ^ t2
    f2, twos = (t1 & t2) | (twos & u), twos ^ u
    return ones, twos, f1 ^ f2, f1 & f2  # f1 + f2 → fours, eights


@_jit
def _few(addresses: np.ndarray, start: int, m: int, zero: np.ndarray) -> tuple:
    """Words ``start … start+m−1`` of the (at most eight) payloads, ``zero[:m]`` standing in for the missing ones."""
    n = addresses.size
    x = [_payload(addresses, p, start, m) if p < n else zero[:m] for p in range(8)]
    return x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]


@_jit
def _planes_few(x: tuple, p0: np.ndarray, p1: np.ndarray, p2: np.ndarray, p3: np.ndarray) -> None:
    """The count planes of weight 1, 2, 4, 8 of up to eight payloads' words in one pass."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x
    for i in range(p0.size):
        p0[i], p1[i], p2[i], p3[i] = _tree8(x0[i], x1[i], x2[i], x3[i], x4[i], x5[i], x6[i], x7[i])


def scratch(num_planes: int) -> np.ndarray:
    """One thread's counters for B = ``num_planes`` planes, to pass to the count kernels.

    Rows: P = max(B, 3) accumulator planes (the adders of :func:`_count_chunk` always write
    weights 1, 2, 4; planes above B stay 0), P pending planes, two carry buffers. The caller
    keeps one per thread and reuses it: allocating it on every call costs page faults.
    """
    planes = max(num_planes, 3)
    return np.empty((2 * planes + 2, CHUNK_WORDS), np.uint64)


@_jit
def _split(scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows of :func:`scratch` as (acc, pending, which levels are pending, carry)."""
    planes = (scratch.shape[0] - 2) // 2
    return scratch[:planes], scratch[planes : 2 * planes], np.zeros(planes, np.bool_), scratch[2 * planes :]


@_jit
def count_planes(addresses: np.ndarray, first: int, last: int, planes: np.ndarray, scratch: np.ndarray) -> None:
    """Count 1 bits over the payloads at ``addresses`` (int64 words each) for words ``first … last−1``.

    Writes the bit-sliced counts into ``planes`` (B, words), B = ``planes.shape[0]``: plane j
    holds bit j of each coordinate's count. Only the planes leave the cache.
    """
    b = planes.shape[0]
    if addresses.size <= 8:  # one pass, the counters in registers; planes above B go to spare rows
        scratch[0] = 0
        for start in range(first, last, CHUNK_WORDS):
            m = min(CHUNK_WORDS, last - start)
            out = [planes[j, start : start + m] if j < b else scratch[j, :m] for j in range(4)]
            _planes_few(_few(addresses, start, m, scratch[0]), out[0], out[1], out[2], out[3])
        return
    acc, pending, has, carry = _split(scratch)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        for j in range(b):
            planes[j, start : start + m] = acc[j, :m]


@_jit
def count_ones(addresses: np.ndarray, first: int, last: int, counts: np.ndarray, scratch: np.ndarray) -> None:
    """Like :func:`count_planes`, but writes the int32 counts, 64 per word, into ``counts``."""
    acc, pending, has, carry = _split(scratch)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        _emit_counts(acc, m, counts[64 * start : 64 * (start + m)])
