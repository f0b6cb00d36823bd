"""The broadcast's format: Δ as integer levels (``sign1``, ``trit5``, ``planesB``): encoding, decoding, applying."""

from __future__ import annotations

import numpy as np
import torch

from .. import accel
from ..formats import (
    POW3,
    SIGN1,
    TRIT5,
    as_uint8,
    check_levels,
    encoded_size,
    level_format,
    levels_to_values,
    trit_table,
)
from ..lion import apply_update_
from .signs import pack_bits, unpack_bits

__all__ = ["apply_levels_", "decode_levels", "encode_levels", "planes_to_counts"]


def encode_levels(k: torch.Tensor, num_levels: int) -> torch.Tensor:
    """Encode integer levels ``k ∈ {0, …, num_levels−1}`` into bytes (see module doc)."""
    k = k.reshape(-1)
    d = k.numel()
    fmt, b = level_format(num_levels)
    if fmt == SIGN1:
        return pack_bits(k > 0)
    if fmt == TRIT5:
        if (fast := accel.choose("encode_trits", k.device, d)) is not None:  # five levels → a byte, in one pass
            return fast(k)
        t = k.to(torch.uint8)
        if d % 5:
            t = torch.cat([t, t.new_zeros(5 - d % 5)])
        t = t.view(-1, 5)
        out = t[:, 0].clone()
        for j in range(1, 5):
            out += t[:, j] * POW3[j]
        return out
    if k.device.type == "cpu" and num_levels <= 256:  # bytes: a quarter of the int32 passes' memory traffic
        k8 = k.to(torch.uint8).numpy()
        bit = np.empty_like(k8)
        return torch.from_numpy(
            np.concatenate([np.packbits(np.bitwise_and(k8, 1 << j, out=bit), bitorder="big") for j in range(b)])
        )  # packbits packs every nonzero byte as a 1 bit
    k = k.to(torch.int32)
    return torch.cat([pack_bits(((k >> j) & 1).bool()) for j in range(b)])


def decode_levels(
    buf: torch.Tensor | bytes | np.ndarray, num_levels: int, d: int, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Inverse of :func:`encode_levels`: ``d`` integer levels, int32 or (up to 256 levels) uint8.

    uint8 levels are a quarter of the memory, and :func:`apply_levels_` reads them as they
    are. A level that cannot occur (a trit5 byte above 242, a bit-plane level ≥ L) is a
    ``ValueError``: nothing is returned for a corrupted payload.
    """
    if dtype not in (torch.int32, torch.uint8) or (dtype == torch.uint8 and num_levels > 256):
        raise ValueError(f"levels are int32, or uint8 for at most 256 levels; got {dtype} for {num_levels} levels")
    p = as_uint8(buf)
    if p.numel() != encoded_size(d, num_levels):
        raise ValueError(
            f"expected {encoded_size(d, num_levels)} bytes for {d} values of {num_levels} levels, got {p.numel()}"
        )
    fmt, b = level_format(num_levels)
    if fmt == SIGN1:
        bits = unpack_bits(p, d)
        return bits.view(torch.uint8) if dtype == torch.uint8 else bits.to(dtype)
    if fmt == TRIT5:
        if (fast := accel.choose("decode_trits", p.device, d)) is not None:  # the largest byte found on the way
            return fast(p, d, dtype)
        if (int(p.max()) if p.numel() else 0) > 242:
            raise ValueError("trit5 byte above 242 (3^5 - 1): corrupted payload")
        if p.device.type == "cpu":  # numpy's take: no int64 index copy, 3× its fancy indexing
            k8 = np.take(trit_table(p.device).numpy(), p.numpy(), axis=0).reshape(-1)
            return torch.from_numpy(k8[:d] if dtype == torch.uint8 else k8[:d].astype(np.int32))
        return trit_table(p.device)[p.long()].view(-1)[:d].to(dtype)
    k = _levels_from_planes(p.view(b, -1), d, dtype)
    if d and num_levels < 1 << b and int(k.numpy().max() if k.device.type == "cpu" else k.max()) >= num_levels:
        raise ValueError(f"level above {num_levels - 1}: corrupted payload")
    return k


def _levels_from_planes(planes: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Levels ``k = Σⱼ 2ʲ·(bit j)`` of ``d`` values from B packed bit planes ``(B, ⌈d/8⌉)`` uint8, as ``dtype``."""
    b = planes.shape[0]
    if planes.device.type != "cpu" or b > 8:
        return planes_to_counts(planes, d).to(dtype)
    if (fast := accel.choose("levels_from_planes", planes.device, d)) is not None:  # 8 levels a byte in registers
        return fast(planes, d, dtype)
    p = planes.contiguous().numpy()
    k8, bit = np.zeros(d, dtype=np.uint8), np.empty(d, dtype=np.uint8)  # bytes: a quarter of int32's traffic
    for j in range(b):  # k |= bit j of every level
        np.bitwise_or(k8, np.left_shift(np.unpackbits(p[j], count=d), j, out=bit), out=k8)
    return torch.from_numpy(k8 if dtype == torch.uint8 else k8.astype(np.int32))


def planes_to_counts(planes: torch.Tensor, d: int) -> torch.Tensor:
    """The per-coordinate counts (int32) from :func:`count_planes`."""
    counts = torch.zeros(d, dtype=torch.int32, device=planes.device)
    for j in range(planes.shape[0]):
        counts |= unpack_bits(planes[j].contiguous(), d).to(torch.int32) << j
    return counts


def apply_levels_(
    x: torch.Tensor, levels: torch.Tensor, num_levels: int, lr: float, weight_decay: float
) -> torch.Tensor:
    """In place: ``x ← x − lr·(Δ + wd·x)`` with Δ given as levels. Returns ``x``.

    Exactly ``lion.apply_update_(x, levels_to_values(levels, L), lr, wd)``, bit for bit
    (that composition is the reference). With float32 ``x`` (contiguous) and its levels on
    one device, :mod:`flower_dlion.accel` may run it as one pass over ``x`` and the levels
    instead of seven passes and five d-sized temporaries.
    A level outside ``0 … L−1`` is a ``ValueError``; a fused pass finds it as it goes and
    leaves ``x`` partly updated, so check untrusted levels first (:func:`decode_levels` does).
    """
    fusable = (
        num_levels >= 2
        and x.dtype == torch.float32
        and x.is_contiguous()
        and levels.device == x.device
        and levels.numel() == x.numel()
        and (x.is_cpu or (levels.dtype in (torch.uint8, torch.int32) and levels.is_contiguous()))
    )
    if fusable and (fast := accel.choose("apply_levels_", x.device, x.numel())) is not None:
        if (done := fast(x, levels, num_levels, lr, weight_decay)) is not None:  # None: it would round otherwise
            return done
    check_levels(levels, num_levels)
    return apply_update_(x, levels_to_values(levels, num_levels), lr, weight_decay)
