"""SCAFFOLD (issue 30's drift-control baseline): the client's corrected steps and Δcᵢ, the server's c,
malformed control variates, and the bytes both ways.
"""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.clients.fedavg import OWN_CONTROL
from flower_dlion_app.config import read_config
from flower_dlion_app.model import seeded_net
from flower_dlion_app.protocol import CONTROL
from flower_dlion_app.server_app import build_strategy, run_federation, train_config
from flower_dlion_app.strategies.scaffold import Scaffold
from tests.app.test_data_config import fake_fashion_dir

from ..library.test_strategy import StubGrid

D = 281_034


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("fashion")
    fake_fashion_dir(folder, n_train=80, n_test=40)
    return str(folder)


def _config(fake_data: str, strategy: str) -> dict:
    """One SGD step per round (local-batches 1), no momentum, no weight decay."""
    return {
        "strategy": strategy,
        "batch-size": 8,
        "partitioner": "iid",
        "data-dir": fake_data,
        "lr": 0.05,
        "momentum": 0.0,
        "weight-decay": 0.0,
        "local-batches": 1,
    }


def _round(strategy, grid: LocalGrid, cfg: dict, server_round: int, x: dict) -> Message:
    msgs = list(strategy.configure_train(server_round, ArrayRecord(x), train_config(read_config(cfg)), grid))
    (reply,) = grid.send_and_receive(msgs)
    return reply


def test_client_step_is_corrected_by_c_minus_ci_and_reports_delta_c(fake_data: str) -> None:
    # Prepare: one node; round 1 without c, then round 2 with a known c (K = 1, η = 0.05, β = 0)
    eta = 0.05
    cfg = _config(fake_data, "scaffold")
    strategy = build_strategy(read_config(cfg))
    strategy.min_train_nodes = strategy.min_available_nodes = 1
    grid = LocalGrid(client_app, 1, run_config=cfg)
    avg_cfg = _config(fake_data, "fedavg")
    avg = build_strategy(read_config(avg_cfg))
    avg.min_train_nodes = avg.min_available_nodes = 1
    avg_grid = LocalGrid(client_app, 1, run_config=avg_cfg)
    x = seeded_net(0).state_dict()
    # Execute: round 1
    reply = _round(strategy, grid, cfg, 1, x)
    y1 = reply.content["arrays"].to_torch_state_dict()
    delta1 = {k: torch.from_numpy(a.numpy()) for k, a in reply.content[CONTROL].items()}
    # Assert: c = cᵢ = 0, so the step is FedAvg's and Δcᵢ = (x − y)/η (the gradient), kept as cᵢ
    y_avg = _round(avg, avg_grid, avg_cfg, 1, x).content["arrays"].to_torch_state_dict()
    assert all(torch.equal(y1[k], y_avg[k]) for k in y1)
    assert set(delta1) == {n for n, _ in seeded_net(0).named_parameters()}
    for name, d in delta1.items():
        torch.testing.assert_close(d, (x[name] - y1[name]) / eta, rtol=1e-6, atol=1e-6)
    own = grid.context(grid.node_ids[0]).state[OWN_CONTROL]
    assert all(np.array_equal(own[k].numpy(), delta1[k].numpy()) for k in delta1)
    # Execute: round 2 from the same x with c = 0.01 everywhere
    strategy.control = {k: np.full(d.shape, 0.01, np.float32) for k, d in delta1.items()}
    reply2 = _round(strategy, grid, cfg, 2, x)
    y2 = reply2.content["arrays"].to_torch_state_dict()
    y2_avg = _round(avg, avg_grid, avg_cfg, 2, x).content["arrays"].to_torch_state_dict()
    # Assert: y = y_FedAvg − η·(c − cᵢ), and Δcᵢ = −c + (x − y)/η
    for name, d in delta1.items():
        torch.testing.assert_close(y2[name], y2_avg[name] - eta * (0.01 - d), rtol=1e-5, atol=1e-6)
        got = torch.from_numpy(reply2.content[CONTROL][name].numpy())
        torch.testing.assert_close(got, -0.01 + (x[name] - y2[name]) / eta, rtol=1e-5, atol=1e-5)


def _reply(node: int, value: float, control: dict[str, np.ndarray] | None, examples: int = 10) -> Message:
    arrays = ArrayRecord({"w": Array(np.full(3, value, np.float32))})
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": examples})})
    if control is not None:
        content[CONTROL] = ArrayRecord({k: Array(v) for k, v in control.items()})
    msg = Message(content=content, dst_node_id=node, message_type="train")
    return Message(content, reply_to=msg)  # from node ``node``


def _started(nodes: list[int]) -> Scaffold:
    """A SCAFFOLD strategy with c = 1 that sent round 1 to ``nodes`` (all connected)."""
    strategy = Scaffold(fraction_evaluate=0.0, min_available_nodes=1)
    strategy.control = {"w": np.array([1.0, 1.0, 1.0], np.float32)}
    x = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    list(strategy.configure_train(1, x, ConfigRecord(), StubGrid(nodes)))
    return strategy


def test_server_averages_the_models_and_moves_c_by_the_sampled_share(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 4 connected nodes, 3 replies of which one has a non-finite Δc
    strategy = Scaffold(fraction_evaluate=0.0, min_available_nodes=1)
    strategy.control = {"w": np.array([1.0, 1.0, 1.0], np.float32)}
    list(
        strategy.configure_train(
            1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), ConfigRecord(), StubGrid([1, 2, 3, 4])
        )
    )
    replies = [
        _reply(1, 1.0, {"w": np.array([2.0, 0.0, -2.0], np.float32)}),
        _reply(2, 3.0, {"w": np.array([0.0, 4.0, 2.0], np.float32)}),
        _reply(3, 100.0, {"w": np.array([np.nan, 0.0, 0.0], np.float32)}),
    ]
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    arrays, _ = strategy.aggregate_train(1, replies)
    # Assert: x = mean of the 2 valid models, c ← c + (2/4)·mean(Δc) = 1 + ½·[1, 2, 0]
    np.testing.assert_array_equal(arrays["w"].numpy(), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(strategy.control["w"], [1.5, 2.0, 1.0])
    assert "rejected reply from node 3: Δc 'w' has non-finite values" in caplog.text


@pytest.mark.parametrize(
    ("control", "reason"),
    [
        (None, "no 'control' record"),
        ({"v": np.zeros(3, np.float32)}, "Δc 'v' of shape (3,) is not one of the model's arrays"),
        ({"w": np.zeros(2, np.float32)}, "Δc 'w' of shape (2,) is not one of the model's arrays"),
        ({"w": np.zeros(3, np.float64)}, "Δc 'w' must be float32, got float64"),
    ],
)
def test_a_malformed_control_variate_is_rejected_and_c_is_kept(control, reason, caplog) -> None:
    strategy = Scaffold(fraction_evaluate=0.0, min_available_nodes=1)
    strategy.control = {"w": np.array([1.0, 1.0, 1.0], np.float32)}
    list(
        strategy.configure_train(
            1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), ConfigRecord(), StubGrid([1, 2])
        )
    )
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    arrays, _ = strategy.aggregate_train(1, [_reply(1, 5.0, control), _reply(2, 1.0, {"w": np.ones(3, np.float32)})])
    # Assert: only node 2 counts
    assert reason in caplog.text
    np.testing.assert_array_equal(arrays["w"].numpy(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(strategy.control["w"], [1.5, 1.5, 1.5])


def test_scaffold_federation_sends_two_models_each_way(fake_data: str, tmp_path: Path) -> None:
    # Prepare
    cfg = {
        **_config(fake_data, "scaffold"),
        "momentum": 0.9,
        "local-batches": 2,
        "num-server-rounds": 3,
        "eval-every": 3,
        "results-dir": str(tmp_path),
    }
    # Execute
    result = run_federation(LocalGrid(client_app, 2, run_config=cfg), cfg, save_model=False)
    # Assert: up, 2 models a reply; down, 1 model in round 1 (c = 0), then 2
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()][1:]
    model = 4 * D
    assert all(2 * 2 * model < r["bytes_up"] < 2 * 2 * model + 20_000 for r in rows)
    assert 2 * model < rows[0]["bytes_down"] < 2 * model + 10_000
    assert all(2 * 2 * model < r["bytes_down"] < 2 * 2 * model + 20_000 for r in rows[1:])
    assert all(np.isfinite(a).all() for a in result.arrays.to_numpy_ndarrays())


def test_client_refuses_a_malformed_c_and_keeps_its_own(fake_data: str) -> None:
    # Prepare: a node with cᵢ after round 1; round 2's c has a non-finite value
    cfg = _config(fake_data, "scaffold")
    strategy = build_strategy(read_config(cfg))
    strategy.min_train_nodes = strategy.min_available_nodes = 1
    grid = LocalGrid(client_app, 1, run_config=cfg)
    x = seeded_net(0).state_dict()
    delta = _round(strategy, grid, cfg, 1, x).content[CONTROL]
    strategy.control = {k: np.zeros(a.shape, np.float32) for k, a in delta.items()}
    strategy.control["classifier.3.bias"][4] = np.inf
    before = {k: a.numpy().copy() for k, a in grid.context(grid.node_ids[0]).state[OWN_CONTROL].items()}
    # Execute
    reply = _round(strategy, grid, cfg, 2, x)
    # Assert: an error naming the variate; cᵢ unchanged
    assert reply.has_error() and "control variate 'classifier.3.bias'" in reply.error.reason
    after = grid.context(grid.node_ids[0]).state[OWN_CONTROL]
    assert all(np.array_equal(after[k].numpy(), v) for k, v in before.items())


def test_a_round_without_a_valid_reply_changes_neither_x_nor_c() -> None:
    strategy = _started([1, 2])
    # Execute: both replies carry a Δc of the wrong dtype
    arrays, _ = strategy.aggregate_train(1, [_reply(n, 5.0, {"w": np.ones(3, np.float64)}) for n in (1, 2)])
    # Assert
    assert arrays is None
    np.testing.assert_array_equal(strategy.control["w"], [1.0, 1.0, 1.0])
