"""Distributed Lion as a Flower strategy: bit-packed client signs in, a packed Δ out.

Start here. ``configure_train`` samples the nodes (:mod:`~.nodes`) and asks the downlink ``self.down``
(:class:`~.downlink.Downlink`) for each one's message, only what it lacks to reach x; the client takes its
Lion step and packs its signs (:mod:`flower_dlion.clients.dlion`); ``aggregate_train`` sorts the replies
once, has ``self.check`` check them (:class:`~.reply_check.ReplyCheck`), and each later step reads what the
check returned: the refused logged (:mod:`~.nodes`), the counts unmasked (``secure``), Δ voted or averaged
and applied to x, the metrics (``self.up``, :class:`~.uplink.Uplink`), the downlink told, the divergence
watch, the stop rule. The check and both links share the global model (``self.model``,
:class:`~.global_model.GlobalModel`) and the server's state and checkpoints (:class:`~.server_state.ServerState`).
The arguments are kept in small groups that check themselves (``strategy.options``, :mod:`~.options`);
with ``secure=True``, :mod:`~.secure_rounds` keys the nodes and unmasks the counts.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from logging import WARNING
from typing import Any, Literal

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from ..params import ModelSpec
from ..protocol import STATE_KEY, RejectedReply, checksum
from . import divergence
from .common import ServerModelStrategy
from .downlink import Downlink
from .nodes import described_model
from .option_attribute import OptionAttribute
from .options import Options
from .replies import reported_losses, sort_replies
from .reply_check import ReplyCheck
from .secure_rounds import SecureRounds
from .server_state import Broadcast, Round, RoundCounts, ServerState
from .uplink import Uplink

__all__ = ["Broadcast", "DistributedLion", "RejectedReply", "ServerState"]


class DistributedLion(ServerModelStrategy):
    r"""Distributed Lion (Liu et al., 2024) on Flower's Message API.

    Each sampled client keeps its own replica of x and its own Lion momentum, and
    replies with its Lion direction packed to one bit per parameter. The strategy sums
    the signs, aggregates them, applies the update to the global model it keeps, and
    broadcasts the packed update in the next round::

        S = Σᵢ δᵢ,   Δ = sign(S) (vote) or S / n (mean),   x ← x − lr·(Δ + wd·x)

    In-sync clients receive only the packed Δ of the rounds they missed (1 bit a parameter for
    a vote of an odd number of clients, 1.6 with ties, ⌈log₂(n+1)⌉ for the mean); new or lost
    clients the full model (or, with ``init_seed``, x₀'s seed and the Δs since).

    Used as Flower's ``FedAvg`` is (``strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds,
    evaluate_fn=...)``), with :class:`~flower_dlion.DLionClient` on the nodes; x is the model's trainable
    parameters, the rest of its state_dict is handled as :mod:`flower_dlion.params` says.

    Beyond the paper (each off by default): K ``local_steps``, client i uploading Uᵢ = Σₖ δₖ as
    its sign, the integer (``upload="sum"``, FedLion) or a scaled sign with error feedback
    (``"ef-sign"``), and the server applying ``Δ = K·sign(Σᵢ Uᵢ)`` (vote) or ``Σᵢ Uᵢ / n`` (mean),
    ``x ← x − lr·(Δ + K·wd·x)``; Δ quantized to ``broadcast_bits``; momentum sync (Lion Cub).

    The floats clients choose (ef-sign scales, momenta, buffers) are combined by medians (:mod:`~flower_dlion.bounds`).

    Parameters
    ----------
    aggregation : {"vote", "mean"} (default: "vote")
        Majority vote (``sign(S)``, 0 on a tie) or mean (``S / n``) of the client signs.
    lr : float (default: 2e-3)
        Learning rate, applied on the server and on every replica. A round moves each parameter by
        up to lr (K·lr with ``local_steps``) whatever its gradient, so Lion's rate is far below SGD's:
        2e-3 is what the repository's default run and quickstart use for their CNNs. FedAvg's SGD
        rates (0.01–0.1) are 5–50× too large: when you convert a FedAvg app, lower its rate.
    lr_schedule : callable (int -> float) | None (default: None)
        The factor of ``lr`` in server round t (in [0, 1], checked for every round before round 1):
        the round's rate is ``lr · lr_schedule(t)`` for its local steps and its Δ. E.g.
        :func:`flower_dlion.lion.cosine_decay`. The anchored downlink needs a constant rate.
    weight_decay : float (default: 0.1)
        Decoupled weight decay ``wd`` in ``x ← x − lr·(Δ + wd·x)``.
    beta1 : float (default: 0.9)
        Lion's interpolation factor for the direction, sent to the clients.
    beta2 : float (default: 0.99)
        Lion's momentum decay, sent to the clients.
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled each round.
    fraction_evaluate : float (default: 0.0)
        Fraction of nodes sent Flower's own evaluate message after each round (the float32 model:
        your ``@app.evaluate()`` works unchanged); 0: evaluation on the server only (``evaluate_fn``).
    min_train_nodes : int | None (default: None)
        Minimum number of nodes sampled each round; None: 2, or 3 with ``secure``.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes evaluated, with ``fraction_evaluate`` > 0.
    min_available_nodes : int | None (default: None)
        Wait until this many nodes are connected (1 for a one-node federation); None: 2, 3 with ``secure``.
    min_replies : int (default: 1)
        A round with fewer valid replies applies no update.
    max_failed_rounds : int (default: 3)
        After this many rounds in a row with fewer than ``min_replies`` valid replies,
        ``aggregate_train`` raises :class:`~flower_dlion.RunStopped` naming the rounds and why; 0
        never stops. Round 1 also stops when every node answered its hello with an error.
    wait_for_nodes : float | None (default: None)
        Seconds a round waits for the nodes it needs before the run stops naming both counts; None: the round timeout.
    divergence_factor : float (default: 10.0)
        f > 1 (``math.inf``: non-finite losses only). A WARNING names round t, its train-loss Lₜ, the running
        minimum mₜ = min_{s<t} Lₛ, f and the nodes when Lₜ > f·mₜ in ``divergence_rounds`` rounds in a row,
        or when a node's train-loss is not finite (:mod:`~.divergence`; a resume goes on with m and the streak).
    divergence_rounds : int (default: 1)
        R ≥ 1, the rounds in a row with Lₜ > f·mₜ before it warns (1: in the round the loss passes f·m).
    stop_on_divergence : bool (default: False)
        Stop the run at that warning: ``aggregate_train`` raises :class:`~flower_dlion.RunStopped`.
    max_history_bytes : int | None (default: None)
        Bytes of past Δs (anchored: counts) kept for clients that missed rounds; ``None``: the
        model's size (chain), 8 times it (anchored).
    local_steps : int (default: 1)
        K, the local steps each client takes on its own copy of x per round.
    local_optimizer : {"lion", "sgd"} (default: "lion")
        "lion": K Lion steps at ``lr`` (FedLion's client). "sgd": K SGD steps at ``local_lr`` give
        g = x − x_K, and the client uploads one Lion step's sign on it (FedSMU, Lu et al., 2025;
        the server counts one step a round); with ``upload="ef-sign"``, g itself as a scaled sign
        with error feedback (``lr=1``, ``weight_decay=0``, ``aggregation="mean"``,
        ``broadcast_bits=1``: FedAvg at 1 bit a parameter each way). Needs ``accumulate=1``.
    local_lr : float | None (default: None)
        The local SGD learning rate of ``local_optimizer="sgd"`` (required there, refused with "lion").
    stale_momentum : {"keep", "decay", "reset"} (default: "keep")
        What a client that missed k rounds does with its Lion momentum when it is sampled again:
        keeps it, decays it as k rounds without gradients would (m ← β₂ᵏ·m), or resets it to 0.
    local_proximal_mu : float (default: 0.0)
        Drift control for skewed data: each local step's gradient gains μ·(x_local − x), pulling
        the client's copy back toward the round's x (FedProx's term, inside the local Lion or SGD
        steps). Needs ``local_steps`` > 1; 0 turns it off.
    drift_correction : {"off", "scaffold"} (default: "off")
        Experimental. "scaffold": SCAFFOLD's control variates for the 1-bit SGD client (needs "sgd", "ef-sign",
        "mean", ``broadcast_bits`` ≥ 1, no ``server_momentum``): local steps on g + (h − hᵢ)/(K·η), h the last
        broadcast, hᵢ ← uᵢ − (h − hᵢ) (uᵢ = x − y_K); no extra payload byte, 4 bytes a parameter on a client;
        a node that missed the round before runs uncorrected and starts anew (:mod:`flower_dlion.drift`).
    accumulate : int (default: 1)
        Minibatches averaged into each local gradient.
    upload : {"sign", "sum", "ef-sign"} (default: "sign")
        What a client sends for U = Σₖ δₖ: sign(U) (1 bit), U itself (⌈log₂(2K+1)⌉ bits),
        or a scaled sign of U + e with one float32 scale per tensor and error feedback e.
    broadcast_bits : int (default: 0)
        0: broadcast Δ exactly as levels. p ≥ 1: quantize Δ + e to 2 (p = 1, scaled sign)
        or 2ᵖ − 1 levels with one scale per tensor, keeping the error e on the server.
    scale_block : int (default: 0)
        B > 0: the ef-sign upload and the quantized broadcast carry one float32 scale per B values
        of each tensor (Lion Cub's), not one per tensor. Needs ef-sign or ``broadcast_bits`` ≥ 1.
    server_momentum : float (default: 0.0)
        μ of a Nesterov momentum on Δ (DiLoCo's outer optimizer): ``M ← μ·M + Δ``, the server
        applies ``Δ + μ·M``, quantized with error feedback (needs ``broadcast_bits`` ≥ 1). 0: off. With "sgd" and
        "ef-sign" it is FedAvgM's, Nesterov form (x = heavy-ball's − μ·M: :func:`~.server_delta.quantized_delta`).
    momentum_sync_every : int (default: 0)
        Every R rounds, clients also upload their momentum (float32) and the next round
        sends them the coordinate-wise median; 0 never does.
    momentum_sync_layers : sequence of str (default: ())
        Parameter-name prefixes of the momenta to synchronize; empty means all.
    buffer_sync_every : int (default: 10)
        In round 1, every R-th and the last round, clients upload their buffers (BatchNorm's
        statistics) and the server's copy becomes their median; clients keep their own. 0: never.
    init_seed : int | None (default: None)
        When the initial model is built after ``torch.manual_seed(init_seed)``, a new node is
        sent the seed (and a checksum) instead of the full model.
    sample_seed : int (default: 0)
        Seed of the partition sampling (round t samples with ``default_rng([seed, t])``),
        also sent to the clients (their batch order and coin flips).
    state_key : str (default: "")
        The run's identity for clients that keep their state in files (run config
        ``client-state-dir``): 1 to 64 of ``A-Z a-z 0-9 _ -``, kept in checkpoints so that a resumed
        run finds the files. "": a random key of this object's (:attr:`run_key`), so that two runs
        never share a client's state, even with the same run id (in-process grids, parallel sweeps).
    downlink : {"auto", "anchored", "chain"} (default: "auto")
        What a client that is behind receives. "anchored" (:mod:`flower_dlion.anchored_counts`): the
        counts C = Σ Δ since its version, entropy-coded (about log₂ √k bits a value k rounds
        behind; needs a vote with exact broadcast). "chain": the missed Δs. "auto": anchored if it can.
    anchor_every : int (default: 200)
        Rounds between anchors (``xₐ ← x``, C ← 0) of the anchored downlink.
    sign_noise : float (default: 0.0)
        τ of stochastic signs: the Lion steps' (or the ef-sign upload's) sign of ``v + τ·mean|v|·ξ``
        per tensor (:mod:`~flower_dlion.stochastic`: less bias under skew, more variance); 0: none.
    sign_noise_kind : {"uniform", "gaussian"} (default: "uniform")
        The distribution of ξ.
    secure : bool (default: False)
        Secure aggregation (:mod:`~.secure_rounds`; docs/USER_GUIDE.md, "Secure aggregation"): clients
        upload their signs under pairwise masks, b = ⌈log₂(n+1)⌉ bits a parameter; the server learns
        the counts (the same Δ), not one client's signs in any round. Needs the sign upload, an exact
        broadcast; one more query round trip a round (the survivors' reveals).
    secure_degree : int (default: 0)
        Neighbours each client masks with (SecAgg+'s graph); 0: every other participant.

    Notes
    -----
    Faults: a node without a valid reply keeps its last confirmed version and is sent the Δs since; a replica
    checksum or version mismatch, or a lost state, gets the full model (``checksum-mismatches``, ``state-resets``).

    Examples
    --------
    >>> strategy = DistributedLion(aggregation="vote", lr=2e-3, weight_decay=0.1)
    >>> result = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=100)

    References
    ----------
    B. Liu et al., "Communication Efficient Distributed Training with Distributed Lion", arXiv:2404.00438.

    """

    # Each option by its argument name, read-only, for users: ``strategy.lr`` is ``strategy.options.step.lr``.
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
    drift_correction = OptionAttribute("local")
    accumulate = OptionAttribute("local")
    aggregation = OptionAttribute("uplink")
    upload = OptionAttribute("uplink")
    broadcast_bits = OptionAttribute("uplink")
    server_momentum = OptionAttribute("uplink")
    scale_block = OptionAttribute("uplink")
    sign_noise = OptionAttribute("uplink")
    sign_noise_kind = OptionAttribute("uplink")
    downlink = OptionAttribute("downlink")
    anchor_every = OptionAttribute("downlink")
    max_history_bytes = OptionAttribute("downlink")
    init_seed = OptionAttribute("downlink")
    momentum_sync_every = OptionAttribute("sync")
    momentum_sync_layers = OptionAttribute("sync")
    buffer_sync_every = OptionAttribute("sync")
    secure = OptionAttribute("secure")
    secure_degree = OptionAttribute("secure")
    divergence_factor = OptionAttribute("divergence")
    divergence_rounds = OptionAttribute("divergence")
    stop_on_divergence = OptionAttribute("divergence")

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
        min_train_nodes: int | None = None,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int | None = None,
        min_replies: int = 1,
        max_failed_rounds: int = 3,
        wait_for_nodes: float | None = None,
        divergence_factor: float = 10.0,
        divergence_rounds: int = 1,
        stop_on_divergence: bool = False,
        max_history_bytes: int | None = None,
        local_steps: int = 1,
        local_optimizer: Literal["lion", "sgd"] = "lion",
        local_lr: float | None = None,
        local_proximal_mu: float = 0.0,
        stale_momentum: Literal["keep", "decay", "reset"] = "keep",
        drift_correction: Literal["off", "scaffold"] = "off",
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
        sign_noise: float = 0.0,
        sign_noise_kind: Literal["uniform", "gaussian"] = "uniform",
        secure: bool = False,
        secure_degree: int = 0,
    ) -> None:
        self.options = Options.from_arguments(locals())  # each group checks itself, then Options the combinations
        min_train_nodes, min_available_nodes = self.options.secure.sampling(min_train_nodes, min_available_nodes)
        super().__init__(  # checks and keeps the sampling arguments
            fraction_train=fraction_train, min_train_nodes=min_train_nodes, min_available_nodes=min_available_nodes,
            min_replies=min_replies, sample_seed=sample_seed, fraction_evaluate=fraction_evaluate,
            min_evaluate_nodes=min_evaluate_nodes, max_failed_rounds=max_failed_rounds, wait_for_nodes=wait_for_nodes,
        )  # fmt: skip
        if state_key and not STATE_KEY.fullmatch(state_key):
            raise ValueError(f"state_key must be 1 to 64 of A-Z a-z 0-9 _ - (a folder name) or '', got {state_key!r}")
        self.state_key = state_key
        self._auto_key = secrets.token_hex(8)  # this run's, where state_key names none (see run_key)
        self.checkpoint_round = 0  # the latest checkpoint's round (clients keep their state as of it)
        self._round: Round | None = None
        self._counts = RoundCounts()  # what the round in progress counted (resyncs, state resets, clipped scales)
        self.history: list[dict[str, Any]] = []  # one dict of metrics per aggregated round
        self.divergence = divergence.DivergenceState()  # the divergence watch's running minimum and streak
        state, model = ServerState(), self.model
        self.check = ReplyCheck(self.options, state, model)  # each reply refused or parsed
        self.up = Uplink(self.options, state, model)  # the valid replies in, Δ applied to x
        self.down = Downlink(self.options, state, model, self)  # what each node is sent
        sec, node_of = self.options.secure, lambda k: self.nodes.node_of.get(k)  # keys, masks, unmasking (secure)
        self.secure_rounds = SecureRounds(sec, node_of, lambda: self.run_key) if sec.secure else None
        self._grid: Grid | None = None  # the round's grid (the unmasking asks the survivors for their reveals)

    @property
    def state(self) -> ServerState:
        """The server's state between rounds, one object that the uplink and the downlink share."""
        return self.up.state

    @state.setter
    def state(self, state: ServerState) -> None:
        self.check.state = self.up.state = self.down.state = state

    @property
    def run_key(self) -> str:
        """The run's identity the clients file their state under: ``state_key``, else a random one of this object's."""
        return self.state_key or self._auto_key

    def lr_at(self, server_round: int) -> float:
        """The learning rate of ``server_round``: ``lr · lr_schedule(server_round)`` (:meth:`StepOptions.lr_at`)."""
        return self.options.step.lr_at(server_round)

    def _check_rounds(self, start_round: int, num_rounds: int) -> None:
        """Check the schedule's factor for every round of the run (before round 1)."""
        for server_round in range(start_round, num_rounds + 1):
            self.lr_at(server_round)

    @property
    def version(self) -> int:
        """The number of Δs applied to x since the start."""
        return self.state.version

    def _init_model(self, arrays: ArrayRecord, spec: ModelSpec | None = None) -> None:
        """Take x from the initial arrays; set up the momentum mask and the downlink (x₀'s checksum, the anchor)."""
        super()._init_model(arrays, spec)
        self.model.mask_momentum(self.options.sync.momentum_sync_layers)
        self.down.start()

    def _check_hello(self, node_id: int, record: ConfigRecord | MetricRecord) -> None:
        """Refuse a node whose model does not match the federation's (or, first, the initial arrays).

        The first description that matches the initial arrays becomes the federation's
        (:func:`~.nodes.described_model`); a hello without one (a client of another library) is taken as it is.
        """
        reference = self.spec if self.spec is not None else self._described
        spec = described_model(node_id, record, reference, self._initial, self._initial_checksums)
        if reference is None and spec is not None:
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
        """Sample nodes and send each one only what it lacks to reach the current x (round 1: x first).

        Raises
        ------
        ValueError
            In the first round, when no node can take part (:meth:`_sample_with_model`).

        """
        node_ids = self._sample_with_model(grid, server_round, arrays)
        assert self.x is not None
        rnd = Round(server_round, self.state.version, checksum(self.x), lr=self.lr_at(server_round))
        rnd.momentum_sync = self.options.sync.momentum_round(server_round)
        has_buffers = self.spec is not None and bool(self.spec.buffers)
        rnd.buffer_sync = has_buffers and self.options.sync.buffer_round(server_round, self.num_rounds)
        self._round, self._grid = rnd, grid
        messages = self._train_messages(grid, node_ids, rnd, config)
        self.state.synced_momentum = None
        self._outbox = messages
        return messages

    def _train_messages(self, grid: Grid, node_ids: list[int], rnd: Round, config: ConfigRecord) -> list[Message]:
        """Each sampled node's train message (``secure``: the keyed nodes', with the round's masking record)."""
        t = rnd.server_round
        if self.secure_rounds is None:
            return [self.down.message_for(node_id, t, rnd, config) for node_id in node_ids]
        keyed = self.secure_rounds.prepare(grid, {n: self.partition_of(n) for n in node_ids}, rnd)
        return [self.down.message_for(n, t, rnd, config, self.secure_rounds.record_for(key, rnd)) for n, key in keyed]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check the replies, vote or average the valid uploads into Δ, apply Δ to x, and return x.

        The replies are sorted and checked once; each later step reads what the check returned (the
        module doc lists them). What each key of the returned MetricRecord means, its range in an
        honest run and when it signals a problem: docs/USER_GUIDE.md, "The round's metrics".
        """
        rnd, counts, secure = self._round, self._counts, self.secure_rounds
        if rnd is None or rnd.server_round != server_round or self.x is None:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for that round")
        arrived = sort_replies(replies, self._outbox, self.nodes.pid_of)
        losses = reported_losses(arrived, rnd.sent)  # each sent node's own train-loss, rejected ones (NaN) too
        checked = self.check.check_replies(arrived, rnd, counts)
        self.nodes.log_refused(server_round, checked.replies, self._outbox)
        valid, unmasked = checked.valid, None
        if secure is not None:  # the masked sum of the survivors, unmasked: the counts (or none)
            assert self._grid is not None
            valid, unmasked = secure.counts(
                self._grid, rnd, checked.errors, valid, self.partition_of, self.num_parameters
            )
        outcome = self.up.apply(valid, rnd, counts, unmasked) if len(valid) >= self.min_replies else None
        if outcome is None:
            n, least = len(valid), self.min_replies
            log(WARNING, "round %d: %d valid replies < min_replies=%d, x unchanged", server_round, n, least)
        queries = None if secure is None else secure.round_bytes()  # its key and unmask queries' traffic
        metrics = self.up.round_metrics(rnd, checked, valid, outcome, counts, queries)
        self.down.end_round(checked.valid, rnd, None if outcome is None else outcome.broadcast)
        self.history.append({"round": server_round, **metrics})
        self._round, self._counts = None, RoundCounts()
        self.divergence = divergence.watch(self.divergence, self.options.divergence, server_round, metrics, losses)
        self._failures.count_round(server_round, checked.replies, len(valid), rnd.sent)  # RunStopped: too many failed
        if checked.stop is not None:
            raise checked.stop  # no node can keep its state (.state_writes): its row is in the history
        return self.arrays(), MetricRecord(metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """x, the server state (:class:`ServerState`), the run's keys and the metrics so far."""
        keys = {"state_key": self.state_key, "run_key": self.run_key}
        secure = None if self.secure_rounds is None else self.secure_rounds.state_dict()
        return super().state_dict() | self.state.to_dict() | keys | {"secure": secure}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: every node says hello again and is sent what it lacks."""
        super().load_state_dict(state)
        self.model.mask_momentum(self.options.sync.momentum_sync_layers)
        self.divergence = divergence.replay(self.options.divergence, self.history)  # m and the streak, from history
        self.state = ServerState.from_dict(state)
        self.state_key = str(state["state_key"])
        self._auto_key = str(state.get("run_key", self._auto_key))  # a resumed run is the same run
        if self.secure_rounds is not None and state.get("secure") is not None:
            self.secure_rounds.load_state_dict(state["secure"])
        self._round = None
