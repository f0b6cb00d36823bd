"""The divergence watch: its pure update on hand-computed losses, and DistributedLion's warnings, stop and resume."""

import logging
import math

import pytest
from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion import RunStopped
from flower_dlion.strategies import DistributedLion
from flower_dlion.strategies.divergence import (
    DivergenceOptions,
    DivergenceState,
    replay,
    report,
    update,
)

from .test_strategy import SIGNS, StubGrid, first_round, signs_reply

NAN = math.nan


def run_watch(options: DivergenceOptions, losses: list[float | None]) -> tuple[list[DivergenceState], list[int]]:
    """The states after each round of ``losses`` (round t = index + 1) and the rounds that warned."""
    state, states, warned = DivergenceState(), [], []
    for t, loss in enumerate(losses, start=1):
        state, warning = update(state, options, t, loss)
        states.append(state)
        if warning is not None:
            warned.append(t)
    return states, warned


# ------------------------------------------------------------------ the pure update
def test_a_loss_above_ten_times_its_running_minimum_warns_in_that_round() -> None:
    # Prepare: the run, 0.389 to 37.3; threshold 10 × 0.389 = 3.89 from round 4
    losses: list[float | None] = [1.0, 0.5, 0.389, 4.0, 37.3, 0.3, 3.0]
    # Execute
    states, warned = run_watch(DivergenceOptions(), losses)
    # Assert: m_t and k_t by hand; rounds 4 (4.0 > 3.89) and 5 warn, 6 resets, 7 (3.0 ≤ 10 × 0.3) does not
    assert [s.minimum for s in states] == [1.0, 0.5, 0.389, 0.389, 0.389, 0.3, 0.3]
    assert [s.streak for s in states] == [0, 0, 0, 1, 2, 0, 0]
    assert warned == [4, 5]


@pytest.mark.parametrize(("rounds", "warned"), [(1, [2, 3, 4, 6]), (2, [3, 4]), (3, [4]), (4, [])])
def test_divergence_rounds_is_the_streak_the_warning_needs(rounds: int, warned: list[int]) -> None:
    # Prepare: threshold 10 × 1.0; rounds 2-4 above it, 5 below, 6 above again
    losses: list[float | None] = [1.0, 20.0, 30.0, 40.0, 5.0, 50.0]
    # Execute
    states, got = run_watch(DivergenceOptions(divergence_rounds=rounds), losses)
    # Assert
    assert [s.streak for s in states] == [0, 1, 2, 3, 0, 1]
    assert got == warned


def test_the_factor_is_a_strict_bound_on_the_ratio() -> None:
    # Prepare: factor 2 over the minimum 1.5: 3.0 is on the bound (no warning), 3.0001 above it
    options = DivergenceOptions(divergence_factor=2.0)
    # Execute
    _, warned = run_watch(options, [1.5, 3.0, 3.0001])
    # Assert
    assert warned == [3]


def test_a_round_without_a_valid_reply_leaves_the_minimum_and_the_streak() -> None:
    # Prepare: round 3 had no valid reply (loss None) between two rounds above 10 × 1.0
    options = DivergenceOptions(divergence_rounds=2)
    # Execute
    states, warned = run_watch(options, [1.0, 11.0, None, 12.0])
    # Assert: the streak goes on over round 3, which neither warns nor counts
    assert [(s.minimum, s.streak) for s in states] == [(1.0, 0), (1.0, 1), (1.0, 1), (1.0, 2)]
    assert warned == [4]


def test_a_non_finite_round_loss_counts_and_does_not_move_the_minimum() -> None:
    # Execute
    states, warned = run_watch(DivergenceOptions(divergence_rounds=2), [1.0, math.inf, NAN, 0.5])
    # Assert
    assert [(s.minimum, s.streak) for s in states] == [(1.0, 0), (1.0, 1), (1.0, 2), (0.5, 0)]
    assert warned == [3]


def test_a_minimum_of_zero_or_below_leaves_only_non_finite_losses_to_watch() -> None:
    # Execute: a loss that reaches 0, and one that goes negative (no ratio to speak of)
    _, warned_zero = run_watch(DivergenceOptions(), [0.0, 5.0, 100.0])
    _, warned_negative = run_watch(DivergenceOptions(), [-1.0, 100.0, math.inf])
    # Assert
    assert warned_zero == [] and warned_negative == [3]


def test_a_non_finite_node_loss_warns_with_the_node_and_its_partition() -> None:
    # Prepare: m = 0.5; this round's loss 0.6 (the finite replies') is fine, node 12's is NaN
    state = DivergenceState(minimum=0.5, streak=0)
    losses = {(11, 1): 0.6, (12, 2): NAN, (13, 3): 0.55}
    # Execute
    new, warning = update(state, DivergenceOptions(), 7, 0.6, losses)
    # Assert
    assert new == DivergenceState(minimum=0.5, streak=0)
    assert warning == (
        "round 7: divergence: a non-finite train-loss from 1 node: train-loss 0.6, running minimum 0.5, "
        "divergence_factor 10 (threshold 5), divergence_rounds 1; nodes above the threshold or not finite: "
        "node 12 (partition 2): nan"
    )


def test_a_non_finite_node_loss_in_round_one_warns_before_there_is_a_minimum() -> None:
    # Execute: the only node's loss is inf, so the round has no valid reply
    new, warning = update(DivergenceState(), DivergenceOptions(), 1, None, {(5, 0): math.inf})
    # Assert
    assert new == DivergenceState()
    assert warning == (
        "round 1: divergence: a non-finite train-loss from 1 node: train-loss none, running minimum none, "
        "divergence_factor 10 (threshold none), divergence_rounds 1; nodes above the threshold or not finite: "
        "node 5 (partition 0): inf"
    )


def test_replay_gives_the_state_the_rounds_made() -> None:
    # Prepare: a history as the strategy keeps it (round 3 without a valid reply: its train-loss is NaN)
    history = [
        {"round": 1, "num-replies": 3, "train-loss": 2.0},
        {"round": 2, "num-replies": 3, "train-loss": 0.8},
        {"round": 3, "num-replies": 0, "train-loss": NAN},
        {"round": 4, "num-replies": 2, "train-loss": 9.0},
    ]
    # Execute
    state = replay(DivergenceOptions(divergence_factor=5.0), history)
    # Assert: m = 0.8; round 4's 9.0 > 5 × 0.8 = 4.0
    assert state == DivergenceState(minimum=0.8, streak=1)


def test_report_logs_the_warning_or_stops_the_run(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    caplog.set_level(logging.WARNING, logger="flwr")
    text = "round 5: divergence: something"
    # Execute
    report(text, DivergenceOptions(), 5)
    report(None, DivergenceOptions(stop_on_divergence=True), 6)  # nothing seen: neither logs nor stops
    with pytest.raises(RunStopped) as stopped:
        report(text, DivergenceOptions(stop_on_divergence=True), 5)
    # Assert
    assert [r.getMessage() for r in caplog.records] == [
        f"{text}. Lower lr or local_steps; stop_on_divergence=True stops the run here",
        f"{text}. Stopping the run (stop_on_divergence=True)",
    ]
    assert str(stopped.value) == f"the run cannot learn: {text} (stop_on_divergence=True)"
    assert stopped.value.server_round == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"divergence_factor": 1.0}, "divergence_factor must be a number > 1 (math.inf: watch for non-finite losses "
         "only), got 1.0"),
        ({"divergence_factor": NAN}, "divergence_factor must be a number > 1 (math.inf: watch for non-finite losses "
         "only), got nan"),
        ({"divergence_factor": "10"}, "divergence_factor must be a number > 1 (math.inf: watch for non-finite losses "
         "only), got '10'"),
        ({"divergence_rounds": 0}, "divergence_rounds must be an integer >= 1, got 0"),
        ({"divergence_rounds": 2.0}, "divergence_rounds must be an integer >= 1, got 2.0"),
        ({"stop_on_divergence": 1}, "stop_on_divergence must be True or False, got 1"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name_at_construction(kwargs: dict, message: str) -> None:
    # Execute
    with pytest.raises(ValueError) as refused:
        DistributedLion(**kwargs)
    # Assert
    assert str(refused.value) == message


def test_the_arguments_are_read_back_and_infinity_is_allowed() -> None:
    # Execute
    strategy = DistributedLion(divergence_factor=math.inf, divergence_rounds=3, stop_on_divergence=True)
    # Assert
    assert (strategy.divergence_factor, strategy.divergence_rounds, strategy.stop_on_divergence) == (math.inf, 3, True)
    assert DistributedLion().options.divergence == DivergenceOptions(
        divergence_factor=10.0, divergence_rounds=1, stop_on_divergence=False
    )


# ------------------------------------------------------------------ the strategy, with mock replies
def two_rounds(strategy: DistributedLion, second: dict[int, float]) -> None:
    """Round 1: nodes 1-3 report train-loss 0.5; round 2: node n reports ``second[n]`` (a NaN one is rejected)."""
    sent = first_round(strategy, [1, 2, 3])
    strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[n - 1], **{"train-loss": 0.5}) for n in (1, 2, 3)])
    x = strategy.x.clone()
    messages = strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    sent = {m.metadata.dst_node_id: m for m in messages}
    replies = [signs_reply(sent[n], SIGNS[n - 1], x, **{"train-loss": second[n]}) for n in (1, 2, 3)]
    strategy.aggregate_train(2, replies)


def test_the_strategy_warns_naming_the_round_the_losses_and_the_nodes(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: round 2's valid replies, 50.0 and 0.5 (32 examples each), mean 25.25 > 10 × 0.5; node 3's is NaN
    strategy = DistributedLion(lr=0.1)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    two_rounds(strategy, {1: 50.0, 2: 0.5, 3: NAN})
    # Assert: one divergence warning, in round 2; node 3's reply was also rejected
    lines = [r.getMessage() for r in caplog.records if "divergence" in r.getMessage()]
    assert lines == [
        "round 2: divergence: train-loss above divergence_factor × its running minimum for 1 round in a row and a "
        "non-finite train-loss from 1 node: train-loss 25.25, running minimum 0.5, divergence_factor 10 (threshold "
        "5), divergence_rounds 1; nodes above the threshold or not finite: node 1 (partition 1): 50, node 3 "
        "(partition 3): nan. Lower lr or local_steps; stop_on_divergence=True stops the run here"
    ]
    assert "rejected reply from node 3 (partition 3): metric 'train-loss' is nan" in caplog.text
    assert strategy.history[-1]["train-loss"] == 25.25 and strategy.history[-1]["num-rejected"] == 1
    assert strategy.divergence == DivergenceState(minimum=0.5, streak=1)


def test_the_strategy_stops_the_run_with_stop_on_divergence() -> None:
    # Prepare
    strategy = DistributedLion(lr=0.1, stop_on_divergence=True)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        two_rounds(strategy, {1: 6.5, 2: 5.5, 3: 5.0})
    # Assert: the mean 17/3 > 10 × 0.5; node 3's 5.0 is on the threshold, not above it
    assert stopped.value.server_round == 2
    assert str(stopped.value) == (
        "the run cannot learn: round 2: divergence: train-loss above divergence_factor × its running minimum for 1 "
        "round in a row: train-loss 5.667, running minimum 0.5, divergence_factor 10 (threshold 5), divergence_rounds "
        "1; nodes above the threshold or not finite: node 1 (partition 1): 6.5, node 2 (partition 2): 5.5 "
        "(stop_on_divergence=True)"
    )


def test_a_resumed_strategy_goes_on_with_the_minimum_and_the_streak(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: two rounds (0.5, then 6.0 > 5.0: a streak of 1 of the 2 that warn), checkpointed and resumed
    strategy = DistributedLion(lr=0.1, divergence_rounds=2)
    two_rounds(strategy, {1: 6.0, 2: 6.0, 3: 6.0})
    resumed = DistributedLion(lr=0.1, divergence_rounds=2)
    resumed.load_state_dict(strategy.state_dict())
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute: round 3 of the resumed run (the nodes say hello again and get the full model), 7.0 each
    x = resumed.x.clone()
    sent = {
        m.metadata.dst_node_id: m
        for m in resumed.configure_train(3, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    }
    resumed.aggregate_train(3, [signs_reply(sent[n], SIGNS[n - 1], x, **{"train-loss": 7.0}) for n in (1, 2, 3)])
    # Assert: the state came back from the checkpoint's history, and round 3 is the second in a row
    assert resumed.divergence == DivergenceState(minimum=0.5, streak=2)
    lines = [r.getMessage() for r in caplog.records if "divergence" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "round 3: divergence: train-loss above divergence_factor × its running minimum for 2 rounds in a row: "
        "train-loss 7, running minimum 0.5,"
    )
