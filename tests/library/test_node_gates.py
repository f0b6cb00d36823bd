"""Issue 62, integrity on every path: too few nodes stop the run by name; a node of the wrong layout is left out.

* too few nodes connected (``min_available_nodes``), or able to take part for secure aggregation
  (``min_train_nodes``, at least 3): the run stops with :class:`RunStopped` after at most
  ``wait_for_nodes`` seconds, naming both counts; a node that connects during the wait is taken;
* ``run_federation`` writes ``summary.json`` in every outcome: "stopped" with the reason, "failed"
  for any other error; a round without a train message is a row, not a ``StopIteration``;
* a node whose reply has the wrong layout (its model changed shape) is told once, one WARNING line,
  and left out of sampling until it says hello again (a new node id, a reconnection, a resume).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from flower_dlion.protocol import CLIENT_UPLOAD, METRICS
from flower_dlion.strategies import DistributedLion
from flower_dlion.strategies.nodes import HELLO_TYPE
from flower_dlion.strategies.run_stops import RunStopped

from .test_strategy import SIGNS, StubGrid, first_round, initial_arrays, signs_reply

WAITED = "after waiting 0.05 s (wait_for_nodes, by default the round timeout)"
SECURE_NEEDS = "secure aggregation needs at least {} nodes a round (min_train_nodes = {}, run config 'min-train-nodes')"


class CountingGrid(StubGrid):
    """A StubGrid that keeps the node ids it said hello to, and whose nodes may connect later or fail the hello."""

    def __init__(self, node_ids: list[int], later: list[int] | None = None, **kwargs: object) -> None:
        super().__init__(node_ids, **kwargs)  # type: ignore[arg-type]
        self.later = list(later or [])  # connect at the second look
        self.hellos: list[int] = []
        self.failing: set[int] = set()  # answer the hello with an error

    def get_node_ids(self) -> list[int]:
        ids = super().get_node_ids()
        self.node_ids += self.later
        self.later = []
        return ids

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        self.hellos += [m.metadata.dst_node_id for m in messages if m.metadata.message_type == HELLO_TYPE]
        out = super().send_and_receive([m for m in messages if m.metadata.dst_node_id not in self.failing])
        return out + [Message(Error(code=2, reason="no data"), reply_to=m) for m in messages
                      if m.metadata.dst_node_id in self.failing]  # fmt: skip


def secure(min_available_nodes: int | None = None, min_train_nodes: int | None = None) -> DistributedLion:
    strategy = DistributedLion(secure=True, min_available_nodes=min_available_nodes, min_train_nodes=min_train_nodes)
    strategy.wait_for_nodes = 0.05
    return strategy


# ---------------------------------------------------------------- too few nodes, library
@pytest.mark.parametrize(
    ("min_available", "min_train", "nodes", "expected"),
    [
        (2, 3, [1, 2], f"{SECURE_NEEDS.format(3, 3)}; 2 are connected {WAITED}"),
        (None, None, [1, 2], f"{SECURE_NEEDS.format(3, 3)}; 2 are connected {WAITED}"),
        (2, 5, [1, 2, 3, 4], f"{SECURE_NEEDS.format(5, 5)}; 4 are connected {WAITED}"),
        (2, 3, [1], f"{SECURE_NEEDS.format(3, 3)}; 1 is connected {WAITED}"),
        (
            6,
            3,
            [1, 2, 3, 4],
            "min_available_nodes = 6 nodes must be connected before a round samples (run config "
            f"'min-available-nodes'); 4 are connected {WAITED}",
        ),
    ],
)
def test_a_secure_run_with_too_few_nodes_stops_before_round_one_naming_both_counts(
    min_available: int | None, min_train: int | None, nodes: list[int], expected: str
) -> None:
    # Prepare
    strategy = secure(min_available, min_train)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.configure_train(1, initial_arrays(), ConfigRecord(), CountingGrid(nodes))
    # Assert: round 1, the reason names what is needed and what there is; nothing was sent
    assert str(stopped.value) == f"the run cannot learn: {expected}" and stopped.value.server_round == 1
    assert strategy.x is None


def test_a_plain_run_waits_for_min_available_nodes_at_most_wait_for_nodes_seconds() -> None:
    # Prepare: 3 nodes wanted, 2 connected; the wait defaults to the round timeout (query_timeout)
    strategy = DistributedLion(min_available_nodes=3)
    strategy.nodes.query_timeout = 0.05
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.configure_train(1, initial_arrays(), ConfigRecord(), CountingGrid([1, 2]))
    # Assert
    assert str(stopped.value) == (
        "the run cannot learn: min_available_nodes = 3 nodes must be connected before a round samples "
        f"(run config 'min-available-nodes'); 2 are connected {WAITED}"
    )


def test_a_node_that_connects_during_the_wait_is_taken() -> None:
    # Prepare: 2 nodes connected, a third at the next look (a secure run needs 3)
    strategy = secure(2, 3)
    strategy.wait_for_nodes = 5.0
    grid = CountingGrid([1, 2], later=[3])
    # Execute
    nodes = strategy.nodes.discover(grid, 1)
    # Assert: the three, each greeted once
    assert nodes == [1, 2, 3] and sorted(grid.hellos) == [1, 2, 3]


def test_a_secure_run_counts_the_nodes_that_can_take_part_not_the_connected() -> None:
    # Prepare: 3 connected, node 3 answers its hello with an error
    strategy = secure(3, 3)
    grid = CountingGrid([1, 2, 3])
    grid.failing = {3}
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.nodes.discover(grid, 1)
    # Assert: 2 of 3 can take part, node 3 named with why
    assert str(stopped.value) == (
        f"the run cannot learn: {SECURE_NEEDS.format(3, 3)}; 2 of the 3 connected can take part {WAITED} "
        "(node 3: its hello got no useful answer)"
    )


def test_wait_for_nodes_is_checked() -> None:
    # Execute / Assert: the attribute's own message; None and 0 are allowed
    strategy = DistributedLion()
    for bad in (-1.0, float("nan"), float("inf"), True, "60"):
        with pytest.raises(ValueError) as err:
            strategy.wait_for_nodes = bad  # type: ignore[assignment]
        assert str(err.value) == f"wait_for_nodes must be a finite number of seconds >= 0, or None, got {bad!r}"
    strategy.wait_for_nodes = 0
    assert strategy.wait_for_nodes == 0 and DistributedLion().wait_for_nodes is None


# ---------------------------------------------------------------- too few nodes, the app
RUN_CONFIG = {"partitioner": "iid", "batch-size": 16, "holdout": 200, "eval-every": 5, "device": "cpu"}


# ---------------------------------------------------------------- replies of the wrong layout
def wrong_layout(instruction: Message) -> Message:
    """A reply whose signs are of a 9-parameter model (the federation's has 10)."""
    good = signs_reply(instruction, SIGNS[0])
    array = Array(dtype="bit", shape=(9,), stype="dlion.sign1", data=good.content[CLIENT_UPLOAD]["signs"].data)
    content = RecordDict(
        {CLIENT_UPLOAD: ArrayRecord({"signs": array}), METRICS: MetricRecord(dict(good.content[METRICS]))}
    )
    return Message(content, reply_to=instruction)


def client_layout_error(instruction: Message) -> Message:
    """What a DLionClient whose model changed shape answers a full model (clients/replica.py)."""
    reason = "<class 'ClientStateError'>:<'node 4: server model layout 7eea0c7b != client's abff1fb1'>"
    return Message(Error(code=2, reason=reason), reply_to=instruction)


def sampled(strategy: DistributedLion, server_round: int, grid: StubGrid) -> list[int]:
    return sorted(m.metadata.dst_node_id for m in strategy.configure_train(server_round, ArrayRecord(),
                                                                           ConfigRecord(), grid))  # fmt: skip


LEFT_OUT = (
    "round 1: rejected reply from node 4 (partition 4) of the wrong layout: {}. The node is left out of sampling "
    "until it says hello again (a new node id, or a resume)"
)


@pytest.mark.parametrize(
    ("make_reply", "problem"),
    [
        (wrong_layout, "Array 'signs' shape (9,), expected (10,)"),
        (
            client_layout_error,
            "client error (code 2): <class 'ClientStateError'>:<'node 4: server model layout 7eea0c7b != "
            "client's abff1fb1'>",
        ),
    ],
    ids=["server-check", "client-error"],
)
def test_a_node_of_the_wrong_layout_is_told_once_and_left_out_until_it_says_hello_again(
    make_reply, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: round 1 with nodes 1-4; node 4 replies with the wrong layout
    strategy = DistributedLion(lr=0.1)
    sent = first_round(strategy, [1, 2, 3, 4])
    replies = [signs_reply(sent[n], SIGNS[n - 1]) for n in (1, 2, 3)] + [make_reply(sent[4])]
    grid = CountingGrid([1, 2, 3, 4])
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute: round 1, then rounds 2 and 3 (node 4 still connected), then node 4 back as node 14
    _, metrics = strategy.aggregate_train(1, replies)
    rounds = [sampled(strategy, 2, grid)]
    strategy.aggregate_train(2, [])
    rounds.append(sampled(strategy, 3, grid))
    strategy.aggregate_train(3, [])
    grid.node_ids, grid.partitions = [1, 2, 3, 14], {14: 4}
    rounds.append(sampled(strategy, 4, grid))
    # Assert: one line about node 4, naming its partition and the problem; left out of rounds 2 and 3, no hello
    # sent to it; its partition back with node 14's hello
    lines = [r.getMessage() for r in caplog.records if "node 4 " in r.getMessage()]
    assert lines == [LEFT_OUT.format(problem)]
    assert metrics["num-replies"] == 3 and metrics["num-rejected"] == 1
    assert rounds == [[1, 2, 3], [1, 2, 3], [1, 2, 3, 14]] and grid.hellos == [14]
    assert strategy.partition_of(14) == 4 and strategy.partition_of(4) == -1


def test_a_reply_rejected_for_another_reason_leaves_the_node_in(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: node 4's reply has the right shape but one byte too many
    strategy = DistributedLion(lr=0.1)
    sent = first_round(strategy, [1, 2, 3, 4])
    good = signs_reply(sent[4], SIGNS[3])
    data = good.content[CLIENT_UPLOAD]["signs"].data + b"\x00"
    array = Array(dtype="bit", shape=(10,), stype="dlion.sign1", data=data)
    bad = Message(
        RecordDict({CLIENT_UPLOAD: ArrayRecord({"signs": array}), METRICS: good.content[METRICS]}), reply_to=sent[4]
    )
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[n - 1]) for n in (1, 2, 3)] + [bad])
    # Assert: the usual rejection, and node 4 sampled again
    assert "round 1: rejected reply from node 4 (partition 4): Array 'signs' has 3 bytes, expected 2" in caplog.text
    assert "left out" not in caplog.text
    assert sampled(strategy, 2, CountingGrid([1, 2, 3, 4])) == [1, 2, 3, 4]


def test_a_left_out_node_is_greeted_again_after_it_reconnects_or_a_resume() -> None:
    # Prepare: node 4 left out in round 1
    strategy = DistributedLion(lr=0.1)
    sent = first_round(strategy, [1, 2, 3, 4])
    strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[n - 1]) for n in (1, 2, 3)] + [wrong_layout(sent[4])])
    state = strategy.state_dict()
    grid = CountingGrid([1, 2, 3])
    # Execute: node 4 leaves (not listed) and comes back under the same id; a resumed strategy greets everyone
    gone = strategy.nodes.discover(grid, 2)
    grid.node_ids = [1, 2, 3, 4]
    back = strategy.nodes.discover(grid, 2)
    resumed = DistributedLion(lr=0.1)
    resumed.load_state_dict(state)
    again = resumed.nodes.discover(CountingGrid([1, 2, 3, 4]), 2)
    # Assert
    assert gone == [1, 2, 3] and back == [1, 2, 3, 4] and grid.hellos == [4] and again == [1, 2, 3, 4]


def test_a_momentum_array_of_another_model_is_the_wrong_layout_too() -> None:
    # Prepare: the round asks for the momentum (10 float32 values); node 3 sends 12
    strategy = DistributedLion(lr=0.1, momentum_sync_every=1)
    sent = first_round(strategy, [1, 2, 3])

    def reply(n: int, momentum: np.ndarray) -> Message:
        good = signs_reply(sent[n], SIGNS[n - 1])
        arrays = ArrayRecord({"signs": good.content[CLIENT_UPLOAD]["signs"], "momentum": Array(momentum)})
        return Message(RecordDict({CLIENT_UPLOAD: arrays, METRICS: good.content[METRICS]}), reply_to=sent[n])

    replies = [reply(n, np.zeros(10, np.float32)) for n in (1, 2)] + [reply(3, np.zeros(12, np.float32))]
    # Execute
    _, metrics = strategy.aggregate_train(1, replies)
    # Assert
    assert metrics["num-replies"] == 2
    assert strategy.nodes.left_out == {3: "Array 'momentum' shape (12,), expected (10,)"}
