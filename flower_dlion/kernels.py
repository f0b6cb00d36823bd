"""Fused CPU kernels for the codec (numba): sign packing and vote counting at memory speed.

Optional: :mod:`flower_dlion.codec` uses them when numba is installed (the ``fast`` extra)
and falls back to numpy otherwise, with bit-identical results (the tests run both). Imports
numpy and numba only. Each kernel works on a range of its output, releases the GIL, and is
called by the codec on torch's CPU threads, one range per thread; numba's own threading
layer is not used, so the kernels are safe to call from any number of threads at once.

Why fused: numpy does "compare" and "pack" as two passes, and the fallback's bit-sliced vote
is five torch operations per pair of payloads on 512 kB chunks; here each value (each payload
word) is read from memory once and everything else happens in registers or cache. Small
helpers on contiguous 1-D slices keep the loops simple enough for LLVM to vectorize them.

Safety: the count kernels read the payloads through raw addresses (``addresses``, int64),
so that n payloads need no n × d array and no copy; the caller (:class:`codec._KernelWords`)
checks every payload's length and keeps the arrays alive during the call.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["BLOCK", "CHUNK_WORDS", "count_ones", "count_planes", "pack_positive", "vote_masks"]

BLOCK = 4096  # float32 values compared per block (16 kB; 512 packed bytes)
CHUNK_WORDS = 1024  # int64 words counted per chunk (8 kB per plane: the counters stay in L2)
_MAGIC = np.uint64(0x8040201008040201)  # 8 bytes of 0/1 × this, top byte = the 8 bits, MSB first

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)


# ------------------------------------------------------------------------------- pack
@_jit
def _compare(v: np.ndarray, bits: np.ndarray) -> np.uint8:
    """bits[i] = v[i] > 0; returns 1 if some v[i] is an exact zero."""
    zero = np.uint8(0)
    for i in range(v.size):
        x = v[i]
        bits[i] = x > 0  # the sign bit: 1 for v > 0
        zero |= x == 0  # exact zeros get a coin flip later
    return zero


@_jit
def _pack_bytes(bits: np.ndarray, out: np.ndarray) -> None:
    """out[k] = the 8 bytes bits[8k : 8k+8] (each 0 or 1) as one byte, MSB first."""
    words = bits.view(np.uint64)
    for k in range(out.size):
        out[k] = np.uint8((words[k] * _MAGIC) >> np.uint64(56))


@_jit
def pack_positive(v: np.ndarray, out: np.ndarray, first: int, last: int) -> bool:
    """Pack ``v > 0`` for blocks ``first … last−1`` of :data:`BLOCK` values into ``out``.

    ``v`` is float32 of length d, ``out`` uint8 of length ⌈d/8⌉ (the last byte's spare bits
    are 0). Returns whether these blocks hold an exact zero.
    """
    d = v.size
    bits = np.zeros(BLOCK, np.uint8)
    zero = np.uint8(0)
    for b in range(first, last):
        start = b * BLOCK
        m = min(BLOCK, d - start)
        zero |= _compare(v[start : start + m], bits[:m])
        nbytes = (m + 7) // 8
        bits[m : 8 * nbytes] = 0  # a partial last byte is padded with 0 bits
        _pack_bytes(bits[: 8 * nbytes], out[start // 8 : start // 8 + nbytes])
    return zero != 0


# ------------------------------------------------------------------------------ count
@intrinsic
def _words_at(typingctx: object, address: types.Type) -> tuple:
    """An address (int64) as a pointer to uint64 words, for :func:`numba.carray`."""
    sig = types.CPointer(types.uint64)(types.int64)

    def codegen(context: object, builder: object, signature: object, args: tuple) -> object:
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint64)))

    return sig, codegen


@_jit
def _payload(addresses: np.ndarray, p: int, start: int, m: int) -> np.ndarray:
    """Words ``start … start+m−1`` of payload ``p`` (no copy)."""
    return numba.carray(_words_at(addresses[p] + 8 * start), m)


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
def _emit_vote(acc: np.ndarray, m: int, n: int, gt: np.ndarray, tie: np.ndarray) -> None:
    """Packed masks count > n/2 and count = n/2 of the first ``m`` words, compared from the top plane down."""
    threshold = n // 2  # count > n/2 ⇔ count > ⌊n/2⌋; a tie needs n even and count = n/2
    for j in range(acc.shape[0] - 1, -1, -1):
        t = ~np.uint64(0) if (threshold >> j) & 1 else np.uint64(0)  # bit j of the threshold, on every lane
        _compare_plane(acc[j, :m], t, gt, tie, j == acc.shape[0] - 1)
    if n % 2:
        tie[:] = 0  # no ties with an odd number of voters


@_jit
def _compare_plane(bit: np.ndarray, t: np.uint64, gt: np.ndarray, eq: np.ndarray, top: bool) -> None:
    """One bit of count vs threshold: gt |= eq ∧ bit ∧ ¬t (count has 1, threshold 0), eq &= (bit ≡ t).

    ``gt`` (decided greater by a higher bit) and ``eq`` (equal in every higher bit) start at
    the ``top`` plane, where no higher bit exists.
    """
    if top:
        for i in range(bit.size):
            gt[i] = bit[i] & ~t
            eq[i] = ~(bit[i] ^ t)
    else:
        for i in range(bit.size):
            gt[i] |= eq[i] & bit[i] & ~t
            eq[i] &= ~(bit[i] ^ t)


@_jit
def _emit_counts(acc: np.ndarray, m: int, counts: np.ndarray) -> None:
    """Per-coordinate counts (int32) of the first ``m`` words: coordinate 64·i + l is bit 8·(l//8) + 7 − l%8."""
    for i in range(m):
        for lane in range(64):  # byte lane//8 of the word (little-endian), bit 7 − lane%8 of it (MSB first)
            shift = np.uint64(8 * (lane >> 3) + 7 - (lane & 7))
            c = 0
            for j in range(acc.shape[0]):
                c |= np.int32((acc[j, i] >> shift) & np.uint64(1)) << j
            counts[64 * i + lane] = c


@_jit
def _count_chunk(
    addresses: np.ndarray, start: int, m: int, acc: np.ndarray, pending: np.ndarray, has: np.ndarray, carry: np.ndarray
) -> None:
    """Bit-sliced counts of words ``start … start+m−1`` over all payloads into ``acc[:, :m]`` (plane j = bit j)."""
    n = addresses.size
    acc[:] = 0
    for p in range(0, n - 1, 2):  # two payloads at a time through a carry-save adder
        _full_add(acc[0, :m], _payload(addresses, p, start, m), _payload(addresses, p + 1, start, m), carry[0, :m])
        _carry_up(acc, pending, has, 1, carry, m)
    if n % 2:
        _half_add(acc[0, :m], _payload(addresses, n - 1, start, m), carry[0, :m])
        _carry_up(acc, pending, has, 1, carry, m)
    for k in range(1, acc.shape[0]):  # half-add the planes left pending, lowest weight first
        if has[k]:
            has[k] = False
            _half_add(acc[k, :m], pending[k, :m], carry[0, :m])
            _carry_up(acc, pending, has, k + 1, carry, m)


@_jit
def _scratch(num_planes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One thread's counters: acc and pending planes, which levels are pending, two carry buffers."""
    acc, pending = np.empty((num_planes, CHUNK_WORDS), np.uint64), np.empty((num_planes, CHUNK_WORDS), np.uint64)
    return acc, pending, np.zeros(num_planes, np.bool_), np.empty((2, CHUNK_WORDS), np.uint64)


@_jit
def count_planes(addresses: np.ndarray, first: int, last: int, planes: np.ndarray) -> None:
    """Count 1 bits over the payloads at ``addresses`` (int64 words each) for words ``first … last−1``.

    Writes the bit-sliced counts into ``planes`` (B, words), B = ``planes.shape[0]``: plane j
    holds bit j of each coordinate's count. Only the planes leave the cache.
    """
    b = planes.shape[0]
    acc, pending, has, carry = _scratch(b)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        for j in range(b):
            planes[j, start : start + m] = acc[j, :m]


@_jit
def vote_masks(addresses: np.ndarray, num_planes: int, first: int, last: int, gt: np.ndarray, tie: np.ndarray) -> None:
    """Like :func:`count_planes`, but writes only the packed masks count > n/2 and count = n/2."""
    acc, pending, has, carry = _scratch(num_planes)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        _emit_vote(acc, m, addresses.size, gt[start : start + m], tie[start : start + m])


@_jit
def count_ones(addresses: np.ndarray, num_planes: int, first: int, last: int, counts: np.ndarray) -> None:
    """Like :func:`count_planes`, but writes the int32 counts, 64 per word, into ``counts``."""
    acc, pending, has, carry = _scratch(num_planes)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        _emit_counts(acc, m, counts[64 * start : 64 * (start + m)])
