"""The argument checks of :class:`~flower_dlion.strategies.dlion.DistributedLion`'s constructor.

Two groups, run in this order by ``__init__`` (the sampling arguments are checked by the base
class between them): what a round computes and sends (:func:`check_update_arguments`), then the
server's step and the downlink (:func:`check_step_and_downlink_arguments`). Each raises a
``ValueError`` that names the argument, its value and what it needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..uploads import upload_kind
from .common import check_common_args

__all__ = ["check_step_and_downlink_arguments", "check_update_arguments"]


def check_update_arguments(
    *,
    aggregation: str,
    upload: str,
    local_steps: int,
    accumulate: int,
    broadcast_bits: int,
    momentum_sync_every: int,
    buffer_sync_every: int,
    local_optimizer: str,
    local_lr: float | None,
    stale_momentum: str,
    local_proximal_mu: float,
    server_momentum: float,
    scale_block: int,
) -> None:
    """Check what a round computes and sends: local steps, upload, broadcast, syncs.

    The keyword arguments are :class:`~flower_dlion.strategies.dlion.DistributedLion`'s of the
    same names (its docstring says what each one is).

    Raises
    ------
    ValueError
        An argument out of its range, or a combination that has no meaning (e.g.
        ``server_momentum`` with an exact broadcast, ``scale_block`` without scales).

    """
    if aggregation not in ("vote", "mean"):
        raise ValueError(f"aggregation must be 'vote' or 'mean', got {aggregation!r}")
    upload_kind(upload)  # ValueError naming the choices
    for name, value in (("local_steps", local_steps), ("accumulate", accumulate)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= broadcast_bits <= 8:
        raise ValueError(f"broadcast_bits must be in [0, 8] (0: exact), got {broadcast_bits}")
    for name, value in (("momentum_sync_every", momentum_sync_every), ("buffer_sync_every", buffer_sync_every)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (0: never), got {value}")
    _check_local_optimizer(local_optimizer, local_lr, upload, accumulate)
    if stale_momentum not in ("keep", "decay", "reset"):
        raise ValueError(f"stale_momentum must be 'keep', 'decay' or 'reset', got {stale_momentum!r}")
    if not (math.isfinite(local_proximal_mu) and local_proximal_mu >= 0):
        raise ValueError(f"local_proximal_mu must be finite and >= 0 (0: off), got {local_proximal_mu}")
    if local_proximal_mu and local_steps == 1:
        raise ValueError(f"local_proximal_mu={local_proximal_mu} needs local_steps > 1: one step starts and ends at x")
    if not (math.isfinite(server_momentum) and 0.0 <= server_momentum < 1.0):
        raise ValueError(f"server_momentum must be in [0, 1) (0: off), got {server_momentum}")
    if server_momentum and not broadcast_bits:
        raise ValueError(
            f"server_momentum={server_momentum} needs broadcast_bits >= 1: the momentum step Δ + μ·M "
            "has no exact low-bit form, so it is quantized with error feedback"
        )
    if scale_block < 0:
        raise ValueError(f"scale_block must be >= 0 (0: one scale per tensor), got {scale_block}")
    if scale_block and upload != "ef-sign" and not broadcast_bits:
        raise ValueError(
            f"scale_block={scale_block} needs scales: upload='ef-sign' or broadcast_bits >= 1 "
            f"(got upload={upload!r}, broadcast_bits=0)"
        )
    if upload == "ef-sign" and aggregation == "mean" and broadcast_bits == 0:
        raise ValueError("upload='ef-sign' with aggregation='mean' needs broadcast_bits >= 1 (no exact form)")


def _check_local_optimizer(local_optimizer: str, local_lr: float | None, upload: str, accumulate: int) -> None:
    """Check the local optimizer and its learning rate (``local_lr`` is for "sgd" only)."""
    if local_optimizer not in ("lion", "sgd"):
        raise ValueError(f"local_optimizer must be 'lion' or 'sgd', got {local_optimizer!r}")
    if local_optimizer == "lion" and local_lr is not None:
        raise ValueError(f"local_lr={local_lr} applies to local_optimizer='sgd' only (local Lion steps use lr)")
    if local_optimizer == "sgd":
        if local_lr is None or not (math.isfinite(local_lr) and local_lr > 0):
            raise ValueError(f"local_optimizer='sgd' needs local_lr finite and > 0, got {local_lr}")
        if upload not in ("sign", "ef-sign") or accumulate != 1:
            raise ValueError(
                "local_optimizer='sgd' uploads the sign of one Lion step on the local SGD delta (upload='sign') "
                "or the delta itself as a scaled sign with error feedback (upload='ef-sign'): it needs one of "
                f"them and accumulate=1, got upload={upload!r}, accumulate={accumulate}"
            )


def check_step_and_downlink_arguments(
    *,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    lion_steps: int,
    local_steps: int,
    max_history_bytes: int | None,
    aggregation: str,
    broadcast_bits: int,
    downlink: str,
    lr_schedule: Callable[[int], float] | None,
    anchor_every: int,
) -> None:
    """Check the server's step (rate, decay, betas) and the downlink (history, anchors).

    The keyword arguments are :class:`~flower_dlion.strategies.dlion.DistributedLion`'s of the
    same names, and ``lion_steps``, the number of Lion steps a round counts: ``local_steps``, or
    1 for the local SGD client.

    Raises
    ------
    ValueError
        An argument out of its range (torch.optim's wording for lr, weight_decay and the
        betas), or a downlink that cannot carry this update (the anchored downlink needs
        integer Δs at a constant rate).

    """
    check_common_args(lr=lr, weight_decay=weight_decay, betas={"beta1": beta1, "beta2": beta2})
    if lr * weight_decay * lion_steps >= 1.0:
        raise ValueError(
            f"lr * weight_decay * local_steps must be < 1 (got {lr * weight_decay * lion_steps}): "
            "x would flip sign every round"
        )
    if max_history_bytes is not None and max_history_bytes < 0:
        raise ValueError(f"max_history_bytes must be >= 0 or None, got {max_history_bytes}")
    exact_vote = aggregation == "vote" and broadcast_bits == 0
    if downlink not in ("auto", "anchored", "chain"):
        raise ValueError(f"downlink must be 'auto', 'anchored' or 'chain', got {downlink!r}")
    if lr_schedule is not None and not callable(lr_schedule):
        raise ValueError(f"lr_schedule must be a function of the server round or None, got {lr_schedule!r}")
    if downlink == "anchored" and lr_schedule is not None:
        raise ValueError(
            "downlink='anchored' needs a constant learning rate (x = γ·xₐ − η·C), got an lr_schedule; "
            "use 'chain' or 'auto'"
        )
    if downlink == "anchored" and not exact_vote:
        raise ValueError(
            f"downlink='anchored' needs integer Δs: aggregation='vote' and broadcast_bits=0 "
            f"(got aggregation={aggregation!r}, broadcast_bits={broadcast_bits}); use 'chain' or 'auto'"
        )
    if not 1 <= anchor_every * lion_steps <= 1 << 20:
        raise ValueError(
            f"anchor_every must be >= 1 with anchor_every * local_steps <= 2**20 (the counts' range), "
            f"got {anchor_every} (local_steps={local_steps})"
        )
