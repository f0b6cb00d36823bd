"""Run config ``model``: the study harness and the repository app on a second model (``cnn-bn``,
the CNN with BatchNorm), for D-Lion and the FedAvg family alike (issue 30).
"""

import json
from pathlib import Path

import pytest
import torch

from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import _CHOICES, read_config
from flower_dlion_app.model import MODELS, NetBN, seeded_net
from flower_dlion_app.server_app import run_federation


def test_model_choices_are_the_models() -> None:
    assert _CHOICES["model"] == tuple(MODELS)
    choices = r"\('cnn', 'cnn-bn', 'char-lstm', 'char-transformer'\)"
    with pytest.raises(ValueError, match=rf"'model' must be one of {choices}, got 'resnet'"):
        read_config({"model": "resnet"})
    assert isinstance(seeded_net(3, "cnn-bn"), NetBN)
    a, b = seeded_net(3, "cnn-bn").state_dict(), seeded_net(3, "cnn-bn").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["dlion-mean", "fedavg"])
def test_a_federation_trains_the_batchnorm_model(strategy: str, tmp_path: Path) -> None:
    # Prepare: 3 clients, 3 rounds of the BatchNorm CNN (D-Lion: K = 2, ef-sign, x₀ from the seed)
    cfg = {
        "model": "cnn-bn",
        "strategy": strategy,
        "partitioner": "iid",
        "batch-size": 16,
        "num-server-rounds": 3,
        "eval-every": 3,
        "holdout": 1000,
        "results-dir": str(tmp_path),
    }
    if strategy == "dlion-mean":
        cfg.update({"local-steps": 2, "upload": "ef-sign", "broadcast-bits": 1, "lr": 0.002})
    else:
        cfg.update({"lr": 0.03, "local-batches": 2, "weight-decay": 0.0})
    # Execute
    result = run_federation(LocalGrid(client_app, 3, run_config=cfg), cfg, save_model=False)
    # Assert: the BatchNorm model's parameters, every reply valid, and running statistics that moved
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_parameters"] == 281_130
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()][1:]
    assert all(r["num_replies"] == 3 for r in rows)
    if strategy == "dlion-mean":
        assert sum(r["checksum_mismatches"] for r in rows) == 0
    final = result.arrays.to_torch_state_dict()
    assert "features.1.running_mean" in final
    assert not torch.equal(final["features.1.running_mean"], torch.zeros(16))
    assert summary["final_accuracy"] > 0.3
