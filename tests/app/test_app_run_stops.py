"""The app's run config, baselines and summaries when a run stops (library side: tests/library/test_run_stops.py)."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from flower_dlion import DistributedLion
from flower_dlion.strategies.run_stops import RunStopped
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import FEDAVG_FAMILY, read_config
from flower_dlion_app.protocol import CONTROL
from flower_dlion_app.server_app import fedavg_family, run_federation
from flower_dlion_app.strategies.global_opt import GlobalOptimizer

from ..library.test_run_stops import Tiny, failing_app, initial
from ..library.test_strategy import StubGrid

RUN_CONFIG = {"partitioner": "iid", "batch-size": 16, "holdout": 200, "eval-every": 5, "device": "cpu"}


# ---------------------------------------------------------------- the run config, before round 1
@pytest.mark.parametrize(
    ("run_config", "expected"),
    [
        ({"strategy": "fedavg", "lr": -0.1}, "run-config 'lr' must be finite and > 0, got -0.1"),
        ({"lr": 0.0}, "run-config 'lr' must be finite and > 0, got 0.0"),
        ({"strategy": "fedprox", "lr": math.inf}, "run-config 'lr' must be finite and > 0, got inf"),
        (
            {"strategy": "fedavg", "weight-decay": math.nan},
            "run-config 'weight-decay' must be finite and >= 0, got nan",
        ),
        ({"weight-decay": -0.1}, "run-config 'weight-decay' must be finite and >= 0, got -0.1"),
        ({"seed": -1}, "run-config 'seed' must be in [0, 2**32) (numpy's seeds), got -1"),
        ({"seed": 2**32}, "run-config 'seed' must be in [0, 2**32) (numpy's seeds), got 4294967296"),
        (
            {"partitioner": "pathological", "classes-per-partition": 11},
            "run-config 'classes-per-partition' must be <= 10 (Fashion-MNIST's classes) for partitioner "
            "'pathological', got 11",
        ),
        (
            {"partitioner": "shard", "classes-per-partition": 60_001},
            "run-config 'classes-per-partition' (shards per partition) must be <= 60000 (the clients' images: "
            "60000 - holdout 0; times num-partitions, at most that) for partitioner 'shard', got 60001",
        ),
        (
            {"partitioner": "shard", "holdout": 10_000, "classes-per-partition": 50_001},
            "run-config 'classes-per-partition' (shards per partition) must be <= 50000 (the clients' images: "
            "60000 - holdout 10000; times num-partitions, at most that) for partitioner 'shard', got 50001",
        ),
        ({"max-failed-rounds": -1}, "run-config 'max-failed-rounds' must be >= 0 (0: never stop), got -1"),
    ],
)
def test_a_run_config_that_cannot_learn_fails_before_round_one(run_config: dict, expected: str) -> None:
    # Execute / Assert: the message names the key, the value and what is allowed
    with pytest.raises(ValueError, match=re.escape(expected)):
        read_config(run_config)


def test_the_limits_themselves_are_allowed() -> None:
    # Prepare: each new check's boundary value
    configs = [
        {"seed": 2**32 - 1},
        {"weight-decay": 0.0, "strategy": "fedavg"},
        {"partitioner": "pathological", "classes-per-partition": 10},
        {"partitioner": "shard", "classes-per-partition": 60_000},
        {"partitioner": "iid", "classes-per-partition": 11},  # read by pathological and shard only
        {"max-failed-rounds": 0},
    ]
    # Execute
    read = [read_config(c) for c in configs]
    # Assert
    assert [cfg["max-failed-rounds"] for cfg in read] == [3, 3, 3, 3, 3, 0]
    assert [read[0]["seed"], read[2]["classes-per-partition"], read[3]["classes-per-partition"]] == [
        2**32 - 1,
        10,
        60_000,
    ]


def test_max_failed_rounds_is_checked_by_the_strategies() -> None:
    # Execute / Assert: the keyword's own message, for both of our strategies
    for make in (DistributedLion, GlobalOptimizer):
        with pytest.raises(
            ValueError, match=re.escape("max_failed_rounds must be an integer >= 0 (0: never stop), got -1")
        ):
            make(max_failed_rounds=-1)
        with pytest.raises(
            ValueError, match=re.escape("max_failed_rounds must be an integer >= 0 (0: never stop), got True")
        ):
            make(max_failed_rounds=True)
    assert DistributedLion().max_failed_rounds == 3 and GlobalOptimizer(max_failed_rounds=0).max_failed_rounds == 0


def test_the_gradient_baselines_stop_too() -> None:
    # Prepare: GlobalOptimizer (global Lion) on 2 nodes that always raise; 2 failed rounds stop it
    app, _ = failing_app(None, Tiny)
    strategy = GlobalOptimizer(max_failed_rounds=2)
    # Execute
    with pytest.raises(RunStopped, match=re.escape("2 rounds in a row without a valid reply (rounds 1 to 2;")):
        strategy.start(LocalGrid(app, 2), initial(Tiny), num_rounds=4)
    # Assert
    assert [h["num-replies"] for h in strategy.history] == [0, 0]


# ---------------------------------------------------------------- the FedAvg family
def reply(node: int, value: float, control: bool = False) -> Message:
    """A FedAvg reply from ``node``: array "w" = [value] × 3, 10 examples (``control``: SCAFFOLD's Δc = 0 too)."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.full(3, value, np.float32))}),
            "metrics": MetricRecord({"num-examples": 10}),
        }
    )
    if control:
        content[CONTROL] = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN))


def test_fedavg_drops_replies_with_non_finite_arrays(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    strategy = fedavg_family("fedavg", read_config({"strategy": "fedavg"}))
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute: node 1 sends NaN, node 2 a finite model
    arrays, _ = strategy.aggregate_train(1, [reply(1, math.nan), reply(2, 0.5)])
    # Assert: the model is node 2's alone; node 1 and its array are named
    assert arrays is not None and arrays["w"].numpy().tolist() == [0.5, 0.5, 0.5]
    assert "round 1: dropped reply from node 1: array 'arrays/w' has non-finite values" in caplog.messages


@pytest.mark.parametrize("name", FEDAVG_FAMILY)
def test_the_fedavg_family_stops_after_max_failed_rounds_rounds_of_non_finite_replies(name: str) -> None:
    # Prepare: every strategy fedavg_family builds, told to stop after 2 failed rounds, having sent round 1
    strategy = fedavg_family(name, read_config({"strategy": name, "max-failed-rounds": 2}))
    x = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    list(strategy.configure_train(1, x, ConfigRecord({"lr": 0.1}), StubGrid([1, 2, 3, 4, 5])))
    scaffold = name == "scaffold"
    # Execute: round 1 fails, round 2 has valid replies (reset), rounds 3 and 4 fail
    strategy.aggregate_train(1, [reply(1, math.nan, scaffold), reply(2, math.inf, scaffold)])
    arrays, _ = strategy.aggregate_train(
        2, [reply(1, math.nan, scaffold)] + [reply(n, 0.5, scaffold) for n in (2, 3, 4, 5)]
    )
    strategy.aggregate_train(3, [reply(1, math.nan, scaffold), reply(2, -math.inf, scaffold)])
    with pytest.raises(RunStopped) as stopped:
        strategy.aggregate_train(4, [reply(1, math.nan, scaffold), reply(2, math.nan, scaffold)])
    # Assert: round 2 aggregated; rounds 3 and 4 stopped the run
    assert arrays is not None and np.isfinite(arrays["w"].numpy()).all()
    assert stopped.value.server_round == 4
    assert str(stopped.value).startswith(
        "the run cannot learn: 2 rounds in a row without a valid reply (rounds 3 to 4; max_failed_rounds=2); "
        "round 4: 0 valid replies (0 errors, 2 with non-finite arrays). Rejected in these rounds: "
        "4× from nodes 1, 2: array 'arrays/w' has non-finite values. Look at"
    )


def test_run_federation_writes_a_stopped_summary_and_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: the repository app on 2 nodes whose every train message raises; 2 failed rounds stop the run
    cfg = {**RUN_CONFIG, "num-server-rounds": 5, "max-failed-rounds": 2, "results-dir": str(tmp_path / "out")}
    grid = LocalGrid(client_app, 2, run_config=cfg)

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            raise RuntimeError("the data disk is gone")
        return client_app(msg, context)

    grid.client_app = app  # type: ignore[assignment]
    caplog.set_level(logging.INFO, logger="flwr")
    # Execute
    with pytest.raises(RunStopped) as stopped:
        run_federation(grid, cfg)
    # Assert: summary.json says stopped, when and why; the rows of round 0 and 1; no model
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["stopped_in_round"], summary["reason"]) == ("stopped", 2, str(stopped.value))
    assert summary["reason"].startswith(
        "the run cannot learn: 2 rounds in a row without a valid reply (rounds 1 to 2; max_failed_rounds=2); "
        "round 2: 0 valid of 2 sent (2 rejected, 0 without a reply). Rejected in these rounds: "
        "4× from nodes 1000, 1001: client error (code 2): <class 'RuntimeError'>:<'the data disk is gone'>. Look at"
    )
    assert summary["final_accuracy"] is None and summary["config"] == read_config(cfg)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1] and not (out / "final_model.pt").exists()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    out = out.resolve()
    assert errors == [
        f"[flower-dlion] dlion-vote: stopped in round 2: {stopped.value}",
        f"[flower-dlion] wrote {out / 'summary.json'} (status 'stopped') and {out / 'results.jsonl'}",
    ]


def test_a_diverging_fedavg_run_stops_and_a_finished_one_says_completed(tmp_path: Path) -> None:
    # Prepare: FedAvg with a learning rate that overflows the clients' models in their first steps
    cfg = {**RUN_CONFIG, "strategy": "fedavg", "lr": 1e30, "local-batches": 2, "num-server-rounds": 4}
    diverging = {**cfg, "max-failed-rounds": 2, "results-dir": str(tmp_path / "nan")}
    # Execute
    with pytest.raises(RunStopped, match=re.escape("2 with non-finite arrays")):
        run_federation(LocalGrid(client_app, 2, run_config=diverging), diverging)
    finished = {**cfg, "lr": 0.01, "num-server-rounds": 1, "results-dir": str(tmp_path / "ok")}
    run_federation(LocalGrid(client_app, 2, run_config=finished), finished)
    # Assert
    stopped = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert (stopped["status"], stopped["stopped_in_round"]) == ("stopped", 2)
    assert "4× from nodes 1000, 1001: array 'arrays/" in stopped["reason"]
    completed = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert completed["status"] == "completed" and "reason" not in completed
