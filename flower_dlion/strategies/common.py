"""What both of our strategies share: checks, the server's model, sampling (through its nodes), the round loop.

The server's model is a flat float32 vector x (the trainable parameters) plus the rest of the
model's state_dict (buffers; frozen parameters, named by reference: :mod:`flower_dlion.params`).
Nodes are known by their partition id (or, without one, their node id) and sampled reproducibly; the round loop
can start at a later round (a resume); federated evaluation sends Flower's own evaluate messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from ..params import ModelSpec
from ..protocol import RejectedReply, error_text
from .global_model import GlobalModel, Layout
from .nodes import Nodes
from .replies import CheckedReplies, check_each, sort_replies
from .run_loop import DLionResult, run_rounds, run_totals
from .run_stops import FailedRounds, whole_reason

if TYPE_CHECKING:
    from .secure_rounds import SecureRounds

__all__ = ["CheckedReplies", "DLionResult", "Layout", "ServerModelStrategy"]

R = TypeVar("R")


class ServerModelStrategy(Strategy):
    """Base of our strategies: the strategy holds the global model (``strategy.model``, a :class:`GlobalModel`).

    x is taken from the initial arrays in round 1 (by the subclass's configure_train): the entries the
    clients' model description (their hello) calls trainable, every array when they send none.

    Nodes are known by a key, not by Flower's node ids (:class:`~flower_dlion.strategies.nodes.Nodes`,
    ``strategy.nodes``): each new node id gets one hello and says which partition it trains on.
    Round t samples ``max(min_train_nodes, ⌊fraction_train · N⌋)`` of the N connected keys with
    ``numpy.random.default_rng([sample_seed, t])``: the same partitions in every run with the same
    seed, whatever the node ids, and after a resume.

    Parameters
    ----------
    fraction_train : float
        Fraction of connected nodes sampled each round.
    min_train_nodes : int
        Minimum number of nodes sampled each round.
    min_available_nodes : int
        Wait until this many nodes are connected before sampling.
    min_replies : int
        A round with fewer valid replies applies no update.
    sample_seed : int
        Seed of the sampling.
    fraction_evaluate : float
        Fraction of connected nodes sent Flower's own evaluate message (the full model as
        "arrays", the evaluate config as "config") after each round; 0 sends none.
    min_evaluate_nodes : int
        Minimum number of nodes evaluated, when ``fraction_evaluate`` > 0.
    max_failed_rounds : int (default: 3)
        The run stops (:class:`RunStopped`, naming the rounds and why replies were rejected)
        after this many rounds in a row with fewer than ``min_replies`` valid replies; a round
        with enough resets the count. 0 never stops. Independently, the first round stops when
        every connected node answered its hello with an error.
    wait_for_nodes : float | None (default: None)
        Seconds a round waits for ``min_available_nodes`` connected nodes, and for as many as it
        needs (secure aggregation: ``min_train_nodes``, at least 3) that can take part, before the
        run stops (:class:`RunStopped`, naming both counts); None: the round timeout (``start``'s
        ``timeout``). Also an attribute: ``strategy.wait_for_nodes = 60``.

    """

    secure_rounds: SecureRounds | None = None  # secure aggregation's keys and unmasking (DistributedLion's)
    _failures: FailedRounds  # failed rounds in a row, and why (the run's stop rule; set in __init__)

    def __init__(
        self,
        *,
        fraction_train: float,
        min_train_nodes: int,
        min_available_nodes: int,
        min_replies: int,
        sample_seed: int = 0,
        fraction_evaluate: float = 0.0,
        min_evaluate_nodes: int = 2,
        max_failed_rounds: int = 3,
        wait_for_nodes: float | None = None,
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        for name, value in (
            ("min_train_nodes", min_train_nodes),
            ("min_available_nodes", min_available_nodes),
            ("min_replies", min_replies),
            ("min_evaluate_nodes", min_evaluate_nodes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(max_failed_rounds, bool) or not isinstance(max_failed_rounds, int) or max_failed_rounds < 0:
            raise ValueError(f"max_failed_rounds must be an integer >= 0 (0: never stop), got {max_failed_rounds!r}")
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.min_replies = min_replies
        self.sample_seed = sample_seed
        self.max_failed_rounds = max_failed_rounds
        self._failures = FailedRounds(max_failed_rounds, min_replies)  # failed rounds in a row, and why
        self.model = GlobalModel()  # x, its description and the rest of the model (set in round 1)
        self.nodes = Nodes(self, lambda node_id, why: self._failures.reject(node_id, why), wait_for_nodes)
        self._outbox: list[Message] = []  # the train messages of the round in progress
        self._evaluating: set[int] = set()  # nodes sent an evaluate message this round
        self.num_rounds = 0  # the last round of the run in progress (set by start)
        self.history: list[dict[str, Any]] = []  # one dict of metrics per aggregated round (subclasses fill it)
        self._initial: dict[str, np.ndarray] | None = None  # the initial arrays, until x is made from them
        self._described: ModelSpec | None = None  # the model description the first valid hello gave
        self._initial_checksums: dict[str, int] = {}  # of the initial arrays' frozen tensors, once computed

    @property
    def wait_for_nodes(self) -> float | None:
        """Seconds a round waits for enough nodes before the run stops (None: the round timeout)."""
        return self.nodes.wait_for_nodes

    @wait_for_nodes.setter
    def wait_for_nodes(self, seconds: float | None) -> None:
        self.nodes.wait_for_nodes = seconds  # checked there

    @property
    def x(self) -> torch.Tensor | None:
        """The global model's trainable parameters, flat float32 (None before round 1): ``model.x``."""
        return self.model.x

    @x.setter
    def x(self, x: torch.Tensor | None) -> None:
        self.model.x = x

    @property
    def spec(self) -> ModelSpec | None:
        """What the model holds (set with x): ``model.spec``."""
        return self.model.spec

    @property
    def _layout(self) -> Layout:
        """(name, shape) of each tensor of x: ``model.layout``."""
        return self.model.layout

    @property
    def num_parameters(self) -> int:
        """Length d of the flat parameter vector (0 before the first round)."""
        return self.model.num_parameters

    @property
    def sizes(self) -> list[int]:
        """Number of values of each tensor of x, in flat order."""
        return self.model.sizes

    # ------------------------------------------------------------------ the model
    def _init_model(self, arrays: ArrayRecord, spec: ModelSpec | None = None) -> None:
        """Take x and the rest from the initial arrays (subclasses add their optimizer state).

        Raises
        ------
        ValueError
            When ``spec`` (the clients' model description) does not match the arrays: the
            message names the first differing tensor.

        """
        self.model.take({name: arr.numpy() for name, arr in arrays.items()}, spec, self._initial_checksums)

    def arrays(self) -> ArrayRecord:
        """The global model as an ArrayRecord with the initial names, shapes and dtypes (a state_dict)."""
        return self.model.arrays()

    def _sample_with_model(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> list[int]:
        """:meth:`_sample`, and in the first round x from ``arrays`` as the nodes' hellos describe the model.

        Raises
        ------
        ValueError
            In the first round, when every node that answered was refused for good (its model
            does not match the initial arrays, naming the first differing tensor; its ClientApp
            has no DLionClient): nothing has been trained.

        """
        if self.x is None:
            self._initial = {name: arr.numpy() for name, arr in arrays.items()}
            self._initial_checksums = {}
        node_ids = self._sample(grid, server_round)
        if self.x is None:
            if not node_ids and self.nodes.refused:
                reasons = "; ".join(f"node {n}: {why}" for n, why in list(self.nodes.refused.items())[:3])
                raise ValueError(f"no node can take part: {reasons}")
            self._init_model(arrays, self._described)
            self._initial = None
        return node_ids

    # ------------------------------------------------------------------ nodes (nodes.py)
    def partition_of(self, node_id: int) -> int:
        """The key a node is known by: its partition id, or its node id (-1 if unknown)."""
        return self.nodes.partition_of(node_id)

    def _check_and_log_replies(
        self, server_round: int, replies: Iterable[Message], check: Callable[[Message], R]
    ) -> CheckedReplies[R]:
        """The three steps of :mod:`.replies` with ``check(msg)`` (the parsed reply, or RejectedReply).

        For a strategy whose check is one function; each refusal is logged and counted, a node
        whose reply has the wrong layout is left out of sampling until it says hello again.
        """
        checked = check_each(sort_replies(replies, self._outbox, self.nodes.pid_of), check)
        self.nodes.log_refused(server_round, checked, self._outbox)
        for reply, err in checked.refused:
            self._failures.reject(reply.node_id, whole_reason(reply.msg, err))
        return checked

    def _round_outcome(self, server_round: int, valid: int, why: str) -> None:
        """Count the round as failed (fewer than ``min_replies`` valid replies) or reset the count.

        ``why`` is the round's own account (e.g. "0 valid of 3 sent (3 rejected, 0 without a
        reply)"). Subclasses call it at the end of ``aggregate_train``.

        Raises
        ------
        RunStopped
            At the ``max_failed_rounds``-th failed round in a row: the message names the rounds,
            ``why`` and the last distinct reasons replies were rejected for, with their nodes.

        """
        self._failures.outcome(server_round, valid, why)

    def _hello_config(self, server_round: int) -> ConfigRecord:
        """What a hello carries (subclasses add their keys)."""
        return ConfigRecord()

    def _check_hello(self, node_id: int, record: ConfigRecord | MetricRecord) -> None:
        """Raise RejectedReply for a hello this strategy cannot work with (subclasses check the model)."""

    def _nodes_needed(self) -> tuple[int, str] | None:
        """The nodes every round needs to take part, and why: secure aggregation's; None without it."""
        return None if self.secure_rounds is None else self.secure_rounds.nodes_needed(self.min_train_nodes)

    def _on_new_node(self, pid: int, node_id: int, version: int, previous: int | None) -> None:
        """A node introduced itself (``previous``: the node id this key had before)."""
        if previous is not None:
            log(WARNING, "partition %d: node %d replaces node %d (a restarted SuperNode?)", pid, node_id, previous)

    def _sample(self, grid: Grid, server_round: int, *, evaluate: bool = False) -> list[int]:
        """Node ids of the keys sampled for ``server_round`` (seeded by round, see the class doc).

        ``evaluate``: the federated evaluation's sample (``fraction_evaluate``,
        ``min_evaluate_nodes``, its own stream of the seeded generator).
        """
        if evaluate:
            seed = [self.sample_seed, server_round, 1]
            return self.nodes.sample(grid, server_round, self.fraction_evaluate, self.min_evaluate_nodes, seed,
                                     "configure_evaluate")  # fmt: skip
        seed = [self.sample_seed, server_round]
        return self.nodes.sample(grid, server_round, self.fraction_train, self.min_train_nodes, seed, "configure_train")

    # ------------------------------------------------------------------ federated evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's evaluate messages ("arrays": the full model, "config"), as FedAvg sends them.

        The sample is drawn as the training sample is (seeded by the round, ``fraction_evaluate``
        and ``min_evaluate_nodes``). Each message carries the whole model in float32: with
        ``fraction_evaluate = 0`` (the default) nothing is sent and the model is evaluated on the
        server only (``evaluate_fn``).
        """
        if not self.fraction_evaluate or self.x is None:
            return []
        node_ids = self._sample(grid, server_round, evaluate=True)
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        content = RecordDict({"arrays": self.arrays(), "config": config})
        self._evaluating = set(node_ids)
        return [
            Message(content=content, dst_node_id=n, message_type=MessageType.EVALUATE, group_id=str(server_round))
            for n in node_ids
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The example-weighted mean of the replies' metrics (``num-examples``), as FedAvg's."""
        valid = []
        for msg in replies:
            try:
                if msg.has_error():
                    raise RejectedReply(error_text(msg))
                if msg.metadata.src_node_id not in self._evaluating:
                    raise RejectedReply("no evaluate message was sent to this node")
                records = list(msg.content.metric_records.values())
                if len(records) != 1 or not isinstance(records[0].get("num-examples"), int):
                    raise RejectedReply("expected one MetricRecord with an integer 'num-examples'")
                if records[0]["num-examples"] < 1:
                    raise RejectedReply("'num-examples' must be >= 1")
            except RejectedReply as err:
                log(
                    WARNING,
                    "round %d: rejected evaluate reply from node %d: %s",
                    server_round,
                    msg.metadata.src_node_id,
                    err,
                )
                continue
            valid.append(msg.content)
        self._evaluating = set()
        return aggregate_metricrecords(valid, "num-examples") if valid else None

    # ------------------------------------------------------------------ the round loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        start_round: int = 1,
        on_round_end: Callable[[int], Any] | None = None,
    ) -> DLionResult:
        """Flower's ``Strategy.start`` loop, from ``start_round`` (a resume), with a per-round hook.

        As Flower's: rounds ``start_round`` … ``num_rounds`` of configure/send/aggregate
        train, federated evaluation (when ``fraction_evaluate`` > 0), then
        ``evaluate_fn(round, arrays)``; ``evaluate_fn(0, …)`` before round 1 (not when
        resuming). ``on_round_end(round)`` runs after each round's evaluation (the server app
        writes checkpoints there).

        Returns
        -------
        DLionResult
            Flower's ``Result`` plus ``totals``: the run's bytes up and down, as measured and as
            float32 would have been, replies and rounds (:meth:`run_totals`), also logged as the
            closing line, ``[flower-dlion] run totals (result.totals): …``.

        """
        self._check_rounds(start_round, num_rounds)
        return run_rounds(
            self,
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config or ConfigRecord(),
            evaluate_config or ConfigRecord(),
            evaluate_fn,
            start_round=start_round,
            on_round_end=on_round_end,
        )

    def _check_rounds(self, start_round: int, num_rounds: int) -> None:
        """Refuse, before round 1, a run whose rounds the strategy cannot serve (subclasses check)."""

    def run_totals(self) -> MetricRecord:
        """The run's totals so far (what :attr:`DLionResult.totals` holds; :func:`.run_loop.run_totals`)."""
        return run_totals(self.history)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to go on from here (torch-saveable)."""
        return self.model.to_dict() | {
            "partitions": dict(self.nodes.node_of),  # only informative: node ids change after a resume
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` (node ids are forgotten: nodes say hello again)."""
        self.model.load_dict(state)
        self.nodes.forget()
        self.history = [dict(h) for h in state.get("history", [])]
        self._failures = FailedRounds(self.max_failed_rounds, self.min_replies)

    def summary(self) -> None:
        """Log the strategy's options (their ``describe()`` lines, where it has ``options``) and its sampling."""
        if (options := getattr(self, "options", None)) is not None:
            first, *rest = options.describe()
            log(INFO, "\t├──> %s", first)
            for line in rest:
                log(INFO, "\t│\t└──%s", line)
        self._log_sampling()

    def _log_sampling(self) -> None:
        """The sampling line of ``summary()``."""
        log(
            INFO,
            "\t└──> Sampling: fraction_train=%.2f | min_train_nodes=%d | min_available_nodes=%d | min_replies=%d"
            " | fraction_evaluate=%.2f",
            self.fraction_train,
            self.min_train_nodes,
            self.min_available_nodes,
            self.min_replies,
            self.fraction_evaluate,
        )
