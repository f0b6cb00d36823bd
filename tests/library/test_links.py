"""DistributedLion has an uplink and a downlink (issue 50, item 3): objects given options and state, not mixins."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion.protocol import CONFIG
from flower_dlion.strategies import DistributedLion
from flower_dlion.strategies.common import ServerModelStrategy
from flower_dlion.strategies.downlink import Downlink
from flower_dlion.strategies.server_state import ServerState
from flower_dlion.strategies.uplink import Applied, RoundCounts, Uplink

from .test_strategy import SIGNS, StubGrid, first_round, signs_reply


def test_the_strategy_holds_its_links_and_they_share_its_options_and_state() -> None:
    # Prepare
    strategy = DistributedLion(downlink="chain")
    # Assert: composition, not inheritance; one ServerState for both links, the strategy's
    assert DistributedLion.__bases__ == (ServerModelStrategy,)
    assert isinstance(strategy.up, Uplink) and isinstance(strategy.down, Downlink)
    assert strategy.up.options is strategy.options and strategy.down.options is strategy.options
    assert strategy.up.state is strategy.state and strategy.down.state is strategy.state
    assert strategy.downlink == "chain"  # the option keeps its name
    # Execute: a new state (as load_state_dict sets one) reaches both links
    strategy.state = ServerState()
    # Assert
    assert strategy.up.state is strategy.state and strategy.down.state is strategy.state


def test_the_links_share_the_strategys_global_model_and_read_its_nodes() -> None:
    # Prepare
    strategy = DistributedLion()
    model, nodes = strategy.up.model, strategy.down.nodes
    assert model is strategy.down.model is strategy.check.model is strategy.model and model.x is None
    # Execute
    first_round(strategy, [1, 2])
    strategy.checkpoint_round = 7
    # Assert
    assert model.x is strategy.x and model.num_parameters == 10 and model.sizes == [6, 4]
    assert model.scale_sizes(0) == [6, 4] and model.rest == {}
    assert nodes.checkpoint_round == 7 and nodes.run_key == strategy.run_key and nodes.partition_of(2) == 2


def test_the_uplink_returns_the_chain_delta_and_the_strategy_hands_it_to_the_downlink() -> None:
    # Prepare
    strategy = DistributedLion(aggregation="vote", lr=0.1, weight_decay=0.5, downlink="chain")
    sent = first_round(strategy, [1, 2, 3])
    valid = [strategy.check.check_reply(signs_reply(sent[n], SIGNS[n - 1]), strategy._round).outcome for n in (1, 2, 3)]
    counts = RoundCounts()
    # Execute: the uplink alone applies Δ and keeps nothing for the downlink itself
    outcome = strategy.up.apply(valid, strategy._round, counts)  # type: ignore[arg-type]
    # Assert
    assert isinstance(outcome, Applied) and outcome.broadcast is not None and outcome.broadcast.version == 1
    assert strategy.state.version == 1 and not strategy.state.broadcasts and counts.clipped == 0


def test_a_round_through_the_strategy_keeps_the_delta_for_the_chain_and_resets_its_counts() -> None:
    # Prepare
    strategy = DistributedLion(aggregation="vote", lr=0.1, weight_decay=0.5, downlink="chain")
    sent = first_round(strategy, [1, 2, 3])
    # Execute
    _, metrics = strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[n - 1]) for n in (1, 2, 3)])
    msgs = strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    # Assert
    assert [b.version for b in strategy.state.broadcasts] == [1] and metrics is not None
    assert metrics["applied"] == 1 and strategy._counts == RoundCounts()
    assert {m.content[CONFIG]["kind"] for m in msgs} == {"deltas"}
