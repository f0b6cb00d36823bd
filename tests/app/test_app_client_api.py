"""The repository app on the public client API (the library's side: tests/library/test_client_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as repo_app
from flower_dlion_app.config import read_config
from flower_dlion_app.server_app import run_federation


# ---------------------------------------------------------------- the repository's app on the same API
def test_the_repository_app_runs_on_one_node_when_the_run_config_says_so(tmp_path: Path) -> None:
    # Prepare
    cfg = {"num-server-rounds": 2, "min-available-nodes": 1, "min-train-nodes": 1, "results-dir": str(tmp_path)}
    # Execute
    result = run_federation(LocalGrid(repo_app, 1, run_config=cfg), cfg, save_model=False)
    # Assert
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert all(m["num-replies"] == 1 for m in result.train_metrics_clientapp.values())
    with pytest.raises(ValueError, match="run-config 'min-available-nodes' must be >= 1, got 0"):
        read_config({"min-available-nodes": 0})
