"""Issue 50, item 7: the public surface a user meets when converting a plain Flower FedAvg app.

* ``start`` returns the run's byte totals (``result.totals``) and logs them in one closing line;
* every per-round metric has a value that means something in an honest run (the agreement of
  ef-sign uploads is that of their signs, not NaN);
* ``DistributedLion``'s default ``lr`` is the one the README's quickstart runs with;
* what a client does with fewer batches than a round needs, and with none, is what the docs say.

Prepare / Execute / Assert, on the in-process grid (every message and context serialized).
"""

from __future__ import annotations

import logging
import math
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.common.serde import context_to_proto
from torch import nn

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.clients.local_work import LocalWork
from flower_dlion.params import Binding, cross_entropy_loss
from flower_dlion.protocol import CONFIG
from flower_dlion.strategies.run_loop import totals_line
from flower_dlion.testing import LocalGrid

from ..replies import with_arrays
from .test_strategy import first_round, signs_reply

ROOT = Path(__file__).resolve().parents[2]


def tiny_net() -> nn.Module:
    """8 inputs → 3 classes: 27 trainable values."""
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 3))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch i: 2 examples whose inputs and labels are all i (so a loss function can tell it apart)."""
    return torch.full((2, 8), float(i)), torch.full((2,), i, dtype=torch.int64)


def recording_app(batches_of: Any, seen: list[tuple[int, int, int]]) -> ClientApp:
    """A ClientApp whose node trains on ``batches_of(partition, round)``; ``seen`` gets (partition, round, batch)."""
    app = ClientApp()

    def loss_fn(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append((current["pid"], current["round"], int(b[1][0])))
        return F.cross_entropy(model(b[0]), b[1])

    client = DLionClient(app, tiny_net, loss_fn)
    current: dict[str, int] = {}

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        current["pid"] = pid = int(context.node_config["partition-id"])
        current["round"] = rnd = int(msg.content[CONFIG]["server-round"])
        return client.train(msg, context, batches_of(pid, rnd))

    return app


def start_tiny(app: ClientApp, nodes: int, rounds: int, **strategy: Any) -> tuple[DistributedLion, LocalGrid, Any]:
    grid = LocalGrid(app, nodes)
    s = DistributedLion(lr=1e-3, min_available_nodes=nodes, min_train_nodes=nodes, **strategy)
    torch.manual_seed(0)
    result = s.start(grid, ArrayRecord(tiny_net().state_dict()), num_rounds=rounds)
    return s, grid, result


def test_run_totals_sum_the_history_and_the_line_says_faults_and_leaves_out_unmeasured_bytes() -> None:
    # Prepare: two rounds as a DistributedLion history holds them, one with a rejected and a lost reply
    strategy = DistributedLion()
    common = {"bytes-up-fp32": 4000, "bytes-down-fp32": 8000, "tie-fraction": 0.0, "agreement": 0.5}
    strategy.history = [
        {"round": 1, "applied": 1, "num-replies": 3, "num-rejected": 0, "num-failed": 0, "bytes-up": 100}
        | {"bytes-down": 400}
        | common,
        {"round": 2, "applied": 0, "num-replies": 0, "num-rejected": 2, "num-failed": 1, "bytes-up": 60}
        | {"bytes-down": 200}
        | common,
    ]
    # Execute
    totals = strategy.run_totals()
    # Assert: exact sums, ratios and line
    assert dict(totals) == {
        "rounds": 2,
        "rounds-applied": 1,
        "num-replies": 3,
        "num-rejected": 2,
        "num-failed": 1,
        "bytes-up": 160,
        "bytes-down": 600,
        "bytes-up-fp32": 8000,
        "bytes-down-fp32": 16000,
        "fp32-over-sent-up": 50.0,
        "fp32-over-sent-down": 16000 / 600,
    }
    assert totals_line(totals) == (
        "[flower-dlion] run totals (result.totals): 2 rounds, 3 replies, 2 rejected, 1 without a reply: "
        "0.00 MB up, 0.00 MB down (fp32 would have been 0.01 / 0.02 MB: 50.0× / 26.7× fewer)"
    )
    # a strategy that measures no bytes (the gradient baselines) gets the counts only
    counts = MetricRecord({"rounds": 5, "rounds-applied": 5, "num-replies": 10, "num-rejected": 0})
    assert totals_line(counts) == "[flower-dlion] run totals (result.totals): 5 rounds, 10 replies"


# ---------------------------------------------------------------- 2. the round's metrics
def test_the_agreement_of_ef_sign_uploads_is_that_of_their_signs_not_nan() -> None:
    # Prepare: 3 honest-looking ef-sign replies (the third claims a large scale, cut to the median)
    strategy = DistributedLion(aggregation="mean", lr=0.1, weight_decay=0.0, upload="ef-sign", broadcast_bits=1)
    sent = first_round(strategy, [1, 2, 3])
    signs = [[1, 1, -1, -1, 1, -1, 1, 1, -1, 1], [1, -1, -1, 1, 1, -1, -1, 1, -1, 1], [-1] * 10]
    claimed = [np.array([2.0, 1.0], np.float32), np.array([1.0, 3.0], np.float32), np.array([9.0, 5.0], np.float32)]
    replies = [
        with_arrays(sent[n], signs_reply(sent[n], signs[n - 1]), scales=Array(claimed[n - 1])) for n in (1, 2, 3)
    ]
    # Execute
    _, metrics = strategy.aggregate_train(1, replies)
    # Assert: Σ signs per coordinate 1, −1, −3, −1, 1, −3, −1, 1, −3, 1: mean |Σ| / n = 16 / 30, as for
    # the sign upload; one scale a tensor above its lower median is cut (the median rule, not a fault)
    assert metrics["agreement"] == 16 / 30
    assert metrics["clipped-scales"] == 2 and metrics["tie-fraction"] == 0.0
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in metrics.values())


# ---------------------------------------------------------------- 3. the default lr
def test_the_default_lr_is_the_one_the_readme_and_the_quickstart_run_with() -> None:
    # Prepare: the D-Lion quickstart's run config, the README's server snippet
    quickstart = tomllib.loads((ROOT / "examples/quickstart-pytorch/pyproject.toml").read_text())
    readme = (ROOT / "README.md").read_text()
    # Execute
    default = DistributedLion().lr
    # Assert
    assert default == 2e-3 == quickstart["tool"]["flwr"]["app"]["config"]["learning-rate"]
    assert "strategy = DistributedLion(lr=2e-3, weight_decay=0.1)" in readme


# ---------------------------------------------------------------- 4. fewer batches than a round needs, or none
def test_two_batches_start_over_for_five_local_steps_and_a_used_up_generator_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: partition 0 hands over a list of 2 batches, partition 1 a generator of 2; K = 5
    seen: list[tuple[int, int, int]] = []

    def batches_of(pid: int, rnd: int) -> Any:
        return [batch(0), batch(1)] if pid == 0 else (batch(b) for b in (0, 1))

    app = recording_app(batches_of, seen)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    strategy, _, _ = start_tiny(app, 2, 1, local_steps=5, max_failed_rounds=0)
    # Assert: the list starts over (b₀ b₁ b₀ b₁ b₀, each example counted each time it is used) …
    assert [b for pid, _, b in seen if pid == 0] == [0, 1, 0, 1, 0]
    row = strategy.history[0]
    assert row["num-replies"] == 1 and row["num-examples"] == 5 * 2 and row["num-rejected"] == 1
    # … the generator cannot, and the node's error reply says why and what to pass instead
    assert [b for pid, _, b in seen if pid == 1] == [0, 1]
    assert (
        "rejected reply from node 1001 (partition 1): client error (code 2): <class 'ValueError'>:<'node 1001: "
        "batches is "
        "used up: it is an iterator (generator), which gives its batches once, and it ran out after 2 batches this "
        "round (a round takes local-steps × accumulate batches, starting over when they run out); pass something "
        "that can be iterated again (a DataLoader, a list)'>"
    ) in caplog.text


def test_empty_batches_fail_the_round_saying_so_and_the_node_keeps_its_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: partition 1 has no batch in round 2 only
    seen: list[tuple[int, int, int]] = []
    app = recording_app(lambda pid, rnd: [] if (pid, rnd) == (1, 2) else [batch(pid)], seen)
    grid = LocalGrid(app, 2)
    strategy = DistributedLion(lr=1e-3)
    states: list[bytes] = []
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    torch.manual_seed(0)
    strategy.start(
        grid,
        ArrayRecord(tiny_net().state_dict()),
        num_rounds=3,
        on_round_end=lambda r: states.append(context_to_proto(grid.context(1001)).SerializeToString()),
    )
    # Assert: an error reply that says what is wrong …
    assert (
        "rejected reply from node 1001 (partition 1): client error (code 2): <class 'ValueError'>:<'node 1001: "
        "batches is "
        "empty: the round needs at least one batch, and the list gave none (an empty partition? a DataLoader "
        "with drop_last=True and fewer examples than its batch_size?)'>"
    ) in caplog.text
    assert [(r["num-replies"], r["num-rejected"]) for r in strategy.history] == [(2, 0), (1, 1), (2, 0)]
    # … the node's state as after round 1, bit for bit, and round 3 goes on from it: the Δ it missed, no resync
    assert states[1] == states[0] != states[2]
    last = strategy.history[2]
    assert (last["full-syncs"], last["checksum-mismatches"], last["state-resets"]) == (0, 0, 0)


def test_local_work_names_the_node_whose_batches_are_empty() -> None:
    # Prepare: the gradients of node 7's round, from an empty list
    work = LocalWork(Binding(tiny_net()), cross_entropy_loss, [], accumulate=1, node_id=7)
    # Execute / Assert
    with pytest.raises(
        ValueError, match=r"^node 7: batches is empty: the round needs at least one batch, and the list"
    ):
        work.gradient(torch.zeros(27), 0)
