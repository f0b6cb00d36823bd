"""The options of :class:`~flower_dlion.strategies.dlion.DistributedLion`, in small groups that check themselves.

:class:`DistributedLion`'s flat keyword arguments (its docstring says what each one is) are kept
in five frozen groups, each named as the strategy's code uses it:

- :class:`StepOptions`: the server's Lion step (rate, schedule, decay, betas);
- :class:`LocalOptions`: what each client does between two uploads (local steps, their optimizer);
- :class:`UplinkOptions`: what a client uploads and how the server makes Δ of the uploads, down
  to Δ's quantization for the broadcast (the options of
  :class:`~flower_dlion.strategies.aggregation.Uplink`);
- :class:`DownlinkOptions`: how a node is brought to x (the options of
  :class:`~flower_dlion.strategies.downlink_messages.Downlink`);
- :class:`SyncOptions`: the momentum and buffer synchronizations.

Each group raises a ``ValueError`` naming the argument, its value and what it needs when it is
built with a value out of its range; :class:`Options` holds the five and checks the combinations
that involve two of them. The strategy reads each option by its argument name
(``strategy.lr`` is ``strategy.options.step.lr``) through :class:`OptionAttribute`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..uploads import upload_kind
from .common import check_common_args

__all__ = [
    "DownlinkOptions",
    "LocalOptions",
    "OptionAttribute",
    "Options",
    "StepOptions",
    "SyncOptions",
    "UplinkOptions",
]


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """The server's Lion step ``x ← x − lr·(Δ + wd·x)`` and Lion's betas, sent to the clients.

    Raises
    ------
    ValueError
        ``lr``, ``weight_decay`` or a beta out of its range (torch.optim's wording), or an
        ``lr_schedule`` that is not a function.

    """

    lr: float = 2e-3
    lr_schedule: Callable[[int], float] | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99

    def __post_init__(self) -> None:
        check_common_args(lr=self.lr, weight_decay=self.weight_decay, betas={"beta1": self.beta1, "beta2": self.beta2})
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise ValueError(f"lr_schedule must be a function of the server round or None, got {self.lr_schedule!r}")


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    """What a client does in a round before it uploads: its local steps and their optimizer.

    Raises
    ------
    ValueError
        A count below 1, an unknown optimizer or momentum policy, a ``local_lr`` missing for
        (or given without) ``local_optimizer="sgd"``, a bad ``local_proximal_mu`` or one
        without local steps. (The "sgd" client's needs of the upload: :class:`Options`.)

    """

    local_steps: int = 1
    local_optimizer: Literal["lion", "sgd"] = "lion"
    local_lr: float | None = None
    local_proximal_mu: float = 0.0
    stale_momentum: Literal["keep", "decay", "reset"] = "keep"
    accumulate: int = 1

    def __post_init__(self) -> None:
        for name, value in (("local_steps", self.local_steps), ("accumulate", self.accumulate)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        optimizer, local_lr = self.local_optimizer, self.local_lr
        if optimizer not in ("lion", "sgd"):
            raise ValueError(f"local_optimizer must be 'lion' or 'sgd', got {optimizer!r}")
        if optimizer == "lion" and local_lr is not None:
            raise ValueError(f"local_lr={local_lr} applies to local_optimizer='sgd' only (local Lion steps use lr)")
        if optimizer == "sgd" and (local_lr is None or not (math.isfinite(local_lr) and local_lr > 0)):
            raise ValueError(f"local_optimizer='sgd' needs local_lr finite and > 0, got {local_lr}")
        if self.stale_momentum not in ("keep", "decay", "reset"):
            raise ValueError(f"stale_momentum must be 'keep', 'decay' or 'reset', got {self.stale_momentum!r}")
        mu = self.local_proximal_mu
        if not (math.isfinite(mu) and mu >= 0):
            raise ValueError(f"local_proximal_mu must be finite and >= 0 (0: off), got {mu}")
        if mu and self.local_steps == 1:
            raise ValueError(f"local_proximal_mu={mu} needs local_steps > 1: one step starts and ends at x")

    @property
    def lion_steps(self) -> int:
        """The Lion steps a round counts (Δ's scale and decay): ``local_steps``, 1 for the "sgd" client."""
        return 1 if self.local_optimizer == "sgd" else self.local_steps


@dataclass(frozen=True, kw_only=True)
class UplinkOptions:
    """What a client uploads and how the server makes Δ of the uploads, quantized for the broadcast.

    Raises
    ------
    ValueError
        An unknown aggregation or upload, ``broadcast_bits`` outside [0, 8], ``server_momentum``
        outside [0, 1) or with an exact broadcast, a negative ``scale_block`` or one without
        scales, or ef-sign uploads averaged into an exact broadcast (it has no exact form).

    """

    aggregation: Literal["vote", "mean"] = "vote"
    upload: Literal["sign", "sum", "ef-sign"] = "sign"
    broadcast_bits: int = 0
    server_momentum: float = 0.0
    scale_block: int = 0

    def __post_init__(self) -> None:
        if self.aggregation not in ("vote", "mean"):
            raise ValueError(f"aggregation must be 'vote' or 'mean', got {self.aggregation!r}")
        upload_kind(self.upload)  # ValueError naming the choices
        bits, momentum, block = self.broadcast_bits, self.server_momentum, self.scale_block
        if not 0 <= bits <= 8:
            raise ValueError(f"broadcast_bits must be in [0, 8] (0: exact), got {bits}")
        if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"server_momentum must be in [0, 1) (0: off), got {momentum}")
        if momentum and not bits:
            raise ValueError(
                f"server_momentum={momentum} needs broadcast_bits >= 1: the momentum step Δ + μ·M "
                "has no exact low-bit form, so it is quantized with error feedback"
            )
        if block < 0:
            raise ValueError(f"scale_block must be >= 0 (0: one scale per tensor), got {block}")
        if block and self.upload != "ef-sign" and not bits:
            raise ValueError(
                f"scale_block={block} needs scales: upload='ef-sign' or broadcast_bits >= 1 "
                f"(got upload={self.upload!r}, broadcast_bits=0)"
            )
        if self.upload == "ef-sign" and self.aggregation == "mean" and bits == 0:
            raise ValueError("upload='ef-sign' with aggregation='mean' needs broadcast_bits >= 1 (no exact form)")

    @property
    def exact_vote(self) -> bool:
        """Whether Δ is K·sign(S) sent exactly: integer levels, as the anchored downlink needs."""
        return self.aggregation == "vote" and self.broadcast_bits == 0


@dataclass(frozen=True, kw_only=True)
class DownlinkOptions:
    """How a node that lacks rounds is brought to x: the anchored or chain downlink, or x₀'s seed.

    Raises
    ------
    ValueError
        An unknown ``downlink`` or a negative ``max_history_bytes``. (What the anchored
        downlink needs of the step and the uplink, and ``anchor_every``'s range, which
        depends on ``local_steps``: :class:`Options`.)

    """

    downlink: Literal["auto", "anchored", "chain"] = "auto"
    anchor_every: int = 200
    max_history_bytes: int | None = None
    init_seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_history_bytes is not None and self.max_history_bytes < 0:
            raise ValueError(f"max_history_bytes must be >= 0 or None, got {self.max_history_bytes}")
        if self.downlink not in ("auto", "anchored", "chain"):
            raise ValueError(f"downlink must be 'auto', 'anchored' or 'chain', got {self.downlink!r}")


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """Every how many rounds the clients' momenta (which of them) and buffers are synchronized.

    ``momentum_sync_layers`` is kept as a tuple, whatever sequence of names it is given as.

    Raises
    ------
    ValueError
        A negative period (0: never).

    """

    momentum_sync_every: int = 0
    momentum_sync_layers: tuple[str, ...] = ()
    buffer_sync_every: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "momentum_sync_layers", tuple(self.momentum_sync_layers))
        for name, value in (
            ("momentum_sync_every", self.momentum_sync_every),
            ("buffer_sync_every", self.buffer_sync_every),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: never), got {value}")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The five groups of options, and the checks that combine two of them.

    Raises
    ------
    ValueError
        The "sgd" client with an upload it cannot make, a decay that flips x's sign
        (``lr · weight_decay · local_steps`` ≥ 1), the anchored downlink with a scheduled rate or
        with Δs that are not integers, or ``anchor_every`` out of the anchored counts' range.

    """

    step: StepOptions = StepOptions()
    local: LocalOptions = LocalOptions()
    uplink: UplinkOptions = UplinkOptions()
    downlink: DownlinkOptions = DownlinkOptions()
    sync: SyncOptions = SyncOptions()

    def __post_init__(self) -> None:
        local, uplink, step, downlink = self.local, self.uplink, self.step, self.downlink
        if local.local_optimizer == "sgd" and (uplink.upload not in ("sign", "ef-sign") or local.accumulate != 1):
            raise ValueError(
                "local_optimizer='sgd' uploads the sign of one Lion step on the local SGD delta (upload='sign') "
                "or the delta itself as a scaled sign with error feedback (upload='ef-sign'): it needs one of "
                f"them and accumulate=1, got upload={uplink.upload!r}, accumulate={local.accumulate}"
            )
        decay = step.lr * step.weight_decay * local.lion_steps
        if decay >= 1.0:
            raise ValueError(
                f"lr * weight_decay * local_steps must be < 1 (got {decay}): x would flip sign every round"
            )
        if downlink.downlink == "anchored" and step.lr_schedule is not None:
            raise ValueError(
                "downlink='anchored' needs a constant learning rate (x = γ·xₐ − η·C), got an lr_schedule; "
                "use 'chain' or 'auto'"
            )
        if downlink.downlink == "anchored" and not uplink.exact_vote:
            raise ValueError(
                f"downlink='anchored' needs integer Δs: aggregation='vote' and broadcast_bits=0 "
                f"(got aggregation={uplink.aggregation!r}, broadcast_bits={uplink.broadcast_bits}); "
                "use 'chain' or 'auto'"
            )
        if not 1 <= downlink.anchor_every * local.lion_steps <= 1 << 20:
            raise ValueError(
                f"anchor_every must be >= 1 with anchor_every * local_steps <= 2**20 (the counts' range), "
                f"got {downlink.anchor_every} (local_steps={local.local_steps})"
            )

    @property
    def anchored(self) -> bool:
        """Whether the downlink is anchored: asked for, or "auto" with integer Δs at a constant rate."""
        if self.downlink.downlink == "auto":
            return self.uplink.exact_vote and self.step.lr_schedule is None
        return self.downlink.downlink == "anchored"


class OptionAttribute:
    """A read-only attribute of the strategy: the field of the same name in one group of its ``options``.

    ``lr = OptionAttribute("step")`` in a class body makes ``obj.lr`` read ``obj.options.step.lr``;
    setting it raises ``AttributeError`` (the options are checked together: build a new strategy).

    Parameters
    ----------
    group : str
        The :class:`Options` field that holds the option.

    """

    def __init__(self, group: str) -> None:
        self.group = group
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj.options, self.group), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only (options.{self.group}.{self.name}): build a new strategy")
