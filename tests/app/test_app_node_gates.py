"""The repository app's summaries at the node gates (library side: tests/library/test_node_gates.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.serverapp.strategy import FedAvg

from flower_dlion.strategies.nodes import HELLO_TYPE
from flower_dlion.strategies.run_stops import RunStopped
from flower_dlion.testing import LocalGrid
from flower_dlion_app import server_app
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.metering import Exchange, MeteredGrid
from flower_dlion_app.results import Recorder
from flower_dlion_app.server_app import run_federation

from ..library.test_node_gates import RUN_CONFIG, SECURE_NEEDS, WAITED
from ..library.test_strategy import StubGrid


def test_the_app_with_too_few_nodes_for_secure_aggregation_writes_a_stopped_summary(tmp_path: Path) -> None:
    # Prepare: secure = true, min-train-nodes = 3, two SuperNodes (min-available-nodes = 2, the default)
    cfg = {**RUN_CONFIG, "secure": True, "min-train-nodes": 3, "num-server-rounds": 3, "wait-for-nodes": 0.05,
           "results-dir": str(tmp_path)}  # fmt: skip
    # Execute
    with pytest.raises(RunStopped) as stopped:
        run_federation(LocalGrid(client_app, 2, run_config=cfg), cfg)
    # Assert: stopped in round 1, naming both counts; the summary says so; the row of round 0 only
    reason = f"the run cannot learn: {SECURE_NEEDS.format(3, 3)}; 2 are connected {WAITED}"
    assert str(stopped.value) == reason
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["stopped_in_round"], summary["reason"]) == ("stopped", 1, reason)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0]


def test_the_app_writes_a_failed_summary_for_any_other_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the server's evaluation breaks in round 1 (its second call, after round 0's)
    cfg = {**RUN_CONFIG, "num-server-rounds": 1, "results-dir": str(tmp_path)}
    calls: list[int] = []
    evaluate = server_app.evaluate

    def breaking(*args: object) -> tuple[float, float]:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("the disk is full")
        return evaluate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(server_app, "evaluate", breaking)
    # Execute
    with pytest.raises(OSError, match="the disk is full"):
        run_federation(LocalGrid(client_app, 2, run_config=cfg), cfg)
    # Assert
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["stopped_in_round"]) == ("failed", 1)
    assert summary["reason"] == "OSError: the disk is full"


def test_a_round_without_a_train_message_is_a_row(tmp_path: Path) -> None:
    # Prepare: round 1 sent only hellos (e.g. too few nodes could mask), round 2 trained
    metered = MeteredGrid(StubGrid([1]))
    recorder = Recorder(tmp_path, metered)
    hello = Exchange(HELLO_TYPE, 2, 2, 0, bytes_down=100, bytes_up=80, train_loss=None)
    train = Exchange("train", 2, 2, 1, bytes_down=1000, bytes_up=50, train_loss=1.5)
    # Execute
    metered.exchanges.append(hello)
    first = recorder.record(1, None, None, FedAvg())
    metered.exchanges.append(train)
    second = recorder.record(2, None, None, FedAvg())
    # Assert: the hellos' bytes, nothing sent to train; then the train exchange's counts
    keys = ("bytes_up", "bytes_down", "num_sent", "num_replies", "num_errors", "train_loss")
    assert [first[k] for k in keys] == [80, 100, 0, 0, 0, None]
    assert [second[k] for k in keys] == [50, 1000, 2, 2, 1, 1.5]
