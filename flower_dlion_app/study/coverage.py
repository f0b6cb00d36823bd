"""Whether a cell's partitioning gives every client data and every class a client, checked before it runs.

Some partitionings leave something out: ``pathological-2`` on 8 clients of Fashion-MNIST (seed 0)
gives class 9 to no client, and ``pathological-1`` on 3 clients gives each client one of the
classes 0, 1, 2 and nobody the other seven; a class with fewer images than the clients that
share it leaves one of them empty. flwr-datasets says so only in a warning, once, when it first
computes the partitions. The sweep computes each cell's partitions the way its clients will
(`partition_indices` on the training labels without the ``holdout``, the same arguments, and
the same on-disk cache, so the clients then load them instead of computing them again), records
what is missing in the cell's JSON (``partition_check``), and refuses such a cell unless the
study says ``allow-empty = true``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["cell_coverage", "describe", "partition_coverage", "partition_key"]


def partition_coverage(labels: np.ndarray, parts: Sequence[np.ndarray], classes: Sequence[int]) -> dict[str, Any]:
    """What a partitioning leaves out.

    Parameters
    ----------
    labels : np.ndarray
        The class label of every row the partitions index.
    parts : sequence of np.ndarray
        Each client's row indices into ``labels``.
    classes : sequence of int
        The classes that should reach some client (the training set's classes).

    Returns
    -------
    dict
        ``client_sizes``: each client's number of rows; ``missing_classes``: the classes of
        ``classes`` that no client has, ascending; ``empty_clients``: the clients (partition ids)
        with no rows, ascending.

    """
    seen: set[int] = set()
    for rows in parts:
        seen.update(int(c) for c in np.unique(labels[rows]))
    return {
        "client_sizes": [int(rows.size) for rows in parts],
        "missing_classes": sorted(int(c) for c in classes if int(c) not in seen),
        "empty_clients": [i for i, rows in enumerate(parts) if rows.size == 0],
    }


def partition_key(run_config: dict[str, Any], num_clients: int) -> tuple[Any, ...]:
    """What a cell's partitions depend on: cells with the same key train on the same partitions.

    Parameters
    ----------
    run_config : dict
        The cell's run config (defaults filled in by ``read_config``).
    num_clients : int
        The cell's number of clients (its partitions).

    Returns
    -------
    tuple
        ``(dataset, data-dir, partitioner, num_clients, alpha, seed, classes-per-partition, holdout)``.

    """
    from flower_dlion_app.config import read_config

    cfg = read_config(run_config)
    return (
        cfg["dataset"],
        cfg["data-dir"],
        cfg["partitioner"],
        num_clients,
        float(cfg["alpha"]),
        int(cfg["seed"]),
        int(cfg["classes-per-partition"]),
        int(cfg["holdout"]),
    )


def cell_coverage(run_config: dict[str, Any], num_clients: int) -> dict[str, Any]:
    """`partition_coverage` of the partitions the clients of a cell will train on.

    The arguments are those of `partition_key`, and so is the cache: cells with the same key
    compute their partitions once. Returns a new dict each call, as `partition_coverage`; the
    classes are those of the whole training set.
    """
    found = _coverage(*partition_key(run_config, num_clients))
    return {k: list(v) for k, v in found.items()}


@functools.lru_cache(maxsize=64)
def _coverage(
    dataset: str, data_dir: str, partitioner: str, num_clients: int, alpha: float, seed: int, cpp: int, holdout: int
) -> dict[str, Any]:
    from flower_dlion_app.data import load_fashion_mnist, partition_indices

    if dataset == "shakespeare":  # a client is a role with one window at least; no class is any client's to give
        from flower_dlion_app.tasks import client_data

        settings = {"dataset": dataset, "data-dir": data_dir, "partitioner": partitioner, "alpha": alpha}
        _, parts = client_data(settings | {"seed": seed, "classes-per-partition": cpp, "holdout": holdout}, num_clients)
        sizes = [int(p.size) for p in parts]
        empty = [i for i, n in enumerate(sizes) if not n]
        return {"client_sizes": sizes, "missing_classes": [], "empty_clients": empty}
    ds = load_fashion_mnist(data_dir)
    labels = ds.y_train[: ds.y_train.size - holdout]  # as clients.common: the last `holdout` images are the server's
    parts = partition_indices(
        labels, partitioner=partitioner, num_partitions=num_clients, alpha=alpha, seed=seed, classes_per_partition=cpp
    )
    return partition_coverage(labels, parts, np.unique(ds.y_train).tolist())


def describe(check: dict[str, Any]) -> str:
    """What a `partition_coverage` result leaves out, in words ("" when nothing)."""
    missing, empty = check["missing_classes"], check["empty_clients"]
    what = []
    if missing:
        what.append(f"no client has class{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    if empty:
        what.append(f"client{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} got no data")
    return " and ".join(what)
