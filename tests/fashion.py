"""Fashion-MNIST for the library's tests, as a user's own app would load it: no import of the repository's app.

The same data and the same partitions as ``flower_dlion_app.data`` gives (its IDX files, its
normalization, flwr-datasets' Dirichlet partitioner with the same arguments), so the tests that
moved here from the app's helpers train on exactly what they trained on before. The files come
from ``$FLOWER_DLION_FASHION`` (a folder with the four IDX files, optionally gzipped) or Debian's
``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``).
"""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["FashionMNIST", "dirichlet_partitions", "load", "to_tensor"]

FOLDERS = [os.environ.get("FLOWER_DLION_FASHION", ""), "/usr/share/datasets/fashion-mnist"]
FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
MEAN, STD = 0.2860, 0.3530  # the training set's pixel statistics


class FashionMNIST(NamedTuple):
    """Images as uint8 (N, 28, 28), labels as int64 (N,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _read_idx(path: Path) -> np.ndarray:
    """One IDX file (gzipped or not) as a numpy array."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


@functools.cache
def load() -> FashionMNIST:
    """Fashion-MNIST from the first folder of :data:`FOLDERS` that holds its four files.

    Returns
    -------
    FashionMNIST
        60,000 training and 10,000 test images with their labels.

    Raises
    ------
    FileNotFoundError
        No folder holds the four files.

    """
    for folder in filter(None, FOLDERS):
        found = {}
        for key, stem in FILES.items():
            for name in (stem + ".gz", stem):
                if (Path(folder) / name).is_file():
                    found[key] = Path(folder) / name
                    break
        if len(found) == 4:
            arrays = {k: _read_idx(p) for k, p in found.items()}
            y_train, y_test = arrays["y_train"].astype(np.int64), arrays["y_test"].astype(np.int64)
            return FashionMNIST(arrays["x_train"], y_train, arrays["x_test"], y_test)
    raise FileNotFoundError(
        f"Fashion-MNIST's IDX files are in none of {[f for f in FOLDERS if f]}: set FLOWER_DLION_FASHION "
        "or install Debian's dataset-fashion-mnist"
    )


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) → normalized float32 (N, 1, 28, 28)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    return x.sub_(MEAN).div_(STD).unsqueeze(1)


@functools.cache
def dirichlet_partitions(num_partitions: int, alpha: float = 0.5, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Row indices of each Dirichlet(``alpha``) partition of the training set (flwr-datasets' partitioner).

    Parameters
    ----------
    num_partitions : int
        Number of partitions.
    alpha : float (default: 0.5)
        The concentration: smaller is more skewed.
    seed : int (default: 0)
        The partitioner's seed.

    Returns
    -------
    tuple of numpy.ndarray
        One int64 array of training-set rows per partition.

    """
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    labels = load().y_train
    part = DirichletPartitioner(
        num_partitions=num_partitions, partition_by="label", alpha=alpha, min_partition_size=10, seed=seed
    )
    part.dataset = Dataset.from_dict({"label": labels, "row": np.arange(labels.size)})
    return tuple(np.asarray(part.load_partition(i)["row"], dtype=np.int64) for i in range(num_partitions))
