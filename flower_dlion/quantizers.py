"""TernGrad (Wen et al., 2017): stochastic ternary gradients with a per-tensor scaler.

Imports torch only. For each tensor j of the flat gradient g (slices given by ``sizes``)::

    σⱼ = std(gⱼ)                                  # population standard deviation
    gⱼ ← clamp(gⱼ, −c·σⱼ, c·σⱼ)                   # gradient clipping, c = 2.5 in the paper
    sⱼ = max |gⱼ|                                  # the tensor's scaler (one float32)
    bⱼ ~ Bernoulli(|gⱼ| / sⱼ)                      # elementwise, independent
    tⱼ = sign(gⱼ) · bⱼ  ∈ {−1, 0, +1}              # sent as a trit: levels tⱼ + 1 ∈ {0, 1, 2}
    ĝⱼ = sⱼ · tⱼ                                   # E[ĝⱼ] = gⱼ (of the clipped gradient)

Reference: W. Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning", NeurIPS 2017.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CLIP", "ternarize", "unternarize"]

CLIP = 2.5  # Wen et al.'s clipping factor c


def _check_sizes(sizes: Sequence[int], d: int) -> None:
    if sum(sizes) != d or any(s < 1 for s in sizes):
        raise ValueError(f"tensor sizes {list(sizes)} must be positive and sum to d={d}")


def _per_value(scales: torch.Tensor, sizes: Sequence[int], d: int) -> torch.Tensor:
    """Each tensor's scaler repeated over its values (length d)."""
    _check_sizes(sizes, d)
    return torch.repeat_interleave(scales, torch.as_tensor(list(sizes), device=scales.device), output_size=d)


def ternarize(
    g: torch.Tensor, sizes: Sequence[int], *, generator: torch.Generator | None = None, clip: float | None = CLIP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastically ternarize a flat gradient, one scaler per tensor.

    Parameters
    ----------
    g : torch.Tensor
        Flat float gradient of length d = ``sum(sizes)``.
    sizes : sequence of int
        Number of values of each tensor, in flat order.
    generator : torch.Generator | None (default: None)
        Source of the Bernoulli draws (on ``g``'s device); seed it for reproducibility.
    clip : float | None (default: 2.5)
        Clip each tensor to ``±clip·std`` before ternarizing; ``None`` turns clipping off.

    Returns
    -------
    levels : torch.Tensor
        int32 in {0, 1, 2} (t + 1), length d, on ``g``'s device.
    scales : torch.Tensor
        float32 scaler sⱼ of each tensor (0 for an all-zero tensor).

    """
    g = g.float()
    _check_sizes(sizes, g.numel())
    parts = []
    for gj in torch.split(g, list(sizes)):
        if clip is not None:
            bound = clip * gj.std(correction=0)
            gj = gj.clamp(-bound, bound)  # Wen et al.'s gradient clipping
        parts.append(gj)
    g = torch.cat(parts)
    scales = torch.stack([gj.abs().max() for gj in parts])  # sⱼ = max|gⱼ|
    s = _per_value(scales, sizes, g.numel())
    prob = torch.where(s > 0, g.abs() / torch.where(s > 0, s, 1.0), 0.0)  # P(bⱼ = 1) = |gⱼ|/sⱼ
    u = torch.rand(g.numel(), generator=generator, device=g.device)
    t = torch.where(u < prob, g.sign(), 0.0)  # sign(gⱼ)·bⱼ
    return (t + 1).to(torch.int32), scales


def unternarize(levels: torch.Tensor, scales: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """ĝ = sⱼ · (levels − 1) as float32, the unbiased estimate of the (clipped) gradient."""
    per_value = _per_value(scales.to(torch.float32).to(levels.device), sizes, levels.numel())
    return (levels.to(torch.float32) - 1.0) * per_value
