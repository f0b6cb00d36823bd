"""Fused GPU kernels for the sign pack and the vote count (Triton; used by :mod:`flower_dlion.codec`).

One kernel reads the Lion direction once and writes its packed signs: each program
loads ``8·BYTES`` consecutive float32 values as a ``(BYTES, 8)`` tile, compares them with
zero and folds each row of 8 bits into one byte (MSB first, the layout of
:func:`numpy.packbits`), so the ``⌈d/8⌉`` bytes leave in one pass instead of the dozen
passes and launches of the tensor-operation path. A one-element flag records whether
any exact zero was seen (the codec then sends coin flips for those).

The vote count reads the n payloads through a table of their addresses (no stacking
copy): each program adds its bytes of every payload into per-value counters held in
registers (the bits are unpacked there, never in memory) and writes what was asked — the
int32 counts, the vote's two packed masks, or the counts' packed bit planes (the mean's
levels).

Imports only torch and Triton (shipped with torch's CUDA builds on Linux); with
``TRITON_INTERPRET=1`` set before import, the same kernel runs on CPU tensors, which is
how the tests check it without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BYTES = 1024  # packed bytes per program: 8,192 values, 32 kB read


@triton.jit
def _pack_positive(v_ptr, out_ptr, zero_ptr, d, nbytes, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # this program's output bytes
    bit = tl.arange(0, 8)  # bit j of a byte holds value 8·byte + j, MSB first
    idx = byte[:, None] * 8 + bit[None, :]  # (BYTES, 8) value indices
    inside = idx < d
    v = tl.load(v_ptr + idx, mask=inside, other=-1.0)  # one read of v
    weight = (128 >> bit).to(tl.int32)  # 128, 64, …, 1
    packed = tl.sum((v > 0).to(tl.int32) * weight[None, :], axis=1)  # 8 signs → 1 byte
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)
    zeros = tl.sum(((v == 0) & inside).to(tl.int32))  # exact zeros (+0 and −0) in this tile
    if zeros > 0:
        tl.atomic_max(zero_ptr, 1)


def pack_positive(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bits of ``v > 0`` packed into ⌈d/8⌉ bytes, and a flag tensor (int32, 1 if ``v`` has an exact zero).

    Parameters
    ----------
    v : torch.Tensor
        Contiguous 1-D float32 tensor (on a CUDA device; any device under ``TRITON_INTERPRET=1``).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        The packed uint8 bytes and the zero flag, both on ``v``'s device; nothing is
        synchronized (read the flag when the bytes are needed anyway).

    """
    if v.dtype != torch.float32 or v.dim() != 1 or not v.is_contiguous():
        raise ValueError(f"pack_positive needs a contiguous 1-D float32 tensor, got {v.dtype} {tuple(v.shape)}")
    d = v.numel()
    nbytes = (d + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=v.device)
    flag = torch.zeros(1, dtype=torch.int32, device=v.device)
    if d:
        _pack_positive[(triton.cdiv(nbytes, BYTES),)](v, out, flag, d, nbytes, BYTES=BYTES)
    return out, flag


COUNT_BYTES = 256  # payload bytes per program of the vote count: 2,048 counters in registers
_COUNTS, _MASKS, _PLANES = 0, 1, 2  # what the count kernel writes


@triton.jit
def _count_votes(
    addr_ptr,
    n,
    nbytes,
    d,
    threshold,
    ties,
    out_ptr,
    tie_ptr,
    WHAT: tl.constexpr,
    PLANES: tl.constexpr,
    BYTES: tl.constexpr,
):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # this program's bytes of every payload
    inside = byte < nbytes
    shift = 7 - tl.arange(0, 8)  # value 8·byte + j is bit 7 − j (MSB first)
    count = tl.zeros((BYTES, 8), dtype=tl.int32)  # per-value counts, in registers
    for i in range(n):
        payload = tl.load(addr_ptr + i).to(tl.pointer_type(tl.uint8))  # payload i's address
        x = tl.load(payload + byte, mask=inside, other=0).to(tl.int32)  # one read of each payload byte
        count += (x[:, None] >> shift[None, :]) & 1  # unpacked in registers, never in memory
    weight = (1 << shift).to(tl.int32)  # 128, 64, …, 1: 8 bits → 1 byte
    if WHAT == 0:  # the counts
        value = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + value, count, mask=value < d)
    elif WHAT == 1:  # the vote's masks: count > n/2 and count = n/2 (n even)
        gt = tl.sum((count > threshold).to(tl.int32) * weight[None, :], axis=1)
        tie = tl.sum(((count == threshold) & (ties != 0)).to(tl.int32) * weight[None, :], axis=1)
        tl.store(out_ptr + byte, gt.to(tl.uint8), mask=inside)
        tl.store(tie_ptr + byte, tie.to(tl.uint8), mask=inside)
    else:  # the bit planes of the counts, packed like the payloads
        for j in tl.static_range(PLANES):
            plane = tl.sum(((count >> j) & 1) * weight[None, :], axis=1)
            tl.store(out_ptr + j * nbytes + byte, plane.to(tl.uint8), mask=inside)


def _launch_count(payloads: Sequence[torch.Tensor], d: int, what: int, *outs: torch.Tensor) -> None:
    nbytes = (d + 7) // 8
    for p in payloads:
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous() or p.numel() != nbytes:
            raise ValueError(f"expected {nbytes} packed bytes (contiguous 1-D uint8), got {p.dtype} {tuple(p.shape)}")
        if p.device != outs[0].device:
            raise ValueError(f"payloads on {p.device} and {outs[0].device}: put them on one device")
    n = len(payloads)
    addresses = torch.tensor([p.data_ptr() for p in payloads], dtype=torch.int64).to(outs[0].device)
    grid = (triton.cdiv(nbytes, COUNT_BYTES),)
    tie = outs[1] if len(outs) > 1 else outs[0]
    _count_votes[grid](
        addresses, n, nbytes, d, n // 2, int(n % 2 == 0), outs[0], tie,
        WHAT=what, PLANES=max(1, n.bit_length()), BYTES=COUNT_BYTES,
    )  # fmt: skip


def count_ones(payloads: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    """Per-value number of 1 bits over n packed payloads (int32, length d), each payload read once.

    Every program adds its bytes of all n payloads into per-value counters in registers, so
    extra memory is the output alone — never n × d.
    """
    out = torch.empty(d, dtype=torch.int32, device=payloads[0].device)
    _launch_count(payloads, d, _COUNTS, out)
    return out


def vote_masks(payloads: Sequence[torch.Tensor], d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed masks (gt, tie) of count > n/2 and count = n/2 (ties only for even n)."""
    nbytes = (d + 7) // 8
    gt = torch.empty(nbytes, dtype=torch.uint8, device=payloads[0].device)
    tie = torch.empty_like(gt)
    _launch_count(payloads, d, _MASKS, gt, tie)
    return gt, tie


def count_planes(payloads: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    """The counts' B = ⌊log₂ n⌋ + 1 bit planes, packed like the payloads: ``(B, ⌈d/8⌉)`` uint8."""
    nbytes = (d + 7) // 8
    out = torch.empty(max(1, len(payloads).bit_length()), nbytes, dtype=torch.uint8, device=payloads[0].device)
    _launch_count(payloads, d, _PLANES, out)
    return out
