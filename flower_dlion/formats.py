"""The wire formats' shared definitions: their names, sizes and tables, and what a level means.

The bottom of the package (torch and numpy only, no other module of it): the one place both the
codec (:mod:`flower_dlion.codec`, the reference, which describes the formats) and its accelerated
twins (:mod:`flower_dlion.accel`) take a format's constants from. A module under ``flower_dlion``
rather than ``flower_dlion.codec``: importing a module of the codec package runs the codec's
``__init__``, which imports :mod:`flower_dlion.accel`, so the twins would import the codec again.
:mod:`flower_dlion.codec` re-exports every name here.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "MASKS",
    "POW3",
    "SIGN1",
    "TRIT5",
    "as_uint8",
    "check_levels",
    "encoded_size",
    "level_format",
    "levels_to_values",
    "packed_size",
    "trit_table",
    "zero_mask_words",
]

SIGN1 = "sign1"
TRIT5 = "trit5"
POW3 = (1, 3, 9, 27, 81)  # the weights of a trit5 byte's five digits
MASKS = np.dtype("<u8")  # zero masks, a word per 64 values: viewed as bytes, laid out as the packed bits


def packed_size(d: int) -> int:
    """Bytes needed for ``d`` bits: ⌈d/8⌉."""
    return (d + 7) // 8


def level_format(num_levels: int) -> tuple[str, int]:
    """The format used for ``num_levels`` levels and its bits per value (or 0 for trit5)."""
    if num_levels < 2:
        raise ValueError(f"num_levels must be >= 2, got {num_levels}")
    if num_levels == 2:
        return SIGN1, 1
    if num_levels == 3:
        return TRIT5, 0
    b = math.ceil(math.log2(num_levels))
    return f"planes{b}", b


def encoded_size(d: int, num_levels: int) -> int:
    """Bytes used by :func:`flower_dlion.codec.encode_levels` for ``d`` values of ``num_levels`` levels."""
    fmt, b = level_format(num_levels)
    if fmt == TRIT5:
        return (d + 4) // 5
    return b * packed_size(d)


def zero_mask_words(d: int) -> np.ndarray:
    """⌈d/64⌉ mask words (:data:`MASKS`) for a kernel to write whole (not zeroed: a memset would be one more pass)."""
    return np.empty(-(-d // 64), dtype=MASKS)


def as_uint8(buf: torch.Tensor | bytes | np.ndarray) -> torch.Tensor:
    """View received bytes as a 1-D uint8 tensor without copying where possible."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"packed data must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        return buf
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1))
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8)


_TRIT_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def trit_table(device: torch.device) -> torch.Tensor:
    """256 × 5 table: the five base-3 digits of every byte value."""
    if device not in _TRIT_LUT_CACHE:
        byte = torch.arange(256, dtype=torch.int32)
        digits = torch.stack([(byte // p) % 3 for p in POW3], dim=1).to(torch.uint8)
        _TRIT_LUT_CACHE[device] = digits.to(device)
    return _TRIT_LUT_CACHE[device]


def levels_to_values(k: torch.Tensor, num_levels: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map levels to update values: ``Δ = (2k − (L−1)) / (L−1)``.

    The numerator is an exact integer and the one division is correctly rounded, so the
    server and every client (CPU or GPU) get bit-identical Δ from the same levels. The
    divisor is a tensor on ``k``'s device: divided by a Python number, torch's CUDA kernel
    multiplies by the number's rounded reciprocal instead, 1 ulp off for some levels of
    L − 1 = 7, 11, 12, … (the mean of that many votes), and GPU replicas would drift from
    the server's x.
    """
    top = num_levels - 1
    return (2 * k.to(torch.int32) - top).to(dtype) / torch.full((), top, dtype=dtype, device=k.device)


def check_levels(levels: torch.Tensor, num_levels: int) -> None:
    """A ``ValueError`` unless every level is in ``0 … num_levels−1``."""
    top = num_levels - 1
    if levels.numel() and not 0 <= int((bounds := torch.aminmax(levels)).min) <= int(bounds.max) <= top:
        raise ValueError(f"level outside 0…{top}: corrupted update")
