r"""Drift correction for the 1-bit SGD client: SCAFFOLD's control variates (option II), no extra payload byte.

The mode it is for ("ef-sgd"): ``local_optimizer="sgd"``, ``upload="ef-sign"``,
``aggregation="mean"``, ``broadcast_bits`` ≥ 1. Each client runs K SGD steps at η (``local_lr``)
from the round's x and uploads u = x − y_K as a scaled sign with error feedback; the server
averages the decoded uploads and broadcasts that mean as a scaled sign with its own error
feedback. With ``drift_correction="scaffold"`` (Karimireddy et al., 2020, Algorithm 1, option
II) everything is kept in units of a round's update, ``h = K·η·c``::

    client i, round t:   h   = Δ̂ₜ₋₁                     the broadcast of round t−1 (x ← x − lr·(Δ̂ + wd·x))
                         hᵢ  = its own state, made in round t−1
                         y₀ = x,  yₖ₊₁ = yₖ − η·(g(yₖ) + (h − hᵢ)/(K·η))    = SCAFFOLD's g + c − cᵢ
                         uᵢ = x − y_K = η·Σₖ g(yₖ) + (h − hᵢ)
                         ûᵢ = sⱼ·sign(uᵢ + eᵢ) per block j          the upload (error feedback eᵢ)
                         hᵢ ← uᵢ − (h − hᵢ)                          = cᵢ − c + (x − y_K)/(K·η), times K·η
    server:              Δ̄ₜ = mean of the decoded uploads, each scale cut to the round's lower median λⱼ
                         Δ̂ₜ = Q(Δ̄ₜ + e)                          unchanged: one scaled sign, error feedback
                         sends λ with round t+1's config (``drift-limits``)
    client i, round t+1: hᵢ ← hᵢ − clipped_part(ûᵢ, λ)              hᵢ as the server counted the upload

So hᵢ is the client's own drift-free update of the round, η·Σₖ g(yₖ), and ``h − hᵢ`` moves each
local step by the gap between the federation's last mean update and the client's own: a client whose
data pulls x away from the others' is pulled back. **No payload byte is added**: h is the Δ every
in-sync client already receives (scale × sign), and hᵢ never leaves the client. What is added is in
each train message's config: the keys ``drift-correction`` and ``drift-limits`` (8 bytes a scale
block: about 70 bytes a message for a 2-tensor model, measured), counted in ``bytes-down`` like
everything sent. Client memory: hᵢ (float32, 4d bytes) and the last upload's signs and scales (d/8
bytes + 4 a block), persisted with the node's state. Not the naive ``cᵢ = uᵢ/(K·η)``: with that, a
client at a fixed point corrects only half its drift (uᵢ = (η·K·gᵢ + h)/2).

**hᵢ from uᵢ, not from the decoded upload ûᵢ.** The first version kept hᵢ ← ûᵢ − (h − hᵢ), so that
the server's mean was exactly the clients' mean hᵢ. But ûᵢ = uᵢ + eᵢ,ₜ₋₁ − eᵢ,ₜ, and the next round's
correction then hands the quantization error back a second time, on top of the error feedback that
already repays it: the error-feedback input becomes ... + 2·eᵢ,ₜ − eᵢ,ₜ₋₁ (a double root at 1 of
z² − 2z + 1). On 2 classes per client of Fashion-MNIST that first rule diverged at local lr 0.1
(docs/RESULTS.md has the cells), and on the skewed quadratics of tests/library/test_drift.py it
ended 0.34 from the optimum against 0.263 with uᵢ. SCAFFOLD's option II itself uses the client's
own x − y_K, as here.

Why the sums agree (full participation, hᵢ = h = 0 in round 1): write Dₜ = mean hᵢ − h at the
start of round t (hᵢ after the cut). The mean of the new hᵢ is mean (uᵢ − cutᵢ) + Dₜ, the server's
mean is Δ̄ₜ = mean (uᵢ + eᵢ,ₜ₋₁ − eᵢ,ₜ − cutᵢ) (cutᵢ: what it clipped off upload i), and its
broadcast is Δ̂ₜ = Δ̄ₜ + eₜ₋₁ − eₜ (its own error feedback e). Hence
``Dₜ₊₁ = Dₜ + mean (eᵢ,ₜ − eᵢ,ₜ₋₁) + eₜ − eₜ₋₁ = eₜ + mean eᵢ,ₜ``: Σᵢ (c − cᵢ) is −n/(K·η) times the
server's and the clients' error-feedback residuals, bounded, never accumulated
(tests/library/test_drift.py checks it each round): what the residuals hold back, they repay
in later uploads and broadcasts. Without the limits the clipped mass would accumulate in D, a leak of the federation's
mean update (measured on quadratics: 1.02 from the optimum against 0.34 with them, 8.7 without
correction). What still breaks the identity, and the client's rule makes transient:

* **Partial participation** (a node sampled in round t that did not upload in round t−1, a new
  node, a node resynced with the full model): its hᵢ is not paired with the Δ̂ it now receives.
  It runs the round **uncorrected** (h − hᵢ := 0) and starts anew, hᵢ ← uᵢ; SCAFFOLD's stale
  cᵢ is not kept. Sparse sampling thus degrades to the plain ef-sgd client, not to a wrong c.
* **A refused reply**: the server's mean lacks that upload, the client does not know it.

Not with the server's momentum (``server_momentum`` > 0 is refused): the broadcast is then
Δ̄ + μ·M, not the clients' mean update, and using it as c feeds the momentum back into every
client's update (a loop with gain above 1); its c would need M on every client.

**It did not help on real skew** (docs/RESULTS.md, "Drift correction and server momentum under strong
skew: tuning"): with 2 classes per client on Fashion-MNIST (n = 8, K = 100, 15 rounds) it ended below
the uncorrected client at local lr 0.1 (one client's loss went NaN in round 3; the first rule
diverged outright) and at 0.01 (stable, lower); SCAFFOLD itself needed lr 0.003 on that split.
Server momentum (``server_momentum=0.5``) is the lever that helped there.

Imports torch only. Reference: S. P. Karimireddy et al., "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DRIFT_KINDS",
    "LIMIT",
    "Drift",
    "check_drift",
    "clipped_part",
    "decoded_upload",
    "next_state",
    "offset",
    "problem",
]

DRIFT_KINDS = ("off", "scaffold")
LIMIT = 1e6  # a clip limit (a median of ef-sign scales) beyond this is refused by the client


@dataclass
class Drift:
    """A client's correction state: hᵢ (float32, d values, on the device), the round whose upload made it.

    ``signs`` and ``scales``: that upload's packed signs and per-block scales (host, uint8 and float32),
    kept until the next round's message says where the server cut the scales (:func:`clipped_part`).
    """

    h: torch.Tensor
    round: int
    signs: Any = None  # numpy uint8 (⌈d/8⌉,) or None
    scales: Any = None  # numpy float32 (blocks,) or None


def check_drift(
    drift: str, *, local_optimizer: str, upload: str, aggregation: str, broadcast_bits: int, server_momentum: float
) -> None:
    """Refuse (``ValueError`` naming the option, its value and what it needs) a drift correction that does not apply."""
    if drift not in DRIFT_KINDS:
        raise ValueError(f"drift_correction must be one of {DRIFT_KINDS}, got {drift!r}")
    if drift == "off":
        return
    fits = local_optimizer == "sgd" and upload == "ef-sign" and aggregation == "mean" and broadcast_bits >= 1
    if not fits:
        raise ValueError(
            f"drift_correction={drift!r} corrects local SGD steps with the broadcast mean of ef-sign uploads: it "
            "needs local_optimizer='sgd', upload='ef-sign', aggregation='mean' and broadcast_bits >= 1, got "
            f"local_optimizer={local_optimizer!r}, upload={upload!r}, aggregation={aggregation!r}, "
            f"broadcast_bits={broadcast_bits}"
        )
    if server_momentum:
        raise ValueError(
            f"drift_correction={drift!r} takes c from the broadcast, which with server_momentum={server_momentum} "
            "is Δ + μ·M, not the clients' mean update (c would feed the momentum back): use server_momentum=0"
        )


def offset(diff: torch.Tensor, steps: int, local_lr: float) -> torch.Tensor:
    """SCAFFOLD's c − cᵢ from ``diff`` = h − hᵢ (round-update units): ``(h − hᵢ)/(K·η)``, a new tensor."""
    if steps < 1 or not (math.isfinite(local_lr) and local_lr > 0):
        raise ValueError(f"steps must be >= 1 and local_lr > 0, got {steps} and {local_lr}")
    return diff / (steps * local_lr)


def next_state(update: torch.Tensor, diff: torch.Tensor | None) -> torch.Tensor:
    """The client's new hᵢ = uᵢ − (h − hᵢ), a new tensor (``update``: uᵢ = x − y_K; ``diff`` None: hᵢ ← uᵢ)."""
    return update.clone() if diff is None else update - diff


def decoded_upload(bits: torch.Tensor, scales: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """ûᵢ = ±sⱼ per block, as the server decodes a 1-bit scaled sign (before it clips the scales): float32."""
    per_value = torch.repeat_interleave(scales.to(torch.float32), torch.as_tensor(list(sizes), device=scales.device))
    return torch.where(bits.to(per_value.device), per_value, -per_value)


def clipped_part(bits: torch.Tensor, scales: torch.Tensor, limits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """What the server's scale clipping took off an upload: ±max(sⱼ − limitⱼ, 0) per value (float32).

    ``limits``: the round's cut per block (the lower median of the clients' scales); the upload as
    the server decoded it is ``decoded_upload(bits, scales) − clipped_part(bits, scales, limits)``.
    """
    return decoded_upload(bits, (scales.to(torch.float32) - limits.to(torch.float32)).clamp_(min=0.0), sizes)


def problem(state: Drift | None, d: int) -> str | None:
    """Why a client's correction state cannot be used (it then starts anew), or None where it can."""
    if state is None:
        return "it has none (its first round with drift correction, or a state saved without it)"
    if state.h.shape != (d,) or state.h.dtype != torch.float32:
        return f"it is {state.h.dtype} {tuple(state.h.shape)}, the model needs float32 ({d},)"
    if not bool(torch.isfinite(state.h).all()):
        return "it has non-finite values"
    if (state.signs is None) != (state.scales is None) or (
        state.signs is not None and (state.signs.shape != ((d + 7) // 8,) or state.signs.dtype.name != "uint8")
    ):
        return "its upload's signs do not fit the model"
    if state.scales is not None and not (state.scales.dtype.name == "float32" and (state.scales >= 0).all()):
        return "its upload's scales are not non-negative float32"
    return None
