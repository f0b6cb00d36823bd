"""Distributed Lion as a Flower strategy: bit-packed client signs in, a packed Δ out."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Literal

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from .. import codec, lion
from ..model import layout_fingerprint
from ..protocol import (
    CONFIG,
    DELTA,
    LEVELS_STYPE,
    METRICS,
    REPLY_METRICS,
    SIGN_STYPE,
    UPDATE,
    RejectedReply,
    check_envelope,
    checksum,
    message_bytes,
    read_metrics,
)
from .common import ServerModelStrategy, check_common_args

__all__ = ["DistributedLion", "RejectedReply"]


@dataclass
class _Broadcast:
    """One applied Δ, kept encoded so that lagging clients can replay it."""

    version: int  # x's version after applying it
    num_levels: int
    lr: float
    weight_decay: float
    payload: bytes


@dataclass
class _Round:
    """What the strategy sent in the round in progress."""

    server_round: int
    base_version: int
    base_checksum: int
    sent: dict[int, str] = field(default_factory=dict)  # node id → kind sent
    bytes_down: int = 0
    bytes_down_fp32: int = 0


class DistributedLion(ServerModelStrategy):
    r"""Distributed Lion (Liu et al., 2024) on Flower's Message API.

    Each sampled client keeps its own replica of x and its own Lion momentum, and
    replies with its Lion direction packed to one bit per parameter. The strategy sums
    the signs, aggregates them, applies the update to the global model it keeps, and
    broadcasts the packed update in the next round::

        S = Σᵢ δᵢ,   Δ = sign(S) (vote) or S / n (mean),   x ← x − lr·(Δ + wd·x)

    In-sync clients receive only the packed Δ of the rounds they missed (1 bit per
    parameter for a vote between an odd number of clients, 1.6 bits with possible ties,
    ⌈log₂(n+1)⌉ bits for the mean); new or lost clients receive the full model.

    Parameters
    ----------
    aggregation : {"vote", "mean"} (default: "vote")
        Majority vote (``sign(S)``, 0 on a tie) or mean (``S / n``) of the client signs.
    lr : float (default: 5e-4)
        Learning rate, applied on the server and on every replica.
    weight_decay : float (default: 0.1)
        Decoupled weight decay ``wd`` in ``x ← x − lr·(Δ + wd·x)``.
    beta1 : float (default: 0.9)
        Lion's interpolation factor for the direction, sent to the clients.
    beta2 : float (default: 0.99)
        Lion's momentum decay, sent to the clients.
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled each round.
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled each round.
    min_available_nodes : int (default: 2)
        Wait until this many nodes are connected before sampling.
    min_replies : int (default: 1)
        A round with fewer valid replies applies no update.
    max_history_bytes : int | None (default: None)
        Bytes of past encoded Δs kept for clients that missed rounds; ``None`` keeps up
        to the size of the full model (a longer chain is never cheaper than the model).

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
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.99,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        min_replies: int = 1,
        max_history_bytes: int | None = None,
    ) -> None:
        if aggregation not in ("vote", "mean"):
            raise ValueError(f"aggregation must be 'vote' or 'mean', got {aggregation!r}")
        super().__init__(
            fraction_train=fraction_train,
            min_train_nodes=min_train_nodes,
            min_available_nodes=min_available_nodes,
            min_replies=min_replies,
        )
        check_common_args(
            lr=lr,
            weight_decay=weight_decay,
            betas={"beta1": beta1, "beta2": beta2},
        )
        if lr * weight_decay >= 1.0:
            raise ValueError(f"lr * weight_decay must be < 1 (got {lr * weight_decay}): x would flip sign every step")
        if max_history_bytes is not None and max_history_bytes < 0:
            raise ValueError(f"max_history_bytes must be >= 0 or None, got {max_history_bytes}")
        self.aggregation = aggregation
        self.lr = lr
        self.weight_decay = weight_decay
        self.beta1 = beta1
        self.beta2 = beta2
        self.max_history_bytes = max_history_bytes

        # Global model and its bookkeeping, set from the initial arrays in round 1.
        self.version = 0
        self._history: deque[_Broadcast] = deque()
        self._node_version: dict[int, int] = {}
        self._round: _Round | None = None
        self.history: list[dict[str, Any]] = []  # one dict of metrics per aggregated round

    # ------------------------------------------------------------------ summary
    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> Distributed Lion: aggregation=%s", self.aggregation)
        log(
            INFO,
            "\t│\t└──lr=%g | weight_decay=%g | beta1=%g | beta2=%g",
            self.lr,
            self.weight_decay,
            self.beta1,
            self.beta2,
        )
        self._log_sampling()

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and send each one only what it lacks to reach the current x."""
        if self.x is None:
            self._init_model(arrays)
        assert self.x is not None
        node_ids = self._sample(grid)
        rnd = _Round(server_round, self.version, checksum(self.x))
        self._round = rnd
        messages = []
        for node_id in node_ids:
            content, kind, payload_len = self._content_for(node_id, server_round, config)
            msg = Message(
                content=content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=str(server_round)
            )
            size = message_bytes(msg)
            rnd.sent[node_id] = kind
            rnd.bytes_down += size
            rnd.bytes_down_fp32 += size - payload_len + (4 * self.num_parameters if kind != "none" else 0)
            messages.append(msg)
        return messages

    def _content_for(self, node_id: int, server_round: int, config: ConfigRecord) -> tuple[RecordDict, str, int]:
        """The message content for one node, its kind, and its payload length in bytes."""
        assert self.x is not None
        cfg = ConfigRecord(dict(config))
        cfg.update(
            {
                "server-round": server_round,
                "version": self.version,
                "beta1": self.beta1,
                "beta2": self.beta2,
            }
        )
        have = self._node_version.get(node_id)
        chain = self._chain_since(have) if have is not None else None
        if have == self.version:
            cfg.update({"kind": "none", "base-version": have})
            return RecordDict({CONFIG: cfg}), "none", 0
        if chain is not None:
            payload = b"".join(b.payload for b in chain)
            cfg.update(
                {
                    "kind": "deltas",
                    "base-version": have,
                    "num-levels": [b.num_levels for b in chain],
                    "lr": [b.lr for b in chain],
                    "weight-decay": [b.weight_decay for b in chain],
                }
            )
            array = Array(dtype="level", shape=(len(chain) * self.num_parameters,), stype=LEVELS_STYPE, data=payload)
            return RecordDict({CONFIG: cfg, UPDATE: ArrayRecord({"payload": array})}), "deltas", len(payload)
        cfg.update({"kind": "full", "base-version": -1, "layout": layout_fingerprint(self._layout)})
        array = Array(self.x.numpy().copy())
        return RecordDict({CONFIG: cfg, UPDATE: ArrayRecord({"payload": array})}), "full", 4 * self.num_parameters

    def _chain_since(self, have: int) -> list[_Broadcast] | None:
        """The Δs from version ``have`` to now, if kept and smaller than the full model."""
        needed = self.version - have
        if needed <= 0 or needed > len(self._history):
            return None
        chain = list(self._history)[-needed:]
        if chain[0].version != have + 1 or sum(len(b.payload) for b in chain) >= 4 * self.num_parameters:
            return None
        return chain

    def _check_reply(self, msg: Message, rnd: _Round) -> tuple[int, bytes, dict[str, float]]:
        """Validate one reply; return (node id, packed signs, metrics) or raise RejectedReply."""
        node_id = msg.metadata.src_node_id
        check_envelope(msg, rnd.sent.keys(), rnd.server_round, (DELTA, METRICS))
        content = msg.content
        record = content[DELTA]
        if not isinstance(record, ArrayRecord) or len(record) != 1:
            raise RejectedReply(f"'{DELTA}' must be an ArrayRecord holding one Array")
        arr = next(iter(record.values()))
        d = self.num_parameters
        if arr.stype != SIGN_STYPE or arr.dtype != "bit":
            raise RejectedReply(f"Array has stype {arr.stype!r} dtype {arr.dtype!r}, expected {SIGN_STYPE!r} 'bit'")
        if tuple(arr.shape) != (d,):
            raise RejectedReply(f"Array shape {tuple(arr.shape)}, expected ({d},)")
        if len(arr.data) != codec.packed_size(d):
            raise RejectedReply(f"{len(arr.data)} bytes of signs, expected {codec.packed_size(d)} for d={d}")
        values = read_metrics(content, METRICS, REPLY_METRICS)
        if values["version"] != rnd.base_version:
            raise RejectedReply(f"replica at version {values['version']}, expected {rnd.base_version}")
        if values["checksum"] != rnd.base_checksum:
            raise RejectedReply(
                f"replica checksum {values['checksum']} differs from the server's {rnd.base_checksum}: "
                "the node will be sent the full model"
            )
        return node_id, arr.data, values

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, vote or average their signs, apply Δ to x, and return x."""
        rnd = self._round
        if rnd is None or rnd.server_round != server_round or self.x is None:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for that round")
        d = self.num_parameters
        payloads, losses, examples, valid_nodes = [], [], [], set()
        bytes_up = bytes_up_fp32 = rejected = 0
        for msg in replies:
            node_id = msg.metadata.src_node_id
            size = message_bytes(msg)
            bytes_up += size
            try:
                node_id, data, values = self._check_reply(msg, rnd)
            except RejectedReply as err:
                rejected += 1
                bytes_up_fp32 += size
                log(WARNING, "round %d: rejected reply from node %d: %s", server_round, node_id, err)
                continue
            bytes_up_fp32 += size - len(data) + 4 * d
            payloads.append(data)
            losses.append(values["train-loss"])
            examples.append(values["num-examples"])
            valid_nodes.add(node_id)
        for node_id in rnd.sent:  # a node without a valid reply is in an unknown state: full model next time
            if node_id in valid_nodes:
                self._node_version[node_id] = rnd.base_version
            else:
                self._node_version.pop(node_id, None)

        n = len(payloads)
        tie_fraction = agreement = 0.0
        applied = n >= self.min_replies
        if applied:
            votes = 2 * codec.count_ones(payloads, d) - n  # S = Σδᵢ
            update = lion.aggregate(votes, n, self.aggregation)
            delta = codec.levels_to_values(update.levels, update.num_levels)
            lion.apply_update_(self.x, delta, self.lr, self.weight_decay)
            self.version += 1
            self._remember(
                _Broadcast(
                    self.version,
                    update.num_levels,
                    self.lr,
                    self.weight_decay,
                    codec.encode_levels(update.levels, update.num_levels).numpy().tobytes(),
                )
            )
            tie_fraction = float((votes == 0).float().mean())
            agreement = float(votes.abs().float().mean()) / n
        else:
            log(WARNING, "round %d: %d valid replies < min_replies=%d, x unchanged", server_round, n, self.min_replies)

        total = sum(examples)
        metrics = {
            "num-replies": n,
            "num-rejected": rejected,
            "num-sampled": len(rnd.sent),
            "full-syncs": sum(1 for kind in rnd.sent.values() if kind == "full"),
            "applied": int(applied),
            "version": self.version,
            "train-loss": sum(v * e for v, e in zip(losses, examples, strict=True)) / total if total else math.nan,
            "num-examples": int(total),
            "bytes-up": int(bytes_up),
            "bytes-down": int(rnd.bytes_down),
            "bytes-up-fp32": int(bytes_up_fp32),
            "bytes-down-fp32": int(rnd.bytes_down_fp32),
            "tie-fraction": tie_fraction,
            "agreement": agreement,
        }
        self.history.append({"round": server_round, **metrics})
        self._round = None
        return self.arrays(), MetricRecord(metrics)

    def _remember(self, broadcast: _Broadcast) -> None:
        """Keep encoded Δs for lagging clients, up to ``max_history_bytes``."""
        self._history.append(broadcast)
        limit = 4 * self.num_parameters if self.max_history_bytes is None else self.max_history_bytes
        while self._history and sum(len(b.payload) for b in self._history) > limit:
            self._history.popleft()
