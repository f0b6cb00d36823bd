"""The codec's functions on a CUDA device, on the Triton kernels: the same arguments, bytes and floats.

:func:`flower_dlion.accel.choose` hands these out on a CUDA device unless
``FLOWER_DLION_KERNELS=off`` or Triton is missing. Each one takes the arguments of the
:mod:`flower_dlion.codec` function of the same name, for inputs the codec has checked it can
take (float32 or levels, contiguous, on one device), and is one launch of
:mod:`.triton_kernels` that nothing waits for: no host synchronization on the way. The fused
Lion step also takes the reference step (``lion.local_step_``) for its probe, and returns None
where the kernel would round otherwise: the codec then runs the composition.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ..formats import as_uint8, check_levels
from . import triton_kernels as kernels
from .probes import LocalStep, fused_step_matches_torch, lion_coefs, torch_steps

__all__ = ["apply_levels_", "count_ones", "count_planes", "pack_local_step_", "pack_signs"]


def pack_signs(
    v: torch.Tensor, generator: torch.Generator | None = None, *, flips: list[int] | None = None
) -> torch.Tensor:
    """:func:`flower_dlion.codec.pack_signs` of a float32 vector: one kernel reads ``v`` once and draws its coins.

    The coins come from Philox at a counter the generator hands out without device work
    (:func:`.triton_kernels.coin_stream`): nothing is synchronized. ``flips`` costs one more
    reduction over ``v``.
    """
    if flips is not None:
        flips.append(int(torch.count_nonzero(v == 0)))
    return kernels.pack_positive(v.contiguous(), generator)


def pack_local_step_(
    m: torch.Tensor,
    g: torch.Tensor,
    beta1: float,
    beta2: float,
    generator: torch.Generator | None = None,
    *,
    flips: list[int] | None = None,
    local_step: LocalStep,
) -> torch.Tensor | None:
    """:func:`flower_dlion.codec.pack_local_step_` of float32 vectors on one CUDA device, in one launch.

    None (``m`` and ``flips`` untouched) where the kernel rounds otherwise than ``local_step``,
    the reference ``lion.local_step_``, on this device (a probe, once per β₁, β₂).
    """
    coefs = tuple(map(float, lion_coefs(beta1, beta2)))
    if not fused_step_matches_torch(functools.partial(_lion_pack_probe, coefs), local_step, beta1, beta2, m.device):
        return None
    if flips is not None:  # the mix's exact zeros, as lion.direction computes the mix
        flips.append(int(torch.count_nonzero(m.mul(beta1).add_(g, alpha=1.0 - beta1) == 0)))
    return kernels.lion_pack(m.view(-1), g.reshape(-1).contiguous(), coefs, generator)  # pack_signs's coins


def _lion_pack_probe(coefs: tuple[float, ...], m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The kernel's fused step (for the probe, which has no zero direction): δ packed, ``m`` updated."""
    return kernels.lion_pack(m, g, coefs, torch.Generator(device=m.device))  # not the device's default generator


def apply_levels_(
    x: torch.Tensor, levels: torch.Tensor, num_levels: int, lr: float, weight_decay: float
) -> torch.Tensor:
    """:func:`flower_dlion.codec.apply_levels_` in one pass, with torch's own L steps (no FMA contraction)."""
    steps = torch_steps(x.device, num_levels, float(lr))  # torch's own lr·Δ of every level
    bad = kernels.apply_levels(x.view(-1), levels.view(-1), steps, float(np.float32(1.0 - lr * weight_decay)))
    if bad.read():
        check_levels(levels, num_levels)  # the flag may be another call's: check exactly
    return x


def count_ones(payloads: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    """:func:`flower_dlion.codec.count_ones` of payloads in GPU memory: per-value counters in registers."""
    return kernels.count_ones([as_uint8(p) for p in payloads], d)


def count_planes(payloads: Sequence[torch.Tensor], d: int, *, chunk_words: int = 1 << 16) -> torch.Tensor:
    """:func:`flower_dlion.codec.count_planes` of payloads in GPU memory (``chunk_words`` is the reference's)."""
    return kernels.count_planes([as_uint8(p) for p in payloads], d)
