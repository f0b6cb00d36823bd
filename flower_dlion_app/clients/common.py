"""What the repository app's clients share: the node's partition of Fashion-MNIST, its batches, its faults.

The data and the partitions are loaded once per process and cached; the model object of the
baseline clients is built once per device and reused (each handler loads the parameters it
received into it). The D-Lion client of the app is :class:`flower_dlion.DLionClient` fed with
:class:`PartitionBatches`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from flwr.app import Context

from flower_dlion.clients.dlion import ClientStateError, resolve_device
from flower_dlion_app.config import read_config
from flower_dlion_app.data import sample_batch
from flower_dlion_app.model import MODELS, Net
from flower_dlion_app.tasks import TaskData, client_data

__all__ = [
    "PartitionBatches",
    "SimulatedFailure",
    "batch",
    "byzantine",
    "inject_failure",
    "model_on",
    "partition",
    "partition_id",
    "seeded_generator",
    "setup",
]


class SimulatedFailure(RuntimeError):
    """A failure injected on purpose (run config ``fail-fraction``), for fault studies."""


def inject_failure(settings: dict[str, Any], pid: int, server_round: int) -> None:
    """Raise :class:`SimulatedFailure` with probability ``fail-fraction``, seeded by (seed, partition, round).

    The same partitions fail in the same rounds in every run with the same seed.
    """
    p = settings["fail-fraction"]
    if p and np.random.default_rng([settings["seed"], pid, server_round, 0xFA11]).random() < p:
        raise SimulatedFailure(f"partition {pid}: simulated failure in round {server_round} (fail-fraction {p})")


def byzantine(settings: dict[str, Any], pid: int, num_partitions: int) -> bool:
    """Whether partition ``pid`` is one of the k = ⌊f·n + ½⌋ Byzantine clients (ids 0 … k−1).

    f is run config ``byzantine-fraction`` and n the number of partitions.
    """
    return pid < int(settings["byzantine-fraction"] * num_partitions + 0.5)


@functools.lru_cache(maxsize=4)
def model_on(device: torch.device, model: str = "cnn") -> Net:
    """One reusable object of run config ``model`` per device (its parameters are overwritten every message)."""
    return MODELS[model]().to(device)


def setup(context: Context) -> tuple[dict[str, Any], torch.device, Net]:
    """The node's checked run config, its device and the model object on it."""
    settings = read_config(context.run_config)
    device = resolve_device(settings["device"])
    return settings, device, model_on(device, settings["model"])


def partition_id(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the node config."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise ClientStateError(
            f"node {context.node_id}: the Fashion-MNIST app needs 'partition-id' and 'num-partitions' in the node "
            'config (simulation sets them; for a SuperNode pass --node-config "partition-id=0 num-partitions=N")'
        ) from err


def partition(context: Context, settings: dict[str, Any]) -> tuple[TaskData, np.ndarray, int]:
    """The task's data (run config ``dataset``: :mod:`flower_dlion_app.tasks`), this node's training rows, its id."""
    pid, num_partitions = partition_id(context)
    if not 0 <= pid < num_partitions:
        raise ClientStateError(f"node {context.node_id}: partition-id {pid} not in [0, {num_partitions})")
    ds, parts = client_data(settings, num_partitions)
    return ds, parts[pid], pid


def batch(
    context: Context,
    settings: dict[str, Any],
    *,
    server_round: int,
    seed: int,
    batch_size: int,
    device: torch.device,
    step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The round's ``step``-th minibatch (inputs, targets) on ``device`` and the partition id."""
    ds, rows, pid = partition(context, settings)
    rows = sample_batch(rows, batch_size, seed=seed, partition_id=pid, server_round=server_round, step=step)
    inputs, targets = ds.train(rows)
    return inputs.to(device), targets.to(device), pid


class PartitionBatches:
    """The node's batches for one round: step k is ``data.sample_batch(…, step=k)``, without end.

    Seeded by (seed, partition, round, step), so a run is reproducible and needs no sampler state.
    """

    def __init__(self, context: Context, settings: dict[str, Any], server_round: int) -> None:
        self.context, self.settings, self.server_round = context, settings, server_round

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            images, labels, _ = batch(
                self.context,
                self.settings,
                server_round=self.server_round,
                seed=self.settings["seed"],
                batch_size=self.settings["batch-size"],
                device=torch.device("cpu"),
                step=step,
            )
            yield images, labels
            step += 1


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A torch generator on ``device`` seeded from integer keys (seed, partition, round)."""
    seed = int(np.random.SeedSequence(list(keys)).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(seed)
