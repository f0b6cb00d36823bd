"""Distributed Lion as a Flower strategy: bit-packed client signs in, a packed Δ out."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Literal

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .. import codec, entropy, lion, quantizers
from ..bounds import median_momentum, robust_buffers
from ..downlink import AnchoredHistory, Segment, levels_to_signs
from ..params import LayoutError, ModelSpec, layer_mask, layout_fingerprint, state_checksum
from ..protocol import (
    BROADCAST,
    CLIENT_STATE_ERROR,
    CODED_STYPE,
    CONFIG,
    LEVELS_STYPE,
    METRICS,
    MOMENTUM,
    OPTIONAL_REPLY_METRICS,
    REPLY_METRICS,
    REST,
    SEED_MISMATCH,
    UPLOAD,
    USER_CONFIG,
    RejectedReply,
    check_envelope,
    checksum,
    float_array,
    message_bytes,
    read_metrics,
    to_array,
)
from ..uploads import Parsed, Shape, upload_kind
from .common import CheckedReplies, ServerModelStrategy, check_common_args

__all__ = ["DistributedLion", "RejectedReply"]

COIN_FLIP_WARNING = 0.05  # warn once when more than this share of the uploaded signs are coin flips


@dataclass
class _Broadcast:
    """One applied Δ, kept encoded so that lagging clients can replay it."""

    version: int  # x's version after applying it
    num_levels: int
    lr: float
    weight_decay: float
    payload: bytes
    scales: tuple[float, ...] | None = None  # one per tensor; None: scale 1


@dataclass
class ServerState:
    """What the server keeps between rounds besides x, and all a checkpoint needs of it.

    ``to_dict`` / ``from_dict`` are the checkpoint's conversion (torch-saveable values only).
    """

    version: int = 0  # Δs applied to x since the start
    broadcasts: deque[_Broadcast] = field(default_factory=deque)  # the last Δs, encoded, for lagging clients
    version_of: dict[int, int] = field(default_factory=dict)  # partition → its replica's version (last valid reply)
    server_error: torch.Tensor | None = None  # error feedback of a quantized broadcast
    outer_momentum: torch.Tensor | None = None  # M of the server's Nesterov momentum on Δ (server_momentum > 0)
    synced_momentum: torch.Tensor | None = None  # the median of the last sync round's momenta, to send next
    seed_failed: set[int] = field(default_factory=set)  # partitions whose x₀ from the seed did not match
    x0_checksum: int = 0  # of x₀ and the rest of the model, for clients that build x₀ from the seed
    anchored: AnchoredHistory | None = None  # the anchored downlink's anchor, counts and kept history
    context_of: dict[int, int] = field(default_factory=dict)  # partition → version whose last two Δs it holds

    def to_dict(self) -> dict[str, Any]:
        """The state as plain values (copies)."""
        return {
            "version": self.version,
            "broadcasts": [vars(b).copy() for b in self.broadcasts],
            "version_of": dict(self.version_of),
            "server_error": None if self.server_error is None else self.server_error.clone(),
            "outer_momentum": None if self.outer_momentum is None else self.outer_momentum.clone(),
            "synced_momentum": None if self.synced_momentum is None else self.synced_momentum.clone(),
            "seed_failed": sorted(self.seed_failed),
            "x0_checksum": self.x0_checksum,
            "anchored": None if self.anchored is None else self.anchored.to_dict(),
            "context_of": dict(self.context_of),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> ServerState:
        """Inverse of :meth:`to_dict`."""
        return cls(
            version=int(state["version"]),
            broadcasts=deque(_Broadcast(**b) for b in state["broadcasts"]),
            version_of={int(p): int(v) for p, v in state["version_of"].items()},
            server_error=state["server_error"],
            outer_momentum=state.get("outer_momentum"),  # absent from checkpoints before it existed
            synced_momentum=state["synced_momentum"],
            seed_failed=set(state["seed_failed"]),
            x0_checksum=int(state["x0_checksum"]),
            anchored=None if state["anchored"] is None else AnchoredHistory.from_dict(state["anchored"]),
            context_of={int(p): int(v) for p, v in state["context_of"].items()},
        )


@dataclass
class _Reply:
    """One validated client reply."""

    node_id: int
    upload: Parsed  # its U: the packed signs or encoded levels as received (decoded levels, scales)
    momentum: torch.Tensor | None  # momentum-sync round: the client's momentum of the synced layers
    buffers: torch.Tensor | None  # buffer round: the client's buffers, flat float32
    values: dict[str, float]


@dataclass
class _Round:
    """What the strategy sent in the round in progress."""

    server_round: int
    base_version: int
    base_checksum: int
    sent: dict[int, str] = field(default_factory=dict)  # node id → kind sent
    seeded: set[int] = field(default_factory=set)  # nodes told to build x₀ from the seed
    chain_lengths: dict[int, int] = field(default_factory=dict)  # node id → number of Δs sent
    momentum_sync: bool = False  # clients upload their momentum this round
    buffer_sync: bool = False  # clients upload their buffers this round
    bytes_down: int = 0
    bytes_down_fp32: int = 0
    lr: float = 0.0  # the round's learning rate, lr · lr_schedule(server_round)


class DistributedLion(ServerModelStrategy):
    r"""Distributed Lion (Liu et al., 2024) on Flower's Message API.

    Each sampled client keeps its own replica of x and its own Lion momentum, and
    replies with its Lion direction packed to one bit per parameter. The strategy sums
    the signs, aggregates them, applies the update to the global model it keeps, and
    broadcasts the packed update in the next round::

        S = Σᵢ δᵢ,   Δ = sign(S) (vote) or S / n (mean),   x ← x − lr·(Δ + wd·x)

    In-sync clients receive only the packed Δ of the rounds they missed (1 bit per
    parameter for a vote between an odd number of clients, 1.6 bits with possible ties,
    ⌈log₂(n+1)⌉ bits for the mean); new or lost clients receive the full model (or, with
    ``init_seed``, the seed of x₀ and the Δs since).

    Used as Flower's ``FedAvg`` is: ``strategy.start(grid, ArrayRecord(model.state_dict()),
    num_rounds, evaluate_fn=...)``, with :class:`~flower_dlion.DLionClient` on the nodes. Each
    node describes its model in its hello; x is the trainable parameters, the rest of the
    state_dict (frozen parameters, buffers) is handled as :mod:`flower_dlion.params` says.

    Beyond the paper (each off by default): K ``local_steps`` per round, where client i
    uploads Uᵢ = Σₖ δₖ as its sign, as the integer (``upload="sum"``, FedLion) or as a
    scaled sign with error feedback (``"ef-sign"``); the server then applies, in steps::

        vote: Δ = K·sign(Σᵢ Uᵢ)      mean: Δ = Σᵢ Uᵢ / n      x ← x − lr·(Δ + K·wd·x)

    and broadcasts Δ exactly as levels (``broadcast_bits=0``) or quantized to p bits with
    server-side error feedback (``broadcast_bits=p``; p = 1: scaled sign). Momenta can be
    synchronized every ``momentum_sync_every`` rounds (Lion Cub).

    Bounded influence: where clients send floats they choose, the server combines them by
    medians (:mod:`flower_dlion.bounds`): ef-sign scales are cut to the round's lower median per
    tensor (``s'ᵢⱼ = min(sᵢⱼ, medianᵢ sᵢⱼ)``), the synced momentum is the coordinate-wise
    median, and so are the buffers. Fewer than half of the clients cannot pull any of them outside
    the honest clients' range, whatever they send.

    Parameters
    ----------
    aggregation : {"vote", "mean"} (default: "vote")
        Majority vote (``sign(S)``, 0 on a tie) or mean (``S / n``) of the client signs.
    lr : float (default: 5e-4)
        Learning rate, applied on the server and on every replica.
    lr_schedule : callable (int -> float) | None (default: None)
        The factor of ``lr`` in each server round t: the round's rate is ``lr · lr_schedule(t)``
        for its local Lion steps and its Δ (each Δ is sent with its rate, so a client catching
        up applies every Δ at its own). Factors must lie in [0, 1]; they are checked for every
        round of ``start`` before round 1. E.g. :func:`flower_dlion.lion.cosine_decay`.
        ``None``: the constant ``lr``. The anchored downlink needs a constant rate ("auto"
        then uses the chain).
    weight_decay : float (default: 0.1)
        Decoupled weight decay ``wd`` in ``x ← x − lr·(Δ + wd·x)``.
    beta1 : float (default: 0.9)
        Lion's interpolation factor for the direction, sent to the clients.
    beta2 : float (default: 0.99)
        Lion's momentum decay, sent to the clients.
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled each round.
    fraction_evaluate : float (default: 0.0)
        Fraction of nodes sent Flower's own evaluate message after each round (the full
        float32 model: your ``@app.evaluate()`` handler works unchanged, at 32 bits per
        parameter); 0: evaluation on the server only (``evaluate_fn``).
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled each round.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes evaluated, with ``fraction_evaluate`` > 0.
    min_available_nodes : int (default: 2)
        Wait until this many nodes are connected before sampling (1 for a one-node federation).
    min_replies : int (default: 1)
        A round with fewer valid replies applies no update.
    max_history_bytes : int | None (default: None)
        Bytes of past encoded Δs (and, anchored, counts) kept for clients that missed rounds;
        ``None``: the size of the full model for a chain (a longer chain is never cheaper than
        the model), 8 times it for the anchored downlink.
    local_steps : int (default: 1)
        K, the local steps each client takes on its own copy of x per round.
    local_optimizer : {"lion", "sgd"} (default: "lion")
        "lion": the K local steps are Lion steps at ``lr`` (FedLion's client). "sgd": K plain
        SGD steps at ``local_lr`` give the client's model change g = x − x_K, and the client
        uploads the sign of one Lion step on it, δ = sign(β₁·m + (1−β₁)·g), m ← β₂·m + (1−β₂)·g
        (FedSMU's client, Lu et al., ICML 2025); the server then counts one step per round
        (``x ← x − lr·(Δ + wd·x)``). Needs ``upload="sign"`` and ``accumulate=1``.
    local_lr : float | None (default: None)
        The local SGD learning rate of ``local_optimizer="sgd"`` (required there, refused with "lion").
    stale_momentum : {"keep", "decay", "reset"} (default: "keep")
        What a client that missed k rounds does with its Lion momentum when it is sampled again:
        keeps it, decays it as k rounds without gradients would (m ← β₂ᵏ·m), or resets it to 0.
    local_proximal_mu : float (default: 0.0)
        Drift control for skewed data: each local step's gradient gains μ·(x_local − x), pulling
        the client's copy back toward the round's x (FedProx's term, inside the local Lion or SGD
        steps). Needs ``local_steps`` > 1; 0 turns it off.
    accumulate : int (default: 1)
        Minibatches averaged into each local gradient.
    upload : {"sign", "sum", "ef-sign"} (default: "sign")
        What a client sends for U = Σₖ δₖ: sign(U) (1 bit), U itself (⌈log₂(2K+1)⌉ bits),
        or a scaled sign of U + e with one float32 scale per tensor and error feedback e.
    broadcast_bits : int (default: 0)
        0: broadcast Δ exactly as levels. p ≥ 1: quantize Δ + e to 2 (p = 1, scaled sign)
        or 2ᵖ − 1 levels with one scale per tensor, keeping the error e on the server.
    scale_block : int (default: 0)
        B > 0: the ef-sign upload and the quantized broadcast carry one float32 scale per block
        of B values of each tensor (Lion Cub's per-block scales, Ishikawa et al., 2024; the
        last block of a tensor is shorter) instead of one per tensor: 4 bytes per B values
        more. Needs ``upload="ef-sign"`` or ``broadcast_bits`` ≥ 1.
    server_momentum : float (default: 0.0)
        μ of a Nesterov momentum on the aggregated update before it is quantized for the
        broadcast (DiLoCo's outer optimizer, Douillard et al., 2023): ``M ← μ·M + Δ``, and the
        server broadcasts and applies ``Δ + μ·M``, quantized with error feedback. In a steady
        direction the step grows toward 1/(1−μ) times Δ: lower ``lr`` to match. 0 turns it off;
        needs ``broadcast_bits`` ≥ 1 (a momentum step has no exact low-bit form).
    momentum_sync_every : int (default: 0)
        Every R rounds, clients also upload their momentum (float32) and the next round
        sends them the coordinate-wise median; 0 never does.
    momentum_sync_layers : sequence of str (default: ())
        Parameter-name prefixes of the momenta to synchronize; empty means all.
    buffer_sync_every : int (default: 10)
        In round 1, every R-th round and the last round of ``start``, clients with buffers
        (BatchNorm statistics) upload them (float32) and the server's copy becomes their
        coordinate-wise median (``bounds.robust_buffers``); clients keep their own (FedBN).
        0 never does (the server keeps the initial buffers).
    init_seed : int | None (default: None)
        When the initial model is the clients' ``model_fn()`` built after
        ``torch.manual_seed(init_seed)``, a new node is sent the seed (and a checksum) instead
        of the full model.
    sample_seed : int (default: 0)
        Seed of the partition sampling (round t samples with ``default_rng([seed, t])``),
        also sent to the clients (their batch order and coin flips).
    state_key : str (default: "")
        The run's identity for clients that keep their state in files (run config
        ``client-state-dir``); kept in checkpoints so that a resumed run finds the files.
        "" sends nothing (state in ``context.state`` only).
    downlink : {"auto", "anchored", "chain"} (default: "auto")
        What a client that is behind receives. "anchored" (:mod:`flower_dlion.downlink`):
        x = γ·xₐ − η·C from an anchor xₐ and the integer counts C = Σ Δ since it, so a client k
        rounds behind gets C_now − C_have entropy-coded (about log₂ √k bits a value; the decay of
        an epoch's Δs comes at its end), and the per-round Δ is coded with the two before it as
        context. Needs a vote with exact broadcast. "chain": the missed Δs one by one
        (k·1.6 bits), applying the decay each round. "auto": anchored where it applies.
    anchor_every : int (default: 200)
        Rounds between anchors (``xₐ ← x``, C ← 0) of the anchored downlink.

    Notes
    -----
    Faults: a node without a valid reply (no answer, an error, a malformed reply) keeps
    its last confirmed version and is sent the Δs since then (it skips those it already
    applied); a replica checksum or version mismatch, or a node that lost its state,
    gets the full model (counted in ``checksum-mismatches`` / ``state-resets``).

    Examples
    --------
    >>> strategy = DistributedLion(aggregation="vote", lr=5e-4, weight_decay=0.1)
    >>> result = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=100)

    References
    ----------
    B. Liu et al., "Communication Efficient Distributed Training with Distributed Lion",
    arXiv:2404.00438, 2024.

    """

    def __init__(
        self,
        *,
        aggregation: Literal["vote", "mean"] = "vote",
        lr: float = 5e-4,
        lr_schedule: Callable[[int], float] | None = None,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.99,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        min_replies: int = 1,
        max_history_bytes: int | None = None,
        local_steps: int = 1,
        local_optimizer: Literal["lion", "sgd"] = "lion",
        local_lr: float | None = None,
        local_proximal_mu: float = 0.0,
        stale_momentum: Literal["keep", "decay", "reset"] = "keep",
        accumulate: int = 1,
        upload: Literal["sign", "sum", "ef-sign"] = "sign",
        broadcast_bits: int = 0,
        scale_block: int = 0,
        server_momentum: float = 0.0,
        momentum_sync_every: int = 0,
        momentum_sync_layers: Sequence[str] = (),
        buffer_sync_every: int = 10,
        init_seed: int | None = None,
        sample_seed: int = 0,
        state_key: str = "",
        downlink: Literal["auto", "anchored", "chain"] = "auto",
        anchor_every: int = 200,
    ) -> None:
        if aggregation not in ("vote", "mean"):
            raise ValueError(f"aggregation must be 'vote' or 'mean', got {aggregation!r}")
        kind = upload_kind(upload)  # ValueError naming the choices
        for name, value in (("local_steps", local_steps), ("accumulate", accumulate)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= broadcast_bits <= 8:
            raise ValueError(f"broadcast_bits must be in [0, 8] (0: exact), got {broadcast_bits}")
        for name, value in (("momentum_sync_every", momentum_sync_every), ("buffer_sync_every", buffer_sync_every)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: never), got {value}")
        if local_optimizer not in ("lion", "sgd"):
            raise ValueError(f"local_optimizer must be 'lion' or 'sgd', got {local_optimizer!r}")
        if local_optimizer == "lion" and local_lr is not None:
            raise ValueError(f"local_lr={local_lr} applies to local_optimizer='sgd' only (local Lion steps use lr)")
        if local_optimizer == "sgd":
            if local_lr is None or not (math.isfinite(local_lr) and local_lr > 0):
                raise ValueError(f"local_optimizer='sgd' needs local_lr finite and > 0, got {local_lr}")
            if upload != "sign" or accumulate != 1:
                raise ValueError(
                    "local_optimizer='sgd' uploads the sign of one Lion step on the local SGD delta: it needs "
                    f"upload='sign' and accumulate=1, got upload={upload!r}, accumulate={accumulate}"
                )
        lion_steps = 1 if local_optimizer == "sgd" else local_steps  # Lion steps a round counts
        if stale_momentum not in ("keep", "decay", "reset"):
            raise ValueError(f"stale_momentum must be 'keep', 'decay' or 'reset', got {stale_momentum!r}")
        if not (math.isfinite(local_proximal_mu) and local_proximal_mu >= 0):
            raise ValueError(f"local_proximal_mu must be finite and >= 0 (0: off), got {local_proximal_mu}")
        if local_proximal_mu and local_steps == 1:
            raise ValueError(
                f"local_proximal_mu={local_proximal_mu} needs local_steps > 1: one step starts and ends at x"
            )
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
        super().__init__(
            fraction_train=fraction_train,
            min_train_nodes=min_train_nodes,
            min_available_nodes=min_available_nodes,
            min_replies=min_replies,
            sample_seed=sample_seed,
            fraction_evaluate=fraction_evaluate,
            min_evaluate_nodes=min_evaluate_nodes,
        )
        check_common_args(
            lr=lr,
            weight_decay=weight_decay,
            betas={"beta1": beta1, "beta2": beta2},
        )
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
        self.aggregation = aggregation
        self.lr = lr
        self.lr_schedule = lr_schedule
        self.weight_decay = weight_decay
        self.beta1 = beta1
        self.beta2 = beta2
        self.max_history_bytes = max_history_bytes
        self.local_steps = local_steps
        self.local_optimizer = local_optimizer
        self.local_lr = local_lr
        self.local_proximal_mu = local_proximal_mu
        self.stale_momentum = stale_momentum
        self._lion_steps = lion_steps  # K for local Lion steps, 1 for the sgd client: Δ's scale and decay
        self.accumulate = accumulate
        self.upload = upload
        self._kind = kind
        self.broadcast_bits = broadcast_bits
        self.scale_block = scale_block
        self.server_momentum = server_momentum
        self.momentum_sync_every = momentum_sync_every
        self.momentum_sync_layers = tuple(momentum_sync_layers)
        self.buffer_sync_every = buffer_sync_every
        self.init_seed = init_seed
        self.state_key = state_key
        self.anchored = downlink == "anchored" or (downlink == "auto" and exact_vote and lr_schedule is None)
        self.anchor_every = anchor_every
        self.checkpoint_round = 0  # the latest checkpoint's round (clients keep their state as of it)

        # Global model and its bookkeeping, set from the initial arrays in round 1.
        self.state = ServerState()
        self._round: _Round | None = None
        self._mask: torch.Tensor | None = None  # parameters whose momentum is synchronized
        self._state_resets = 0  # nodes found without their state since the last round
        self._resyncs = 0  # replies of the round in progress that showed a replica checksum/version mismatch
        self._initial: dict[str, np.ndarray] | None = None  # the initial arrays, until x is made from them
        self._described: ModelSpec | None = None  # the model description the first valid hello gave
        self._told_flips = False  # the coin-flip warning was logged
        self._clipped = 0  # ef-sign scales cut to the median in the round in progress
        self.history: list[dict[str, Any]] = []  # one dict of metrics per aggregated round

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

    def start(  # type: ignore[override]
        self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args: Any, **kwargs: Any
    ) -> Result:
        """Check the schedule's factor for every round of the run, then run Flower's round loop."""
        for server_round in range(kwargs.get("start_round", 1), num_rounds + 1):
            self.lr_at(server_round)  # a bad factor fails before round 1
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    @property
    def _shape(self) -> Shape:
        """The model's size and K, as the upload kinds take them."""
        return Shape(self.num_parameters, self._scale_sizes, self._lion_steps)

    @property
    def _scale_sizes(self) -> list[int]:
        """The number of values under each scale of an upload or a broadcast (``scale_block``)."""
        return quantizers.scale_blocks(self.sizes, self.scale_block)

    @property
    def version(self) -> int:
        """The number of Δs applied to x since the start."""
        return self.state.version

    # ------------------------------------------------------------------ summary
    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> Distributed Lion: aggregation=%s", self.aggregation)
        log(
            INFO,
            "\t│\t└──lr=%g%s | weight_decay=%g | beta1=%g | beta2=%g",
            self.lr,
            " (scheduled)" if self.lr_schedule is not None else "",
            self.weight_decay,
            self.beta1,
            self.beta2,
        )
        if self.local_steps > 1 or self.accumulate > 1 or self.upload != "sign":
            log(
                INFO,
                "\t│\t└──local_steps=%d (%s) | accumulate=%d | upload=%s",
                self.local_steps,
                self.local_optimizer,
                self.accumulate,
                self.upload,
            )
        if self.broadcast_bits or self.momentum_sync_every or self.init_seed is not None:
            log(
                INFO,
                "\t│\t└──broadcast_bits=%d | scale_block=%d | server_momentum=%g | momentum_sync_every=%d "
                "(layers %s) | init_seed=%s",
                self.broadcast_bits,
                self.scale_block,
                self.server_momentum,
                self.momentum_sync_every,
                ",".join(self.momentum_sync_layers) or "all",
                self.init_seed,
            )
        downlink = f"anchored (anchor every {self.anchor_every} rounds)" if self.anchored else "chain"
        log(INFO, "\t│\t└──downlink=%s", downlink)
        self._log_sampling()

    # ------------------------------------------------------------------ train
    def _init_model(self, arrays: ArrayRecord, spec: ModelSpec | None = None) -> None:
        """Take x from the initial arrays; set up the momentum mask and the x₀ checksum."""
        super()._init_model(arrays, spec)
        assert self.x is not None
        self._mask = layer_mask(self._layout, self.momentum_sync_layers)
        self.state.x0_checksum = state_checksum(self.x, self._rest)
        if self.anchored:
            k, d = self._lion_steps, self.num_parameters
            memory = 32 * d if self.max_history_bytes is None else self.max_history_bytes
            self.state.anchored = AnchoredHistory(
                self.x.clone(), 1.0 - self.lr * self.weight_decay * k, self.lr * k, self.anchor_every,
                entropy.blocks_of(self.sizes), memory,
            )  # fmt: skip

    def _check_hello(self, node_id: int, record: ConfigRecord | MetricRecord) -> None:
        """Refuse a node whose model does not match the initial arrays or the federation's model.

        The first description that matches the initial arrays becomes the federation's (which
        arrays are x); a hello without one (a client of another library) is taken as it is.
        """
        if "model" not in record:
            return
        try:
            spec = ModelSpec.decode(record["model"])  # type: ignore[arg-type]
        except (ValueError, TypeError) as err:
            raise RejectedReply(str(err), final=True) from err
        reference = self.spec if self.spec is not None else self._described
        try:
            if reference is not None:
                reference.check_same(spec, theirs=f"node {node_id}", ours="the server")
                return
            assert self._initial is not None, "a hello before configure_train"
            spec.check_arrays(self._initial)
        except LayoutError as err:
            why = f"its model does not match the {'federation' if reference else 'initial arrays'}: {err}"
            raise RejectedReply(why, final=True) from err
        self._described = spec

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and send each one only what it lacks to reach the current x.

        Raises
        ------
        ValueError
            In the first round, when every node that answered was refused for good (its model
            does not match the initial arrays, naming the first differing tensor; its ClientApp
            has no DLionClient): nothing has been trained.

        """
        if self.x is None:
            self._initial = {name: arr.numpy() for name, arr in arrays.items()}
        node_ids = self._sample(grid, server_round)
        if self.x is None:
            if not node_ids and self._refused:
                reasons = "; ".join(f"node {n}: {why}" for n, why in list(self._refused.items())[:3])
                raise ValueError(f"no node can take part: {reasons}")
            self._init_model(arrays, self._described)
            self._initial = None
        assert self.x is not None
        rnd = _Round(server_round, self.state.version, checksum(self.x), lr=self.lr_at(server_round))
        rnd.momentum_sync = bool(self.momentum_sync_every) and server_round % self.momentum_sync_every == 0
        rnd.buffer_sync = self._buffer_round(server_round)
        self._round = rnd
        messages = []
        for node_id in node_ids:
            content, kind, payload_len = self._content_for(node_id, server_round, rnd)
            if len(config):  # the ServerApp's train_config, where FedAvg puts it
                content[USER_CONFIG] = config
            if self.state.synced_momentum is not None:  # the median of the last sync round's momenta
                content[MOMENTUM] = ArrayRecord({"m": Array(self.state.synced_momentum.numpy())})
            msg = Message(
                content=content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=str(server_round)
            )
            size = message_bytes(msg)
            rnd.sent[node_id] = kind
            rnd.bytes_down += size
            needs_model = kind != "none" or node_id in rnd.seeded
            rnd.bytes_down_fp32 += size - payload_len + (4 * self.num_parameters if needs_model else 0)
            messages.append(msg)
        self.state.synced_momentum = None
        self._outbox = messages
        return messages

    def _buffer_round(self, server_round: int) -> bool:
        """Whether clients upload their buffers this round (see ``buffer_sync_every``)."""
        every = self.buffer_sync_every
        if not (every and self.spec is not None and self.spec.buffers):
            return False
        return server_round == 1 or server_round % every == 0 or server_round == self.num_rounds

    def _round_config(self, server_round: int, rnd: _Round) -> ConfigRecord:
        """The keys every client gets this round (non-default options only, to save bytes)."""
        round_config = ConfigRecord(
            {"server-round": server_round, "version": self.state.version, "seed": self.sample_seed}
        )
        round_config.update({"beta1": self.beta1, "beta2": self.beta2})
        if self.local_optimizer == "sgd":
            round_config.update(
                {"local-steps": self.local_steps, "local-optimizer": "sgd", "local-lr": float(self.local_lr or 0.0)}
            )
        elif self.local_steps > 1:
            round_config.update(
                {"local-steps": self.local_steps, "local-lr": rnd.lr, "local-weight-decay": self.weight_decay}
            )
        if self.local_proximal_mu:
            round_config["local-proximal-mu"] = self.local_proximal_mu
        if self.stale_momentum != "keep":
            round_config["stale-momentum"] = self.stale_momentum
        if self.accumulate > 1:
            round_config["accumulate"] = self.accumulate
        if self.upload != "sign":
            round_config["upload"] = self.upload
        if self.scale_block:
            round_config["scale-block"] = self.scale_block
        if rnd.momentum_sync:
            round_config["momentum-sync"] = 1
        if rnd.buffer_sync:
            round_config["buffers"] = 1
        if self.momentum_sync_every and self.momentum_sync_layers:
            round_config["momentum-sync-layers"] = ",".join(self.momentum_sync_layers)
        if self.state_key:
            round_config.update(self._hello_config(server_round))
            round_config["keep-round"] = self.checkpoint_round
        return round_config

    def _hello_config(self, server_round: int) -> ConfigRecord:
        """With state files: the run's key and the round whose end state a node starts from."""
        if not self.state_key:
            return ConfigRecord()
        return ConfigRecord({"state-key": self.state_key, "state-round": server_round - 1})

    def _on_new_node(self, pid: int, node_id: int, version: int, previous: int | None) -> None:
        """Keep the partition's version if the node can start from it; else it gets the full model."""
        super()._on_new_node(pid, node_id, version, previous)
        known = self.state.version_of.get(pid)
        if known is None or known == version or (not self.anchored and known <= version <= self.state.version):
            return  # a new partition (full model), or a node that holds its replica (Δs since `known`)
        self.state.version_of.pop(pid)
        self._state_resets += 1
        log(
            WARNING,
            "partition %d (node %d) %s: it gets the full model%s",
            pid,
            node_id,
            "has no state (a restarted SuperNode?)" if version < 0 else f"is at version {version}, not {known}",
            " and starts a fresh momentum" if version < 0 else "",
        )

    def _content_for(self, node_id: int, server_round: int, rnd: _Round) -> tuple[RecordDict, str, int]:
        """The message content for one node, its kind, and its payload length in bytes."""
        assert self.x is not None
        round_config = self._round_config(server_round, rnd)
        pid = self.partition_of(node_id)
        have = self.state.version_of.get(pid)
        if self.state.anchored is not None and have != self.state.version:
            return self._anchored_content(node_id, pid, have, round_config, rnd)
        if have is None and self.init_seed is not None and pid not in self.state.seed_failed:
            if self.state.version == 0 or self._chain_since(0) is not None:  # x₀ from the seed, then the Δs
                have = 0
                rnd.seeded.add(node_id)
                round_config.update(
                    {
                        "init-seed": self.init_seed,
                        "init-checksum": self.state.x0_checksum,
                        "layout": layout_fingerprint(self._layout),
                    }
                )
        chain = self._chain_since(have) if have is not None else None
        if have == self.state.version:
            round_config.update({"kind": "none", "base-version": have})
            return RecordDict({CONFIG: round_config}), "none", 0
        if chain is not None:
            rnd.chain_lengths[node_id] = len(chain)
            payload = b"".join(b.payload for b in chain)
            round_config.update(
                {
                    "kind": "deltas",
                    "base-version": have,
                    "num-levels": [b.num_levels for b in chain],
                    "lr": [b.lr for b in chain],
                    "weight-decay": [b.weight_decay for b in chain],
                }
            )
            if any(b.scales is not None for b in chain):
                ones = (1.0,) * len(self._scale_sizes)
                round_config["scales"] = [v for b in chain for v in (b.scales if b.scales is not None else ones)]
            array = Array(dtype="level", shape=(len(chain) * self.num_parameters,), stype=LEVELS_STYPE, data=payload)
            return (
                RecordDict({CONFIG: round_config, BROADCAST: ArrayRecord({"payload": array})}),
                "deltas",
                len(payload),
            )
        round_config.update({"kind": "full", "base-version": -1, "layout": layout_fingerprint(self._layout)})
        content = RecordDict({CONFIG: round_config, BROADCAST: ArrayRecord({"payload": to_array(self.x.numpy())})})
        if self._rest:  # frozen parameters and buffers
            content[REST] = ArrayRecord({name: to_array(a) for name, a in self._rest.items()})
        return content, "full", 4 * self.num_parameters

    def _anchored_content(
        self, node_id: int, pid: int, have: int | None, round_config: ConfigRecord, rnd: _Round
    ) -> tuple[RecordDict, str, int]:
        """The anchored downlink's message for one node: the smallest that brings it to x.

        The counts since its version, x₀'s seed and the counts since 0, or the anchor and the
        counts since it (see :mod:`flower_dlion.downlink`).
        """
        history = self.state.anchored
        assert history is not None and self.x is not None
        version, d = self.state.version, self.num_parameters
        options: list[tuple[int, str, int, list[Segment]]] = []  # (bytes, kind, base version, segments)
        if have is not None and (segments := history.segments(have, self.state.context_of.get(pid) == have)):
            options.append((sum(len(s.payload) for s in segments), "counts", have, segments))
        if self.init_seed is not None and pid not in self.state.seed_failed:  # x₀ from the seed, also for a
            segments = history.segments(0) if version else []  # known node whose version is no longer served
            if segments is not None:
                options.append((sum(len(s.payload) for s in segments), "seed", 0, segments))
        start = history.epoch.start
        segments = history.segments(start) if version > start else []
        assert segments is not None, "the counts since the anchor are always kept"
        options.append((4 * d + sum(len(s.payload) for s in segments), "full", start, segments))
        size, kind, base, segments = min(options, key=lambda o: o[0])
        round_config.update({"kind": "full" if kind == "full" else "counts", "base-version": base})
        round_config["anchor-every"] = self.anchor_every
        records: dict[str, Array] = {}
        if kind == "seed":
            rnd.seeded.add(node_id)
            round_config.update(
                {
                    "init-seed": self.init_seed,
                    "init-checksum": self.state.x0_checksum,
                    "layout": layout_fingerprint(self._layout),
                }
            )
        if kind == "full":
            round_config.update({"anchor-version": start, "layout": layout_fingerprint(self._layout)})
            records["payload"] = to_array(history.anchor.numpy())
        if segments:
            if kind != "full":
                rnd.chain_lengths[node_id] = version - base
            round_config.update(
                {
                    "segment-end": [s.end for s in segments],
                    "segment-decay": [s.decay for s in segments],
                    "segment-step": [s.step for s in segments],
                    "segment-refresh": [int(s.refresh) for s in segments],
                    "segment-context": [int(s.context) for s in segments],
                    "segment-bytes": [len(s.payload) for s in segments],
                }
            )
            data = b"".join(s.payload for s in segments)
            records["counts"] = Array(dtype="coded", shape=(len(data),), stype=CODED_STYPE, data=data)
        content = RecordDict({CONFIG: round_config})
        if records:
            content[BROADCAST] = ArrayRecord(records)
        if kind == "full" and self._rest:  # frozen parameters and buffers
            content[REST] = ArrayRecord({name: to_array(a) for name, a in self._rest.items()})
        return content, "full" if kind == "full" else "counts", size

    def _chain_since(self, have: int) -> list[_Broadcast] | None:
        """The Δs from version ``have`` to now, if kept and smaller than the full model."""
        needed = self.state.version - have
        if needed <= 0 or needed > len(self.state.broadcasts):
            return None
        chain = list(self.state.broadcasts)[-needed:]
        if chain[0].version != have + 1 or sum(len(b.payload) for b in chain) >= 4 * self.num_parameters:
            return None
        return chain

    def _expected_arrays(self, rnd: _Round) -> dict[str, tuple[str, str, int]]:
        """Array name → (stype or "", dtype, bytes) that a valid reply holds this round."""
        out = self._kind.expected(self._shape)
        if rnd.momentum_sync:
            assert self._mask is not None
            out["momentum"] = ("numpy.ndarray", "float32", 4 * int(self._mask.sum()))
        if rnd.buffer_sync:
            assert self.spec is not None
            out["buffers"] = ("numpy.ndarray", "float32", 4 * self.spec.num_buffer_values)
        return out

    def _check_reply(self, msg: Message, rnd: _Round) -> _Reply:
        """Validate one reply; return it parsed, or raise RejectedReply."""
        node_id = msg.metadata.src_node_id
        check_envelope(msg, rnd.sent.keys(), rnd.server_round, (UPLOAD, METRICS))
        content = msg.content
        record = content[UPLOAD]
        expected = self._expected_arrays(rnd)
        if not isinstance(record, ArrayRecord) or set(record.keys()) != set(expected):
            got = sorted(record.keys()) if isinstance(record, ArrayRecord) else type(record).__name__
            raise RejectedReply(f"'{UPLOAD}' must be an ArrayRecord holding {sorted(expected)}, got {got}")
        d = self.num_parameters
        floats = {}
        for name, (stype, dtype, nbytes) in expected.items():
            arr = record[name]
            if not isinstance(arr, Array):
                raise RejectedReply(f"{name!r} is a {type(arr).__name__}, expected an Array")
            if dtype == "float32":  # scales, momenta and buffers: exact shape and size, finite
                a = torch.from_numpy(float_array(arr, (nbytes // 4,), name).copy())
                if not bool(torch.isfinite(a).all()) or (name == "scales" and bool((a < 0).any())):
                    raise RejectedReply(
                        f"Array {name!r} has non-finite{' or negative' if name == 'scales' else ''} values"
                    )
                floats[name] = a
                continue
            if arr.stype != stype or arr.dtype != dtype:
                raise RejectedReply(
                    f"Array {name!r} has stype {arr.stype!r} dtype {arr.dtype!r}, expected {stype!r} {dtype!r}"
                )
            if tuple(arr.shape) != (d,):
                raise RejectedReply(f"Array {name!r} shape {tuple(arr.shape)}, expected {(d,)}")
            if len(arr.data) != nbytes:
                raise RejectedReply(f"Array {name!r} has {len(arr.data)} bytes, expected {nbytes} for d={d}")
        upload = self._kind.parse(record[self._kind.main].data, floats, self._shape)
        values = read_metrics(content, METRICS, REPLY_METRICS, optional=OPTIONAL_REPLY_METRICS)
        flips = values.get("coin-flips", 0)
        if not (isinstance(flips, int) and 0 <= flips <= d):
            raise RejectedReply(f"metric 'coin-flips' is {flips!r}, expected an integer in [0, {d}]")
        if values["version"] != rnd.base_version:
            raise RejectedReply(
                f"replica at version {values['version']}, expected {rnd.base_version}: full resync next round",
                resync=True,
            )
        if values["checksum"] != rnd.base_checksum:
            raise RejectedReply(
                f"replica checksum {values['checksum']} differs from the server's {rnd.base_checksum}: "
                "full resync next round",
                resync=True,
            )
        momentum, buffers = floats.get("momentum"), floats.get("buffers")
        return _Reply(node_id, upload, momentum, buffers, values)

    def _aggregate(self, replies: list[_Reply]) -> tuple[codec.PackedAggregate, tuple[float, ...] | None]:
        """Δ of n valid replies: its levels, broadcast bytes and per-tensor scales, with S's ties and Σ|S|.

        Signs broadcast exactly (the default) are aggregated from their packed bits
        (:func:`codec.aggregate_packed`: no d-sized integer array); the other forms from S
        (Σ|S| is 0 for the float S of scaled signs, whose agreement is not reported).
        """
        k = self._lion_steps
        if self.upload == "sign" and self.broadcast_bits == 0:  # the levels of sign(S) or S/n; Δ is K times them
            update = codec.aggregate_packed([r.upload.data for r in replies], self.num_parameters, self.aggregation)
            return update, ((float(k),) * len(self._scale_sizes) if k > 1 else None)
        votes = self._vote_sum(replies)
        levels, scales = self._update(votes, len(replies))
        ties = int(torch.count_nonzero(votes == 0))
        sum_abs = 0  # S is not needed after this: |S| in place, summed by numpy (4× torch's int sum)
        if not votes.dtype.is_floating_point:
            sum_abs = int(votes.abs_().numpy().sum(dtype=np.int64))
        encoded = codec.encode_levels(levels.levels, levels.num_levels).numpy().tobytes()
        return codec.PackedAggregate(levels.levels, levels.num_levels, encoded, ties, sum_abs), scales

    def _vote_sum(self, replies: list[_Reply]) -> torch.Tensor:
        """S = Σᵢ Uᵢ (int32 for sign and sum uploads, float32 for scaled signs; see :mod:`flower_dlion.uploads`).

        Scaled signs count with their scales cut to the round's lower median per tensor
        (``bounds.clip_scales``): no client weighs more than the median client.
        """
        uploads = [r.upload for r in replies]
        total, self._clipped = self._kind.total(uploads, self._shape)
        return total

    def _update(self, votes: torch.Tensor, n: int) -> tuple[lion.Levels, tuple[float, ...] | None]:
        """Δ (in local steps) as levels and per-tensor scales, from S of n valid replies."""
        k, num_tensors = self._lion_steps, len(self._scale_sizes)
        if self.broadcast_bits == 0:  # exact: Δ = K·sign(S) or S/n as levels
            if votes.dtype.is_floating_point:  # weighted vote of scaled signs
                levels = lion.Levels((torch.sign(votes) + 1).to(torch.int32), 3)
            else:
                levels = lion.aggregate(votes, n, self.aggregation, k=k)  # the sum upload (signs: _aggregate)
            return levels, ((float(k),) * num_tensors if k > 1 else None)
        if self.aggregation == "vote":
            target = torch.sign(votes).float() * k
        elif self.upload == "sign":
            target = votes.float() * (k / n)
        else:
            target = votes.float() / n
        if self.server_momentum:  # Nesterov: M ← μ·M + Δ, step Δ + μ·M
            if self.state.outer_momentum is None:
                self.state.outer_momentum = torch.zeros_like(target)
            momentum = self.state.outer_momentum.mul_(self.server_momentum).add_(target)
            target = target.add_(momentum, alpha=self.server_momentum)
        if self.state.server_error is None:
            self.state.server_error = torch.zeros_like(target)
        num_levels = 2 if self.broadcast_bits == 1 else 2**self.broadcast_bits - 1
        levels, scales = quantizers.ef_quantize_(target, self.state.server_error, self._scale_sizes, num_levels)
        return lion.Levels(levels, num_levels), tuple(float(v) for v in scales)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, vote or average their updates, apply Δ to x, and return x."""
        rnd = self._round
        if rnd is None or rnd.server_round != server_round or self.x is None:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for that round")
        replies = list(replies)
        checked = self._check_and_log_replies(
            server_round, replies, lambda msg: self._check_reply(msg, rnd), self._on_rejected
        )
        valid = sorted(checked.valid, key=lambda r: r.node_id)  # a fixed order: float sums are reproducible
        for r in valid:  # confirmed at the round's base version; the others keep their last confirmed one
            pid = self.partition_of(r.node_id)
            self.state.version_of[pid] = rnd.base_version
            self.state.context_of[pid] = int(r.values.get("context", -1))
        for node_id in sorted(set(rnd.sent) - checked.answered):
            pid = self.partition_of(node_id)
            log(WARNING, "round %d: no reply from node %d (partition %d)", server_round, node_id, pid)
        tie_fraction = agreement = 0.0
        applied = len(valid) >= self.min_replies
        if applied:
            tie_fraction, agreement = self._apply(valid, rnd)
        else:
            n, least = len(valid), self.min_replies
            log(WARNING, "round %d: %d valid replies < min_replies=%d, x unchanged", server_round, n, least)
        metrics = self._round_metrics(rnd, replies, valid, checked, applied, tie_fraction, agreement)
        self.history.append({"round": server_round, **metrics})
        self._round = None
        self._state_resets = self._resyncs = 0
        return self.arrays(), MetricRecord(metrics)

    def result_row(self) -> dict[str, int | float]:
        """The last round's fields for ``results.jsonl`` (see :class:`flower_dlion.results.Recorder`)."""
        m = self.history[-1]
        keys = ("num-rejected", "num-failed", "full-syncs", "catch-ups", "checksum-mismatches", "state-resets")
        keys += ("applied", "bytes-up-fp32", "bytes-down-fp32", "tie-fraction", "agreement", "coin-flip-fraction")
        return {key.replace("-", "_"): m[key] for key in keys}

    def result_summary(self, bytes_up: int, bytes_down: int) -> dict[str, float]:
        """How many times fewer bytes than float32 messages the run sent, up and down."""
        return {
            f"fp32_over_sent_{key}": sum(m[f"bytes-{key}-fp32"] for m in self.history) / max(sent, 1)
            for key, sent in (("up", bytes_up), ("down", bytes_down))
        }

    def _on_rejected(self, msg: Message, node_id: int, pid: int, err: RejectedReply, again: bool) -> None:
        """A refused reply from a node of this round: what it says about the node's replica."""
        rnd = self._round
        assert rnd is not None
        if node_id not in rnd.sent or again:
            return  # a stray reply says nothing about the node's replica
        if err.resync or (msg.has_error() and CLIENT_STATE_ERROR in msg.error.reason):
            self.state.version_of.pop(pid, None)  # its replica is unknown: the full model next time
            self._resyncs += int(err.resync)
            if msg.has_error() and node_id in rnd.seeded and SEED_MISMATCH in msg.error.reason:
                self.state.seed_failed.add(pid)  # the full model from now on

    def _apply(self, valid: list[_Reply], rnd: _Round) -> tuple[float, float]:
        """Aggregate the valid replies into Δ, apply it to x, keep it for lagging clients.

        Also combines the round's momenta and buffers. Returns the share of tied coordinates
        and the agreement (mean |S| / (n·scale); NaN for ef-sign).
        """
        assert self.x is not None
        d, n = self.num_parameters, len(valid)
        update, scales = self._aggregate(valid)
        history = self.state.anchored
        if history is not None:  # x = γ·xₐ − η·C (Δ = K·L, the K in η)
            signs = levels_to_signs(update.levels, update.num_levels)
            self.x.copy_(history.apply(signs, update.num_levels, update.encoded))
            self.state.version += 1
        else:
            weight_decay = self.weight_decay * self._lion_steps  # K local Lion steps' worth of decay
            s = None if scales is None else torch.tensor(scales)
            sizes = self._scale_sizes
            quantizers.apply_delta_(self.x, update.levels, update.num_levels, s, sizes, rnd.lr, weight_decay)
            self.state.version += 1
            broadcast = _Broadcast(self.state.version, update.num_levels, rnd.lr, weight_decay, update.encoded, scales)
            self._remember(broadcast)
        agreement = update.sum_abs / (d * n * self._kind.agreement_scale(self._lion_steps))
        if rnd.momentum_sync:
            self.state.synced_momentum = median_momentum([r.momentum for r in valid if r.momentum is not None])
        if rnd.buffer_sync:
            self._combine_buffers(valid)
        return update.ties / d, agreement

    def _round_metrics(
        self,
        rnd: _Round,
        replies: list[Message],
        valid: list[_Reply],
        checked: CheckedReplies[_Reply],
        applied: bool,
        tie_fraction: float,
        agreement: float,
    ) -> dict[str, int | float]:
        """The round's row: replies, faults, bytes as measured and as fp32 would have been, coin flips."""
        d, n = self.num_parameters, len(valid)
        bytes_up = sum(message_bytes(msg) for msg in replies)
        flip_fraction = sum(r.values.get("coin-flips", 0) for r in valid) / (d * n) if n else 0.0
        if flip_fraction > COIN_FLIP_WARNING and not self._told_flips:
            self._told_flips = True
            log(
                WARNING,
                "round %d: %.1f %% of the uploaded signs were coin flips: exact zeros of β₁·m + (1−β₁)·g, which "
                "1 bit cannot carry (e.g. ReLU units inactive on a whole batch); those coordinates move by ±lr at "
                "random (metric coin-flip-fraction; SiLU/GELU or a larger batch avoid it)",
                rnd.server_round,
                100 * flip_fraction,
            )
        losses = [r.values["train-loss"] for r in valid]
        examples = [r.values["num-examples"] for r in valid]
        total = sum(examples)
        clipped, self._clipped = self._clipped, 0
        fp32_extra = sum(4 * d - len(r.upload.data) for r in valid)  # each valid reply's U as float32 instead
        return {
            "num-replies": n,
            "num-rejected": checked.rejected,
            "num-failed": len(set(rnd.sent) - checked.answered),
            "num-sampled": len(rnd.sent),
            "full-syncs": sum(1 for kind in rnd.sent.values() if kind == "full"),
            "catch-ups": sum(1 for b in rnd.chain_lengths.values() if b > 1),
            "checksum-mismatches": self._resyncs,
            "state-resets": self._state_resets,
            "applied": int(applied),
            "version": self.state.version,
            "train-loss": sum(v * e for v, e in zip(losses, examples, strict=True)) / total if total else math.nan,
            "num-examples": int(total),
            "bytes-up": int(bytes_up),
            "bytes-down": int(rnd.bytes_down),
            "bytes-up-fp32": int(bytes_up + fp32_extra),
            "bytes-down-fp32": int(rnd.bytes_down_fp32),
            "tie-fraction": tie_fraction,
            "agreement": agreement,
            "coin-flip-fraction": flip_fraction,
            "clipped-scales": clipped,
        }

    def _combine_buffers(self, replies: list[_Reply]) -> None:
        """The server's buffers ← the median of the replies' (``bounds.robust_buffers``)."""
        assert self.spec is not None
        self._rest.update(robust_buffers(self.spec, [r.buffers.numpy() for r in replies if r.buffers is not None]))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """x, the server state (:class:`ServerState`), the run's state key and the metrics so far."""
        return (
            super().state_dict()
            | self.state.to_dict()
            | {
                "state_key": self.state_key,
                "history": [dict(h) for h in self.history],
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: every node says hello again and is sent what it lacks."""
        super().load_state_dict(state)
        self._mask = layer_mask(self._layout, self.momentum_sync_layers)
        self.state = ServerState.from_dict(state)
        self.state_key = str(state["state_key"])
        self.history = [dict(h) for h in state["history"]]
        self._round = None

    def _remember(self, broadcast: _Broadcast) -> None:
        """Keep encoded Δs for lagging clients, up to ``max_history_bytes``."""
        self.state.broadcasts.append(broadcast)
        limit = 4 * self.num_parameters if self.max_history_bytes is None else self.max_history_bytes
        while self.state.broadcasts and sum(len(b.payload) for b in self.state.broadcasts) > limit:
            self.state.broadcasts.popleft()
