"""Where coin flips come from: the client's explanation by hand, and the server's one warning in real federations."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.coin_flips import ADAPTER, FIRST_LAYER, INACTIVE, WARN_ABOVE, explain
from flower_dlion.protocol import METRICS
from flower_dlion.testing import LocalGrid

from .. import byom

MLP = [("fc1.weight", (3, 4)), ("fc1.bias", (3,)), ("fc2.weight", (2, 3))]  # d = 12 + 3 + 6 = 21


def flat(*parts: list[float]) -> torch.Tensor:
    return torch.tensor([v for part in parts for v in part])


# ---------------------------------------------------------------- the client's explanation, by hand
def test_a_dead_unit_is_inactive_a_blank_input_is_the_first_layer() -> None:
    # Prepare: fc1's unit 0 never fires (its row and bias have momentum 0); or input 1 is always 0
    x = torch.ones(21)
    dead_row = flat([0, 0, 0, 0] + [1] * 8, [0, 1, 1], [1] * 6)
    blank_column = flat([1, 0, 1, 1] * 3, [1, 1, 1], [1] * 6)
    # Execute
    dead, blank = explain(dead_row, x, MLP), explain(blank_column, x, MLP)
    # Assert: 4 of the 5 zeros in fc1.weight, whole rows: inactive units; 3 of 3 in a whole column of the
    # first layer: inputs that are always 0; no zero: nothing to explain
    assert dead == {"coin-flips-tensor": 0, "coin-flips-share": 0.8, "coin-flips-cause": INACTIVE}
    assert blank == {"coin-flips-tensor": 0, "coin-flips-share": 1.0, "coin-flips-cause": FIRST_LAYER}
    assert explain(torch.ones(21), x, MLP) == {}


def test_zeros_beside_an_all_zero_adapter_matrix_are_the_adapters() -> None:
    # Prepare: LoRA on q: A (2×4) has momentum 0 (its gradient is 0 while B = 0); B (4×2) is all 0 in x
    layout = [("q.lora_A.weight", (2, 4)), ("q.lora_B.weight", (4, 2)), ("head.weight", (1, 4))]
    x = flat([0.5] * 8, [0] * 8, [1] * 4)
    m = flat([0] * 8, [0.1] * 8, [0, 1, 1, 1])
    # Execute / Assert: 8 of the 9 zeros beside the zero matrix: adapters; the tensor is A
    assert explain(m, x, layout) == {"coin-flips-tensor": 0, "coin-flips-share": 8 / 9, "coin-flips-cause": ADAPTER}


# ---------------------------------------------------------------- the server's warning
def _run(model_fn, rounds: int, caplog: pytest.LogCaptureFixture, hook=None) -> tuple[DistributedLion, list[str]]:
    app = ClientApp()
    client = DLionClient(app, model_fn)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, DataLoader(byom.partition(context.node_config["partition-id"], 4), 32))

    torch.manual_seed(0)
    strategy = DistributedLion(lr=1e-3)
    caplog.set_level(logging.WARNING, logger="flwr")
    strategy.start(LocalGrid(app, 2, reply_hook=hook), ArrayRecord(model_fn().state_dict()), num_rounds=rounds)
    said = [r.getMessage() for r in caplog.records if "of the uploaded signs were coin flips" in r.getMessage()]
    return strategy, said


class _Lora(nn.Module):
    """A frozen 784 → 10 layer with a rank-4 LoRA adapter (B = 0)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the pretrained base every node holds
            torch.manual_seed(7)
            self.base = nn.Linear(784, 10).requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(4, 784) / 28)
        self.lora_B = nn.Parameter(torch.zeros(10, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


def test_a_lora_model_is_told_once_that_its_zero_adapters_flip_coins(caplog: pytest.LogCaptureFixture) -> None:
    # Execute: 3 rounds; in round 1 A's 3,136 values have gradient 0 (B = 0), B's 40 do not
    strategy, said = _run(_Lora, 3, caplog)
    # Assert: round 1's fraction, exactly; one warning naming A and the adapters; B moved, so A flips no more
    assert strategy.history[0]["coin-flip-fraction"] == pytest.approx(3136 / 3176)
    assert [h["coin-flip-fraction"] for h in strategy.history[1:]] == [0.0, 0.0]
    assert len(said) == 1 and said[0].startswith("round 1: 98.7 %")
    assert "100 % of a client's are in 'lora_A': likely adapter matrices initialised to zero" in said[0]


def test_dead_relu_units_are_named_and_a_steady_fraction_below_the_threshold_is_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: 784 → 32 ReLU → 10 with units 0–2 dead (bias −100): 3·785 + 3·10 values without gradient
    def few_dead() -> nn.Module:
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
        with torch.no_grad():
            model[1].bias[:3] = -100.0
        return model

    def all_dead() -> nn.Module:
        model = few_dead()
        nn.init.constant_(model[1].bias, -100.0)
        return model

    # Execute
    few, said_few = _run(few_dead, 2, caplog)
    caplog.clear()
    dead, said_all = _run(all_dead, 3, caplog)
    # Assert: 9.4 % flips, below the 30 % threshold: counted, not warned. All units dead: the dead
    # layer's 784·32 + 32 values and the second layer's 32·10 weights have no gradient, m stays 0 there,
    # so each is a coin flip in every round (only the last bias moves); warned once, naming the first
    # layer's weight and inactive units (whole rows), not blank inputs
    d = few.num_parameters
    assert [h["coin-flip-fraction"] for h in few.history] == [pytest.approx((3 * 785 + 30) / d)] * 2
    assert (3 * 785 + 30) / d < WARN_ABOVE and said_few == []
    assert [h["coin-flip-fraction"] for h in dead.history] == [pytest.approx((784 * 32 + 32 + 320) / d)] * 3
    assert len(said_all) == 1 and said_all[0].startswith("round 1: 100.0 %")
    assert "in '1.weight': likely units inactive on every example so far" in said_all[0]


def test_a_malformed_explanation_is_refused_by_name(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: node 1001 names a tensor the model does not have
    def hook(node_id: int, reply: Message) -> Message:
        if node_id == 1001 and not reply.has_error() and METRICS in reply.content:
            if "coin-flips-cause" in reply.content[METRICS]:
                reply.content[METRICS]["coin-flips-tensor"] = 7
        return reply

    # Execute
    strategy, _ = _run(_Lora, 1, caplog, hook)
    # Assert: its reply rejected with the metric, its range and the value; the other applied
    assert strategy.history[0]["num-rejected"] == 1 and strategy.history[0]["applied"] == 1
    assert "metric 'coin-flips-tensor' is 7, expected an integer in [0, 2)" in caplog.text
