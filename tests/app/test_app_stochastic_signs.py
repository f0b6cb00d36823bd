"""Stochastic signs with the repository app's clients (library side: tests/library/test_stochastic_signs.py)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord

from flower_dlion import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.model import Net

from ..library.test_stochastic_signs import MODES


@pytest.mark.parametrize("mode", MODES)
def test_a_federation_with_stochastic_signs_is_reproducible_and_differs_from_the_deterministic_one(
    mode: str,
) -> None:
    # Prepare: 4 nodes, 3 rounds, the repository's client
    def run(tau: float, key: str) -> torch.Tensor:
        torch.manual_seed(0)
        strategy = DistributedLion(sign_noise=tau, min_available_nodes=4, state_key=key, **MODES[mode])
        grid = LocalGrid(client_app, 4, run_config={"partitioner": "iid", "batch-size": 16})
        strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=3, timeout=5)
        assert all(h["applied"] == 1 for h in strategy.history)
        return strategy.x.clone()

    # Execute
    noisy, again, plain = run(1.0, f"{mode}-a"), run(1.0, f"{mode}-b"), run(0.0, f"{mode}-c")
    # Assert: the same seed, the same x; not the deterministic run's x
    assert torch.equal(noisy, again) and not torch.equal(noisy, plain)
