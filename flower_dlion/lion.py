"""The Lion math of Distributed Lion (Liu et al., 2024), as small pure functions.

Imports torch only. One round, for n workers sharing parameters x::

    worker i:  δᵢ = sign(β₁·mᵢ + (1−β₁)·gᵢ)          # local Lion direction, sent as 1 bit/value
               mᵢ ← β₂·mᵢ + (1−β₂)·gᵢ               # momentum update uses the OLD mᵢ for δᵢ
    server:    S  = Σᵢ δᵢ                            # integer vote count, |S| ≤ n
               Δ  = sign(S)  (vote)   or   S/n  (mean)
    everyone:  x ← x − lr·(Δ + wd·x)                 # decoupled weight decay

With n = 1 both aggregations are exactly single-worker Lion (:func:`lion_step_`).

Reference: B. Liu et al., "Communication Efficient Distributed Training with
Distributed Lion", 2024; X. Chen et al., "Symbolic Discovery of Optimization
Algorithms", 2023 (Lion).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

__all__ = ["Levels", "aggregate", "apply_update_", "direction", "lion_step_", "local_step_", "update_momentum_"]

Aggregation = Literal["vote", "mean"]


def direction(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """Lion direction ``sign(β₁·m + (1−β₁)·g)`` (values in {−1, 0, +1})."""
    return m.mul(beta1).add_(g, alpha=1.0 - beta1).sign_()  # interpolate, then take the sign


def update_momentum_(m: torch.Tensor, g: torch.Tensor, beta2: float) -> torch.Tensor:
    """In place: ``m ← β₂·m + (1−β₂)·g``. Returns ``m``."""
    return m.mul_(beta2).add_(g, alpha=1.0 - beta2)  # slower EMA than the one used for δ


def local_step_(m: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """A worker's part of one round: returns δ and updates ``m`` in place (after δ)."""
    delta = direction(m, g, beta1)  # δ from the old momentum
    update_momentum_(m, g, beta2)  # then move the momentum
    return delta


def apply_update_(x: torch.Tensor, delta: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
    """In place: ``x ← x − lr·(Δ + wd·x)``. Returns ``x``.

    Done as three separately rounded IEEE operations (lr·Δ, x·(1 − lr·wd), difference)
    rather than one fused kernel, so replicas on different devices stay bit-identical.
    """
    step = delta.to(x.dtype) * lr  # lr·Δ, rounded once
    x.mul_(1.0 - lr * weight_decay)  # decoupled weight decay
    return x.sub_(step)  # descend


def lion_step_(
    x: torch.Tensor, m: torch.Tensor, g: torch.Tensor, *, lr: float, weight_decay: float, beta1: float, beta2: float
) -> torch.Tensor:
    """Single-worker Lion, in place on ``x`` and ``m``. Returns ``x``."""
    return apply_update_(x, local_step_(m, g, beta1, beta2), lr, weight_decay)


class Levels(NamedTuple):
    """An aggregated update as integer levels: ``Δ = (2·levels − (L−1)) / (L−1)``."""

    levels: torch.Tensor
    num_levels: int


def aggregate(votes: torch.Tensor, n: int, how: Aggregation) -> Levels:
    """Aggregate the vote sum ``S = Σδᵢ`` of ``n`` workers into Δ, as levels.

    vote: ``Δ = sign(S)``, 0 on a tie (never broken toward one side). With odd ``n`` no
    tie is possible, so Δ ∈ {−1, +1} needs 2 levels; with even ``n`` it needs 3.
    mean: ``Δ = S / n`` with ``S ∈ {−n, −n+2, …, n}``: n + 1 levels ``k = (S + n) / 2``.

    Use :func:`flower_dlion.codec.levels_to_values` to get Δ itself.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    s = votes.to(torch.int32)
    if how == "vote":
        if n % 2:
            return Levels((s > 0).to(torch.int32), 2)  # S is odd: never 0
        return Levels(torch.sign(s) + 1, 3)  # −1, 0, +1 → 0, 1, 2
    if how == "mean":
        return Levels((s + n) // 2, n + 1)
    raise ValueError(f"aggregation must be 'vote' or 'mean', got {how!r}")
