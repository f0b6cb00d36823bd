"""Learning-rate schedules in the repository app's run config (library side: tests/library/test_lr_schedule.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import ArrayRecord

from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.server_app import build_strategy, run_federation, train_config

from ..library.test_strategy import StubGrid


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr-schedule": "linear"}, r"'lr-schedule' must be one of \('constant', 'cosine'\), got 'linear'"),
        ({"lr-schedule": "cosine", "lr-final": 1.5}, r"'lr-final' must be in \[0, 1\] \(a factor of 'lr'\), got 1.5"),
        ({"lr-final": 0.1}, "'lr-final' = 0.1 applies to lr-schedule 'cosine' only"),
        ({"lr-schedule": "cosine", "strategy": "global-lion"}, "'cosine' applies to .* not to 'global-lion'"),
        ({"lr-schedule": "cosine", "downlink": "anchored"}, "downlink='anchored' needs a constant learning rate"),
    ],
)
def test_schedule_run_config_fails_with_name_value_and_range(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_config(changes)


def test_run_config_cosine_reaches_dlion_and_the_fedavg_clients_rate() -> None:
    cfg = read_config({"lr-schedule": "cosine", "lr-final": 0.1, "num-server-rounds": 4, "lr": 0.01})
    dlion = build_strategy(cfg)
    assert [dlion.lr_at(t) for t in (1, 3, 5)] == pytest.approx([0.01, 0.0055, 0.001])
    # Prepare: FedAvg with the same schedule; its clients read the SGD rate from the train config
    avg_cfg = read_config(
        {"strategy": "fedavg", "lr": 0.03, "lr-schedule": "cosine", "lr-final": 0.1, "num-server-rounds": 4}
    )
    avg = build_strategy(avg_cfg)
    assert type(avg).__name__ == "FedAvg"
    arrays = ArrayRecord()  # FedAvg only forwards the arrays
    for server_round, factor in ((1, 1.0), (3, 0.55)):
        # Execute
        msgs = list(avg.configure_train(server_round, arrays, train_config(avg_cfg), StubGrid([1, 2])))
        # Assert
        assert [m.content["config"]["lr"] for m in msgs] == pytest.approx([0.03 * factor] * 2)


def test_scheduled_sampled_federation_keeps_every_replica_on_the_servers_x(tmp_path: Path) -> None:
    # Prepare: 4 clients, half sampled per round, so clients catch up over Δs of different rates;
    # K = 2 local steps at the round's rate, cosine over 4 rounds to 0.1
    cfg = {
        "strategy": "dlion-mean",
        "broadcast-bits": 1,
        "partitioner": "iid",
        "batch-size": 16,
        "lr": 0.002,
        "local-steps": 2,
        "num-server-rounds": 4,
        "eval-every": 4,
        "holdout": 1000,
        "fraction-train": 0.5,
    }
    finals = {}
    for schedule in ("cosine", "constant"):
        run = {**cfg, "lr-schedule": schedule, "results-dir": str(tmp_path / schedule)}
        if schedule == "cosine":
            run["lr-final"] = 0.1
        # Execute
        finals[schedule] = run_federation(LocalGrid(client_app, 4, run_config=run), run, save_model=False)
        # Assert: every reply valid, no replica ever disagreed with the server's x
        rows = [json.loads(x) for x in (tmp_path / schedule / "results.jsonl").read_text().splitlines()][1:]
        assert sum(r["checksum_mismatches"] for r in rows) == 0 and sum(r["full_syncs"] for r in rows) == 0
        assert all(r["num_replies"] == 2 and r["num_rejected"] == 0 for r in rows)
    # … and the schedule changed the run (same sampling, same batches)
    a, b = (finals[s].arrays.to_numpy_ndarrays() for s in ("cosine", "constant"))
    assert any((u != v).any() for u, v in zip(a, b, strict=True))
