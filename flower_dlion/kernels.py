"""Fused CPU kernels for the codec (numba): sign packing and vote counting at memory speed.

Optional: :mod:`flower_dlion.codec` uses them when numba is installed (the ``fast`` extra)
and falls back to numpy otherwise, with bit-identical results (the tests run both). Imports
numpy and numba only (and llvmlite, numba's code generator, for the vector code of the pack). Each
kernel works on a range of its output, releases the GIL, and is called by the codec on
several threads, one range per thread: on the codec's own threads, or (:class:`Team`, for the
client's pack, Lion step and apply once a process calls them repeatedly) on the OpenMP team
torch itself runs on, whose threads are still awake after torch's last operation. numba's
own threading layer is not used, so the kernels are safe to call from any number of threads
at once.

Why fused: numpy does "compare" and "pack" as two passes, and the fallback's bit-sliced vote
is five torch operations per pair of payloads on 512 kB chunks; here each value (each payload
word) is read from memory once and everything else happens in registers or cache.

- Pack: 64 floats at a time into one uint64 in packbits order (MSB first). On x86-64 with
  AVX2 and no AVX-512 the sign bits go through AVX2's byte packs, one byte shuffle, one
  dword permute and ``pmovmskb`` (no compare; a group holding ±0 or NaN, found by eight
  unordered compares, is compared exactly instead); elsewhere one 64-lane compare straight
  into a 64-bit mask (AVX-512 mask registers) and a bit reversal in each byte. Where the pack
  finds an exact zero, a second, compare-only pass writes the zeros' masks in the same layout
  (the codec sets coin flips there).
- Lion step + pack (the client): m and g as two 64-lane vectors, the mix and the new momentum
  by vector FMAs (rounded as torch's ``add(alpha=)`` is; the codec checks that first), m
  stored back, the mix's signs packed as above.
- Apply Δ (server and clients): ``x·decay − lr·(2k − top)/top`` from the levels k in one pass,
  each operation rounded on its own as the torch composition does.
- Decode a broadcast Δ (clients): bit planes → byte levels by spreading each plane byte's
  8 bits into 8 bytes with one multiply and three masks (no table); ``trit5`` bytes → five
  levels each from a 256-entry table. Encode ``trit5`` (the server): five levels → a byte.
- Count: a chunk of payload words at a time, eight payloads per pass through a tree of
  seven carry-save adders (Harley–Seal) into the counter planes of weight 1, 2 and 4; the
  carry plane of weight 8 goes up once per eight payloads. Up to eight payloads are counted
  and compared in one pass with the counters in registers. Small helpers on contiguous 1-D
  slices keep the loops simple enough for LLVM to vectorize them.

Safety: the count kernels read the payloads through raw addresses (``addresses``, int64),
so that n payloads need no n × d array and no copy; the caller (:class:`codec._KernelWords`)
checks every payload's length and keeps the arrays alive during the call.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import threading
from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "BLOCK",
    "CHUNK_WORDS",
    "apply_levels",
    "count_ones",
    "count_planes",
    "levels_to_trits",
    "lion_pack",
    "pack_positive",
    "planes_to_levels",
    "scratch",
    "trits_to_levels",
    "vote_masks",
    "zero_masks",
]

BLOCK = 64  # float32 values packed per group: one 64-lane compare, one uint64 of bits
CHUNK_WORDS = 1024  # int64 words counted per chunk (8 kB per plane: the counters stay in L2)
# coordinate l of a packed word is bit 8·(l//8) + 7 − l%8 (byte l//8, little-endian; MSB first in the byte)
_LANE_SHIFT = np.array([8 * (lane >> 3) + 7 - (lane & 7) for lane in range(64)], dtype=np.uint64)

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)
_R = TypeVar("_R")


# ------------------------------------------------------------------------------- pack
def _packs_with_avx2() -> bool:
    """Whether numba compiles for an x86-64 CPU with AVX2 and without AVX-512 (BW) here.

    There the signs are packed by :func:`_sign_bits_avx2`; elsewhere by LLVM's own lowering
    of a 64-lane compare (AVX-512 mask registers, Arm's NEON, or scalar code), which on
    AVX2 alone costs about a third more per value (``benchmarks/pack_variants.py``).
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from numba.core import codegen

        flat = numba.config.CPU_FEATURES or codegen.get_host_cpu_features()  # what numba compiles for
    except (AttributeError, ImportError, RuntimeError):
        return False
    features = {f[1:] for f in str(flat).split(",") if f.startswith("+")}
    return "avx2" in features and "avx512bw" not in features


_AVX2_PACKS = _packs_with_avx2()  # read when a kernel is compiled (numba caches per CPU and its features)


def _x86(builder: ir.IRBuilder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    """A call of the LLVM intrinsic ``llvm.x86.avx2.<name>``."""
    kind = ir.FunctionType(result, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, kind, f"llvm.x86.avx2.{name}"), list(args))


def _eighths(builder: ir.IRBuilder, x: ir.Value) -> list[ir.Value]:
    """The 64-lane ``x`` as eight 8-lane vectors (AVX2 registers)."""
    lanes = ir.VectorType(ir.IntType(32), 8)
    return [builder.shuffle_vector(x, x, ir.Constant(lanes, list(range(8 * q, 8 * q + 8)))) for q in range(8)]


def _sign_bits_avx2(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """The 64 floats ``x`` with a clear sign bit, as a uint64 in packbits order (MSB first in each byte).

    ``packssdw`` and ``packsswb`` (signed saturation keeps the sign) bring each value's sign
    into a byte, 32 values per register, in the packs' lane-interleaved order; ``pshufb``
    reverses each 4 bytes and ``permd`` orders the 4-byte groups so that value 8q + r sits in
    byte 8q + 7 − r; ``pmovmskb`` gathers the 32 signs. No compare: this is ``x > 0``
    wherever no value is ±0 or NaN, which the caller checks.
    """
    int32s, int16s, bytes32 = (ir.VectorType(ir.IntType(w), n) for w, n in ((32, 8), (16, 16), (8, 32)))
    parts = _eighths(builder, builder.bitcast(x, ir.VectorType(ir.IntType(32), 64)))
    reverse4 = ir.Constant(bytes32, [3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12] * 2)
    order = ir.Constant(int32s, [4, 0, 5, 1, 6, 2, 7, 3])  # 4-byte groups after the packs: values 0–3, 8–11, …
    halves = []
    for a, b, c, d in (parts[:4], parts[4:]):
        signs = _x86(builder, "packsswb", bytes32, _x86(builder, "packssdw", int16s, a, b),
                     _x86(builder, "packssdw", int16s, c, d))  # fmt: skip
        signs = builder.bitcast(_x86(builder, "pshuf.b", bytes32, signs, reverse4), int32s)
        signs = builder.bitcast(_x86(builder, "permd", int32s, signs, order), bytes32)
        halves.append(builder.zext(_x86(builder, "pmovmskb", ir.IntType(32), signs), ir.IntType(64)))
    word = builder.or_(halves[0], builder.shl(halves[1], ir.Constant(ir.IntType(64), 32)))
    return builder.not_(word)


def _any_zero_or_nan(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Whether one of the 64 floats ``x`` is ±0 or NaN (an i1): eight unordered compares and an OR."""
    masks = _eighths(builder, builder.sext(builder.fcmp_unordered("==", x, ir.Constant(x.type, None)),
                                           ir.VectorType(ir.IntType(32), 64)))  # fmt: skip
    while len(masks) > 1:
        masks = [builder.or_(a, b) for a, b in zip(masks[::2], masks[1::2], strict=True)]
    lanes = builder.bitcast(builder.icmp_signed("<", masks[0], ir.Constant(masks[0].type, None)), ir.IntType(8))
    return builder.icmp_unsigned("!=", lanes, ir.Constant(ir.IntType(8), 0))


def _msb_first(builder: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    """A 64-lane i1 mask as a uint64 in packbits order: value i at bit 7 − i%8 of byte i//8."""
    word = ir.IntType(64)
    bswap, reverse = (
        cgutils.get_or_insert_function(builder.module, ir.FunctionType(word, [word]), f"llvm.{f}.i64")
        for f in ("bswap", "bitreverse")
    )
    return builder.call(reverse, [builder.call(bswap, [builder.bitcast(mask, word)])])  # bits reversed in each byte


def _pack64(builder: ir.IRBuilder, x: ir.Value, exact: Callable[[], ir.Value]) -> tuple[ir.Value, ir.Value]:
    """``x > 0`` of 64 floats in packbits order, and ``exact()`` where a value is ±0 or NaN (else 0).

    With :data:`_AVX2_PACKS` the sign bits (:func:`_sign_bits_avx2`), and the ordered compare
    only in the rare groups with ±0 or NaN; elsewhere the compare and ``exact()`` always.
    ``exact()`` emits the zero report (an i64).
    """
    word = ir.IntType(64)
    if not _AVX2_PACKS:
        return _msb_first(builder, builder.fcmp_ordered(">", x, ir.Constant(x.type, None))), exact()
    fast = _sign_bits_avx2(builder, x)
    with builder.if_else(_any_zero_or_nan(builder, x), likely=False) as (odd, plain):
        with odd:
            slow, report = _msb_first(builder, builder.fcmp_ordered(">", x, ir.Constant(x.type, None))), exact()
            odd_block = builder.basic_block
        with plain:
            plain_block = builder.basic_block
    bits, zeros = builder.phi(word), builder.phi(word)
    bits.add_incoming(slow, odd_block)
    bits.add_incoming(fast, plain_block)
    zeros.add_incoming(report, odd_block)
    zeros.add_incoming(ir.Constant(word, 0), plain_block)
    return bits, zeros


@intrinsic
def _signs64(typingctx: object, v: types.Array, start: types.Integer) -> tuple:
    """The bits of ``v[start : start+64] > 0`` in packbits order, and 1 if one of them is ±0 (else 0).

    Ordered compare, so NaN gives 0, as numpy's ``>`` does (:func:`_pack64`). The zero test
    of the plain compare is an unsigned minimum over the 64 values' bits without the sign
    (0 only for ±0; NaN is not zero) on vector registers, cheaper than a second compare into
    mask registers (docs/PERFORMANCE.md). ``v`` must be C-contiguous float32 with 64 values
    from ``start`` on.
    """
    if not (isinstance(v, types.Array) and v.dtype == types.float32 and v.layout == "C"):
        return None
    sig = types.UniTuple(types.uint64, 2)(v, start)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: tuple) -> object:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        lanes, ints = ir.VectorType(ir.FloatType(), 64), ir.VectorType(ir.IntType(32), 64)
        x = builder.load(builder.bitcast(builder.gep(data, [args[1]]), lanes.as_pointer()), align=4)

        def has_zero() -> ir.Value:
            magnitude = builder.and_(builder.bitcast(x, ints), ir.Constant(ints, [0x7FFFFFFF] * 64))  # |x|'s bits
            umin = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(32), [ints]), "llvm.vector.reduce.umin.v64i32"
            )
            zero = builder.icmp_unsigned("==", builder.call(umin, [magnitude]), ir.Constant(ir.IntType(32), 0))
            return builder.zext(zero, ir.IntType(64))

        return context.make_tuple(builder, signature.return_type, _pack64(builder, x, has_zero))

    return sig, codegen


@intrinsic
def _zero_mask64(typingctx: object, v: types.Array, start: types.Integer) -> tuple:
    """The mask of ``v[start : start+64] == 0`` (±0; NaN is not zero) as a uint64 in packbits order.

    One ordered 64-lane compare (:func:`zero_masks`), its bits placed as :func:`_msb_first` does.
    """
    if not (isinstance(v, types.Array) and v.dtype == types.float32 and v.layout == "C"):
        return None
    sig = types.uint64(v, start)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: tuple) -> object:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        lanes = ir.VectorType(ir.FloatType(), 64)
        x = builder.load(builder.bitcast(builder.gep(data, [args[1]]), lanes.as_pointer()), align=4)
        return _msb_first(builder, builder.fcmp_ordered("==", x, ir.Constant(lanes, None)))

    return sig, codegen


@_jit
def pack_positive(v: np.ndarray, out: np.ndarray, first: int, last: int) -> bool:
    """Pack ``v > 0`` for the groups ``first … last−1`` of :data:`BLOCK` (64) values into ``out``.

    ``v`` is C-contiguous float32 of length d, ``out`` uint8 of length ⌈d/8⌉ (a partial last
    byte's spare bits are 0). A whole group is one 64-lane compare and one uint64 store; a
    partial last group goes value by value. Returns whether these groups hold an exact zero.
    """
    d = v.size
    whole = d // BLOCK
    words = out[: 8 * whole].view(np.uint64)  # group k is word k: 8 bytes, little-endian
    zero = np.uint64(0)
    for k in range(first, min(last, whole)):
        word, has_zero = _signs64(v, BLOCK * k)
        words[k] = word
        zero |= has_zero  # exact zeros get a coin flip later
    if last > whole:  # the partial last group
        out[8 * whole :] = 0
        for i in range(BLOCK * whole, d):
            x = v[i]
            out[i >> 3] |= np.uint8(x > 0) << np.uint8(7 - (i & 7))
            zero |= np.uint64(x == 0)
    return zero != 0


@_jit
def zero_masks(v: np.ndarray, zeros: np.ndarray, first: int, last: int) -> None:
    """Group k's mask of exact zeros (±0; NaN is not zero) into ``zeros[k]``, for the groups ``first … last−1``.

    In packbits order, as :func:`pack_positive` packs the signs: ``zeros`` viewed as bytes is
    ``np.packbits(v == 0)`` (0 where a group has none; every word of the range is written).
    ``v`` is C-contiguous float32 of length d, ``zeros`` uint64 of length ⌈d/64⌉. One compare
    per 64 values: the second pass over ``v`` once :func:`pack_positive` has found a zero.
    """
    d = v.size
    whole = d // BLOCK
    for k in range(first, min(last, whole)):
        zeros[k] = _zero_mask64(v, BLOCK * k)
    if last > whole:  # the partial last group
        mask = zeros[whole : whole + 1].view(np.uint8)  # little-endian: byte j holds values 8j … 8j+7, MSB first
        mask[:] = 0
        for i in range(BLOCK * whole, d):
            mask[(i >> 3) - 8 * whole] |= np.uint8(v[i] == 0) << np.uint8(7 - (i & 7))


# ------------------------------------------------------------------ Lion step + pack
def _splat(builder: ir.IRBuilder, x: ir.Value, lanes: ir.VectorType) -> ir.Value:
    """A vector with ``x`` in every lane."""
    index = ir.IntType(32)
    one = builder.insert_element(ir.Constant(lanes, None), x, ir.Constant(index, 0))
    return builder.shuffle_vector(one, ir.Constant(lanes, None), ir.Constant(ir.VectorType(index, lanes.count), None))


@intrinsic
def _lion64(typingctx: object, m: types.Array, g: types.Array, start: types.Integer, coefs: types.UniTuple) -> tuple:
    """One Lion step on ``m[start : start+64]``, in place; returns δ's bits and its zero directions.

    ``coefs = (β₁, 1−β₁, β₂, 1−β₂)`` as float32. Rounds as torch's ``m.mul(β₁).add_(g,
    alpha=1−β₁)`` does with FMA: ``c = fma(1−β₁, g, fl(β₁·m))`` and ``m ← fma(1−β₂, g,
    fl(β₂·m))``, 64 lanes at a time. Returns ``c > 0`` (ordered) in packbits order
    (:func:`_pack64`), and the mask of ``sign(c) = 0`` — ``c = 0`` or NaN (unordered
    compare), as ``torch.sign`` gives 0 for NaN — in packbits order too.
    """
    if not all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" for a in (m, g)):
        return None
    sig = types.UniTuple(types.uint64, 2)(m, g, start, coefs)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: tuple) -> object:
        lanes = ir.VectorType(ir.FloatType(), 64)
        b1, a1, b2, a2 = (_splat(builder, builder.extract_value(args[3], i), lanes) for i in range(4))
        ptrs = []
        for a, typ in zip(args[:2], signature.args[:2], strict=True):
            data = context.make_array(typ)(context, builder, a).data
            ptrs.append(builder.bitcast(builder.gep(data, [args[2]]), lanes.as_pointer()))
        mv, gv = (builder.load(ptr, align=4) for ptr in ptrs)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3), "llvm.fma.v64f32")
        mix = builder.call(fma, [a1, gv, builder.fmul(b1, mv)])  # β₁·m + (1−β₁)·g
        builder.store(builder.call(fma, [a2, gv, builder.fmul(b2, mv)]), ptrs[0], align=4)  # m ← β₂·m + (1−β₂)·g

        def ties() -> ir.Value:
            return _msb_first(builder, builder.fcmp_unordered("==", mix, ir.Constant(lanes, None)))

        return context.make_tuple(builder, signature.return_type, _pack64(builder, mix, ties))

    return sig, codegen


@_jit
def lion_pack(
    m: np.ndarray,
    g: np.ndarray,
    coefs: tuple[np.float32, np.float32, np.float32, np.float32],
    out: np.ndarray,
    zeros: np.ndarray,
    first: int,
    last: int,
) -> bool:
    """One Lion step fused with the pack, for the groups ``first … last−1`` of 64 values.

    Writes the bits of ``δ = sign(β₁·m + (1−β₁)·g) > 0`` into ``out`` (uint8, ⌈d/8⌉, as
    :func:`pack_positive`), updates ``m ← β₂·m + (1−β₂)·g`` in place (``m`` and ``g``
    C-contiguous float32 of length d, read once), and stores group k's mask of zero
    directions in ``zeros[k]`` (in packbits order, as the bits; 0 where there are none;
    uint64, ⌈d/64⌉). ``coefs = (β₁, 1−β₁, β₂, 1−β₂)``. The partial last group goes through a
    zero-padded copy. Returns whether these groups hold a zero direction.
    """
    d = m.size
    whole = d // BLOCK
    words = out[: 8 * whole].view(np.uint64)
    found = np.uint64(0)
    for k in range(first, min(last, whole)):
        bits, tie = _lion64(m, g, BLOCK * k, coefs)
        words[k] = bits
        zeros[k] = tie
        found |= tie
    if last > whole:  # the partial last group: the same step on a zero-padded copy
        rest = d - BLOCK * whole
        pm, pg = np.zeros(BLOCK, np.float32), np.zeros(BLOCK, np.float32)
        pm[:rest], pg[:rest] = m[BLOCK * whole :], g[BLOCK * whole :]
        bits, tie = _lion64(pm, pg, 0, coefs)
        m[BLOCK * whole :] = pm[:rest]
        real = np.uint64(0)  # the padding's mix is 0, but it is no direction: only the first rest lanes count
        for lane in range(rest):
            real |= np.uint64(1) << np.uint64(8 * (lane >> 3) + 7 - (lane & 7))
        tie &= real
        for j in range(out.size - 8 * whole):  # little-endian: byte j of the word
            out[8 * whole + j] = np.uint8((bits >> np.uint64(8 * j)) & np.uint64(0xFF))
        zeros[whole] = tie
        found |= tie
    return found != 0


# ------------------------------------------------------------------------- apply Δ
@_jit
def apply_levels(
    x: np.ndarray, levels: np.ndarray, top: int, lr: np.float32, decay: np.float32, first: int, last: int
) -> int:
    """``x ← x·decay − ((2k − top)/top)·lr`` with ``k = levels[i]``, for ``i`` in ``first … last−1``.

    ``x`` float32 (in place), ``levels`` integers, ``top = L − 1``; ``lr`` and ``decay``
    float32. Each operation is rounded to float32 on its own (numba never fuses them), as
    the torch operations of ``lion.apply_update_(x, codec.levels_to_values(...))`` are.
    Returns the largest level seen (as unsigned: a negative one is huge); the caller
    checks it against ``top``.
    """
    xs, ks = x[first:last], levels[first:last]  # a loop from 0 is vectorized (no negative-index check)
    topf = np.float32(top)
    worst = np.uint32(0)
    for i in range(xs.size):
        k = np.int32(ks[i])
        worst = max(worst, np.uint32(k))
        numerator = np.int32(2 * k - top)  # int32, as torch's: AVX2 converts no int64 to float in vectors
        xs[i] = xs[i] * decay - np.float32(np.float32(numerator) / topf) * lr  # x·(1 − lr·wd) − lr·Δ
    return worst


# ---------------------------------------------------------------------- decode levels
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
    Arithmetic only (no table), a chunk of :data:`CHUNK_WORDS` plane bytes per pass so the
    words stay in cache while every plane is added.
    """
    for start in range(first, last, CHUNK_WORDS):
        stop = min(start + CHUNK_WORDS, last)
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


# ------------------------------------------------------------------------------ count
def _pointer_to(dtype: types.Type) -> object:
    """An intrinsic: an address (int64) as a pointer to ``dtype``, for :func:`numba.carray`."""

    @intrinsic
    def at(typingctx: object, address: types.Type) -> tuple:
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context: object, builder: ir.IRBuilder, signature: object, a: tuple) -> object:
            return builder.inttoptr(a[0], context.get_value_type(types.CPointer(dtype)))

        return sig, codegen

    return at


_f32_at, _u8_at, _i32_at, _i64_at, _u64_at = (
    _pointer_to(t) for t in (types.float32, types.uint8, types.int32, types.int64, types.uint64)
)


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
def _emit_vote(acc: np.ndarray, m: int, n: int, gt: np.ndarray, tie: np.ndarray) -> None:
    """Packed masks count > n/2 and count = n/2 of the first ``m`` words, compared from the top plane down.

    Planes B−1 … 3 (if any) take one pass each; the last three planes one pass together.
    """
    threshold = n // 2  # count > n/2 ⇔ count > ⌊n/2⌋; a tie needs n even and count = n/2
    top = acc.shape[0] - 1
    for j in range(top, 2, -1):
        t = ~np.uint64(0) if (threshold >> j) & 1 else np.uint64(0)  # bit j of the threshold, on every lane
        _compare_plane(acc[j, :m], t, gt, tie, j == top)
    t2, t1, t0 = [~np.uint64(0) if (threshold >> j) & 1 else np.uint64(0) for j in (2, 1, 0)]
    _compare_low(acc[2, :m], acc[1, :m], acc[0, :m], t2, t1, t0, gt, tie, top == 2, n % 2 == 1)


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
def _compare_low(
    b2: np.ndarray,
    b1: np.ndarray,
    b0: np.ndarray,
    t2: np.uint64,
    t1: np.uint64,
    t0: np.uint64,
    gt: np.ndarray,
    eq: np.ndarray,
    top: bool,
    odd: bool,
) -> None:
    """:func:`_compare_plane` for the planes of weight 4, 2, 1 in one pass; no ties if ``odd``."""
    keep = np.uint64(0) if odd else ~np.uint64(0)
    for i in range(b2.size):
        g, e = (np.uint64(0), ~np.uint64(0)) if top else (gt[i], eq[i])
        g |= e & b2[i] & ~t2
        e &= ~(b2[i] ^ t2)
        g |= e & b1[i] & ~t1
        e &= ~(b1[i] ^ t1)
        g |= e & b0[i] & ~t0
        e &= ~(b0[i] ^ t0)
        gt[i], eq[i] = g, e & keep


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
def _vote_few(
    x: tuple,
    t3: np.uint64,
    t2: np.uint64,
    t1: np.uint64,
    t0: np.uint64,
    keep: np.uint64,
    gt: np.ndarray,
    tie: np.ndarray,
) -> None:
    """Masks count > t and count = t of up to eight payloads' words in one pass (t's bits ``t3 … t0`` on every lane)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x
    for i in range(gt.size):
        ones, twos, fours, eights = _tree8(x0[i], x1[i], x2[i], x3[i], x4[i], x5[i], x6[i], x7[i])
        g, e = eights & ~t3, ~(eights ^ t3)  # compared from the top bit down, as _compare_low
        g |= e & fours & ~t2
        e &= ~(fours ^ t2)
        g |= e & twos & ~t1
        e &= ~(twos ^ t1)
        g |= e & ones & ~t0
        e &= ~(ones ^ t0)
        gt[i], tie[i] = g, e & keep


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
def vote_masks(
    addresses: np.ndarray, first: int, last: int, gt: np.ndarray, tie: np.ndarray, scratch: np.ndarray
) -> None:
    """Like :func:`count_planes`, but writes only the packed masks count > n/2 and count = n/2."""
    n = addresses.size
    if n <= 8:  # one pass, the counters in registers
        scratch[0] = 0
        t = [~np.uint64(0) if (n // 2 >> j) & 1 else np.uint64(0) for j in range(4)]
        keep = np.uint64(0) if n % 2 else ~np.uint64(0)  # no ties with an odd number of voters
        for start in range(first, last, CHUNK_WORDS):
            m = min(CHUNK_WORDS, last - start)
            x = _few(addresses, start, m, scratch[0])
            _vote_few(x, t[3], t[2], t[1], t[0], keep, gt[start : start + m], tie[start : start + m])
        return
    acc, pending, has, carry = _split(scratch)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        _emit_vote(acc, m, addresses.size, gt[start : start + m], tie[start : start + m])


@_jit
def count_ones(addresses: np.ndarray, first: int, last: int, counts: np.ndarray, scratch: np.ndarray) -> None:
    """Like :func:`count_planes`, but writes the int32 counts, 64 per word, into ``counts``."""
    acc, pending, has, carry = _split(scratch)
    for start in range(first, last, CHUNK_WORDS):
        m = min(CHUNK_WORDS, last - start)
        _count_chunk(addresses, start, m, acc, pending, has, carry)
        _emit_counts(acc, m, counts[64 * start : 64 * (start + m)])


# ------------------------------------------------------------- on torch's OpenMP threads
# torch runs its CPU operations on an OpenMP team whose threads spin for a while after each
# operation; a kernel that follows one (the pack after backward) finds them awake. A task
# below is a C callback that GOMP_parallel runs once on each thread of that team: each
# thread takes parts of the work (an atomic counter in the task's int64 arguments) until
# none is left, so a thread that wakes late takes fewer parts and none is waited for twice.
_TASK = types.void(types.voidptr)


@intrinsic
def _take(typingctx: object, args: types.Type, index: types.Integer) -> tuple:
    """Atomically add 1 to the int64 ``args[index]`` (a task's counter); returns the old value."""
    sig = types.int64(types.voidptr, types.int64)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, a: tuple) -> object:
        counter = builder.gep(builder.bitcast(a[0], ir.IntType(64).as_pointer()), [a[1]])
        return builder.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@functools.cache
def _pack_task(pack: object = None) -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task).

    ``pack``: another compiled :func:`pack_positive` to run instead (``benchmarks/pack_variants.py``
    times the formulations on the team); that task is compiled afresh, not cached.
    """
    cache, pack = pack is None, pack_positive if pack is None else pack

    @numba.cfunc(_TASK, cache=cache)
    def task(args: object) -> None:  # int64 [next, parts, groups, v, d, out, masks, found]
        a = numba.carray(args, 8, np.int64)
        parts, groups, d = a[1], a[2], a[4]
        v, found = numba.carray(_f32_at(a[3]), d), numba.carray(_u8_at(a[7]), parts)
        p = _take(args, 0)
        while p < parts:
            first, last = groups * p // parts, groups * (p + 1) // parts
            if a[6]:  # the second pass: the zeros' masks into out (uint64, one per group)
                zero_masks(v, numba.carray(_u64_at(a[5]), groups), first, last)
            else:
                found[p] = pack(v, numba.carray(_u8_at(a[5]), (d + 7) // 8), first, last)
            p = _take(args, 0)

    return task


@functools.cache
def _lion_pack_task() -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task)."""

    @numba.cfunc(_TASK, cache=True)
    def task(args: object) -> None:  # int64 [next, parts, groups, m, g, d, coefs, out, zeros, found]
        a = numba.carray(args, 10, np.int64)
        parts, groups, d = a[1], a[2], a[5]
        m, g = numba.carray(_f32_at(a[3]), d), numba.carray(_f32_at(a[4]), d)
        c = numba.carray(_f32_at(a[6]), 4)
        coefs = (c[0], c[1], c[2], c[3])
        out, zeros = numba.carray(_u8_at(a[7]), (d + 7) // 8), numba.carray(_u64_at(a[8]), groups)
        found = numba.carray(_u8_at(a[9]), parts)
        p = _take(args, 0)
        while p < parts:
            found[p] = lion_pack(m, g, coefs, out, zeros, groups * p // parts, groups * (p + 1) // parts)
            p = _take(args, 0)

    return task


@functools.cache
def _apply_task() -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task)."""

    @numba.cfunc(_TASK, cache=True)
    def task(args: object) -> None:  # int64 [next, parts, d, x, levels, wide, top, scalars, worst]
        a = numba.carray(args, 9, np.int64)
        parts, d, top = a[1], a[2], a[6]
        x, s = numba.carray(_f32_at(a[3]), d), numba.carray(_f32_at(a[7]), 2)  # s: lr, decay
        worst = numba.carray(_u64_at(a[8]), parts)
        p = _take(args, 0)
        while p < parts:
            first, last = d * p // parts, d * (p + 1) // parts
            if a[5]:  # int32 levels
                worst[p] = apply_levels(x, numba.carray(_i32_at(a[4]), d), top, s[0], s[1], first, last)
            else:  # uint8 levels
                worst[p] = apply_levels(x, numba.carray(_u8_at(a[4]), d), top, s[0], s[1], first, last)
            p = _take(args, 0)

    return task


@functools.cache
def _count_task() -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task)."""

    @numba.cfunc(_TASK, cache=True)
    def task(args: object) -> None:  # int64 [next, parts, whole, addresses, n, vote, out, tie, rows, cols,
        a = numba.carray(args, 13, np.int64)  # scratch, scratch rows, next scratch slot]
        parts, whole, n, vote = a[1], a[2], a[4], a[5]
        addresses = numba.carray(_i64_at(a[3]), n)
        out, tie = numba.carray(_u64_at(a[6]), (a[8], a[9])), numba.carray(_u64_at(a[7]), a[9])
        slot = _take(args, 12)  # this thread's counters: one of the caller's scratch arrays (see scratch)
        work = numba.carray(_u64_at(a[10] + slot * a[11] * CHUNK_WORDS * 8), (a[11], CHUNK_WORDS))
        p = _take(args, 0)
        while p < parts:
            first, last = whole * p // parts, whole * (p + 1) // parts
            if vote:
                vote_masks(addresses, first, last, out[0], tie, work)
            else:
                count_planes(addresses, first, last, out, work)
            p = _take(args, 0)

    return task


@intrinsic
def _gomp_parallel(typingctx: object, parallel: types.Integer, task: types.Integer, data: types.Integer,
                   threads: types.Integer) -> tuple:  # fmt: skip
    """``GOMP_parallel(task, data, threads, 0)`` through its address ``parallel`` (all int64)."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, a: tuple) -> object:
        void_p, uint = ir.IntType(8).as_pointer(), ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [void_p, void_p, uint, uint])  # (fn, data, num_threads, flags)
        run = builder.inttoptr(a[0], kind.as_pointer())
        builder.call(run, [builder.inttoptr(a[1], void_p), builder.inttoptr(a[2], void_p), builder.trunc(a[3], uint),
                           ir.Constant(uint, 0)])  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


# The launches: each fills its task's int64 arguments and runs it on the team, compiled and
# with the GIL released: from Python, one call with a few array arguments (Python's own
# per-call work, ctypes and array addresses, cost 15–20 µs against a 57 µs pack of 10⁶
# values). The task's arguments, its float scalars and its per-part results share one
# buffer that is read after the run: numba frees an array after its last use, so none may
# be used only through an address.
_PARTS_PER_THREAD = 4  # a thread that wakes late leaves its parts to the others


@_jit
def _launch_pack(
    parallel: int, task: int, threads: int, v: np.ndarray, out: np.ndarray, masks: bool = False
) -> bool:  # fmt: skip
    """:func:`pack_positive` of every group of ``v`` into ``out`` on the team; whether there is an exact zero.

    With ``masks``, :func:`zero_masks` into ``out`` (uint64, one per group) instead; returns False.
    """
    parts = threads * _PARTS_PER_THREAD
    a = np.zeros(8 + (parts + 7) // 8, dtype=np.int64)  # the arguments, then a byte per part: found
    a[1], a[2], a[3], a[4] = parts, (v.size + BLOCK - 1) // BLOCK, v.ctypes.data, v.size
    a[5], a[6], a[7] = out.ctypes.data, masks, a.ctypes.data + 8 * 8
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[8:].view(np.uint8)[:parts].any()


@_jit
def _launch_lion_pack(
    parallel: int, task: int, threads: int, m: np.ndarray, g: np.ndarray, coefs: tuple, out: np.ndarray,
    zeros: np.ndarray,
) -> bool:  # fmt: skip
    """:func:`lion_pack` of every group on the team; whether there is a zero direction."""
    parts = threads * _PARTS_PER_THREAD
    a = np.zeros(12 + (parts + 7) // 8, dtype=np.int64)  # the arguments, 4 float32 coefs, a byte per part
    c = a[10:12].view(np.float32)
    c[0], c[1], c[2], c[3] = coefs
    a[1], a[2], a[3], a[4], a[5] = parts, zeros.size, m.ctypes.data, g.ctypes.data, m.size
    a[6], a[7], a[8], a[9] = a.ctypes.data + 10 * 8, out.ctypes.data, zeros.ctypes.data, a.ctypes.data + 12 * 8
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[12:].view(np.uint8)[:parts].any()


@_jit
def _launch_apply(
    parallel: int, task: int, threads: int, x: np.ndarray, levels: np.ndarray, top: int, lr: np.float32,
    decay: np.float32,
) -> int:  # fmt: skip
    """:func:`apply_levels` of every value on the team (uint8 or int32 levels); the largest level."""
    parts = threads * _PARTS_PER_THREAD
    a = np.zeros(10 + parts, dtype=np.int64)  # the arguments, float32 lr and decay, a word per part: worst
    s = a[9:10].view(np.float32)
    s[0], s[1] = lr, decay
    a[1], a[2], a[3], a[4] = parts, x.size, x.ctypes.data, levels.ctypes.data
    a[5], a[6], a[7], a[8] = levels.itemsize == 4, top, a.ctypes.data + 9 * 8, a.ctypes.data + 10 * 8
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[10:].view(np.uint64).max()


@_jit
def _launch_count(
    parallel: int, task: int, threads: int, addresses: np.ndarray, whole: int, out: np.ndarray, tie: np.ndarray,
    vote: bool, work: np.ndarray,
) -> int:  # fmt: skip
    """:func:`count_planes` (``out``: the (B, words) planes) or :func:`vote_masks` (``out``, ``tie``) on the team.

    Returns how many of the team's threads took part.
    """
    a = np.zeros(13, dtype=np.int64)
    a[1], a[2], a[3], a[4] = threads * _PARTS_PER_THREAD, whole, addresses.ctypes.data, addresses.size
    a[5], a[6], a[7] = vote, out.ctypes.data, tie.ctypes.data
    a[8], a[9] = 1 if vote else out.shape[0], out.shape[-1]  # rows and words of out
    a[10], a[11] = work.ctypes.data, work.shape[1]
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[12]


class Team:
    """Runs a task on torch's OpenMP team: ``GOMP_parallel`` of the runtime already loaded.

    Works with GNU libgomp and LLVM's libomp (which provides the same entry point); the
    codec makes one only when torch's parallel backend is OpenMP. The call releases the
    GIL; calls from several threads get a team each (OpenMP's rules), and a call from
    inside a parallel region runs on the calling thread alone. Every part is done before
    :meth:`run` returns.
    """

    def __init__(self) -> None:
        parallel = ctypes.CDLL(None).GOMP_parallel  # AttributeError where no OpenMP is loaded
        self._parallel = ctypes.cast(parallel, ctypes.c_void_p).value
        self._local = threading.local()  # per calling thread: the count's scratch arrays

    def run(self, launch: Callable[..., _R], task: object, threads: int, *operands: object) -> _R:
        """``launch``'s task on ``threads`` threads of the team with ``operands``; what ``launch`` returns."""
        return launch(self._parallel, task.address, threads, *operands)

    def pack_positive(self, v: np.ndarray, out: np.ndarray, threads: int) -> bool:
        """:func:`pack_positive` of every group on ``threads`` threads; whether ``v`` has an exact zero."""
        return self.run(_launch_pack, _pack_task(), threads, v, out)

    def zero_masks(self, v: np.ndarray, zeros: np.ndarray, threads: int) -> None:
        """:func:`zero_masks` of every group on ``threads`` threads (after :meth:`pack_positive` found a zero)."""
        self.run(_launch_pack, _pack_task(), threads, v, zeros, True)

    def lion_pack(
        self, m: np.ndarray, g: np.ndarray, coefs: tuple, out: np.ndarray, zeros: np.ndarray, threads: int
    ) -> bool:
        """:func:`lion_pack` of every group on ``threads`` threads; whether there is a zero direction."""
        return self.run(_launch_lion_pack, _lion_pack_task(), threads, m, g, coefs, out, zeros)

    def apply_levels(
        self, x: np.ndarray, levels: np.ndarray, top: int, lr: np.float32, decay: np.float32, threads: int
    ) -> int:
        """:func:`apply_levels` of every value on ``threads`` threads (uint8 or int32 levels); the largest level."""
        if levels.dtype not in (np.uint8, np.int32):
            raise TypeError(f"levels must be uint8 or int32, got {levels.dtype}")
        return int(self.run(_launch_apply, _apply_task(), threads, x, levels, top, lr, decay))

    def count(self, addresses: np.ndarray, whole: int, out: np.ndarray, tie: np.ndarray | None, threads: int) -> None:
        """:func:`count_planes` or :func:`vote_masks` of the words ``0 … whole−1`` on ``threads`` threads.

        With ``tie`` None ``out`` gets the (B, words) count planes; else ``out`` (1-D) gets
        the mask count > n/2 and ``tie`` the mask count = n/2.
        """
        work = self._scratch(threads, addresses.size.bit_length())
        vote = tie is not None
        self.run(_launch_count, _count_task(), threads, addresses, whole, out, tie if vote else out[0], vote, work)

    def _scratch(self, threads: int, num_planes: int) -> np.ndarray:
        """``threads`` stacked :func:`scratch` arrays, allocated once per calling thread and reused."""
        cache = self._local.__dict__.setdefault("scratch", {})
        key = (threads, max(num_planes, 3))
        if key not in cache:
            cache[key] = np.stack([scratch(num_planes) for _ in range(threads)])
        return cache[key]
