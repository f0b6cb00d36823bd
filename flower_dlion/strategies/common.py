"""What both of our strategies do the same way: argument checks, the flat model, sampling."""

from __future__ import annotations

import math
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.supercore import log

__all__ = ["Layout", "check_common_args", "flatten", "log_sampling", "sample", "unflatten"]

Layout = list[tuple[str, tuple[int, ...]]]


def check_common_args(
    *,
    lr: float,
    weight_decay: float,
    betas: dict[str, float],
    fraction_train: float,
    minimums: dict[str, int],
) -> None:
    """Raise ``ValueError`` (torch.optim's wording) for a bad learning rate, decay, beta or count."""
    if not (math.isfinite(lr) and lr > 0.0):
        raise ValueError(f"Invalid learning rate: {lr} (must be finite and > 0)")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be finite and >= 0)")
    for name, beta in betas.items():
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {name} parameter: {beta} (must be in [0, 1))")
    if not 0.0 < fraction_train <= 1.0:
        raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
    for name, value in minimums.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


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


def sample(strategy: Any, grid: Grid) -> list[int]:
    """Flower's node sampling with the strategy's fraction and minimums; logs the sample."""
    num_nodes = int(len(list(grid.get_node_ids())) * strategy.fraction_train)
    node_ids, all_nodes = sample_nodes(grid, strategy.min_available_nodes, max(num_nodes, strategy.min_train_nodes))
    log(INFO, "configure_train: sampled %d nodes (out of %d)", len(node_ids), len(all_nodes))
    return node_ids


def log_sampling(strategy: Any) -> None:
    """The sampling line of ``summary()``."""
    log(
        INFO,
        "\t└──> Sampling: fraction_train=%.2f | min_train_nodes=%d | min_available_nodes=%d | min_replies=%d",
        strategy.fraction_train,
        strategy.min_train_nodes,
        strategy.min_available_nodes,
        strategy.min_replies,
    )
