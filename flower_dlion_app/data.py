"""Fashion-MNIST, offline first, and non-iid partitions made with flwr-datasets.

Where the data comes from, in order:

1. ``data_dir`` (run-config key ``data-dir``), a folder holding the four IDX files
   (``train-images-idx3-ubyte[.gz]`` …) directly or in torchvision's ``FashionMNIST/raw``;
2. Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``);
3. torchvision's download into ``~/.cache/flower-dlion`` (needs internet).

Partitions are computed on the label column alone (a two-column ``datasets.Dataset`` of
labels and row indices) by flwr-datasets' partitioners, so the images are never copied.
They are cached on disk (``<cache>/partitions/<key>.npz``, key: labels, partitioner
arguments and the flwr-datasets version): on Flower's Deployment Engine every message
starts a new ClientApp process, and computing them again took 4–5 s of each message.
``<cache>`` is ``$FLOWER_DLION_CACHE`` or ``~/.cache/flower-dlion``; an unwritable cache
only costs the time.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "DEBIAN_DIR",
    "PARTITIONERS",
    "FashionMNIST",
    "load_fashion_mnist",
    "partition_indices",
    "sample_batch",
    "to_tensor",
]

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path(os.environ.get("FLOWER_DLION_CACHE", Path.home() / ".cache" / "flower-dlion"))
PARTITIONERS = ("iid", "dirichlet", "pathological", "shard")
_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_CACHE_FORMAT = 1  # bump when _compute_partitions changes what it returns
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics


class FashionMNIST(NamedTuple):
    """Images as uint8 (N, 28, 28), labels as int64 (N,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped) into a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {data.size} values")
    return data.reshape(shape).copy()  # writable, independent of the file buffer


def _find_files(folder: Path) -> dict[str, Path] | None:
    """The four IDX files in ``folder`` or its torchvision layout, or None."""
    for base in (folder, folder / "FashionMNIST" / "raw"):
        found = {}
        for key, stem in _FILES.items():
            for name in (stem + ".gz", stem):
                if (base / name).is_file():
                    found[key] = base / name
                    break
        if len(found) == 4:
            return found
    return None


def _load_from(files: dict[str, Path]) -> FashionMNIST:
    arrays = {k: _read_idx(p) for k, p in files.items()}
    return FashionMNIST(
        arrays["x_train"], arrays["y_train"].astype(np.int64), arrays["x_test"], arrays["y_test"].astype(np.int64)
    )


@functools.lru_cache(maxsize=4)
def load_fashion_mnist(data_dir: str = "") -> FashionMNIST:
    """Load Fashion-MNIST (60,000 train / 10,000 test) from the first source that works.

    Parameters
    ----------
    data_dir : str (default: "")
        A folder with the IDX files; empty to skip this source.

    Raises
    ------
    FileNotFoundError
        When none of the three sources works, naming each one and why.

    """
    tried = []
    if data_dir:
        files = _find_files(Path(data_dir).expanduser())
        if files:
            return _load_from(files)
        tried.append(f"data-dir {data_dir!r}: no Fashion-MNIST IDX files there")
    else:
        tried.append("data-dir: not set (run config key 'data-dir')")
    files = _find_files(DEBIAN_DIR)
    if files:
        return _load_from(files)
    tried.append(f"{DEBIAN_DIR}: missing (install with 'apt-get install dataset-fashion-mnist')")
    try:
        from torchvision.datasets import FashionMNIST as TVFashionMNIST

        for train in (True, False):
            TVFashionMNIST(str(CACHE_DIR), train=train, download=True)
        files = _find_files(CACHE_DIR)
        if files:
            return _load_from(files)
        tried.append(f"torchvision download into {CACHE_DIR}: files missing after download")
    except Exception as err:
        tried.append(f"torchvision download into {CACHE_DIR}: {type(err).__name__}: {err}")
    raise FileNotFoundError("Fashion-MNIST not found. Tried:\n  - " + "\n  - ".join(tried))


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) → normalized float32 (N, 1, 28, 28)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    return x.sub_(MEAN).div_(STD).unsqueeze(1)


@functools.lru_cache(maxsize=8)
def _partitions(
    labels_key: bytes, partitioner: str, num_partitions: int, alpha: float, seed: int, classes_per_partition: int
) -> tuple[np.ndarray, ...]:
    """All partitions' row indices: from the disk cache, else computed and cached."""
    from importlib.metadata import version

    args = (_CACHE_FORMAT, partitioner, num_partitions, alpha, seed, classes_per_partition, version("flwr-datasets"))
    key = hashlib.sha256(labels_key + repr(args).encode()).hexdigest()[:32]
    path = CACHE_DIR / "partitions" / f"{key}.npz"
    try:
        with np.load(path) as cached:
            return tuple(cached[f"p{i}"] for i in range(num_partitions))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # not cached yet (or unreadable): compute
    parts = _compute_partitions(labels_key, partitioner, num_partitions, alpha, seed, classes_per_partition)
    try:  # atomic: nodes on one machine may write the same file at once
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            np.savez(f, **{f"p{i}": p for i, p in enumerate(parts)})
        os.replace(f.name, path)
    except OSError:
        pass
    return parts


def _compute_partitions(
    labels_key: bytes, partitioner: str, num_partitions: int, alpha: float, seed: int, classes_per_partition: int
) -> tuple[np.ndarray, ...]:
    """All partitions' row indices, computed by flwr-datasets."""
    from datasets import Dataset
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
        ShardPartitioner,
    )

    labels = np.frombuffer(labels_key, dtype=np.int64)
    if partitioner == "iid":
        part = IidPartitioner(num_partitions=num_partitions)
    elif partitioner == "dirichlet":
        part = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=alpha, min_partition_size=10, seed=seed
        )
    elif partitioner == "pathological":
        part = PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=classes_per_partition,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
    elif partitioner == "shard":
        part = ShardPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_shards_per_partition=classes_per_partition,
            seed=seed,
        )
    else:
        raise ValueError(f"partitioner must be one of {PARTITIONERS}, got {partitioner!r}")
    part.dataset = Dataset.from_dict({"label": labels, "row": np.arange(labels.size)})
    return tuple(np.asarray(part.load_partition(i)["row"], dtype=np.int64) for i in range(num_partitions))


def partition_indices(
    labels: np.ndarray,
    *,
    partitioner: str,
    num_partitions: int,
    alpha: float = 0.5,
    seed: int = 0,
    classes_per_partition: int = 2,
) -> list[np.ndarray]:
    """Row indices of each partition of ``labels``, computed by flwr-datasets.

    Parameters
    ----------
    labels : np.ndarray
        Integer class labels of the whole training set.
    partitioner : str
        ``iid``, ``dirichlet`` (label skew, concentration ``alpha``), ``pathological``
        (``classes_per_partition`` classes each) or ``shard`` (``classes_per_partition``
        label-sorted shards each).
    num_partitions : int
        Number of partitions (clients).
    alpha : float (default: 0.5)
        Dirichlet concentration; smaller is more skewed.
    seed : int (default: 0)
        Seed of the partitioner: the same seed gives the same partitions everywhere.
    classes_per_partition : int (default: 2)
        For ``pathological`` and ``shard``.

    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    key = np.ascontiguousarray(labels, dtype=np.int64).tobytes()
    return list(_partitions(key, partitioner, num_partitions, float(alpha), int(seed), int(classes_per_partition)))


def sample_batch(
    indices: np.ndarray, batch_size: int, *, seed: int, partition_id: int, server_round: int, step: int = 0
) -> np.ndarray:
    """The ``step``-th minibatch a client uses in a round: ``batch_size`` rows drawn without replacement.

    Seeded by (seed, partition, round[, step]), so a run is reproducible and needs no sampler state.
    """
    keys = [seed, partition_id, server_round] + ([step] if step else [])
    rng = np.random.default_rng(keys)
    return rng.choice(indices, size=min(batch_size, indices.size), replace=False)
