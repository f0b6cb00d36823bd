"""Distributed Lion as a Flower strategy: bit-packed client signs in, a packed Δ out.

Start here. One round of :class:`DistributedLion`, and where each step lives:

- ``configure_train`` (below) samples the nodes and asks its downlink ``self.down`` for each one's
  message (:class:`~flower_dlion.strategies.downlink_messages.Downlink`: only what the node lacks
  to reach x);
- the client takes its Lion step and packs its signs (:mod:`flower_dlion.clients.dlion`);
- ``aggregate_train`` (below) has its uplink ``self.up`` check the replies, vote or average them
  into Δ and apply Δ to x (:class:`~flower_dlion.strategies.aggregation.Uplink`), and hands the
  encoded Δ to the downlink;
- what the server keeps between rounds, and checkpoints, is a
  :class:`~flower_dlion.strategies.server_state.ServerState`, shared by the uplink and the downlink,
  which read the model through a :class:`ModelView` and the nodes through a :class:`NodeView`.

The constructor keeps its arguments in small groups that check themselves
(:mod:`~flower_dlion.strategies.options`; ``strategy.options``); the sampling, the hellos and the
round loop that both of our strategies share are in :mod:`~flower_dlion.strategies.common`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING
from typing import Any, Literal

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from .. import entropy
from ..downlink import AnchoredHistory
from ..params import LayoutError, ModelSpec, layer_mask, state_checksum
from ..protocol import STATE_KEY, RejectedReply, checksum
from .aggregation import RoundCounts, Uplink
from .common import DLionResult, ServerModelStrategy
from .downlink_messages import Downlink
from .options import DownlinkOptions, LocalOptions, OptionAttribute, Options, StepOptions, SyncOptions, UplinkOptions
from .server_state import Broadcast, Round, ServerState
from .views import ModelView, NodeView

__all__ = ["Broadcast", "DistributedLion", "RejectedReply", "ServerState"]


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
    lr : float (default: 2e-3)
        Learning rate, applied on the server and on every replica. A round moves each parameter
        by up to lr (K·lr with ``local_steps``) whatever the size of its gradient, so Lion's rate
        is far below SGD's: 2e-3 is what the repository's default run and its quickstart use for
        their CNNs (run config ``lr`` / ``learning-rate``); it was 5e-4 before issue 50. FedAvg's
        SGD rates (0.01–0.1) are 5–50× too large: when you convert a FedAvg app, lower its rate.
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
    max_failed_rounds : int (default: 3)
        After this many rounds in a row with fewer than ``min_replies`` valid replies the run
        stops: ``aggregate_train`` raises :class:`~flower_dlion.strategies.run_stops.RunStopped`
        naming the rounds and why the replies were rejected (the history keeps the last round);
        a round with enough valid replies resets the count. 0 never stops. The first round
        also stops when every node answered its hello with an error.
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
        (``x ← x − lr·(Δ + wd·x)``). With ``upload="ef-sign"`` the client uploads g itself as a
        scaled sign with error feedback instead (no Lion step, m unused): with ``lr=1`` and
        ``weight_decay=0`` that is FedAvg's update at 1 bit per parameter each way (with
        ``aggregation="mean"``, ``broadcast_bits=1``). Needs ``upload="sign"`` or ``"ef-sign"``
        and ``accumulate=1``.
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
        The run's identity for clients that keep their state in files that outlive the run (run
        config ``client-state-dir``): 1 to 64 of ``A-Z a-z 0-9 _ -``, one per run; kept in
        checkpoints so that a resumed run finds the files. "": a random key of this strategy
        object's own (:attr:`run_key`, also kept in checkpoints), so that two runs never share a
        client's state, even where their run ids are the same (in-process grids, parallel sweeps).
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
    >>> strategy = DistributedLion(aggregation="vote", lr=2e-3, weight_decay=0.1)
    >>> result = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=100)

    References
    ----------
    B. Liu et al., "Communication Efficient Distributed Training with Distributed Lion",
    arXiv:2404.00438, 2024.

    """

    # Each option by its argument name, read-only: ``strategy.lr`` is ``strategy.options.step.lr``.
    lr = OptionAttribute("step")
    lr_schedule = OptionAttribute("step")
    weight_decay = OptionAttribute("step")
    beta1 = OptionAttribute("step")
    beta2 = OptionAttribute("step")
    local_steps = OptionAttribute("local")
    local_optimizer = OptionAttribute("local")
    local_lr = OptionAttribute("local")
    local_proximal_mu = OptionAttribute("local")
    stale_momentum = OptionAttribute("local")
    accumulate = OptionAttribute("local")
    aggregation = OptionAttribute("uplink")
    upload = OptionAttribute("uplink")
    broadcast_bits = OptionAttribute("uplink")
    server_momentum = OptionAttribute("uplink")
    scale_block = OptionAttribute("uplink")
    downlink = OptionAttribute("downlink")
    anchor_every = OptionAttribute("downlink")
    max_history_bytes = OptionAttribute("downlink")
    init_seed = OptionAttribute("downlink")
    momentum_sync_every = OptionAttribute("sync")
    momentum_sync_layers = OptionAttribute("sync")
    buffer_sync_every = OptionAttribute("sync")

    def __init__(
        self,
        *,
        aggregation: Literal["vote", "mean"] = "vote",
        lr: float = 2e-3,
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
        max_failed_rounds: int = 3,
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
        self.options = Options(  # each group checks itself as it is built, then Options checks them together
            step=StepOptions(lr=lr, lr_schedule=lr_schedule, weight_decay=weight_decay, beta1=beta1, beta2=beta2),
            local=LocalOptions(local_steps=local_steps, local_optimizer=local_optimizer, local_lr=local_lr,
                local_proximal_mu=local_proximal_mu, stale_momentum=stale_momentum, accumulate=accumulate),
            uplink=UplinkOptions(aggregation=aggregation, upload=upload, broadcast_bits=broadcast_bits,
                server_momentum=server_momentum, scale_block=scale_block),
            downlink=DownlinkOptions(downlink=downlink, anchor_every=anchor_every, max_history_bytes=max_history_bytes,
                init_seed=init_seed),
            sync=SyncOptions(momentum_sync_every=momentum_sync_every, momentum_sync_layers=momentum_sync_layers,
                buffer_sync_every=buffer_sync_every),
        )  # fmt: skip
        super().__init__(  # checks and keeps the sampling arguments
            fraction_train=fraction_train, min_train_nodes=min_train_nodes, min_available_nodes=min_available_nodes,
            min_replies=min_replies, sample_seed=sample_seed, fraction_evaluate=fraction_evaluate,
            min_evaluate_nodes=min_evaluate_nodes, max_failed_rounds=max_failed_rounds,
        )  # fmt: skip
        if state_key and not STATE_KEY.fullmatch(state_key):
            raise ValueError(f"state_key must be 1 to 64 of A-Z a-z 0-9 _ - (a folder name) or '', got {state_key!r}")
        self.state_key = state_key
        self._auto_key = secrets.token_hex(8)  # this run's, where state_key names none (see run_key)
        self.checkpoint_round = 0  # the latest checkpoint's round (clients keep their state as of it)
        self._start_bookkeeping()

    def _start_bookkeeping(self) -> None:
        """The global model and its bookkeeping, empty (set from the initial arrays in round 1); the two links."""
        self._round: Round | None = None
        self._mask: torch.Tensor | None = None  # parameters whose momentum is synchronized
        self._counts = RoundCounts()  # what the round in progress counted (resyncs, state resets, clipped scales)
        self._initial: dict[str, np.ndarray] | None = None  # the initial arrays, until x is made from them
        self._described: ModelSpec | None = None  # the model description the first valid hello gave
        self.history: list[dict[str, Any]] = []  # one dict of metrics per aggregated round
        state, model = ServerState(), ModelView(self)
        self.up = Uplink(self.options, state, model)  # replies in, Δ applied to x
        self.down = Downlink(self.options, state, model, NodeView(self))  # what each node is sent

    @property
    def state(self) -> ServerState:
        """The server's state between rounds, one object that the uplink and the downlink share."""
        return self.up.state

    @state.setter
    def state(self, state: ServerState) -> None:
        self.up.state = self.down.state = state

    @property
    def run_key(self) -> str:
        """The run's identity the clients file their state under: ``state_key``, else a random one of this object's."""
        return self.state_key or self._auto_key

    @property
    def anchored(self) -> bool:
        """Whether the downlink is anchored (``downlink="anchored"``, or "auto" where it applies)."""
        return self.options.anchored

    @property
    def _lion_steps(self) -> int:
        """K for local Lion steps, 1 for the sgd client: Δ's scale and decay."""
        return self.options.local.lion_steps

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
    ) -> DLionResult:
        """Check the schedule's factor for every round of the run, then run Flower's round loop (with ``totals``)."""
        for server_round in range(kwargs.get("start_round", 1), num_rounds + 1):
            self.lr_at(server_round)  # a bad factor fails before round 1
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

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

    def _hello_config(self, server_round: int) -> ConfigRecord:
        """The run's key and the round whose end state a node starts from (a train message sends the round)."""
        return ConfigRecord({"state-key": self.run_key, "state-round": server_round - 1})

    def _on_new_node(self, pid: int, node_id: int, version: int, previous: int | None) -> None:
        """Keep the partition's version if the node can start from it (the downlink decides); else count a reset."""
        super()._on_new_node(pid, node_id, version, previous)
        if self.down.forget_stale_replica(pid, node_id, version):
            self._counts.state_resets += 1

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
        rnd = Round(server_round, self.state.version, checksum(self.x), lr=self.lr_at(server_round))
        rnd.momentum_sync = bool(self.momentum_sync_every) and server_round % self.momentum_sync_every == 0
        rnd.buffer_sync = self._buffer_round(server_round)
        self._round = rnd
        messages = [self.down.message_for(node_id, server_round, rnd, config) for node_id in node_ids]
        self.state.synced_momentum = None
        self._outbox = messages
        return messages

    def _buffer_round(self, server_round: int) -> bool:
        """Whether clients upload their buffers this round (see ``buffer_sync_every``)."""
        every = self.buffer_sync_every
        if not (every and self.spec is not None and self.spec.buffers):
            return False
        return server_round == 1 or server_round % every == 0 or server_round == self.num_rounds

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, vote or average their updates, apply Δ to x, and return x.

        Each step is the uplink's (:class:`~.aggregation.Uplink`: ``check_reply``, ``apply``,
        ``round_metrics``); the Δ it applied goes to the downlink (``_remember``). What each key of
        the returned MetricRecord means, its range in an honest run and when it signals a problem:
        docs/GUIDE.md, "The round's metrics".
        """
        rnd = self._round
        if rnd is None or rnd.server_round != server_round or self.x is None:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for that round")
        replies, counts = list(replies), self._counts
        checked = self._check_and_log_replies(
            server_round,
            replies,
            lambda msg: self.up.check_reply(msg, rnd),
            lambda msg, node_id, pid, err, again: self.up.on_rejected(msg, node_id, pid, err, again, rnd, counts),
        )
        valid = sorted(checked.valid, key=lambda r: r.node_id)  # a fixed order: float sums are reproducible
        for r in valid:  # confirmed at the round's base version; the others keep their last confirmed one
            pid = self.partition_of(r.node_id)
            self.state.version_of[pid] = rnd.base_version
            self.state.context_of[pid] = int(r.values.get("context", -1))
        for node_id in sorted(set(rnd.sent) - checked.answered):
            pid = self.partition_of(node_id)
            log(WARNING, "round %d: no reply from node %d (partition %d)", server_round, node_id, pid)
        outcome = None
        if len(valid) >= self.min_replies:
            outcome = self.up.apply(valid, rnd, counts)
            if outcome.broadcast is not None:  # the chain downlink keeps it for clients that fall behind
                self._remember(outcome.broadcast)
        else:
            n, least = len(valid), self.min_replies
            log(WARNING, "round %d: %d valid replies < min_replies=%d, x unchanged", server_round, n, least)
        metrics = self.up.round_metrics(rnd, replies, valid, checked, outcome, counts)
        self.history.append({"round": server_round, **metrics})
        self._round, self._counts = None, RoundCounts()
        missing = len(set(rnd.sent) - checked.answered)
        why = f"{len(valid)} valid of {len(rnd.sent)} sent ({checked.rejected} rejected, {missing} without a reply)"
        self._round_outcome(server_round, len(valid), why)  # RunStopped after max_failed_rounds failed rounds
        return self.arrays(), MetricRecord(metrics)

    def _remember(self, broadcast: Broadcast) -> None:
        """Hand the round's encoded Δ to the downlink, which keeps it for lagging clients (the chain)."""
        self.down.remember(broadcast)

    # ------------------------------------------------------------------ results
    def result_row(self) -> dict[str, int | float]:
        """The last round's fields for an app's per-round log (the repository app writes them to ``results.jsonl``)."""
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

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """x, the server state (:class:`ServerState`), the run's keys and the metrics so far."""
        return (
            super().state_dict()
            | self.state.to_dict()
            | {
                "state_key": self.state_key,
                "run_key": self.run_key,
                "history": [dict(h) for h in self.history],
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: every node says hello again and is sent what it lacks."""
        super().load_state_dict(state)
        self._mask = layer_mask(self._layout, self.momentum_sync_layers)
        self.state = ServerState.from_dict(state)
        self.state_key = str(state["state_key"])
        self._auto_key = str(state.get("run_key", self._auto_key))  # a resumed run is the same run
        self.history = [dict(h) for h in state["history"]]
        self._round = None
