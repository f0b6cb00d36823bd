"""The options of :class:`~flower_dlion.strategies.dlion.DistributedLion`, in small groups that check themselves.

:class:`DistributedLion`'s flat keyword arguments (its docstring says what each one is) are kept
in seven frozen groups, each named as the strategy's code uses it:

- :class:`StepOptions`: the server's Lion step (rate, schedule, decay, betas);
- :class:`LocalOptions`: what each client does between two uploads (local steps, their optimizer);
- :class:`UplinkOptions`: what a client uploads and how the server makes Δ of the uploads, down
  to Δ's quantization for the broadcast (the options of
  :class:`~flower_dlion.strategies.uplink.Uplink`);
- :class:`DownlinkOptions`: how a node is brought to x (the options of
  :class:`~flower_dlion.strategies.downlink.Downlink`);
- :class:`SyncOptions`: the momentum and buffer synchronizations;
- :class:`SecureOptions`: secure aggregation of the signs (:mod:`flower_dlion.secure`);
- :class:`~.divergence.DivergenceOptions`: the divergence watch (:mod:`~.divergence`).

Each group raises a ``ValueError`` naming the argument, its value and what it needs when it is
built with a value out of its range; :class:`Options` holds the seven and checks the combinations
that involve two of them. The library reads an option from its group (``self.options.step.lr``);
the strategy offers each one to its users by its argument name, read-only (``strategy.lr`` is
``strategy.options.step.lr``), through :class:`OptionAttribute`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..drift import DRIFT_KINDS, check_drift
from ..lion import MAX_DECAY, check_hyperparameters
from ..secure.masking import MIN_PARTICIPANTS
from ..stochastic import NOISE_KINDS, NOISE_LIMIT
from ..uploads import upload_kind
from .divergence import DivergenceOptions
from .option_attribute import OptionAttribute

__all__ = [
    "DownlinkOptions",
    "LocalOptions",
    "OptionAttribute",
    "Options",
    "SecureOptions",
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
        check_hyperparameters(
            lr=self.lr, weight_decay=self.weight_decay, betas={"beta1": self.beta1, "beta2": self.beta2}
        )
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise ValueError(f"lr_schedule must be a function of the server round or None, got {self.lr_schedule!r}")

    def lr_at(self, server_round: int) -> float:
        """The learning rate of ``server_round``: ``lr · lr_schedule(server_round)``.

        Raises
        ------
        ValueError
            The schedule's factor for that round is not a number in [0, 1].

        """
        if self.lr_schedule is None:
            return self.lr
        factor = self.lr_schedule(server_round)
        try:
            value = float(factor)
        except (TypeError, ValueError):
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"lr_schedule({server_round}) must be a number in [0, 1] (a factor of lr), got {factor!r}")
        return self.lr * value


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    """What a client does in a round before it uploads: its local steps and their optimizer.

    Raises
    ------
    ValueError
        A count below 1, an unknown optimizer or momentum policy, a ``local_lr`` missing for
        (or given without) ``local_optimizer="sgd"``, a bad ``local_proximal_mu`` or one
        without local steps, an unknown ``drift_correction``. (The "sgd" client's needs of the upload,
        and drift correction's: :class:`Options`.)

    """

    local_steps: int = 1
    local_optimizer: Literal["lion", "sgd"] = "lion"
    local_lr: float | None = None
    local_proximal_mu: float = 0.0
    stale_momentum: Literal["keep", "decay", "reset"] = "keep"
    drift_correction: Literal["off", "scaffold"] = "off"
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
        if self.drift_correction not in DRIFT_KINDS:
            raise ValueError(f"drift_correction must be one of {DRIFT_KINDS}, got {self.drift_correction!r}")

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
        scales, ef-sign uploads averaged into an exact broadcast (it has no exact form), or a
        ``sign_noise`` outside [0, 100], of an unknown kind, or with the sum upload.

    """

    aggregation: Literal["vote", "mean"] = "vote"
    upload: Literal["sign", "sum", "ef-sign"] = "sign"
    broadcast_bits: int = 0
    server_momentum: float = 0.0
    scale_block: int = 0
    sign_noise: float = 0.0
    sign_noise_kind: Literal["uniform", "gaussian"] = "uniform"

    def __post_init__(self) -> None:
        self._check_noise()
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

    def _check_noise(self) -> None:
        """τ in [0, 100] for the signs (of the Lion steps or the ef-sign upload), a known noise kind."""
        tau, kind = self.sign_noise, self.sign_noise_kind
        if not (math.isfinite(tau) and 0.0 <= tau <= NOISE_LIMIT):
            raise ValueError(f"sign_noise must be in [0, {NOISE_LIMIT:g}] (0: deterministic signs), got {tau}")
        if kind not in NOISE_KINDS:
            raise ValueError(f"sign_noise_kind must be one of {NOISE_KINDS}, got {kind!r}")
        if tau and self.upload == "sum":
            raise ValueError(f"sign_noise={tau} perturbs signs: upload='sign' or 'ef-sign', got upload='sum'")

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

    def momentum_round(self, server_round: int) -> bool:
        """Whether the clients upload their momenta in ``server_round`` (every ``momentum_sync_every``)."""
        return bool(self.momentum_sync_every) and server_round % self.momentum_sync_every == 0

    def buffer_round(self, server_round: int, last_round: int) -> bool:
        """Whether clients with buffers upload them in ``server_round``: round 1, every R-th and the last."""
        every = self.buffer_sync_every
        return bool(every) and (server_round == 1 or server_round % every == 0 or server_round == last_round)


@dataclass(frozen=True, kw_only=True)
class SecureOptions:
    """Secure aggregation: clients upload their signs under pairwise masks; the server sees only the counts.

    Raises
    ------
    ValueError
        A negative ``secure_degree``. (What secure
        aggregation needs of the upload and the synchronizations: :class:`Options`.)

    """

    secure: bool = False
    secure_degree: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.secure, bool):
            raise ValueError(f"secure must be True or False, got {self.secure!r}")
        if self.secure_degree < 0:
            raise ValueError(f"secure_degree must be >= 0 (0: every other participant), got {self.secure_degree}")

    def sampling(self, min_train_nodes: int | None, min_available_nodes: int | None) -> tuple[int, int]:
        """The two node counts, None meaning 2 (3 with ``secure``); refuses a secure run that may sample 2."""
        least = MIN_PARTICIPANTS if self.secure else 2
        min_train_nodes = least if min_train_nodes is None else min_train_nodes
        if self.secure and min_train_nodes < MIN_PARTICIPANTS:
            raise ValueError(
                f"secure=True needs min_train_nodes >= {MIN_PARTICIPANTS} (a masked round of two would show each "
                f"client the other's signs), got {min_train_nodes}"
            )
        return min_train_nodes, least if min_available_nodes is None else min_available_nodes


@dataclass(frozen=True, kw_only=True)
class Options:
    """The seven groups of options, and the checks that combine two of them.

    Raises
    ------
    ValueError
        The "sgd" client with an upload it cannot make, drift correction outside the 1-bit SGD
        mode or with the server's momentum (:func:`flower_dlion.drift.check_drift`), a decay that flips x's sign
        (``lr · weight_decay · local_steps`` ≥ 1), the anchored downlink with a scheduled rate or
        with Δs that are not integers, ``anchor_every`` out of the anchored counts' range, or
        secure aggregation of anything but 1-bit signs into an exact Δ, or with momentum sync.

    """

    step: StepOptions = StepOptions()
    local: LocalOptions = LocalOptions()
    uplink: UplinkOptions = UplinkOptions()
    downlink: DownlinkOptions = DownlinkOptions()
    sync: SyncOptions = SyncOptions()
    secure: SecureOptions = SecureOptions()
    divergence: DivergenceOptions = field(default_factory=DivergenceOptions)  # frozen, defined in .divergence

    def __post_init__(self) -> None:
        local, uplink, step, downlink = self.local, self.uplink, self.step, self.downlink
        if local.local_optimizer == "sgd" and (uplink.upload not in ("sign", "ef-sign") or local.accumulate != 1):
            raise ValueError(
                "local_optimizer='sgd' uploads the sign of one Lion step on the local SGD delta (upload='sign') "
                "or the delta itself as a scaled sign with error feedback (upload='ef-sign'): it needs one of "
                f"them and accumulate=1, got upload={uplink.upload!r}, accumulate={local.accumulate}"
            )
        check_drift(local.drift_correction, local_optimizer=local.local_optimizer, upload=uplink.upload,
                    aggregation=uplink.aggregation, broadcast_bits=uplink.broadcast_bits,
                    server_momentum=uplink.server_momentum)  # fmt: skip
        decay = step.lr * step.weight_decay * local.lion_steps
        if decay > MAX_DECAY:
            raise ValueError(
                f"lr * weight_decay * local_steps must be <= {MAX_DECAY} (got {decay}): x would lose more than "
                "half of itself every round"
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
        if self.secure.secure:
            self._check_secure()

    def _check_secure(self) -> None:
        """Secure aggregation masks 1-bit signs and unmasks their counts: an exact Δ, no float uploads."""
        uplink, sync = self.uplink, self.sync
        if uplink.upload != "sign" or uplink.broadcast_bits:
            raise ValueError(
                "secure=True masks the 1-bit sign upload and broadcasts the exact Δ of its counts: it needs "
                f"upload='sign' and broadcast_bits=0, got upload={uplink.upload!r}, "
                f"broadcast_bits={uplink.broadcast_bits}"
            )
        if sync.momentum_sync_every:
            raise ValueError(
                f"secure=True uploads nothing but masked signs: momentum_sync_every={sync.momentum_sync_every} "
                "would send each client's float32 momentum in the clear; use 0"
            )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> Options:
        """The seven groups from a constructor's keyword arguments: each group takes the fields it names.

        ``DistributedLion.__init__`` passes its ``locals()``; arguments no group names (the sampling
        ones) are left to the caller.
        """
        groups = {"step": StepOptions, "local": LocalOptions, "uplink": UplinkOptions,
                  "downlink": DownlinkOptions, "sync": SyncOptions, "secure": SecureOptions,
                  "divergence": DivergenceOptions}  # fmt: skip
        return cls(
            **{name: group(**{f.name: arguments[f.name] for f in fields(group)}) for name, group in groups.items()}
        )

    @property
    def anchored(self) -> bool:
        """Whether the downlink is anchored: asked for, or "auto" with integer Δs at a constant rate."""
        if self.downlink.downlink == "auto":
            return self.uplink.exact_vote and self.step.lr_schedule is None
        return self.downlink.downlink == "anchored"

    def describe(self) -> list[str]:
        """The lines the strategy's ``summary()`` logs: every option, the groups left at their defaults skipped."""
        step, local, up, down, sync = self.step, self.local, self.uplink, self.downlink, self.sync
        scheduled = " (scheduled)" if step.lr_schedule is not None else ""
        lines = [
            f"Distributed Lion: aggregation={up.aggregation}",
            f"lr={step.lr:g}{scheduled} | weight_decay={step.weight_decay:g} | beta1={step.beta1:g} | "
            f"beta2={step.beta2:g}",
        ]
        if local.local_steps > 1 or local.accumulate > 1 or up.upload != "sign":
            lines.append(
                f"local_steps={local.local_steps} ({local.local_optimizer}) | accumulate={local.accumulate} | "
                f"upload={up.upload}{'' if local.drift_correction == 'off' else ' | drift=' + local.drift_correction}"
            )
        if up.broadcast_bits or sync.momentum_sync_every or down.init_seed is not None:
            layers = ",".join(sync.momentum_sync_layers) or "all"
            lines.append(
                f"broadcast_bits={up.broadcast_bits} | scale_block={up.scale_block} | "
                f"server_momentum={up.server_momentum:g} | momentum_sync_every={sync.momentum_sync_every} "
                f"(layers {layers}) | init_seed={down.init_seed}"
            )
        anchored = f"anchored (anchor every {down.anchor_every} rounds)" if self.anchored else "chain"
        if up.sign_noise:
            lines.append(f"stochastic signs: sign_noise={up.sign_noise:g} ({up.sign_noise_kind})")
        if self.secure.secure:
            sec = self.secure
            lines.append(f"secure aggregation: degree={sec.secure_degree}")
        return [*lines, *self.divergence.describe(), f"downlink={anchored}"]
