"""CPU kernels (numba) for the level codes of a broadcast Δ: bit planes and ``trit5``, to levels and back.

Optional, as :mod:`.numba_pack` is (the ``fast`` extra; :mod:`flower_dlion.accel.cpu` calls
them, the codec's numpy reference runs otherwise, bit-identical). Each kernel works on a range
``first … last−1`` and releases the GIL (:mod:`flower_dlion.accel.threads` runs ranges on
several threads).

- Decode (clients): bit planes → byte levels by spreading each plane byte's 8 bits into 8 bytes
  with one multiply and three masks (no table); ``trit5`` bytes → five levels each from a
  256-entry table.
- Encode ``trit5`` (the server): five levels → a byte.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["levels_to_trits", "planes_to_levels", "trits_to_levels"]

_PLANE_WORDS = 1024  # plane words decoded per chunk (8 kB per plane: they stay in L2)

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)

_BYTE_MSB = np.uint64(0x0102040810204080)  # byte r keeps bit 7 − r of a byte (value 8q + r, MSB first)
_LOW7, _HIGH = np.uint64(0x7F7F7F7F7F7F7F7F), np.uint64(0x8080808080808080)
_EVERY_BYTE = np.uint64(0x0101010101010101)


@_jit
def _spread(v: np.uint8) -> np.uint64:
    """The 8 bits of byte ``v`` (MSB first) as 8 bytes of 0 or 1: byte r is bit 7 − r."""
    w = (np.uint64(v) * _EVERY_BYTE) & _BYTE_MSB  # v in every byte; byte r keeps its bit 7 − r
    return ((w + _LOW7) & _HIGH) >> np.uint64(7)  # a nonzero byte → 1 (adding 0x7F sets bit 7, never carries)


@_jit
def planes_to_levels(planes: np.ndarray, out: np.ndarray, first: int, last: int) -> None:
    """Levels ``k = Σⱼ 2ʲ·(bit j)`` from B bit planes, for the plane bytes ``first … last−1``.

    ``planes`` uint8 (B, ⌈d/8⌉): plane j packs bit j of every level, MSB first (the
    ``planesB`` wire format); ``out`` uint64 (⌈d/8⌉): word q gets the levels 8q … 8q+7,
    one per byte (little-endian: as uint8, ``out`` holds the levels in order). B ≤ 8.
    Arithmetic only (no table), a chunk of ``_PLANE_WORDS`` plane bytes per pass so the
    words stay in cache while every plane is added.
    """
    for start in range(first, last, _PLANE_WORDS):
        stop = min(start + _PLANE_WORDS, last)
        words, p0 = out[start:stop], planes[0, start:stop]
        for i in range(words.size):
            words[i] = _spread(p0[i])
        for j in range(1, planes.shape[0]):
            pj, shift = planes[j, start:stop], np.uint64(j)
            for i in range(words.size):
                words[i] |= _spread(pj[i]) << shift


@_jit
def trits_to_levels(packed: np.ndarray, digits: np.ndarray, out: np.ndarray, first: int, last: int) -> int:
    """Levels from ``trit5`` bytes ``first … last−1``: byte i holds levels 5i … 5i+4 as its base-3 digits.

    ``digits`` uint8 (256, 5) is the table of every byte's five digits (least significant
    first), ``out`` uint8 of length 5·``packed.size``. Returns the largest byte seen (above
    242 = 3⁵ − 1 the payload is corrupted; the caller checks).
    """
    worst = 0
    for i in range(first, last):
        b = packed[i]
        worst = max(worst, b)
        for j in range(5):
            out[5 * i + j] = digits[b, j]
    return worst


@_jit
def levels_to_trits(levels: np.ndarray, out: np.ndarray, first: int, last: int) -> None:
    """``trit5`` bytes ``first … last−1`` from levels in {0, 1, 2}: byte i = Σⱼ 3ʲ·levels[5i + j].

    ``levels`` uint8 with five levels for every byte written (the caller encodes a partial
    last group itself).
    """
    ks, bs = levels[5 * first : 5 * last], out[first:last]  # loops from 0 over slices
    for i in range(bs.size):
        b = 5 * i
        bs[i] = ks[b] + 3 * ks[b + 1] + 9 * ks[b + 2] + 27 * ks[b + 3] + 81 * ks[b + 4]
