"""Probes: whether a fused kernel rounds exactly as torch's composition does, checked once and kept.

A fused kernel may only stand in for the reference where it gives the same bits. The Lion
step's mix and momentum are FMAs in the kernels and ``add(alpha=)`` in torch, which is one
FMA on x86-64 with AVX2 or AVX-512, Arm64 and CUDA, but not everywhere: :func:`fused_step_matches_torch`
runs both on a probe once per device type and (β₁, β₂). Applying Δ multiplies levels by
torch's own steps ``lr·Δ`` (:func:`torch_steps`).

The reference composition comes from the caller (the codec hands its twin ``lion.local_step_``):
like every module of :mod:`flower_dlion.accel`, this one imports nothing above it but the
formats' definitions (:mod:`flower_dlion.formats`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from ..formats import levels_to_values

__all__ = ["LocalStep", "fused_step_matches_torch", "lion_coefs", "torch_steps"]

LocalStep = Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]  # lion.local_step_: δ, m updated

_FUSED_EXACT: dict[tuple[str, float, float], bool] = {}  # (device type, β₁, β₂) → the fused step equals torch's
_STEPS: dict[tuple[torch.device, int, float], torch.Tensor] = {}  # (device, L, lr) → lr·Δ of the L levels


@functools.lru_cache(maxsize=64)
def lion_coefs(beta1: float, beta2: float) -> tuple[np.float32, ...]:
    """``(β₁, 1−β₁, β₂, 1−β₂)`` as float32, as torch rounds a Python scalar for a float32 tensor."""
    return tuple(np.float32(c) for c in (beta1, 1.0 - beta1, beta2, 1.0 - beta2))


def fused_step_matches_torch(
    fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    local_step: LocalStep,
    beta1: float,
    beta2: float,
    device: torch.device,
) -> bool:
    """Whether ``fused(m, g)`` gives torch's δ > 0 bits and m bit for bit (checked once per device type, β₁, β₂).

    Parameters
    ----------
    fused : Callable
        The kernel's step: updates ``m`` in place and returns the bits of δ > 0, packed (``sign1``).
    local_step : Callable
        The reference, ``lion.local_step_(m, g, β₁, β₂)``: returns δ and updates ``m`` in place.
    beta1, beta2 : float
        β₁ and β₂.
    device : torch.device
        Where both run. The probe: 3·2¹⁵ + 45 values spanning many magnitudes (past one torch
        thread's range, with a partial last group).

    Returns
    -------
    bool
        The same bits and the same m (kept per device type, β₁ and β₂).

    """
    key = (device.type, float(beta1), float(beta2))
    if key not in _FUSED_EXACT:
        gen = torch.Generator().manual_seed(0)
        d = 3 * 2**15 + 45
        m = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(40).sub(20).exp2()
        g = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(40).sub(20).exp2()
        m, g = m.to(device), g.to(device)
        m_ref = m.clone()
        expected = np.packbits((local_step(m_ref, g, beta1, beta2) > 0).cpu().numpy(), bitorder="big")  # sign1
        packed = fused(m, g)
        same_m = torch.equal(m.view(torch.int32), m_ref.view(torch.int32))
        _FUSED_EXACT[key] = same_m and np.array_equal(packed.cpu().numpy(), expected)
    return _FUSED_EXACT[key]


def torch_steps(device: torch.device, num_levels: int, lr: float) -> torch.Tensor:
    """``levels_to_values(arange(L), L) * lr`` on ``device``, as torch computes it there (kept: a round reuses it)."""
    key = (device, num_levels, lr)
    steps = _STEPS.get(key)
    if steps is None:
        if len(_STEPS) >= 64:  # a learning-rate schedule: keep only the latest
            _STEPS.clear()
        steps = _STEPS[key] = levels_to_values(torch.arange(num_levels, device=device), num_levels) * lr
    return steps
