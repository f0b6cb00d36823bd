"""The upload's format: a client's δ as ⌈d/8⌉ bytes of signs (``sign1``), exact zeros as seeded coin flips."""

from __future__ import annotations

import numpy as np
import torch

from .. import accel
from ..accel import threads
from ..formats import MASKS, as_uint8, packed_size
from ..lion import local_step_

__all__ = [
    "count_mask_bits",
    "pack_bits",
    "pack_local_step_",
    "pack_signs",
    "set_coin_flips",
    "unpack_bits",
    "unpack_signs",
]

_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)  # bit j of a byte holds element j (MSB first)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D boolean tensor into ⌈d/8⌉ bytes (MSB first), on the tensor's device."""
    if bits.device.type == "cpu":  # numpy's C loop: one pass, no temporaries
        return torch.from_numpy(np.packbits(bits.reshape(-1).numpy().view(np.uint8), bitorder="big"))
    d = bits.numel()
    b = bits.reshape(-1).to(torch.uint8)
    if d % 8:
        b = torch.cat([b, b.new_zeros(8 - d % 8)])
    b = b.view(-1, 8)
    out = b[:, 0] << 7
    for j in range(1, 8):
        out |= b[:, j] << _SHIFTS[j]
    return out


def unpack_bits(packed: torch.Tensor | bytes | np.ndarray, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``d`` bits as a boolean tensor."""
    p = as_uint8(packed)
    if p.numel() != packed_size(d):
        raise ValueError(f"expected {packed_size(d)} packed bytes for {d} bits, got {p.numel()}")
    if p.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(p.numpy(), count=d, bitorder="big").view(np.bool_))
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=p.device)
    return ((p.unsqueeze(1) >> shifts) & 1).view(-1)[:d].bool()


def pack_signs(
    v: torch.Tensor, generator: torch.Generator | None = None, *, flips: list[int] | None = None
) -> torch.Tensor:
    """Pack the signs of ``v`` into ⌈d/8⌉ bytes: bit 1 for v > 0, bit 0 for v < 0.

    Exact zeros have no 1-bit code. Sending them all as one fixed side would push every
    such parameter the same way each round, so each zero is sent as a fair coin flip
    drawn from ``generator`` (unbiased; seed it for reproducible runs). On the CPU (float32)
    numpy compares and packs 256 k values at a time on torch's threads, and each group of
    64 values that holds a zero takes one random 64-bit word for its coins
    (:func:`set_coin_flips`); the numba kernel (:mod:`flower_dlion.accel`) gives the same
    bits and masks. A CUDA device's kernel draws the coins itself, from Philox at a counter the
    generator hands out. Elsewhere it is tensor operations on ``v``'s device
    (``torch.randint`` coins for all d values, used at the zeros).

    ``flips``: a list to append the number of coin flips (exact zeros) to.
    """
    v = v if v.dim() == 1 else v.reshape(-1)
    if v.is_cpu and v.dtype == torch.float32:  # one pass on torch's threads: numpy's, or the kernel's
        pack_positive = accel.choose("pack_positive", v.device, v.numel()) or _pack_positive_numpy
        return _flip_coins(*pack_positive(v.contiguous().numpy()), generator, flips)
    if v.dtype == torch.float32 and (fast := accel.choose("pack_signs", v.device, v.numel())) is not None:
        return fast(v, generator, flips=flips)  # a CUDA device's kernel: it draws the coins itself
    bits = v > 0
    zeros = v == 0
    if flips is not None:
        flips.append(int(torch.count_nonzero(zeros)))
    if bool(zeros.any()):
        coin = torch.randint(0, 2, (v.numel(),), generator=generator, device=v.device, dtype=torch.uint8)
        bits = torch.where(zeros, coin.bool(), bits)
    return pack_bits(bits)


def _flip_coins(
    packed: np.ndarray, zeros: np.ndarray | None, generator: torch.Generator | None, flips: list[int] | None
) -> torch.Tensor:
    """The CPU pack's last step: ``packed`` with a coin flip at each of ``zeros`` (None: no zero), as a tensor.

    ``flips``: as :func:`pack_signs`'s (the number of zeros is appended).
    """
    if zeros is not None:  # set a coin flip's bit at each exact zero
        set_coin_flips(packed, zeros, generator)
    if flips is not None:
        flips.append(count_mask_bits(zeros))
    return torch.from_numpy(packed)


def count_mask_bits(zeros: np.ndarray | None) -> int:
    """Number of set bits in the zero masks (0 for none)."""
    if zeros is None:
        return 0
    if hasattr(np, "bitwise_count"):  # numpy ≥ 2.0
        return int(np.bitwise_count(zeros).sum())
    return int(np.unpackbits(zeros.view(np.uint8)).sum())


def set_coin_flips(packed: np.ndarray, zeros: np.ndarray, generator: torch.Generator | None) -> None:
    """Set a fair coin flip's bit in ``packed`` wherever ``zeros`` has one (``packed`` has a 0 bit there).

    ``zeros`` holds the masks of the exact zeros in the packed layout, a word per 64 values
    (:data:`flower_dlion.formats.MASKS`: its bytes are ``np.packbits(v == 0)``). The j-th group
    of 64 values with a zero takes the j-th uniform 64-bit word that ``generator`` draws
    (``random_(-2**63)``, every bit pattern equally likely), and its zeros take that word's bits
    at their own positions: the word's little-endian bytes are the group's 8 bytes of coins. So a lone zero
    costs one draw, and a vector that is half zeros (a sum of two local directions) d/64 draws
    and a few passes over d/8 bytes (``benchmarks/zero_pack.py``).
    """
    k = np.flatnonzero(zeros)
    words = torch.empty(k.size, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    coins = zeros[k] & words.numpy().view(np.uint64)
    whole = packed.size // 8
    full = k < whole  # all but a partial last group
    packed[: 8 * whole].view(MASKS)[k[full]] |= coins[full]
    if k.size and not full[-1]:  # the partial last group's bytes
        packed[8 * whole :] |= coins[-1:].astype(MASKS).view(np.uint8)[: packed.size - 8 * whole]


def pack_local_step_(
    m: torch.Tensor,
    g: torch.Tensor,
    beta1: float,
    beta2: float,
    generator: torch.Generator | None = None,
    *,
    flips: list[int] | None = None,
) -> torch.Tensor:
    """A worker's Lion step with its direction packed: ``pack_signs(lion.local_step_(m, g, β₁, β₂), generator)``.

    Returns the ⌈d/8⌉ bytes of ``δ = sign(β₁·m + (1−β₁)·g)`` (zeros as coin flips, see
    :func:`pack_signs`) and updates ``m ← β₂·m + (1−β₂)·g`` in place, exactly as the
    composition does: the same bytes, the same coins from ``generator``, the same ``m`` bit
    for bit. With float32 ``m`` (contiguous) and ``g`` on one device, :mod:`flower_dlion.accel`
    may run it as one fused pass that reads ``m`` and ``g`` once and writes ``m`` and the
    bits, where the fused arithmetic rounds as torch's does (it checks on a probe).
    ``flips``: as :func:`pack_signs`'s.
    """
    fusable = m.dtype == g.dtype == torch.float32 and m.is_contiguous() and g.numel() == m.numel()
    if fusable and m.device == g.device:  # a twin probes its rounding on the reference step; None: run that here
        if m.is_cpu and (fast := accel.choose("lion_pack", m.device, m.numel())) is not None:
            step = fast(m, g, beta1, beta2, local_step=local_step_)  # δ's bits, its zeros' masks; m updated
            if step is not None:
                return _flip_coins(*step, generator, flips)  # the coins as pack_signs draws them
        elif not m.is_cpu and (fast := accel.choose("pack_local_step_", m.device, m.numel())) is not None:
            packed = fast(m, g, beta1, beta2, generator, flips=flips, local_step=local_step_)  # coins drawn in it
            if packed is not None:
                return packed
    return pack_signs(local_step_(m, g, beta1, beta2), generator, flips=flips)


_CHUNK = 1 << 18  # values per numpy chunk (a multiple of 8: chunks start on byte boundaries)
_CHUNKS_PER_THREAD = 4  # below 2·4 chunks (2²¹ values) one thread: waking another costs more than it saves


def _pack_positive_numpy(v: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Bits of ``v > 0`` packed, and the masks of ``v``'s exact zeros by group of 64 (None: no zero).

    numpy compares and packs a 1 MB chunk at a time (its loops release the GIL) on torch's
    threads and packs the chunk's zeros, if any, while it is in cache; the masks are only
    made when there are some. The chunks are large because each numpy call costs
    microseconds and, on several threads, a turn of the GIL: 64 k-value chunks made the
    pack 2–3× slower than these.
    """
    d = v.size
    out = np.empty(packed_size(d), dtype=np.uint8)
    found: list[tuple[int, np.ndarray]] = []  # (first byte, the chunk's zeros packed)

    def pack(first: int, last: int) -> None:  # chunks first … last−1
        for s in range(first * _CHUNK, min(last * _CHUNK, d), _CHUNK):
            c = v[s : s + _CHUNK]
            out[s // 8 : s // 8 + (c.size + 7) // 8] = np.packbits(c > 0, bitorder="big")  # the sign bit: 1 for v > 0
            zero = c == 0  # exact zeros (+0 and −0) get coin flips: packed while the chunk is in cache
            if zero.any():
                found.append((s // 8, np.packbits(zero, bitorder="big")))  # list.append is atomic

    threads.on_threads(pack, -(-d // _CHUNK), _CHUNKS_PER_THREAD)
    if not found:
        return out, None
    zeros = np.zeros(-(-d // 64), dtype=MASKS)
    zero_bytes = zeros.view(np.uint8)
    for start, b in found:
        zero_bytes[start : start + b.size] = b
    return out, zeros


def unpack_signs(packed: torch.Tensor | bytes | np.ndarray, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a tensor of ±1 of length ``d``."""
    return unpack_bits(packed, d).to(dtype) * 2 - 1
