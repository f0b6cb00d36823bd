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

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

__all__ = [
    "MAX_DECAY",
    "Levels",
    "aggregate",
    "anchored",
    "apply_update_",
    "check_hyperparameters",
    "cosine_decay",
    "direction",
    "lion_step_",
    "local_sgd",
    "local_step_",
    "local_steps_",
    "update_momentum_",
    "weighted_vote",
]

MAX_DECAY = 0.5  # lr·wd·K at most: a round keeps at least half of x (the server's options, the clients' range checks)
Aggregation = Literal["vote", "mean"]
Perturb = Callable[[torch.Tensor], object]  # in place: v ← v + σ·ξ before a sign (flower_dlion.stochastic)


def check_hyperparameters(*, lr: float, weight_decay: float, betas: dict[str, float]) -> None:
    """Raise ``ValueError`` (torch.optim's wording) for a bad learning rate, decay or beta (every strategy's check)."""
    if not (math.isfinite(lr) and lr > 0.0):
        raise ValueError(f"Invalid learning rate: {lr} (must be finite and > 0)")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be finite and >= 0)")
    for name, beta in betas.items():
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {name} parameter: {beta} (must be in [0, 1))")


def direction(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """Lion direction ``sign(β₁·m + (1−β₁)·g)`` (values in {−1, 0, +1})."""
    return m.mul(beta1).add_(g, alpha=1.0 - beta1).sign_()  # interpolate, then take the sign


def update_momentum_(m: torch.Tensor, g: torch.Tensor, beta2: float) -> torch.Tensor:
    """In place: ``m ← β₂·m + (1−β₂)·g``. Returns ``m``."""
    return m.mul_(beta2).add_(g, alpha=1.0 - beta2)  # slower EMA than the one used for δ


def local_step_(
    m: torch.Tensor,
    g: torch.Tensor,
    beta1: float,
    beta2: float,
    perturb: Callable[[torch.Tensor], object] | None = None,
) -> torch.Tensor:
    """A worker's part of one round: returns δ and updates ``m`` in place (after δ).

    ``perturb``: in place on the mix c = β₁·m + (1−β₁)·g before its sign (a stochastic sign,
    δ = sign(c + σ·ξ): :mod:`flower_dlion.stochastic`); None: the deterministic sign.
    """
    if perturb is None:
        delta = direction(m, g, beta1)  # δ from the old momentum
    else:
        mix = m.mul(beta1).add_(g, alpha=1.0 - beta1)
        perturb(mix)
        delta = mix.sign_()
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


def anchored(anchor: torch.Tensor, counts: torch.Tensor, decay: float, step: float) -> torch.Tensor:
    """The parameters x from an anchor and the integer counts since it: ``x = γ·xₐ − η·C`` (a new tensor).

    The anchored form of ``x ← x − lr·(Δ + wd·x)`` (issue 38's downlink): with Δₜ = q·Lₜ
    for integer Lₜ, C = Σₜ Lₜ over the j rounds since the anchor xₐ, ``γ = (1 − lr·wd)ʲ`` and
    ``η = lr·q``. Unlike the per-round rule, the Δs of the current anchor epoch are not decayed
    until the next anchor (``xₐ ← x``, C ← 0); a replica that missed rounds then needs only
    C_now − C_have, whatever the order of the Δs. γ and η come from the server as numbers
    (not recomputed), and the three operations (γ·xₐ, η·C, difference) are each rounded once,
    so every device gets the same bits.
    """
    return anchor.mul(decay).sub_(counts.to(anchor.dtype).mul_(step))


def lion_step_(
    x: torch.Tensor, m: torch.Tensor, g: torch.Tensor, *, lr: float, weight_decay: float, beta1: float, beta2: float
) -> torch.Tensor:
    """Single-worker Lion, in place on ``x`` and ``m``. Returns ``x``."""
    return apply_update_(x, local_step_(m, g, beta1, beta2), lr, weight_decay)


def local_steps_(
    x: torch.Tensor,
    m: torch.Tensor,
    gradient: Callable[[torch.Tensor, int], torch.Tensor],
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    perturb: Perturb | None = None,
) -> torch.Tensor:
    """K local Lion steps (FedLion's client), in place on ``x`` and ``m``.

    ``gradient(x, k)`` returns the gradient at ``x`` for step ``k``. Returns the integer sum
    of the K directions ``U = Σₖ δₖ`` (float32 values in ``[−K, K]``). The last step's
    update is not applied to ``x``: the server's broadcast replaces the local copy.
    ``perturb``: each step's stochastic sign (:func:`local_step_`).
    """
    total = None
    for k in range(steps):
        delta = local_step_(m, gradient(x, k), beta1, beta2, perturb)  # δₖ from mₖ, then mₖ₊₁
        if k + 1 < steps:
            apply_update_(x, delta, lr, weight_decay)  # move the local copy
        total = delta if total is None else total.add_(delta)  # U += δₖ (δ₀'s buffer holds U)
    assert total is not None, "steps must be >= 1"
    return total


def local_sgd(
    x: torch.Tensor, gradient: Callable[[torch.Tensor, int], torch.Tensor], *, steps: int, lr: float
) -> torch.Tensor:
    """The model change of K plain SGD steps from ``x`` (FedSMU's local work); ``x`` is not changed.

    ``x₀ = x``, ``xₖ₊₁ = xₖ − lr·gradient(xₖ, k)``; returns ``x − x_K = lr·Σₖ gradient(xₖ, k)``,
    which the caller treats as one gradient: sign(β₁·m + (1−β₁)·(x − x_K)) is FedSMU's update.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    x_local = x.clone()
    for k in range(steps):
        x_local.add_(gradient(x_local, k), alpha=-lr)
    return x.sub(x_local)


class Levels(NamedTuple):
    """An aggregated update as integer levels: ``Δ = (2·levels − (L−1)) / (L−1)``."""

    levels: torch.Tensor
    num_levels: int


def aggregate(votes: torch.Tensor, n: int, how: Aggregation, k: int = 1) -> Levels:
    """Aggregate the sum ``S = Σᵢ uᵢ`` of ``n`` workers' integer updates ``uᵢ ∈ [−k, k]``: THE definition.

    With one Lion step per round (``k = 1``) the uᵢ are the signs δᵢ; with K local steps
    they are the sums of the K signs (``k = K``, FedLion's upload).

    vote: ``Δ = sign(S)``, 0 on a tie (never broken toward one side). With ``k = 1`` and odd
    ``n`` no tie is possible, so Δ ∈ {−1, +1} needs 2 levels ``[S > 0]``; otherwise it needs 3,
    ``sign(S) + 1``.
    mean: ``Δ = S / (n·k)`` (multiply by ``k`` for the mean of the uᵢ). With ``k = 1``,
    ``S ∈ {−n, −n+2, …, n}``: n + 1 levels ``(S + n) / 2``; with ``k > 1`` every integer in
    ``[−nk, nk]`` can occur: 2nk + 1 levels ``S + nk``.

    Every other computation of these levels is this function's twin, equal to it bit for bit:
    :func:`flower_dlion.codec.aggregate_packed` counts them straight from n packed sign payloads
    (``k = 1``, S = 2·c − n for c the votes for +1), and :func:`flower_dlion.strategies.server_delta.choose_aggregator`
    picks it for the 1-bit sign upload (tests/library/test_aggregation_home.py holds the two equal).

    Parameters
    ----------
    votes
        S, integer values (any dtype; taken as int32), |S| ≤ n·k.
    n
        The number of workers summed, ≥ 1.
    how
        ``"vote"`` or ``"mean"``.
    k
        The largest |uᵢ|, ≥ 1.

    Returns
    -------
    Levels
        int32 levels and their number L: ``Δ = (2·levels − (L−1)) / (L−1)``
        (:func:`flower_dlion.codec.levels_to_values`).

    Raises
    ------
    ValueError
        ``n`` or ``k`` below 1, or ``how`` neither ``"vote"`` nor ``"mean"``.

    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    s = votes.to(torch.int32)
    if how == "vote":
        if n % 2 and k == 1:
            return Levels((s > 0).to(torch.int32), 2)  # S is odd: never 0
        return Levels(torch.sign(s).add_(1), 3)  # −1, 0, +1 → 0, 1, 2
    if how == "mean":
        if k == 1:
            return Levels((s + n).floor_divide_(2), n + 1)  # S + n is even
        return Levels(s + n * k, 2 * n * k + 1)
    raise ValueError(f"aggregation must be 'vote' or 'mean', got {how!r}")


def weighted_vote(votes: torch.Tensor) -> Levels:
    """The vote of a real-valued sum ``S = Σᵢ sᵢ·δᵢ`` of scaled signs: ``Δ = sign(S)`` as 3 levels.

    The vote of :func:`aggregate` where each worker's sign counts with its own scale
    ``sᵢ ≥ 0`` (the ef-sign upload): S is not an integer, so its sign is taken as it is
    (never rounded toward 0 first), and S can be exactly 0 for any n: always 3 levels
    ``sign(S) + 1`` (a mean has no integer levels: it is sent quantized instead).

    Parameters
    ----------
    votes
        S, floating point.

    Returns
    -------
    Levels
        int32 levels in {0, 1, 2} for Δ ∈ {−1, 0, +1}, and 3.

    """
    return Levels((torch.sign(votes) + 1).to(torch.int32), 3)


def cosine_decay(num_rounds: int, final: float = 0.0) -> Callable[[int], float]:
    """The factor of the learning rate in round t = 1, 2, … of a cosine decay over ``num_rounds``.

    ``f(t) = final + (1 − final)·½·(1 + cos(π·min(t − 1, T)/T))`` with T = ``num_rounds``
    (optax's ``cosine_decay_schedule`` counted from round 1): 1 in round 1, ``final`` from
    round T + 1 on. Pass it as ``DistributedLion(lr=..., lr_schedule=cosine_decay(T, 0.1))``.

    Raises
    ------
    ValueError
        ``num_rounds`` < 1, or ``final`` outside [0, 1].

    """
    if num_rounds < 1:
        raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
    if not 0.0 <= final <= 1.0:
        raise ValueError(f"final must be in [0, 1] (a factor of lr), got {final}")

    def factor(t: int) -> float:
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * min(max(t - 1, 0), num_rounds) / num_rounds))

    return factor
