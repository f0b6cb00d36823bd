"""The app's two tasks behind one seam: Fashion-MNIST images (the default) and Shakespeare's roles.

Run config ``dataset`` picks one; everything the app's clients and server need of it goes
through :func:`client_data` (a node's training rows and their batches) and
:func:`evaluation_set` (the server's test or validation set):

==================  ===================================  ========================================
                    ``fashion-mnist``                    ``shakespeare``
==================  ===================================  ========================================
a sample            a 28×28 image and its class          80 characters and the next one
                                                         (:mod:`flower_dlion_app.shakespeare`)
models              ``cnn``, ``cnn-bn``                  ``char-lstm``, ``char-transformer``
partitioners        ``iid``, ``dirichlet``,              ``natural`` (a speaking role is a
                    ``pathological``, ``shard``          client, LEAF's split), ``iid`` (the
                                                         control: the same sizes, windows shuffled)
test set            the 10,000 test images               :data:`EVAL_WINDOWS` test windows drawn
                                                         with seed 0 from every role's last 20 %
validation          the last ``holdout`` training        ``holdout`` other test windows (seed 1,
(``holdout`` > 0)   images, kept from the clients        disjoint from the test draw)
==================  ===================================  ========================================

With Shakespeare, num-partitions N may be smaller than the number of roles (1,112): node i then
trains on role ``order[i]`` of a permutation drawn with the run's seed, so a 20-node simulation
gets 20 roles from all over the plays rather than the first 20 by name.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import numpy as np
import torch

from flower_dlion_app import shakespeare
from flower_dlion_app.data import load_fashion_mnist, partition_indices, to_tensor

__all__ = ["DATASETS", "EVAL_WINDOWS", "MODELS_OF", "PARTITIONERS_OF", "TaskData", "client_data", "evaluation_set"]

DATASETS = ("fashion-mnist", "shakespeare")
MODELS_OF = {"fashion-mnist": ("cnn", "cnn-bn"), "shakespeare": ("char-lstm", "char-transformer")}
PARTITIONERS_OF = {"fashion-mnist": ("iid", "dirichlet", "pathological", "shard"), "shakespeare": ("natural", "iid")}
EVAL_WINDOWS = 4_000  # Shakespeare's test set: ±0.8 % standard error at 50 % (the LSTM reads 80 characters a window)


class TaskData(Protocol):
    """A task's training samples, by row."""

    def train(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and targets of training rows ``rows`` (CPU tensors)."""


class _Images:
    def __init__(self, data_dir: str) -> None:
        self.ds = load_fashion_mnist(data_dir)

    def train(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return to_tensor(self.ds.x_train[rows]), torch.from_numpy(self.ds.y_train[rows])


class _Text:
    def __init__(self) -> None:
        self.data = shakespeare.load_shakespeare()

    def train(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return shakespeare.batch(self.data, np.asarray(rows), split="train")


@functools.lru_cache(maxsize=4)
def _data(dataset: str, data_dir: str) -> TaskData:
    return _Images(data_dir) if dataset == "fashion-mnist" else _Text()


@functools.lru_cache(maxsize=4)
def _partitions(
    dataset: str, data_dir: str, partitioner: str, num_partitions: int, alpha: float, seed: int, cpp: int, holdout: int
) -> tuple[np.ndarray, ...]:
    if dataset == "fashion-mnist":
        labels = load_fashion_mnist(data_dir).y_train
        labels = labels[: labels.size - holdout]  # the last `holdout` images are the server's validation set
        kw = {"alpha": alpha, "seed": seed, "classes_per_partition": cpp}
        return tuple(partition_indices(labels, partitioner=partitioner, num_partitions=num_partitions, **kw))
    text = _data(dataset, data_dir)
    assert isinstance(text, _Text)
    roles = text.data.num_clients
    if num_partitions > roles:
        raise ValueError(f"num-partitions {num_partitions}: Shakespeare has {roles} roles, one a client at most")
    parts = shakespeare.partitions(text.data, "role" if partitioner == "natural" else "iid", seed=seed)
    order = np.arange(roles) if num_partitions == roles else np.random.default_rng([seed, 0x5EED]).permutation(roles)
    return tuple(parts[i] for i in order[:num_partitions])


def client_data(settings: dict[str, Any], num_partitions: int) -> tuple[TaskData, tuple[np.ndarray, ...]]:
    """The task's training data and every partition's rows, as run config ``settings`` says (cached)."""
    key = (settings["dataset"], settings["data-dir"])
    parts = _partitions(
        *key,
        settings["partitioner"],
        num_partitions,
        settings["alpha"],
        settings["seed"],
        settings["classes-per-partition"],
        settings["holdout"],
    )
    return _data(*key), parts


def evaluation_set(cfg: dict[str, Any]) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(name, inputs, targets): the task's test set, or its validation set when ``holdout`` > 0."""
    if cfg["dataset"] == "fashion-mnist":
        data = load_fashion_mnist(cfg["data-dir"])
        if cfg["holdout"]:
            rows = slice(data.y_train.size - cfg["holdout"], None)
            return "validation", to_tensor(data.x_train[rows]), torch.from_numpy(data.y_train[rows])
        return "test", to_tensor(data.x_test), torch.from_numpy(data.y_test)
    text = shakespeare.load_shakespeare()
    n, holdout = EVAL_WINDOWS, cfg["holdout"]
    order = np.random.default_rng(0).permutation(text.test.num_windows)
    rows = np.sort(order[n : n + holdout]) if holdout else np.sort(order[:n])  # validation: after the test draw
    x, y = shakespeare.batch(text, rows, split="test")
    return ("validation" if holdout else "test"), x, y
