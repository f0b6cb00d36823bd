"""A learning-rate schedule per server round (issue 30): ``lion.cosine_decay``, ``DistributedLion(lr_schedule=…)``,
run config ``lr-schedule`` / ``lr-final`` for D-Lion and the FedAvg family.
"""

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion import lion
from flower_dlion.protocol import CONFIG
from flower_dlion.strategies import DistributedLion

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
