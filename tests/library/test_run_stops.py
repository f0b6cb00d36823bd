"""Issue 49: runs that cannot learn stop.

* a run config that cannot learn fails before round 1, naming the key, the value and what is allowed;
* a run whose rounds get no valid reply ``max-failed-rounds`` times in a row stops with
  :class:`RunStopped` (D-Lion, the gradient baselines, the FedAvg family), naming the rounds and why
  the replies were rejected; a round with a valid reply resets the count; 0 never stops;
* a federation whose every node answers the hello with an error stops in round 1, before any train
  message, naming the nodes and the errors;
* ``run_federation`` then writes ``summary.json`` with status "stopped" and the reason, logs it at
  ERROR, and raises (the ServerApp fails).
"""

from __future__ import annotations

import re

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.protocol import HELLO_ACTION
from flower_dlion.strategies.run_stops import FailedRounds, RunStopped, short_reason
from flower_dlion.testing import LocalGrid

from ..byom import ByomNet


# ---------------------------------------------------------------- rounds without a valid reply
class Tiny(nn.Module):
    """784 → 10, no buffers: a model the gradient baselines take as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def failing_app(fails: set[int] | None, model_fn: type[nn.Module] = ByomNet) -> tuple[ClientApp, list[int]]:
    """A user's ClientApp whose train handler raises in the rounds ``fails`` (None: every round).

    The other rounds train on one synthetic batch of 8 images. Returns the app and the rounds its
    train handler was called in.
    """
    app = ClientApp()
    client = DLionClient(app, model_fn)
    called: list[int] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        server_round = int(msg.metadata.group_id)
        called.append(server_round)
        if fails is None or server_round in fails:
            raise RuntimeError(f"no data on node {context.node_id}")
        gen = torch.Generator().manual_seed(server_round)
        batch = (torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen))
        return client.train(msg, context, [batch])

    return app, called


def initial(model_fn: type[nn.Module] = ByomNet) -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(model_fn().state_dict())


def test_dlion_stops_after_max_failed_rounds_rounds_whose_replies_all_failed() -> None:
    # Prepare: 2 nodes whose train handler raises in every round; 3 failed rounds stop the run
    app, called = failing_app(None)
    grid = LocalGrid(app, 2)
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=3)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.start(grid, initial(), num_rounds=5)
    # Assert: stopped in round 3, its round kept in the history; the message names rounds, counts and the error
    assert stopped.value.server_round == 3 and len(strategy.history) == 3
    assert [h["num-replies"] for h in strategy.history] == [0, 0, 0] and called == [1, 1, 2, 2, 3, 3]
    assert str(stopped.value) == (
        "the run cannot learn: 3 rounds in a row without a valid reply (rounds 1 to 3; max_failed_rounds=3); "
        "round 3: 0 valid of 2 sent (2 rejected, 0 without a reply). Rejected in these rounds: "
        "3× from node 1000: client error (code 2): <class 'RuntimeError'>:<'no data on node 1000'>; "
        "3× from node 1001: client error (code 2): <class 'RuntimeError'>:<'no data on node 1001'>. "
        "Look at these errors in the clients' logs (the ClientApp, its data, the learning rate and weight decay); "
        "max_failed_rounds = 0 (run config 'max-failed-rounds') never stops a run"
    )


def test_max_failed_rounds_zero_runs_every_round() -> None:
    # Prepare: every reply fails, and the run is told never to stop
    app, called = failing_app(None)
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=0)
    # Execute
    strategy.start(LocalGrid(app, 2), initial(), num_rounds=4)
    # Assert: all 4 rounds ran, none applied
    assert [(h["round"], h["num-replies"], h["applied"]) for h in strategy.history] == [(r, 0, 0) for r in (1, 2, 3, 4)]
    assert called == [1, 1, 2, 2, 3, 3, 4, 4]


def test_a_round_with_valid_replies_resets_the_count() -> None:
    # Prepare: replies fail in rounds 2, 3, 5 and 6 (4 failed rounds, never 3 in a row); R = 3
    app, _ = failing_app({2, 3, 5, 6})
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=3)
    # Execute
    strategy.start(LocalGrid(app, 2), initial(), num_rounds=6)
    # Assert: the run went to the end
    assert [h["num-replies"] for h in strategy.history] == [2, 0, 0, 2, 0, 0]


def test_the_count_starts_again_after_a_good_round() -> None:
    # Prepare: replies fail in rounds 2, 3, then 5, 6, 7; R = 3
    app, _ = failing_app({2, 3, 5, 6, 7})
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=3)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.start(LocalGrid(app, 2), initial(), num_rounds=8)
    # Assert: rounds 5 to 7 stopped it; the reasons are those of rounds 5 to 7 only (3 per node)
    assert [h["num-replies"] for h in strategy.history] == [2, 0, 0, 2, 0, 0, 0]
    assert "3 rounds in a row without a valid reply (rounds 5 to 7; max_failed_rounds=3)" in str(stopped.value)
    assert "3× from node 1000: client error" in str(stopped.value)


def test_only_the_last_five_distinct_reasons_are_kept() -> None:
    # Prepare: 7 distinct reasons (0 and 1 forgotten), reason 4 again from node 8, then a long one (2 forgotten)
    failures = FailedRounds(max_failed_rounds=1)
    for node_id in range(7):
        failures.reject(node_id, f"reason {node_id}")
    failures.reject(8, "reason 4")
    failures.reject(9, "x" * 600)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        failures.outcome(4, 0, "0 valid of 0 sent")
    # Assert: reasons 3, 5, 6, 4 and the long one (its start and its end), in the order last seen
    text = str(stopped.value)
    assert text.startswith(
        "the run cannot learn: 1 round in a row without a valid reply (round 4; max_failed_rounds=1)"
    )
    assert re.findall(r"(\d+)× from (nodes? [\d, ]+): (reason \d|x+ … x+)", text) == [
        ("1", "node 3", "reason 3"),
        ("1", "node 5", "reason 5"),
        ("1", "node 6", "reason 6"),
        ("2", "nodes 4, 8", "reason 4"),
        ("1", "node 9", "x" * 248 + " … " + "x" * 248),
    ]


# A ClientApp's exception as Flower's Ray backend reports it: the remote traceback (cause first, > 2000
# characters, with colour codes), then the wrapper Flower raises
TRACEBACK = (
    "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=13422, ip=192.0.2.2, actor_id=d02fd57f)\n"
    + '  File "/app/flower_dlion_app/data.py", line 211, in _compute_partitions\n    return tuple(...)\n' * 40
    + "ZeroDivisionError: division by zero\n\nThe above exception was the direct cause of the following exception:\n\n"
    "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=13422, ip=192.0.2.2, actor_id=d02fd57f)\n"
    '  File "/flwr/simulation/ray_transport/ray_actor.py", line 65, in run\n'
    "    raise ClientAppException(str(ex)) from ex\n"
    "flwr.clientapp.client_app.ClientAppException: \n"
    "Exception ClientAppException occurred. Message: division by zero"
)


class RayTaskError(Exception):
    """Stands for ``ray.exceptions.RayTaskError(ClientAppException)``."""


def test_a_traceback_is_reported_by_its_cause() -> None:
    # Prepare: the reply's reason as Flower makes it from a Ray task's exception
    reason = "client error (code 2): <class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'" + TRACEBACK + "'>"
    # Execute / Assert: the class and the last exception line with a message; a short one-line reason as it is
    assert len(reason) > 2000
    assert short_reason(reason) == (
        "client error (code 2): <class 'ray.exceptions.RayTaskError(ClientAppException)'> … "
        "ZeroDivisionError: division by zero"
    )
    chained = "Traceback:\nOSError: [Errno 2] No such file\n\nThe above ...\nClientStateError: node 7: cannot write\n"
    assert short_reason(chained) == "ClientStateError: node 7: cannot write"
    assert short_reason("client error (code 2): <class 'RuntimeError'>:<'boom'>") == (
        "client error (code 2): <class 'RuntimeError'>:<'boom'>"
    )


def test_the_stop_names_the_cause_of_a_long_traceback() -> None:
    # Prepare: every train message raises with a traceback longer than the logged 2000 characters
    app = ClientApp()
    DLionClient(app, ByomNet)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise RayTaskError(TRACEBACK)

    strategy = DistributedLion(lr=1e-3, max_failed_rounds=2)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.start(LocalGrid(app, 2), initial(), num_rounds=3)
    # Assert: one reason for both nodes, the root cause
    assert "Rejected in these rounds: 4× from nodes 1000, 1001: client error (code 2): <class " in str(stopped.value)
    assert "RayTaskError'> … ZeroDivisionError: division by zero. Look at" in str(stopped.value)


# ---------------------------------------------------------------- no node answers the hello
def test_no_node_answering_the_hello_stops_round_one_before_any_train_message() -> None:
    # Prepare: a ClientApp whose hello handler raises (node 1002 with another error); its train handler counts calls
    app = ClientApp()
    client = DLionClient(None, ByomNet)  # registers nothing: the app's own query handler answers the hello
    trained: list[int] = []

    @app.query(HELLO_ACTION)
    def hello(msg: Message, context: Context) -> Message:
        if context.node_id == 1002:
            raise ValueError("partition 2 is missing")
        raise RuntimeError("the hello broke")

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        trained.append(context.node_id)
        return client.train(msg, context, [])

    strategy = DistributedLion(lr=1e-3)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.start(LocalGrid(app, 3), initial(), num_rounds=5)
    # Assert: round 1, nothing sent or trained; the nodes grouped by their error
    assert stopped.value.server_round == 1 and trained == [] and strategy.history == [] and strategy.x is None
    assert str(stopped.value) == (
        "the run cannot learn: no node answered the hello usefully (round 1): nodes 1000, 1001: client error "
        "(code 2): <class 'RuntimeError'>:<'the hello broke'>; node 1002: client error (code 2): "
        "<class 'ValueError'>:<'partition 2 is missing'>. Each node's ClientApp answers the strategy's hello with "
        "its DLionClient (`DLionClient(app, Net)` registers the handler for the query message): see the clients' "
        "logs for these errors"
    )
