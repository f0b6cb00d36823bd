"""Data sources, partitions and run configuration."""

import gzip
import tomllib
from pathlib import Path

import numpy as np
import pytest

from flower_dlion_app import data
from flower_dlion_app.config import DEFAULTS, GROUPS, generate, read_config

ROOT = Path(__file__).resolve().parents[2]


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def fake_fashion_dir(folder: Path, n_train: int = 50, n_test: int = 20) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (n_train, 28, 28)))
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.arange(n_train) % 10)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (n_test, 28, 28)))
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.arange(n_test) % 10)


def test_data_dir_is_used_first(tmp_path: Path) -> None:
    fake_fashion_dir(tmp_path / "FashionMNIST" / "raw")  # torchvision's layout
    ds = data.load_fashion_mnist(str(tmp_path))
    assert ds.x_train.shape == (50, 28, 28) and ds.y_test.tolist() == [i % 10 for i in range(20)]


def test_clear_error_names_all_three_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no internet")

    monkeypatch.setattr(data, "DEBIAN_DIR", tmp_path / "nope")
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", offline)
    with pytest.raises(FileNotFoundError) as err:
        data.load_fashion_mnist.__wrapped__(str(tmp_path / "empty"))
    text = str(err.value)
    assert "data-dir" in text and str(tmp_path / "nope") in text and "apt-get install dataset-fashion-mnist" in text
    assert "torchvision download" in text and "no internet" in text


def test_real_fashion_mnist_is_available() -> None:
    ds = data.load_fashion_mnist()
    assert ds.x_train.shape == (60_000, 28, 28) and ds.x_test.shape == (10_000, 28, 28)
    assert np.bincount(ds.y_test).tolist() == [1000] * 10


@pytest.mark.parametrize("partitioner", data.PARTITIONERS)
def test_partitions_cover_the_data_disjointly_and_reproducibly(partitioner: str) -> None:
    labels = np.repeat(np.arange(10), 300)
    parts = data.partition_indices(labels, partitioner=partitioner, num_partitions=6, alpha=0.5, seed=3)
    rows = np.concatenate(parts)
    assert len(parts) == 6 and len(np.unique(rows)) == rows.size <= labels.size
    if partitioner in ("iid", "dirichlet"):
        assert rows.size == labels.size
    again = data.partition_indices(labels, partitioner=partitioner, num_partitions=6, alpha=0.5, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    if partitioner == "pathological":
        assert all(len(np.unique(labels[p])) == 2 for p in parts)


def test_partitions_are_cached_on_disk_for_the_next_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: an empty cache; the first call computes and writes the partitions
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path)
    labels = np.repeat(np.arange(10), 200)
    computed = data._partitions.__wrapped__(labels.tobytes(), "dirichlet", 4, 0.5, 1, 2)

    # Execute: a new process (no lru_cache) must not compute them again
    def fail(*args: object) -> None:
        raise AssertionError("partitions computed again")

    monkeypatch.setattr(data, "_compute_partitions", fail)
    cached = data._partitions.__wrapped__(labels.tobytes(), "dirichlet", 4, 0.5, 1, 2)
    # Assert: identical, one file; other arguments or labels are another key
    assert all(np.array_equal(a, b) for a, b in zip(computed, cached, strict=True))
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 1
    with pytest.raises(AssertionError, match="computed again"):
        data._partitions.__wrapped__(labels.tobytes(), "dirichlet", 4, 0.5, 2, 2)  # another seed
    with pytest.raises(AssertionError, match="computed again"):
        data._partitions.__wrapped__(labels[::-1].copy().tobytes(), "dirichlet", 4, 0.5, 1, 2)


def test_a_corrupt_partition_cache_file_is_recomputed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path)
    labels = np.repeat(np.arange(10), 50)
    first = data._partitions.__wrapped__(labels.tobytes(), "iid", 3, 0.5, 0, 2)
    (path,) = (tmp_path / "partitions").glob("*.npz")
    path.write_bytes(path.read_bytes()[:60])  # a truncated zip
    again = data._partitions.__wrapped__(labels.tobytes(), "iid", 3, 0.5, 0, 2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert path.stat().st_size > 100  # rewritten


def test_dirichlet_alpha_controls_skew() -> None:
    labels = np.repeat(np.arange(10), 600)

    def mean_classes(alpha: float) -> float:
        parts = data.partition_indices(labels, partitioner="dirichlet", num_partitions=10, alpha=alpha, seed=0)
        return float(np.mean([np.sum(np.bincount(labels[p], minlength=10) > 0.05 * len(p)) for p in parts]))

    assert mean_classes(0.1) < mean_classes(100.0)


def test_sample_batch_is_seeded_and_within_partition() -> None:
    idx = np.arange(100, 200)
    a = data.sample_batch(idx, 16, seed=1, partition_id=2, server_round=5)
    assert np.array_equal(a, data.sample_batch(idx, 16, seed=1, partition_id=2, server_round=5))
    assert not np.array_equal(a, data.sample_batch(idx, 16, seed=1, partition_id=2, server_round=6))
    assert len(set(a.tolist())) == 16 and set(a.tolist()) <= set(idx.tolist())


def test_pyproject_config_equals_defaults() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert table == DEFAULTS


def test_the_generated_copies_of_the_run_config_are_up_to_date() -> None:
    # Execute: pyproject.toml's table and docs/APP.md's tables as config.GROUPS makes them
    files = generate.generated_files(ROOT)
    # Assert: the files hold exactly that (else: python -m flower_dlion_app.config --write)
    assert all(path.read_text() == text for path, text in files.items()), "python -m flower_dlion_app.config --write"
    assert sorted(DEFAULTS) == sorted(key for group in GROUPS.values() for key in group.keys)
    assert [line for line in generate.pyproject_table().splitlines() if line.startswith("# ")][1:] == [
        f"# {name}: {group.about}" for name, group in GROUPS.items()
    ]


def test_read_config_checks_values() -> None:
    assert read_config({"lr": 1})["lr"] == 1.0
    with pytest.raises(ValueError, match="unknown run-config keys \\['lrr'\\]"):
        read_config({"lrr": 0.1})
    with pytest.raises(ValueError, match=r"'strategy' must be one of \('dlion-vote', .*\), got 'median'"):
        read_config({"strategy": "median"})
    with pytest.raises(ValueError, match=r"'momentum' must be in \[0, 1\), got 1\.0"):
        read_config({"momentum": 1.0})
    with pytest.raises(ValueError, match="'local-epochs' must be >= 1, got 0"):
        read_config({"local-epochs": 0})
    with pytest.raises(ValueError, match="'batch-size' must be int, got '64'"):
        read_config({"batch-size": "64"})
    with pytest.raises(ValueError, match="'fraction-train' must be in \\(0, 1\\]"):
        read_config({"fraction-train": 1.5})
    assert not read_config({})["state-in-context"]  # files by default (their folder: FLOWER_DLION_STATE_DIR or tmp)
    assert read_config({"state-in-context": True, "client-state-dir": "/tmp/s"})["state-in-context"]
    with pytest.raises(ValueError, match=r"\['client-state-dir', 'state-in-context'\] apply to \('dlion-vote'"):
        read_config({"strategy": "global-lion", "state-in-context": True, "client-state-dir": "/tmp/s"})
