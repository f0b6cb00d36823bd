"""GPU kernels (Triton): the client's step, the sign pack, applying Δ, the vote count (for :mod:`.gpu`).

The pack reads the Lion direction once and writes its packed signs: each program
loads ``8·BYTES`` consecutive float32 values as a ``(BYTES, 8)`` tile, compares them with
zero and folds each row of 8 bits into one byte (MSB first, the layout of
:func:`numpy.packbits`), so the ``⌈d/8⌉`` bytes leave in one pass instead of the dozen
passes and launches of the tensor-operation path. An exact zero has no 1-bit sign: the
kernel sets a fair coin flip's bit there, drawn in the kernel from Philox at a counter
that the generator hands out on the host (:func:`coin_stream`), so a pack is one launch
that nothing waits for and nothing reads back. The client's whole step
(:func:`lion_pack`) does the same from m and g, writing the new momentum as it goes.
:func:`apply_levels` applies a broadcast Δ from its levels with torch's own L steps
``lr·Δ``, one read of x, and raises a flag for a level out of range: one per device,
raised to the call's own epoch, so no launch zeroes it first (:class:`Flag`).

The vote count reads the n payloads through a table of their addresses (no stacking
copy). For the count planes (the vote and the mean both come from them) every 32-bit lane
of a program is a bit-sliced counter of 32 values (up to 12 bit planes in registers,
n ≤ 4,095): adding a payload costs two bitwise operations per plane for 32 values, and the
planes are the mean's broadcast as they stand. The int32 counts (and more than 4,095
payloads) use per-value counters in registers instead. Nothing is ever unpacked in memory.

Every launch passes ``enable_fp_fusion=False``: the one multiply-add that must round as
torch's does is written as ``tl.fma``, and no other is fused, so the bits do not depend on
Triton's default for fusion (on up to 3.9, off from 3.10 on).

Imports only torch and Triton (shipped with torch's CUDA builds on Linux); with
``TRITON_INTERPRET=1`` set before import, the same kernels run on CPU tensors, which is
how the tests check them without a GPU; ``scripts/compile_kernels.py`` compiles them for
NVIDIA targets without one (``tests/library/test_gpu_compile.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BYTES = 1024  # packed bytes per program: 8,192 values, 32 kB read


class Flag(NamedTuple):
    """What one kernel call reports: the call raises ``tensor`` (int64, on the device) to at least ``epoch``.

    The tensor is one per device and never reset, and every call gets a new, larger epoch,
    so no launch is spent zeroing a flag before each call. Calls on other streams at the
    same time can only raise it further: :meth:`read` may then say True for a call that
    found nothing (the caller checks again exactly), never False for one that found something.
    """

    tensor: torch.Tensor
    epoch: int

    def read(self) -> bool:
        """Whether the flag is raised (waits for the call, as reading its output would)."""
        return int(self.tensor) >= self.epoch


_FLAGS: dict[torch.device, torch.Tensor] = {}  # device → its flag, zeroed once
_EPOCHS = itertools.count(1 << 32)  # past int32: Triton types the argument int64 from the first call


def _new_flag(device: torch.device) -> Flag:
    """The device's flag with a new epoch for one call."""
    tensor = _FLAGS.get(device)
    if tensor is None:
        tensor = _FLAGS.setdefault(device, torch.zeros(1, dtype=torch.int64, device=device))
    return Flag(tensor, next(_EPOCHS))


_INT64 = 1 << 62  # set in every seed and counter passed to a kernel: Triton then types them int64 on every call


def coin_stream(generator: torch.Generator | None, device: torch.device, nbytes: int) -> tuple[int, int]:
    """The Philox key and first counter of one call's coin flips, taken from ``generator`` with no device work.

    Byte ``b`` of the call's output draws the 8 coins of its values from Philox4x32-10
    (Triton's ``tl.randint``) at counter ``counter + b``: the low 8 bits of the first word,
    MSB first like the signs. A CUDA generator (``None`` on a CUDA device: the device's
    default one) gives its seed and Philox offset, and the offset is advanced past the
    call's ⌈nbytes/4⌉·4 counters: nothing is launched or read back, a seeded generator
    gives the same coins every run, and its later draws differ from these. Any other
    generator (a CPU one, under Triton's interpreter) draws the key instead, with counters from 0.

    Parameters
    ----------
    generator : torch.Generator | None
        Where the coins come from; ``None``: the default generator of ``device``.
    device : torch.device
        The device of the values.
    nbytes : int
        Packed bytes of the call (one counter each).

    Returns
    -------
    tuple[int, int]
        ``(seed, counter)``, each with bit 62 set (Triton types them int64; Philox takes them as they are).

    """
    if generator is None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    elif generator is None:
        generator = torch.default_generator
    if generator.device.type == "cuda":
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + -(-nbytes // 4) * 4)  # torch's Philox offsets are multiples of 4
    else:
        seed, offset = int(torch.randint(0, _INT64, (1,), generator=generator)), 0
    return seed & (_INT64 - 1) | _INT64, offset | _INT64


@triton.jit
def _store_signs(out_ptr, x, inside, byte, bit, seed, counter, nbytes, NAN_IS_ZERO: tl.constexpr):
    """Pack the signs of a ``(BYTES, 8)`` tile into bytes, a fair coin's bit at each zero, and store them."""
    weight = (128 >> bit).to(tl.int32)  # 128, 64, …, 1
    packed = tl.sum((x > 0).to(tl.int32) * weight[None, :], axis=1)  # 8 signs → 1 byte, x > 0 → bit 1
    zero = (x == 0) | (x != x) if NAN_IS_ZERO else x == 0  # +0 and −0 (and NaN, where sign(x) = 0 for it)
    zero = (zero & inside).to(tl.int32)
    if tl.sum(zero) > 0:  # rare: a fair coin flip's bit at each zero
        coins = (tl.randint(seed, counter + byte) & 255).to(tl.int32)  # 8 coins per byte from Philox
        packed = packed | (tl.sum(zero * weight[None, :], axis=1) & coins)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)


@triton.jit(do_not_specialize=["seed", "counter"])
def _pack_positive(v_ptr, out_ptr, seed, counter, d, nbytes, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # this program's output bytes
    bit = tl.arange(0, 8)  # bit j of a byte holds value 8·byte + j, MSB first
    idx = byte[:, None] * 8 + bit[None, :]  # (BYTES, 8) value indices
    inside = idx < d
    v = tl.load(v_ptr + idx, mask=inside, other=-1.0)  # one read of v
    _store_signs(out_ptr, v, inside, byte, bit, seed, counter, nbytes, NAN_IS_ZERO=False)  # a NaN packs as 0


def pack_positive(v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The signs of ``v`` packed into ⌈d/8⌉ bytes: bit 1 for v > 0, a fair coin flip for v = ±0, else 0.

    Parameters
    ----------
    v : torch.Tensor
        Contiguous 1-D float32 tensor (on a CUDA device; any device under ``TRITON_INTERPRET=1``).
    generator : torch.Generator | None (default: None)
        Where the coins come from (:func:`coin_stream`); ``None``: ``v``'s device's default one.

    Returns
    -------
    torch.Tensor
        The packed uint8 bytes on ``v``'s device; nothing is synchronized.

    """
    if v.dtype != torch.float32 or v.dim() != 1 or not v.is_contiguous():
        raise ValueError(f"pack_positive needs a contiguous 1-D float32 tensor, got {v.dtype} {tuple(v.shape)}")
    d = v.numel()
    nbytes = (d + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=v.device)
    if d:
        seed, counter = coin_stream(generator, v.device, nbytes)
        _pack_positive[(-(-nbytes // BYTES),)](v, out, seed, counter, d, nbytes, BYTES=BYTES, enable_fp_fusion=False)
    return out


@triton.jit(do_not_specialize=["seed", "counter"])
def _lion_pack(m_ptr, g_ptr, out_ptr, seed, counter, d, nbytes, b1, a1, b2, a2, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # this program's output bytes
    bit = tl.arange(0, 8)  # bit j of a byte holds value 8·byte + j, MSB first
    idx = byte[:, None] * 8 + bit[None, :]  # (BYTES, 8) value indices
    inside = idx < d
    m = tl.load(m_ptr + idx, mask=inside, other=0.0)  # one read of m
    g = tl.load(g_ptr + idx, mask=inside, other=0.0)  # one read of g
    mix = tl.fma(g, a1, m * b1)  # β₁·m + (1−β₁)·g, rounded as torch's m.mul(β₁).add_(g, alpha=1−β₁)
    tl.store(m_ptr + idx, tl.fma(g, a2, m * b2), mask=inside)  # m ← β₂·m + (1−β₂)·g, from the old m
    _store_signs(out_ptr, mix, inside, byte, bit, seed, counter, nbytes, NAN_IS_ZERO=True)  # δ = sign(mix)


def lion_pack(
    m: torch.Tensor, g: torch.Tensor, coefs: tuple[float, float, float, float], generator: torch.Generator | None = None
) -> torch.Tensor:
    """One Lion step fused with the pack: one read of ``m`` and ``g``, ``m`` written in place.

    Computes ``c = β₁·m + (1−β₁)·g`` as ``fma(1−β₁, g, fl(β₁·m))`` (how torch's
    ``m.mul(β₁).add_(g, alpha=1−β₁)`` rounds where its add is one FMA), packs the signs
    ``δ = sign(c)`` like :func:`pack_positive` (a zero direction, c = ±0 or NaN, as the
    coin flip :func:`pack_positive` would draw for δ = 0 from the same generator), and sets
    ``m ← fma(1−β₂, g, fl(β₂·m))``.

    Parameters
    ----------
    m, g : torch.Tensor
        Contiguous 1-D float32 tensors of the same length d on one device (a CUDA device;
        any device under ``TRITON_INTERPRET=1``, whose emulated FMA rounds twice). ``m`` is
        updated in place.
    coefs : tuple of float
        ``(β₁, 1−β₁, β₂, 1−β₂)``, each exactly a float32 value.
    generator : torch.Generator | None (default: None)
        Where the coins come from (:func:`coin_stream`); ``None``: ``m``'s device's default one.

    Returns
    -------
    torch.Tensor
        The ⌈d/8⌉ packed bytes of δ on ``m``'s device; nothing is synchronized.

    """
    for name, t in (("m", m), ("g", g)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"lion_pack needs contiguous 1-D float32 tensors, got {name}: {t.dtype} {tuple(t.shape)}")
    if g.numel() != m.numel() or g.device != m.device:
        raise ValueError(f"m ({m.numel()} on {m.device}) and g ({g.numel()} on {g.device}) differ")
    d = m.numel()
    nbytes = (d + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=m.device)
    if d:
        seed, counter = coin_stream(generator, m.device, nbytes)
        grid = (-(-nbytes // STEP_BYTES),)
        _lion_pack[grid](m, g, out, seed, counter, d, nbytes, *coefs, BYTES=STEP_BYTES, enable_fp_fusion=False)
    return out


STEP_BYTES = 512  # packed bytes per program of the fused step: 4,096 values, 32 kB read


@triton.jit(do_not_specialize=["epoch"])
def _apply_levels(x_ptr, k_ptr, steps_ptr, bad_ptr, epoch, d, top, decay, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < d
    k = tl.load(k_ptr + i, mask=inside, other=0).to(tl.int32)  # the level of each value
    ok = (k >= 0) & (k <= top)
    step = tl.load(steps_ptr + tl.where(ok, k, 0), mask=inside, other=0.0)  # torch's own lr·Δ for level k
    x = tl.load(x_ptr + i, mask=inside, other=0.0)
    tl.store(x_ptr + i, x * decay - step, mask=inside)  # x·(1 − lr·wd), then − lr·Δ: two roundings, no FMA
    if tl.sum((inside & ~ok).to(tl.int32)) > 0:
        tl.atomic_max(bad_ptr, epoch)


APPLY_BLOCK = 4096  # values per program of the apply


def apply_levels(x: torch.Tensor, levels: torch.Tensor, steps: torch.Tensor, decay: float) -> Flag:
    """In place: ``x ← fl(x·decay) − steps[k]`` for the level ``k`` of each value; one read of x and the levels.

    Parameters
    ----------
    x : torch.Tensor
        Contiguous 1-D float32 tensor (updated in place).
    levels : torch.Tensor
        Contiguous 1-D uint8 or int32 levels, one per value of ``x``, on ``x``'s device.
    steps : torch.Tensor
        float32 ``lr·Δ`` for each of the L levels (as torch computes them), on ``x``'s device.
    decay : float
        ``1 − lr·wd``, exactly a float32 value.

    Returns
    -------
    Flag
        Raised (see :class:`Flag`; nothing is synchronized) if a level was outside
        ``0 … L−1``: those values took step 0's value, so ``x`` is then corrupted.

    """
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"apply_levels needs a contiguous 1-D float32 x, got {x.dtype} {tuple(x.shape)}")
    if levels.dtype not in (torch.uint8, torch.int32) or levels.shape != x.shape or not levels.is_contiguous():
        raise ValueError(f"levels must be contiguous uint8 or int32 of shape {tuple(x.shape)}, got {levels.dtype} "
                         f"{tuple(levels.shape)}")  # fmt: skip
    bad = _new_flag(x.device)
    d = x.numel()
    if d:
        grid = (-(-d // APPLY_BLOCK),)
        top = steps.numel() - 1
        _apply_levels[grid](
            x, levels, steps, bad.tensor, bad.epoch, d, top, decay, BLOCK=APPLY_BLOCK, enable_fp_fusion=False
        )
    return bad


COUNT_BYTES = 256  # payload bytes per program of the vote count: 2,048 counters in registers


@triton.jit
def _count_votes(addr_ptr, n, nbytes, d, out_ptr, COUNTS: tl.constexpr, PLANES: tl.constexpr, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # this program's bytes of every payload
    inside = byte < nbytes
    shift = 7 - tl.arange(0, 8)  # value 8·byte + j is bit 7 − j (MSB first)
    count = tl.zeros((BYTES, 8), dtype=tl.int32)  # per-value counts, in registers
    for i in range(n):
        payload = tl.load(addr_ptr + i).to(tl.pointer_type(tl.uint8))  # payload i's address
        x = tl.load(payload + byte, mask=inside, other=0).to(tl.int32)  # one read of each payload byte
        count += (x[:, None] >> shift[None, :]) & 1  # unpacked in registers, never in memory
    if COUNTS:  # the counts
        value = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + value, count, mask=value < d)
    else:  # the bit planes of the counts, packed like the payloads
        weight = (1 << shift).to(tl.int32)  # 128, 64, …, 1: 8 bits → 1 byte
        for j in tl.static_range(PLANES):
            plane = tl.sum(((count >> j) & 1) * weight[None, :], axis=1)
            tl.store(out_ptr + j * nbytes + byte, plane.to(tl.uint8), mask=inside)


@triton.jit
def _add(p, c):
    """One bit plane of a carry-save counter: ``(p ^ c, p & c)`` — the plane's new bits and the carry."""
    return p ^ c, p & c


@triton.jit
def _put_words(ptr, word, byte, inside, shift):
    """Store 32-bit lanes as their 4 bytes (byte k = bits 8k … 8k+7, as they were read)."""
    tl.store(ptr + byte, ((word[:, None] >> shift[None, :]) & 0xFF).to(tl.uint8), mask=inside)


MAX_SLICED_PLANES = 12  # the bit-sliced count keeps up to 12 planes in registers: n ≤ 4,095 payloads
SLICED_WORDS = 512  # 32-bit lanes per program of the bit-sliced count: 2 kB of every payload


@triton.jit
def _count_sliced(addr_ptr, n, nbytes, out_ptr, PLANES: tl.constexpr, WORDS: tl.constexpr):
    # this program's bytes of every payload, as (WORDS, 4): 32 values per lane, every lane a carry-save counter
    byte = tl.program_id(0).to(tl.int64) * (4 * WORDS) + tl.arange(0, WORDS)[:, None] * 4 + tl.arange(0, 4)[None, :]
    inside = byte < nbytes
    shift = 8 * tl.arange(0, 4)  # byte k of a lane at bits 8k … 8k+7: bitwise work keeps every value in place
    zero = tl.zeros((WORDS,), dtype=tl.int32)
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11 = (
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
    )
    for i in range(n):
        payload = tl.load(addr_ptr + i).to(tl.pointer_type(tl.uint8))  # payload i's address
        x = tl.load(payload + byte, mask=inside, other=0).to(tl.int32)  # one read of each payload byte
        c = tl.sum(x << shift[None, :], axis=1)  # 4 bytes → one 32-bit lane (disjoint bits: the sum is an OR)
        p0, c = _add(p0, c)  # count += bit, plane by plane: 2 operations per plane for 32 values
        if PLANES > 1:
            p1, c = _add(p1, c)
        if PLANES > 2:
            p2, c = _add(p2, c)
        if PLANES > 3:
            p3, c = _add(p3, c)
        if PLANES > 4:
            p4, c = _add(p4, c)
        if PLANES > 5:
            p5, c = _add(p5, c)
        if PLANES > 6:
            p6, c = _add(p6, c)
        if PLANES > 7:
            p7, c = _add(p7, c)
        if PLANES > 8:
            p8, c = _add(p8, c)
        if PLANES > 9:
            p9, c = _add(p9, c)
        if PLANES > 10:
            p10, c = _add(p10, c)
        if PLANES > 11:
            p11, c = _add(p11, c)
    # the bit planes of the counts: already packed like the payloads
    _put_words(out_ptr, p0, byte, inside, shift)
    if PLANES > 1:
        _put_words(out_ptr + nbytes, p1, byte, inside, shift)
    if PLANES > 2:
        _put_words(out_ptr + 2 * nbytes, p2, byte, inside, shift)
    if PLANES > 3:
        _put_words(out_ptr + 3 * nbytes, p3, byte, inside, shift)
    if PLANES > 4:
        _put_words(out_ptr + 4 * nbytes, p4, byte, inside, shift)
    if PLANES > 5:
        _put_words(out_ptr + 5 * nbytes, p5, byte, inside, shift)
    if PLANES > 6:
        _put_words(out_ptr + 6 * nbytes, p6, byte, inside, shift)
    if PLANES > 7:
        _put_words(out_ptr + 7 * nbytes, p7, byte, inside, shift)
    if PLANES > 8:
        _put_words(out_ptr + 8 * nbytes, p8, byte, inside, shift)
    if PLANES > 9:
        _put_words(out_ptr + 9 * nbytes, p9, byte, inside, shift)
    if PLANES > 10:
        _put_words(out_ptr + 10 * nbytes, p10, byte, inside, shift)
    if PLANES > 11:
        _put_words(out_ptr + 11 * nbytes, p11, byte, inside, shift)


def _launch_count(payloads: Sequence[torch.Tensor], d: int, out: torch.Tensor, *, counts: bool) -> None:
    nbytes = (d + 7) // 8
    for p in payloads:
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous() or p.numel() != nbytes:
            raise ValueError(f"expected {nbytes} packed bytes (contiguous 1-D uint8), got {p.dtype} {tuple(p.shape)}")
        if p.device != out.device:
            raise ValueError(f"payloads on {p.device} and {out.device}: put them on one device")
    n = len(payloads)
    addresses = torch.tensor([p.data_ptr() for p in payloads], dtype=torch.int64).to(out.device)
    planes = max(1, n.bit_length())
    if not counts and planes <= MAX_SLICED_PLANES:  # the planes straight from bit-sliced counters
        grid = (-(-nbytes // (4 * SLICED_WORDS)),)
        _count_sliced[grid](addresses, n, nbytes, out, PLANES=planes, WORDS=SLICED_WORDS, enable_fp_fusion=False)
        return
    grid = (-(-nbytes // COUNT_BYTES),)
    _count_votes[grid](
        addresses, n, nbytes, d, out, COUNTS=counts, PLANES=planes, BYTES=COUNT_BYTES, enable_fp_fusion=False
    )


def count_ones(payloads: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    """Per-value number of 1 bits over n packed payloads (int32, length d), each payload read once.

    Every program adds its bytes of all n payloads into per-value counters in registers, so
    extra memory is the output alone — never n × d.
    """
    out = torch.empty(d, dtype=torch.int32, device=payloads[0].device)
    _launch_count(payloads, d, out, counts=True)
    return out


def count_planes(payloads: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    """The counts' B = ⌊log₂ n⌋ + 1 bit planes, packed like the payloads: ``(B, ⌈d/8⌉)`` uint8."""
    nbytes = (d + 7) // 8
    out = torch.empty(max(1, len(payloads).bit_length()), nbytes, dtype=torch.uint8, device=payloads[0].device)
    _launch_count(payloads, d, out, counts=False)
    return out
