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

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.protocol import CONTROL, HELLO_ACTION
from flower_dlion.strategies.run_stops import FailedRounds, RunStopped, short_reason
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import FEDAVG_FAMILY, read_config
from flower_dlion_app.server_app import fedavg_family, run_federation
from flower_dlion_app.strategies.global_opt import GlobalOptimizer

from .byom import ByomNet
from .test_strategy import StubGrid


# ---------------------------------------------------------------- the run config, before round 1
@pytest.mark.parametrize(
    ("run_config", "expected"),
    [
        ({"strategy": "fedavg", "lr": -0.1}, "run-config 'lr' must be finite and > 0, got -0.1"),
        ({"lr": 0.0}, "run-config 'lr' must be finite and > 0, got 0.0"),
        ({"strategy": "fedprox", "lr": math.inf}, "run-config 'lr' must be finite and > 0, got inf"),
        (
            {"strategy": "fedavg", "weight-decay": math.nan},
            "run-config 'weight-decay' must be finite and >= 0, got nan",
        ),
        ({"weight-decay": -0.1}, "run-config 'weight-decay' must be finite and >= 0, got -0.1"),
        ({"seed": -1}, "run-config 'seed' must be in [0, 2**32) (numpy's seeds), got -1"),
        ({"seed": 2**32}, "run-config 'seed' must be in [0, 2**32) (numpy's seeds), got 4294967296"),
        (
            {"partitioner": "pathological", "classes-per-partition": 11},
            "run-config 'classes-per-partition' must be <= 10 (Fashion-MNIST's classes) for partitioner "
            "'pathological', got 11",
        ),
        (
            {"partitioner": "shard", "classes-per-partition": 60_001},
            "run-config 'classes-per-partition' (shards per partition) must be <= 60000 (the clients' images: "
            "60000 - holdout 0; times num-partitions, at most that) for partitioner 'shard', got 60001",
        ),
        (
            {"partitioner": "shard", "holdout": 10_000, "classes-per-partition": 50_001},
            "run-config 'classes-per-partition' (shards per partition) must be <= 50000 (the clients' images: "
            "60000 - holdout 10000; times num-partitions, at most that) for partitioner 'shard', got 50001",
        ),
        ({"max-failed-rounds": -1}, "run-config 'max-failed-rounds' must be >= 0 (0: never stop), got -1"),
    ],
)
def test_a_run_config_that_cannot_learn_fails_before_round_one(run_config: dict, expected: str) -> None:
    # Execute / Assert: the message names the key, the value and what is allowed
    with pytest.raises(ValueError, match=re.escape(expected)):
        read_config(run_config)


def test_the_limits_themselves_are_allowed() -> None:
    # Prepare: each new check's boundary value
    configs = [
        {"seed": 2**32 - 1},
        {"weight-decay": 0.0, "strategy": "fedavg"},
        {"partitioner": "pathological", "classes-per-partition": 10},
        {"partitioner": "shard", "classes-per-partition": 60_000},
        {"partitioner": "iid", "classes-per-partition": 11},  # read by pathological and shard only
        {"max-failed-rounds": 0},
    ]
    # Execute
    read = [read_config(c) for c in configs]
    # Assert
    assert [cfg["max-failed-rounds"] for cfg in read] == [3, 3, 3, 3, 3, 0]
    assert [read[0]["seed"], read[2]["classes-per-partition"], read[3]["classes-per-partition"]] == [
        2**32 - 1,
        10,
        60_000,
    ]


def test_max_failed_rounds_is_checked_by_the_strategies() -> None:
    # Execute / Assert: the keyword's own message, for both of our strategies
    for make in (DistributedLion, GlobalOptimizer):
        with pytest.raises(
            ValueError, match=re.escape("max_failed_rounds must be an integer >= 0 (0: never stop), got -1")
        ):
            make(max_failed_rounds=-1)
        with pytest.raises(
            ValueError, match=re.escape("max_failed_rounds must be an integer >= 0 (0: never stop), got True")
        ):
            make(max_failed_rounds=True)
    assert DistributedLion().max_failed_rounds == 3 and GlobalOptimizer(max_failed_rounds=0).max_failed_rounds == 0


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


def test_the_gradient_baselines_stop_too() -> None:
    # Prepare: GlobalOptimizer (global Lion) on 2 nodes that always raise; 2 failed rounds stop it
    app, _ = failing_app(None, Tiny)
    strategy = GlobalOptimizer(max_failed_rounds=2)
    # Execute
    with pytest.raises(RunStopped, match=re.escape("2 rounds in a row without a valid reply (rounds 1 to 2;")):
        strategy.start(LocalGrid(app, 2), initial(Tiny), num_rounds=4)
    # Assert
    assert [h["num-replies"] for h in strategy.history] == [0, 0]


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


# ---------------------------------------------------------------- the FedAvg family
def reply(node: int, value: float, control: bool = False) -> Message:
    """A FedAvg reply from ``node``: array "w" = [value] × 3, 10 examples (``control``: SCAFFOLD's Δc = 0 too)."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.full(3, value, np.float32))}),
            "metrics": MetricRecord({"num-examples": 10}),
        }
    )
    if control:
        content[CONTROL] = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN))


def test_fedavg_drops_replies_with_non_finite_arrays(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    strategy = fedavg_family("fedavg", read_config({"strategy": "fedavg"}))
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute: node 1 sends NaN, node 2 a finite model
    arrays, _ = strategy.aggregate_train(1, [reply(1, math.nan), reply(2, 0.5)])
    # Assert: the model is node 2's alone; node 1 and its array are named
    assert arrays is not None and arrays["w"].numpy().tolist() == [0.5, 0.5, 0.5]
    assert "round 1: dropped reply from node 1: array 'arrays/w' has non-finite values" in caplog.messages


@pytest.mark.parametrize("name", FEDAVG_FAMILY)
def test_the_fedavg_family_stops_after_max_failed_rounds_rounds_of_non_finite_replies(name: str) -> None:
    # Prepare: every strategy fedavg_family builds, told to stop after 2 failed rounds, having sent round 1
    strategy = fedavg_family(name, read_config({"strategy": name, "max-failed-rounds": 2}))
    x = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    list(strategy.configure_train(1, x, ConfigRecord({"lr": 0.1}), StubGrid([1, 2, 3, 4, 5])))
    scaffold = name == "scaffold"
    # Execute: round 1 fails, round 2 has valid replies (reset), rounds 3 and 4 fail
    strategy.aggregate_train(1, [reply(1, math.nan, scaffold), reply(2, math.inf, scaffold)])
    arrays, _ = strategy.aggregate_train(
        2, [reply(1, math.nan, scaffold)] + [reply(n, 0.5, scaffold) for n in (2, 3, 4, 5)]
    )
    strategy.aggregate_train(3, [reply(1, math.nan, scaffold), reply(2, -math.inf, scaffold)])
    with pytest.raises(RunStopped) as stopped:
        strategy.aggregate_train(4, [reply(1, math.nan, scaffold), reply(2, math.nan, scaffold)])
    # Assert: round 2 aggregated; rounds 3 and 4 stopped the run
    assert arrays is not None and np.isfinite(arrays["w"].numpy()).all()
    assert stopped.value.server_round == 4
    assert str(stopped.value).startswith(
        "the run cannot learn: 2 rounds in a row without a valid reply (rounds 3 to 4; max_failed_rounds=2); "
        "round 4: 0 valid replies (0 errors, 2 with non-finite arrays). Rejected in these rounds: "
        "4× from nodes 1, 2: array 'arrays/w' has non-finite values. Look at"
    )


# ---------------------------------------------------------------- run_federation
RUN_CONFIG = {"partitioner": "iid", "batch-size": 16, "holdout": 200, "eval-every": 5, "device": "cpu"}


def test_run_federation_writes_a_stopped_summary_and_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: the repository app on 2 nodes whose every train message raises; 2 failed rounds stop the run
    cfg = {**RUN_CONFIG, "num-server-rounds": 5, "max-failed-rounds": 2, "results-dir": str(tmp_path / "out")}
    grid = LocalGrid(client_app, 2, run_config=cfg)

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            raise RuntimeError("the data disk is gone")
        return client_app(msg, context)

    grid.client_app = app  # type: ignore[assignment]
    caplog.set_level(logging.INFO, logger="flwr")
    # Execute
    with pytest.raises(RunStopped) as stopped:
        run_federation(grid, cfg)
    # Assert: summary.json says stopped, when and why; the rows of round 0 and 1; no model
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["stopped_in_round"], summary["reason"]) == ("stopped", 2, str(stopped.value))
    assert summary["reason"].startswith(
        "the run cannot learn: 2 rounds in a row without a valid reply (rounds 1 to 2; max_failed_rounds=2); "
        "round 2: 0 valid of 2 sent (2 rejected, 0 without a reply). Rejected in these rounds: "
        "4× from nodes 1000, 1001: client error (code 2): <class 'RuntimeError'>:<'the data disk is gone'>. Look at"
    )
    assert summary["final_accuracy"] is None and summary["config"] == read_config(cfg)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1] and not (out / "final_model.pt").exists()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    out = out.resolve()
    assert errors == [
        f"[flower-dlion] dlion-vote: stopped in round 2: {stopped.value}",
        f"[flower-dlion] wrote {out / 'summary.json'} (status 'stopped') and {out / 'results.jsonl'}",
    ]


def test_a_diverging_fedavg_run_stops_and_a_finished_one_says_completed(tmp_path: Path) -> None:
    # Prepare: FedAvg with a learning rate that overflows the clients' models in their first steps
    cfg = {**RUN_CONFIG, "strategy": "fedavg", "lr": 1e30, "local-batches": 2, "num-server-rounds": 4}
    diverging = {**cfg, "max-failed-rounds": 2, "results-dir": str(tmp_path / "nan")}
    # Execute
    with pytest.raises(RunStopped, match=re.escape("2 with non-finite arrays")):
        run_federation(LocalGrid(client_app, 2, run_config=diverging), diverging)
    finished = {**cfg, "lr": 0.01, "num-server-rounds": 1, "results-dir": str(tmp_path / "ok")}
    run_federation(LocalGrid(client_app, 2, run_config=finished), finished)
    # Assert
    stopped = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert (stopped["status"], stopped["stopped_in_round"]) == ("stopped", 2)
    assert "4× from nodes 1000, 1001: array 'arrays/" in stopped["reason"]
    completed = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert completed["status"] == "completed" and "reason" not in completed
