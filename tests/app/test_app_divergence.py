"""Divergence watch on the repository app (the library's side: tests/library/test_divergence.py)."""

from __future__ import annotations

import logging

import pytest

from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app

from .test_federation import RUN_CONFIG, run_rounds


# ------------------------------------------------------------------ a real run
def test_an_honest_run_with_the_defaults_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: three rounds of two clients on Fashion-MNIST through the real ClientApp
    grid = LocalGrid(client_app, 2, run_config=RUN_CONFIG)
    strategy = DistributedLion(lr=0.01)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    run_rounds(strategy, grid, 3)
    # Assert: no warning, and the watch holds the lowest of the rounds' losses
    losses = [h["train-loss"] for h in strategy.history]
    assert len(losses) == 3 and all(0.0 < v < 10.0 for v in losses)
    assert "divergence" not in caplog.text
    assert strategy.divergence.minimum == min(losses)
    assert strategy.divergence.streak == 0
