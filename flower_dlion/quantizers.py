"""Lossy quantizers with one float32 scale per tensor: TernGrad, scaled sign, uniform, error feedback.

Imports torch only (and the level mapping of :mod:`flower_dlion.codec`, the update of
:mod:`flower_dlion.lion`).

**TernGrad** (Wen et al., 2017): stochastic ternary gradients. For each tensor j of the
flat gradient g (slices given by ``sizes``)::

    σⱼ = std(gⱼ)                                  # population standard deviation
    gⱼ ← clamp(gⱼ, −c·σⱼ, c·σⱼ)                   # gradient clipping, c = 2.5 in the paper
    sⱼ = max |gⱼ|                                  # the tensor's scaler (one float32)
    bⱼ ~ Bernoulli(|gⱼ| / sⱼ)                      # elementwise, independent
    tⱼ = sign(gⱼ) · bⱼ  ∈ {−1, 0, +1}              # sent as a trit: levels tⱼ + 1 ∈ {0, 1, 2}
    ĝⱼ = sⱼ · tⱼ                                   # E[ĝⱼ] = gⱼ (of the clipped gradient)

**Error-feedback quantization** (:func:`quantize`, :func:`ef_quantize_`), used for the
1-bit scaled-sign upload and the p-bit broadcast of Distributed Lion's extensions::

    L = 2:       levels = [vⱼ ≥ 0],  sⱼ = mean |vⱼ|          # scaled sign: ±sⱼ (the L2-best scale)
    L = 2ᵖ − 1:  sⱼ = max |vⱼ|,  levels = round((vⱼ/sⱼ + 1)·(L−1)/2)
    v̂ⱼ = sⱼ · (2·levels − (L−1)) / (L−1)                     # codec.levels_to_values × scale
    error feedback:  w = v + e,  quantize w,  e ← w − ŵ     # what was not sent is sent later

References: W. Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning", NeurIPS 2017; S. P. Karimireddy et al., "Error Feedback Fixes
SignSGD and other Gradient Compression Schemes", ICML 2019; S. Ishikawa et al.,
"Lion Cub: Minimizing Communication Overhead in Distributed Lion", 2024.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .codec import apply_levels_, levels_to_values
from .lion import apply_update_

__all__ = ["CLIP", "apply_delta_", "dequantize", "ef_quantize_", "quantize", "scale_blocks", "ternarize", "unternarize"]

CLIP = 2.5  # Wen et al.'s clipping factor c


def scale_blocks(sizes: Sequence[int], block: int) -> list[int]:
    """The segments that get one scale each: every tensor cut into blocks of ``block`` values.

    A tensor of s values gives ⌈s/B⌉ segments, all of B values but its last (Lion Cub's
    per-block scales, Ishikawa et al., 2024); ``block`` = 0 keeps one segment per tensor.
    Every function here takes the result as its ``sizes``.

    >>> scale_blocks([5, 2, 8], 4)
    [4, 1, 2, 4, 4]
    """
    if block < 0:
        raise ValueError(f"block must be >= 0 (0: one scale per tensor), got {block}")
    if block == 0:
        return list(sizes)
    return [min(block, s - start) for s in sizes for start in range(0, s, block)]


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


def quantize(v: torch.Tensor, sizes: Sequence[int], num_levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministically quantize a flat vector to ``num_levels`` levels, one scale per tensor.

    Parameters
    ----------
    v : torch.Tensor
        Flat float vector of length d = ``sum(sizes)``.
    sizes : sequence of int
        Number of values of each tensor, in flat order.
    num_levels : int
        2 (scaled sign, scale = mean |vⱼ|; 0 is sent as +sⱼ) or an odd number ≥ 3
        (symmetric uniform grid with 0 on it, scale = max |vⱼ|, round to nearest).

    Returns
    -------
    levels : torch.Tensor
        int32 in ``[0, num_levels)``, length d, on ``v``'s device.
    scales : torch.Tensor
        float32 scale sⱼ of each tensor.

    """
    if num_levels != 2 and (num_levels < 3 or num_levels % 2 == 0):
        raise ValueError(f"num_levels must be 2 or an odd number >= 3, got {num_levels}")
    v = v.float()
    _check_sizes(sizes, v.numel())
    parts = torch.split(v, list(sizes))
    if num_levels == 2:
        scales = torch.stack([p.abs().mean() for p in parts])  # sⱼ = mean|vⱼ|
        return (v >= 0).to(torch.int32), scales
    scales = torch.stack([p.abs().max() for p in parts])  # sⱼ = max|vⱼ|
    s = _per_value(scales, sizes, v.numel())
    half = (num_levels - 1) // 2
    unit = torch.where(s > 0, v / torch.where(s > 0, s, 1.0), 0.0)  # in [−1, 1]
    return (torch.round(unit * half) + half).to(torch.int32), scales


def dequantize(
    levels: torch.Tensor, num_levels: int, scales: torch.Tensor | None, sizes: Sequence[int]
) -> torch.Tensor:
    """``sⱼ · (2·levels − (L−1)) / (L−1)`` as float32 (bit-identical on CPU and GPU).

    ``scales=None`` means scale 1: plain :func:`codec.levels_to_values`, no multiplication.
    """
    values = levels_to_values(levels, num_levels)
    if scales is None:
        return values
    return values * _per_value(scales.to(torch.float32).to(levels.device), sizes, levels.numel())


def apply_delta_(
    x: torch.Tensor,
    levels: torch.Tensor,
    num_levels: int,
    scales: torch.Tensor | None,
    sizes: Sequence[int],
    lr: float,
    weight_decay: float,
) -> torch.Tensor:
    """In place: ``x ← x − lr·(Δ + wd·x)`` for ``Δ = dequantize(levels, L, scales, sizes)``. Returns ``x``.

    The one way the server and every client apply a broadcast Δ, so replicas stay
    bit-identical: without scales straight from the levels (:func:`codec.apply_levels_`,
    one fused pass where the kernels run), with per-tensor scales through the float Δ
    (:func:`lion.apply_update_`).
    """
    if scales is None:
        return apply_levels_(x, levels, num_levels, lr, weight_decay)
    return apply_update_(x, dequantize(levels, num_levels, scales, sizes), lr, weight_decay)


def ef_quantize_(
    v: torch.Tensor,
    error: torch.Tensor,
    sizes: Sequence[int],
    num_levels: int,
    perturb: Callable[[torch.Tensor], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``v + error`` and keep what was lost in ``error`` (in place).

    Returns the ``(levels, scales)`` of :func:`quantize`; afterwards
    ``error = v + error_before − dequantize(levels, …)``. ``perturb`` (2 levels only): the signs
    are those of ``w + σ·ξ`` (:mod:`flower_dlion.stochastic`), the scales still mean |w|.
    """
    w = v.float() + error  # add what earlier rounds did not send
    levels, scales = quantize(w, sizes, num_levels)
    if perturb is not None:
        if num_levels != 2:
            raise ValueError(f"a stochastic sign needs 2 levels, got {num_levels}")
        levels = (perturb(w.clone()) >= 0).to(torch.int32)  # type: ignore[operator]
    error.copy_(w - dequantize(levels, num_levels, scales, sizes))  # remember this round's loss
    return levels, scales
