"""What both of our strategies share: checks, the flat model, sampling by partition, the round loop.

Nodes are known by partition id and sampled reproducibly; the round loop can start at a
later round (a resume); there is no federated evaluation.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from ..protocol import HELLO, RejectedReply, error_text, read_metrics, to_array

__all__ = ["Layout", "ServerModelStrategy", "check_common_args", "flatten", "unflatten"]

Layout = list[tuple[str, tuple[int, ...]]]


def check_common_args(*, lr: float, weight_decay: float, betas: dict[str, float]) -> None:
    """Raise ``ValueError`` (torch.optim's wording) for a bad learning rate, decay or beta."""
    if not (math.isfinite(lr) and lr > 0.0):
        raise ValueError(f"Invalid learning rate: {lr} (must be finite and > 0)")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be finite and >= 0)")
    for name, beta in betas.items():
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {name} parameter: {beta} (must be in [0, 1))")


def flatten(arrays: ArrayRecord) -> tuple[torch.Tensor, Layout]:
    """The initial arrays as one flat float32 vector and their (name, shape) layout."""
    flats, layout = [], []
    for name, arr in arrays.items():
        a = arr.numpy()
        if a.dtype.kind != "f":
            raise ValueError(
                f"initial array {name!r} has dtype {a.dtype}: the strategy updates trainable float "
                "parameters only; pass an ArrayRecord of the model's named_parameters()"
            )
        layout.append((name, a.shape))
        flats.append(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).reshape(-1))
    if not flats:
        raise ValueError("initial ArrayRecord is empty")
    return torch.cat(flats).clone(), layout


def unflatten(x: torch.Tensor, layout: Layout) -> ArrayRecord:
    """The flat vector as an ArrayRecord with the initial names and shapes."""
    out, offset, flat = {}, 0, x.numpy()
    for name, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = to_array(flat[offset : offset + n].reshape(shape))  # the values copied once
        offset += n
    return ArrayRecord(out)


class ServerModelStrategy(Strategy):
    """Base of our strategies: the strategy holds the global model x as one flat float32 vector.

    x is taken from the initial arrays in the first ``configure_train``. The model is
    evaluated on the server (``evaluate_fn``); there is no federated evaluation.

    Nodes are known by their partition id, not by Flower's node ids (random per run, new
    after a SuperNode restarts): each new node id gets one ``query`` message
    (``protocol.HELLO``) and says which partition it trains on. Round t samples
    ``max(min_train_nodes, ⌊fraction_train · N⌋)`` of the N connected partitions with
    ``numpy.random.default_rng([sample_seed, t])``: the same partitions in every run with
    the same seed, whatever the node ids, and after a resume.

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

    """

    def __init__(
        self,
        *,
        fraction_train: float,
        min_train_nodes: int,
        min_available_nodes: int,
        min_replies: int,
        sample_seed: int = 0,
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        for name, value in (
            ("min_train_nodes", min_train_nodes),
            ("min_available_nodes", min_available_nodes),
            ("min_replies", min_replies),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.min_replies = min_replies
        self.sample_seed = sample_seed
        self.x: torch.Tensor | None = None  # the global model, flat float32
        self._layout: Layout = []
        self._pid_of: dict[int, int] = {}  # node id → partition id
        self._node_of: dict[int, int] = {}  # partition id → node id
        self.query_timeout = 600.0  # seconds to wait for the answers to a hello
        self._outbox: list[Message] = []  # the train messages of the round in progress

    @property
    def num_parameters(self) -> int:
        """Length d of the flat parameter vector (0 before the first round)."""
        return 0 if self.x is None else self.x.numel()

    def _init_model(self, arrays: ArrayRecord) -> None:
        """Take x and its layout from the initial arrays (subclasses add their optimizer state)."""
        self.x, self._layout = flatten(arrays)

    def arrays(self) -> ArrayRecord:
        """The global model x as an ArrayRecord with the initial names and shapes."""
        assert self.x is not None
        return unflatten(self.x, self._layout)

    def partition_of(self, node_id: int) -> int:
        """The partition id a node said it trains on (-1 if unknown)."""
        return self._pid_of.get(node_id, -1)

    def _reply_node(self, reply: Message, sent: Iterable[Message] | None = None) -> tuple[int, int]:
        """The node a reply speaks for and its partition id (-1 if unknown).

        A node's own reply: its sender. When a node stops heartbeating, the SuperLink answers
        the message sent to it with an error of its own (sender ``SUPERLINK_NODE_ID``); that
        reply is the node's, found by the message it answers (``reply_to_message_id``; the
        Grid gave the sent messages their ids). The node's id is then forgotten, so that it is
        greeted again (hello) when it reconnects: a SuperNode restarted under node
        authentication keeps its id, but not its state.
        """
        node_id = reply.metadata.src_node_id
        answered = reply.metadata.reply_to_message_id
        if node_id == SUPERLINK_NODE_ID and answered:
            for msg in self._outbox if sent is None else sent:
                if msg.metadata.message_id == answered:
                    node_id = msg.metadata.dst_node_id
                    pid = self._pid_of.pop(node_id, -1)
                    if self._node_of.get(pid) == node_id:
                        del self._node_of[pid]
                    return node_id, pid
        return node_id, self.partition_of(node_id)

    def _hello_config(self, server_round: int) -> ConfigRecord:
        """What a hello carries (subclasses add their keys)."""
        return ConfigRecord()

    def _on_new_node(self, pid: int, node_id: int, version: int, previous: int | None) -> None:
        """A node introduced itself (``previous``: the node id this partition had before)."""
        if previous is not None:
            log(WARNING, "partition %d: node %d replaces node %d (a restarted SuperNode?)", pid, node_id, previous)

    def _discover(self, grid: Grid, server_round: int) -> list[int]:
        """Wait for ``min_available_nodes``; say hello to new node ids; the connected nodes we know."""
        connected = list(grid.get_node_ids())
        while len(connected) < self.min_available_nodes:
            log(INFO, "waiting for nodes: %d of %d connected", len(connected), self.min_available_nodes)
            time.sleep(1.0)
            connected = list(grid.get_node_ids())
        new = [n for n in connected if n not in self._pid_of]
        if new:
            content = RecordDict({HELLO: self._hello_config(server_round)})
            group = f"hello-{server_round}"
            hellos = [
                Message(content=content, dst_node_id=n, message_type=MessageType.QUERY, group_id=group) for n in new
            ]
            for reply in grid.send_and_receive(hellos, timeout=self.query_timeout):
                node_id, _ = self._reply_node(reply, hellos)
                try:
                    if reply.has_error():
                        raise RejectedReply(error_text(reply))
                    if node_id not in new:
                        raise RejectedReply("no hello was sent to this node")
                    values = read_metrics(reply.content, HELLO, ("partition-id", "version"), extra_ok=True)
                    pid, version = values["partition-id"], values["version"]
                    if not (isinstance(pid, int) and pid >= 0 and isinstance(version, int) and version >= -1):
                        raise RejectedReply(f"partition-id {pid!r} / version {version!r} are not valid integers")
                except (RejectedReply, KeyError, TypeError) as err:
                    log(WARNING, "round %d: rejected hello from node %d: %s", server_round, node_id, err)
                    continue
                previous = self._node_of.get(pid)
                if previous is not None:
                    self._pid_of.pop(previous, None)
                self._pid_of[node_id] = pid
                self._node_of[pid] = node_id
                self._on_new_node(pid, node_id, version, previous)
        return [n for n in connected if self._pid_of.get(n) is not None and self._node_of[self._pid_of[n]] == n]

    def _sample(self, grid: Grid, server_round: int) -> list[int]:
        """Node ids of the partitions sampled for ``server_round`` (seeded by round, see the class doc)."""
        nodes = self._discover(grid, server_round)
        pids = sorted(self._pid_of[n] for n in nodes)
        k = min(len(pids), max(self.min_train_nodes, int(len(pids) * self.fraction_train)))
        if k < len(pids):
            pids = sorted(np.random.default_rng([self.sample_seed, server_round]).choice(pids, k, replace=False))
        log(INFO, "configure_train: sampled %d nodes (out of %d)", len(pids), len(nodes))
        return [self._node_of[int(p)] for p in pids]

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
    ) -> Result:
        """Flower's ``Strategy.start`` loop, from ``start_round`` (a resume), with a per-round hook.

        As Flower's: rounds ``start_round`` … ``num_rounds`` of configure/send/aggregate
        train, then ``evaluate_fn(round, arrays)``; ``evaluate_fn(0, …)`` before round 1
        (not when resuming). There is no federated evaluation. ``on_round_end(round)`` runs
        after each round's evaluation (the server app writes checkpoints there).
        """
        log(INFO, "Starting %s strategy (rounds %d to %d):", type(self).__name__, start_round, num_rounds)
        self.summary()
        self.query_timeout = timeout
        train_config = ConfigRecord() if train_config is None else train_config
        result = Result()
        t_start = time.time()
        arrays = initial_arrays
        if evaluate_fn and start_round == 1:
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        for current_round in range(start_round, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(current_round, arrays, train_config, grid), timeout=timeout
            )
            agg_arrays, agg_metrics = self.aggregate_train(current_round, replies)
            if agg_arrays is not None:
                result.arrays = arrays = agg_arrays
            if agg_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_metrics)
                result.train_metrics_clientapp[current_round] = agg_metrics
            if evaluate_fn:
                res = evaluate_fn(current_round, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
            if on_round_end:
                on_round_end(current_round)
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to go on from here (torch-saveable)."""
        return {
            "x": None if self.x is None else self.x.clone(),
            "layout": list(self._layout),
            "partitions": dict(self._node_of),  # only informative: node ids change after a resume
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` (node ids are forgotten: nodes say hello again)."""
        self.x = None if state["x"] is None else state["x"].clone()
        self._layout = [(name, tuple(shape)) for name, shape in state["layout"]]
        self._pid_of, self._node_of = {}, {}

    def _log_sampling(self) -> None:
        """The sampling line of ``summary()``."""
        log(
            INFO,
            "\t└──> Sampling: fraction_train=%.2f | min_train_nodes=%d | min_available_nodes=%d | min_replies=%d",
            self.fraction_train,
            self.min_train_nodes,
            self.min_available_nodes,
            self.min_replies,
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: x is evaluated on the server (``evaluate_fn``)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None
