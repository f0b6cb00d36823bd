"""CPU kernels (numba) for one vector: sign pack, the client's Lion step + pack, apply Δ.

Optional: :mod:`flower_dlion.accel.cpu` calls them when numba is installed (the ``fast``
extra) and the codec's numpy reference runs otherwise, with bit-identical results (the tests
run both). Imports numpy and numba only (and llvmlite, numba's code generator, for the
vector code of the pack). Each kernel works on a range ``first … last−1`` of its output and
releases the GIL; :mod:`flower_dlion.accel.threads` calls it on several threads, one range
per thread (or :mod:`flower_dlion.accel.numba_team` runs it on torch's own OpenMP team).
numba's own threading layer is not used, so the kernels are safe to call from any number of
threads at once.

Why fused: numpy does "compare" and "pack" as two passes; here each value is read from
memory once and everything else happens in registers.

- Pack: 64 floats at a time into one uint64 in packbits order (MSB first). On x86-64 with
  AVX2 and no AVX-512 the sign bits go through AVX2's byte packs, one byte shuffle, one
  dword permute and ``pmovmskb`` (no compare; a group holding ±0 or NaN, found by eight
  unordered compares, is compared exactly instead); elsewhere one 64-lane compare straight
  into a 64-bit mask (AVX-512 mask registers) and a bit reversal in each byte. Where the pack
  finds an exact zero, a second, compare-only pass writes the zeros' masks in the same layout
  (the codec sets coin flips there).
- Lion step + pack (the client): m and g as two 64-lane vectors, the mix and the new momentum
  by vector FMAs (rounded as torch's ``add(alpha=)`` is; :mod:`flower_dlion.accel.cpu` checks
  that first), m stored back, the mix's signs packed as above.
- Apply Δ (server and clients): ``x·decay − lr·(2k − top)/top`` from the levels k in one pass,
  each operation rounded on its own as the torch composition does.
- One Δ of the anchored downlink (clients): ``C' = C + L`` and ``x' = γ·xₐ − η·C'`` straight
  from the Δ's packed levels (``sign1`` or ``trit5``), each operation rounded as
  ``lion.anchored``'s torch operations are.

The level codes of a broadcast Δ (bit planes, ``trit5``) are :mod:`.numba_levels`'s.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["BLOCK", "apply_levels", "lion_pack", "pack_positive", "step_counts", "zero_masks"]

BLOCK = 64  # float32 values packed per group: one 64-lane compare, one uint64 of bits

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)


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


# ------------------------------------------------------------------- one anchored Δ
@_jit
def step_counts(
    levels: np.ndarray,
    scale: int,
    counts: np.ndarray,
    anchor: np.ndarray,
    counts_out: np.ndarray,
    x_out: np.ndarray,
    decay: np.float32,
    step: np.float32,
    first: int,
    last: int,
) -> None:
    """``C' = C + L`` and ``x' = xₐ·decay − C'·step`` for the values ``first … last−1``, ``L = scale·k − 1``.

    ``levels`` uint8: a Δ's levels k (``scale`` 2 for two levels, 1 for three). ``counts`` int32
    is read, ``counts_out`` (int32) and ``x_out`` (float32) written; each product and the
    difference are rounded to float32 on their own, as ``lion.anchored``'s three torch
    operations are. A plain loop over slices: LLVM vectorizes it.
    """
    ks, cs, xa = levels[first:last], counts[first:last], anchor[first:last]
    c2, x2 = counts_out[first:last], x_out[first:last]
    for i in range(cs.size):
        c = cs[i] + np.int32(scale) * np.int32(ks[i]) - 1
        c2[i] = c
        x2[i] = xa[i] * decay - np.float32(c) * step
