"""A learning-rate schedule per server round (issue 30): ``lion.cosine_decay``, ``DistributedLion(lr_schedule=…)``,
run config ``lr-schedule`` / ``lr-final`` for D-Lion and the FedAvg family.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion import lion
from flower_dlion.protocol import CONFIG
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.server_app import build_strategy, run_federation, train_config

from .test_strategy import SIGNS, X0, StubGrid, first_round, signs_reply


def test_cosine_decay_hand_computed() -> None:
    # T = 4, final 0.1: f(t) = 0.1 + 0.9·½(1 + cos(π(t−1)/4)), then 0.1 from round 5 on
    f = lion.cosine_decay(4, final=0.1)
    c = math.cos(math.pi / 4)
    want = [1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 0.1, 0.1]
    assert [f(t) for t in range(1, 7)] == pytest.approx(want, abs=1e-15)
    assert lion.cosine_decay(1)(1) == 1.0 and lion.cosine_decay(1)(2) == 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [((0,), "num_rounds must be >= 1, got 0"), ((5, 1.5), r"final must be in \[0, 1\] \(a factor of lr\), got 1.5")],
)
def test_cosine_decay_arguments_are_checked(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lion.cosine_decay(*args)


def test_each_round_applies_and_sends_its_own_rate_and_a_lagging_client_gets_each_deltas_rate() -> None:
    # Prepare: a vote, exact Δ, lr 0.1 halved each round, no decay; node 3 takes part in round 1 only
    lr = 0.1
    strategy = DistributedLion(lr=lr, weight_decay=0.0, lr_schedule=lambda t: 0.5 ** (t - 1))
    assert not strategy.options.anchored  # "auto" takes the chain: the anchored downlink needs a constant rate
    signs = {1: SIGNS[0], 2: SIGNS[1], 3: SIGNS[2]}
    x = torch.from_numpy(X0.copy())
    for server_round, nodes in ((1, [1, 2, 3]), (2, [1, 2])):
        if server_round == 1:
            sent = first_round(strategy, nodes)
        else:
            msgs = strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), StubGrid(nodes))
            sent = {m.metadata.dst_node_id: m for m in msgs}
        # Execute
        strategy.aggregate_train(server_round, [signs_reply(sent[n], signs[n], x) for n in nodes])
        # Assert: x ← x − lr·f(t)·sign(Σ δᵢ)
        votes = sum(torch.tensor(signs[n], dtype=torch.float32) for n in nodes)
        x = x - lr * 0.5 ** (server_round - 1) * torch.sign(votes)
        torch.testing.assert_close(strategy.x, x, rtol=0, atol=1e-7)
    # … node 3, two Δs behind, is sent both, each with the rate it was applied at
    msgs = strategy.configure_train(3, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3], versions={3: 0}))
    late = next(m for m in msgs if m.metadata.dst_node_id == 3).content[CONFIG]
    assert late["kind"] == "deltas" and list(late["lr"]) == pytest.approx([0.1, 0.05])


def test_local_steps_get_the_rounds_rate() -> None:
    strategy = DistributedLion(lr=0.01, local_steps=4, lr_schedule=lion.cosine_decay(3, 0.2), downlink="chain")
    sent = first_round(strategy, [1, 2])
    assert sent[1].content[CONFIG]["local-lr"] == pytest.approx(0.01)
    strategy.aggregate_train(1, [signs_reply(sent[n], [1] * 10) for n in (1, 2)])
    (msg, _) = strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2]))
    assert msg.content[CONFIG]["local-lr"] == pytest.approx(0.01 * lion.cosine_decay(3, 0.2)(2))


class _NoGrid:
    def get_node_ids(self) -> list[int]:
        raise AssertionError("the run started")


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (
            lambda t: 2.0 if t == 3 else 1.0,
            r"lr_schedule\(3\) must be a number in \[0, 1\] \(a factor of lr\), got 2.0",
        ),
        (lambda t: float("nan"), r"lr_schedule\(1\) must be a number in \[0, 1\] .*got nan"),
        (lambda t: "fast", r"lr_schedule\(1\) must be a number in \[0, 1\] .*got 'fast'"),
    ],
)
def test_a_bad_factor_in_any_round_fails_before_round_1(schedule: object, message: str) -> None:
    strategy = DistributedLion(lr=0.01, lr_schedule=schedule)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        strategy.start(_NoGrid(), ArrayRecord(), num_rounds=4)  # type: ignore[arg-type]


def test_schedule_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"lr_schedule must be a function of the server round or None, got 0\.5"):
        DistributedLion(lr_schedule=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="downlink='anchored' needs a constant learning rate"):
        DistributedLion(lr_schedule=lion.cosine_decay(5), downlink="anchored")


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
