"""What both of our strategies share: argument checks, the flat global model, sampling, no federated eval."""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.supercore import log

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
        out[name] = Array(flat[offset : offset + n].reshape(shape).copy())
        offset += n
    return ArrayRecord(out)


class ServerModelStrategy(Strategy):
    """Base of our strategies: the strategy holds the global model x as one flat float32 vector.

    x is taken from the initial arrays in the first ``configure_train``. The model is
    evaluated on the server (``evaluate_fn``); there is no federated evaluation.

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

    """

    def __init__(
        self, *, fraction_train: float, min_train_nodes: int, min_available_nodes: int, min_replies: int
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
        self.x: torch.Tensor | None = None  # the global model, flat float32
        self._layout: Layout = []

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

    def _sample(self, grid: Grid) -> list[int]:
        """Flower's node sampling with this strategy's fraction and minimums; logs the sample."""
        num_nodes = int(len(list(grid.get_node_ids())) * self.fraction_train)
        node_ids, all_nodes = sample_nodes(grid, self.min_available_nodes, max(num_nodes, self.min_train_nodes))
        log(INFO, "configure_train: sampled %d nodes (out of %d)", len(node_ids), len(all_nodes))
        return node_ids

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
