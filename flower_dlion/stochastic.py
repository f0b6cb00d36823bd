r"""Stochastic signs: ``sign(v + σ·ξ)`` with symmetric noise ξ, σ = τ · (mean |v| of each tensor).

A deterministic sign is biased when clients disagree: the vote of signs follows the majority of
the clients, not the mean of their updates, and the more heterogeneous the clients, the larger the
gap (z-SignFedAvg, Tang et al., arXiv:2302.02589). Noise added before the sign makes its expectation
follow the value itself. For one coordinate v of a tensor whose scale is ``σ = τ · mean|v|``:

* **uniform** ξ ~ U[−1, 1]: ``E[sign(v + σξ)] = v/σ`` for ``|v| ≤ σ`` and ``sign(v)`` beyond: unbiased
  (up to the common factor 1/σ) inside the band, the plain sign outside it;
* **gaussian** ξ ~ N(0, 1): ``E[sign(v + σξ)] = erf(v / (σ√2)) ≈ √(2/π) · v/σ`` for small ``|v|/σ``.

The variance of one stochastic sign is ``1 − E²``: τ trades the sign's bias for variance, which the
sum over n clients averages out (the vote of n unbiased signs estimates sign(Σ vᵢ)). τ = 0 is the
deterministic sign (bit for bit: no noise is drawn). The noise comes from the client's round
generator (seeded by the run's seed, the node and the round): a run is reproduced by its seed.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

__all__ = ["NOISE_KINDS", "NOISE_LIMIT", "Perturb", "perturb_", "perturber"]

NOISE_KINDS = ("uniform", "gaussian")
NOISE_LIMIT = 100.0  # τ beyond this is noise alone: refused

Perturb = Callable[[torch.Tensor], torch.Tensor]  # v → v + σ·ξ, in place


def perturb_(
    v: torch.Tensor, *, sizes: Sequence[int], tau: float, kind: str, generator: torch.Generator | None
) -> torch.Tensor:
    """In place: ``v ← v + σ·ξ`` per block of ``sizes`` values, ``σ = τ · mean|v|`` of the block. Returns ``v``."""
    noise = torch.empty_like(v, dtype=torch.float32)
    if kind == "uniform":
        noise.uniform_(-1.0, 1.0, generator=generator)
    elif kind == "gaussian":
        noise.normal_(0.0, 1.0, generator=generator)
    else:
        raise ValueError(f"noise kind must be one of {NOISE_KINDS}, got {kind!r}")
    offset = 0
    for size in sizes:
        block = v[offset : offset + size]
        sigma = tau * float(block.abs().mean()) if size else 0.0
        block.add_(noise[offset : offset + size], alpha=sigma)
        offset += size
    return v


def perturber(sizes: Sequence[int], tau: float, kind: str, generator: torch.Generator | None) -> Perturb | None:
    """The in-place perturbation of a round's signs, or None for τ = 0 (the deterministic sign)."""
    if tau == 0.0:
        return None
    return partial(perturb_, sizes=list(sizes), tau=tau, kind=kind, generator=generator)
