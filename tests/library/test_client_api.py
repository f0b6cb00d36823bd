"""The public client API with a user's own model: BatchNorm, a frozen layer, a tied weight (tests/byom.py).

Prepare / Execute / Assert, on the in-process grid (every message and context serialized as
on the wire). Flower's own simulation engine runs the same app in tests/library/test_examples.py.
"""

import logging
import math
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.bounds import robust_buffers
from flower_dlion.clients import state_home
from flower_dlion.clients.state import STATE_ARRAYS, STATE_REST, ClientStateError
from flower_dlion.clients.state_store import STATE_WHERE
from flower_dlion.params import Entry, ModelSpec
from flower_dlion.testing import LocalGrid

from .. import byom
from ..byom import ByomNet
from ..states import replica_after, rounds_in

CPU = torch.device("cpu")
D = 406_794


def initial_arrays(seed: int = 0) -> ArrayRecord:
    torch.manual_seed(seed)
    return ArrayRecord(ByomNet().state_dict())


def next_replicas(strategy: DistributedLion, grid: LocalGrid, rnd: int) -> dict[int, torch.Tensor]:
    """Each client's replica after it applies what the server would send it next."""
    out = {}
    for msg in strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid):
        node = msg.metadata.dst_node_id
        out[node] = replica_after(msg.content, grid.context(node), strategy.spec, node)
    return out


# ---------------------------------------------------------------- the model description
def test_spec_names_each_entry_of_the_state_dict_by_kind() -> None:
    # Execute
    spec = ModelSpec.from_module(ByomNet())
    # Assert
    kinds = {e.name: e.kind for e in spec.entries}
    assert list(kinds) == list(ByomNet().state_dict())
    assert [e.name for e in spec.trainable] == [n for n, p in ByomNet().named_parameters() if p.requires_grad]
    assert kinds["bn.running_mean"] == kinds["bn.running_var"] == kinds["bn.num_batches_tracked"] == "buffer"
    assert kinds["frozen.weight"] == kinds["frozen.bias"] == "frozen"
    assert kinds["tied.weight"] == "alias" and spec.of_kind("alias")[0].target == "proj.weight"
    assert spec.d == D and spec.num_buffer_values == 64 + 64 + 1
    assert ModelSpec.decode(spec.encode()) == spec


def test_spec_refuses_integer_parameters_and_models_without_trainable_ones() -> None:
    # Prepare
    model = nn.Linear(2, 2)
    model.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    # Execute / Assert
    with pytest.raises(ValueError, match=r"parameter 'steps' has dtype torch.int64: Distributed Lion updates floating"):
        ModelSpec.from_module(model)
    with pytest.raises(ValueError, match="no trainable parameter"):
        ModelSpec.from_module(frozen)
    with pytest.raises(ValueError, match="malformed model description"):
        ModelSpec.decode(b"not zlib")


def test_buffers_are_combined_by_median_and_running_var_is_pooled_around_it() -> None:
    # Prepare: three clients; the third lies (10⁶, 10³⁰)
    spec = ModelSpec(
        (
            Entry("w", (1,), "float32", "trainable"),
            Entry("bn.running_mean", (2,), "float32", "buffer"),
            Entry("bn.running_var", (2,), "float32", "buffer"),
            Entry("bn.num_batches_tracked", (), "int64", "buffer"),
            Entry("scale", (1,), "float32", "buffer"),
        )
    )
    a = np.array([0.0, 4.0, 1.0, 2.0, 1.0, 10.0], np.float32)  # mean (2), var (2), count, scale
    b = np.array([2.0, 0.0, 3.0, 1.0, 3.0, 13.0], np.float32)
    c = np.array([1.0, 100.0, 2.0, 1e6, 1000.0, 1e30], np.float32)
    # Execute
    out = robust_buffers(spec, [a, b, c])
    # Assert: μ = median μᵢ; σ² = median (σᵢ² + (μᵢ − μ)²): coordinate 0: median(1+1, 3+1, 2+0) = 2,
    # coordinate 1: median(2+0, 1+16, 10⁶+96²) = 17; the count and the scale: medians
    np.testing.assert_array_equal(out["bn.running_mean"], np.array([1.0, 4.0], np.float32))
    np.testing.assert_array_equal(out["bn.running_var"], np.array([2.0, 17.0], np.float32))
    assert out["bn.num_batches_tracked"] == 3 and out["bn.num_batches_tracked"].dtype == np.int64
    np.testing.assert_array_equal(out["scale"], np.array([13.0], np.float32))


# ---------------------------------------------------------------- a federation with the user's model
def test_users_model_trains_replicas_stay_exact_and_bytes_are_one_bit() -> None:
    # Prepare
    grid = LocalGrid(byom.app, 4)
    strategy = DistributedLion(lr=1e-3, weight_decay=0.1)  # buffers uploaded in rounds 1, 10 and 12 (the last)
    initial = initial_arrays()
    # Execute
    result = strategy.start(grid, initial, num_rounds=12)
    # Assert: every reply valid (its replica checksum equals the server's x), every round
    assert all(
        h["num-replies"] == 4 and h["num-rejected"] == 0 and h["checksum-mismatches"] == 0 for h in strategy.history
    )
    for node, x in next_replicas(strategy, grid, 13).items():
        assert torch.equal(x, strategy.x), node
    # the returned model is a state_dict: every name, tied weights equal, frozen ones the server's own
    final = result.arrays.to_torch_state_dict()
    assert list(final) == list(initial)
    assert torch.equal(final["tied.weight"], final["proj.weight"])
    start = initial.to_torch_state_dict()
    for name in ("frozen.weight", "frozen.bias"):
        assert torch.equal(final[name], start[name])
        for node in grid.node_ids:  # named by reference: never sent, so never kept in a node's state
            assert name not in grid.context(node).state[STATE_REST]
    model = ByomNet()
    model.load_state_dict(final)  # strict
    assert byom.accuracy(model) > 0.3  # chance is 0.1
    # the server's buffers: the median of what the clients uploaded in round 12 (the last)
    uploads = [
        torch.cat([torch.from_numpy(grid.context(n).state[STATE_REST][e.name].numpy()).reshape(-1).float()
                   for e in strategy.spec.buffers]).numpy()
        for n in grid.node_ids
    ]  # fmt: skip
    expected = robust_buffers(strategy.spec, uploads)
    for name, value in expected.items():
        assert np.array_equal(final[name].numpy(), value), name
    assert int(final["bn.num_batches_tracked"]) == 12  # one forward pass per round on every client
    # 1 bit per trained parameter: every reply of a round without buffers ≤ fp32 / 31, and on average
    # over rounds 2–12 with the buffer rounds 10 and 12 (round 1 also carries the hello and the full model)
    for h in strategy.history[1:]:
        if h["round"] not in (10, 12):
            assert h["bytes-up"] / 4 <= 4 * D / 31, h
    assert sum(h["bytes-up"] for h in strategy.history[1:]) / (4 * 11) <= 4 * D / 31


def test_a_users_dataloader_gives_the_same_run_twice() -> None:
    runs = []
    for _ in range(2):
        # Prepare
        grid = LocalGrid(byom.app, 2)
        strategy = DistributedLion(lr=1e-3)
        # Execute
        strategy.start(grid, initial_arrays(), num_rounds=3)
        runs.append(strategy.x.clone())
    # Assert: the shuffles are seeded by (seed, node, round)
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------- bad input
def test_a_model_that_differs_from_the_initial_arrays_fails_before_round_one() -> None:
    # Prepare: the server's arrays come from a model with 12 classes
    grid = LocalGrid(byom.app, 2)
    wrong = ByomNet()
    wrong.head = nn.Linear(64, 12)
    strategy = DistributedLion()
    # Execute / Assert: the message names the first differing tensor; nothing was trained
    expected = (
        r"no node can take part: node 1000: its model does not match the initial arrays: "
        r"tensor 'head.weight': shape \(12, 64\) in the arrays, \(10, 64\) in the model"
    )
    with pytest.raises(ValueError, match=expected):
        strategy.start(grid, ArrayRecord(wrong.state_dict()), num_rounds=2)
    assert all(not grid.context(n).state for n in grid.node_ids)


def test_a_clientapp_without_dlionclient_is_told_what_to_add() -> None:
    # Prepare: a FedAvg-style ClientApp (a train handler, nothing for the hello)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise AssertionError("never called")

    # Execute / Assert: the run stops before round 1, says what to add, and names the other likely
    # cause (the node runs another app's code: a SuperLink left running by another `flwr run`)
    with pytest.raises(
        ValueError, match=r"node 1000: its ClientApp has no DLionClient to answer the hello: add"
    ) as err:
        DistributedLion().start(LocalGrid(app, 2), initial_arrays(), num_rounds=1)
    assert "If it has one, the node runs another app's code: a local SuperLink left running" in str(err.value)
    assert 'pkill -f "$FLWR_HOME/local-superlink"' in str(err.value)


def test_a_train_message_from_another_strategy_says_what_may_run_here() -> None:
    # Prepare: a FedAvg train message (Flower's "arrays" and "config") sent to a DLionClient
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    msg = Message(
        RecordDict({"arrays": initial_arrays(), "config": ConfigRecord()}), dst_node_id=7, message_type="train"
    )
    # Execute / Assert: refused, naming what it got and both causes
    with pytest.raises(ClientStateError, match=r"node 7: a train message with records \['arrays', 'config'\]") as err:
        DLionClient(ClientApp(), ByomNet).train(msg, context, [])
    assert "does the ServerApp start DistributedLion? If it does, a local SuperLink left running" in str(err.value)


class _Wider(ByomNet):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 11)


def test_one_node_with_another_model_is_refused_once_and_the_others_train(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: node 1002 runs another model
    other = ClientApp()
    other_client = DLionClient(other, _Wider)

    @other.train()
    def train(msg: Message, context: Context) -> Message:
        return other_client.train(msg, context, [(torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.int64))])

    grid = LocalGrid(byom.app, 3)
    grid.client_app = lambda msg, ctx: (other if ctx.node_id == 1002 else byom.app)(msg, ctx)  # type: ignore[assignment]
    strategy = DistributedLion(lr=1e-3)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=3)
    # Assert
    assert [h["num-replies"] for h in strategy.history] == [2, 2, 2]
    refusals = [r.getMessage() for r in caplog.records if "rejected hello from node 1002" in r.getMessage()]
    assert len(refusals) == 1 and "tensor 'head.weight'" in refusals[0] and "(11, 64)" in refusals[0]


def test_a_handler_that_raises_gets_an_error_reply_and_the_node_recovers() -> None:
    # Prepare: node 1001's handler raises in round 2; node 1002's loss raises in round 3, mid-way
    app = ClientApp()

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if (current[0], current[1]) == (1002, 3):
            raise RuntimeError("the user's loss broke")
        return F.cross_entropy(model(batch[0]), batch[1])

    client = DLionClient(app, ByomNet, loss_fn)
    current = [0, 0]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        current[:] = [context.node_id, int(msg.metadata.group_id)]
        if tuple(current) == (1001, 2):
            raise RuntimeError("the user's handler broke")
        loader = DataLoader(byom.partition(context.node_config["partition-id"], 4), batch_size=32, shuffle=True)
        return client.train(msg, context, loader)

    grid = LocalGrid(app, 3)
    strategy = DistributedLion(lr=1e-3)
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=5)
    # Assert: one failed reply in rounds 2 and 3; then every node is back, its replica exact (no resync)
    assert [h["num-rejected"] for h in strategy.history] == [0, 1, 1, 0, 0]
    assert all(h["full-syncs"] == 0 for h in strategy.history[1:]) and strategy.history[4]["num-replies"] == 3
    for node, x in next_replicas(strategy, grid, 6).items():
        assert torch.equal(x, strategy.x), node


def test_a_non_finite_loss_is_refused_and_the_state_is_kept() -> None:
    # Prepare: a loss that is nan
    app = ClientApp()
    client = DLionClient(app, ByomNet, lambda model, batch: model(batch[0]).sum() * math.nan)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, [(torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.int64))])

    grid = LocalGrid(app, 2)
    strategy = DistributedLion()
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=1)
    # Assert
    assert strategy.history[0]["num-rejected"] == 2 and strategy.version == 0
    assert all(STATE_ARRAYS not in grid.context(n).state for n in grid.node_ids)


def test_settings_are_checked_when_the_client_is_made() -> None:
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got 'tpu'"):
        DLionClient(None, ByomNet, device="tpu")
    with pytest.raises(ValueError, match="momentum_dtype must be 'float32' or 'bfloat16', got 'float16'"):
        DLionClient(None, ByomNet, momentum_dtype="float16")
    with pytest.raises(TypeError, match="model_fn must build the model"):
        DLionClient(None, ByomNet())  # type: ignore[arg-type]


# ---------------------------------------------------------------- nodes and state
def test_nodes_without_a_partition_id_are_known_by_their_node_id(tmp_path: Path) -> None:
    # Prepare: SuperNodes with an empty node config, state in files
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_dir=str(tmp_path), state_in_context=False)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, DataLoader(byom.partition(context.node_id % 3, 4), batch_size=32))

    grid = LocalGrid(app, 3, node_configs=[{}, {}, {}], run_id=5)
    strategy = DistributedLion(lr=1e-3)
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=3)
    # Assert
    assert sorted(strategy.nodes.node_of) == grid.node_ids  # keyed by node id
    assert all(h["num-replies"] == 3 and h["num-rejected"] == 0 for h in strategy.history)
    names = sorted(p.name for p in (tmp_path / strategy.run_key).iterdir())
    assert names == ["anchors"] + [f"node-{n}" for n in grid.node_ids]  # the anchors: one file per anchor, shared


def test_by_default_the_state_goes_to_files_and_the_context_says_where(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Prepare: the library's defaults (no state_dir, no state_in_context), the default folder here
    monkeypatch.setattr(state_home, "default_state_dir", lambda: tmp_path)
    app = ClientApp()
    client = DLionClient(app, ByomNet)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, DataLoader(byom.partition(context.node_config["partition-id"], 4), 32))

    grid = LocalGrid(app, 2, run_id=9)
    strategy = DistributedLion(lr=1e-3)
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=3)
    # Assert: each context holds only where its files are (round, machine, folder); the newest rounds' files
    for pid, n in enumerate(grid.node_ids):
        state = grid.context(n).state
        assert list(state.keys()) == [STATE_WHERE]
        where = dict(state[STATE_WHERE])
        folder = tmp_path / strategy.run_key / f"partition-{pid}"
        assert where == {"round": 3, "host": socket.gethostname(), "folder": str(folder)}
    client.wait()  # the last round's files are written after the replies
    for pid in (0, 1):  # two slots a node, written in turn: rounds 2 and 3
        assert rounds_in(tmp_path / strategy.run_key / f"partition-{pid}") == [2, 3]
    assert [h["full-syncs"] for h in strategy.history] == [2, 0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_train_on_a_float32_replica(dtype: torch.dtype) -> None:
    # Prepare: a model in bfloat16 or float16 (Flower's Array cannot hold bfloat16: the arrays are float32)
    def model_fn() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.SiLU(), nn.Linear(32, 10)).to(dtype)

    app = ClientApp()
    client = DLionClient(app, model_fn, lambda m, b: F.cross_entropy(m(b[0].to(dtype)).float(), b[1]))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, DataLoader(byom.partition(context.node_config["partition-id"], 4), 32))

    torch.manual_seed(0)
    state = {k: v.float() if dtype == torch.bfloat16 else v for k, v in model_fn().state_dict().items()}
    grid = LocalGrid(app, 2)
    strategy = DistributedLion(lr=1e-3)
    # Execute
    result = strategy.start(grid, ArrayRecord(state), num_rounds=3)
    # Assert: x is float32 and exact on every replica; the arrays keep the initial dtypes
    assert strategy.x.dtype == torch.float32
    assert all(h["num-replies"] == 2 and h["checksum-mismatches"] == 0 for h in strategy.history)
    for node, x in next_replicas(strategy, grid, 4).items():
        assert torch.equal(x, strategy.x), node
    expected = "float32" if dtype == torch.bfloat16 else "float16"
    assert {a.dtype for a in result.arrays.values()} == {expected}


def test_nodes_build_x0_of_the_users_model_from_the_seed() -> None:
    # Prepare: the server's model is ByomNet() after torch.manual_seed(5), and it says so
    grid = LocalGrid(byom.app, 2)
    strategy = DistributedLion(lr=1e-3, init_seed=5)
    # Execute
    strategy.start(grid, initial_arrays(seed=5), num_rounds=2)
    # Assert: no full model sent, yet every replica checksum matched the server's x
    assert [h["full-syncs"] for h in strategy.history] == [0, 0]
    assert all(h["num-replies"] == 2 and h["num-rejected"] == 0 for h in strategy.history)
    assert strategy.history[0]["bytes-down"] < 2 * 20_000  # the seed and a config, not 4·d bytes each


def test_federated_evaluation_sends_flowers_own_evaluate_messages() -> None:
    # Prepare: the user's evaluate handler, unchanged from a FedAvg app
    app = ClientApp()
    client = DLionClient(app, ByomNet)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, DataLoader(byom.partition(context.node_config["partition-id"], 4), 32))

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = ByomNet()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        metrics = {"accuracy": byom.accuracy(model), "num-examples": 100 * (1 + context.node_config["partition-id"])}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    grid = LocalGrid(app, 2)
    strategy = DistributedLion(lr=1e-3, fraction_evaluate=1.0)
    # Execute
    result = strategy.start(grid, initial_arrays(), num_rounds=2)
    # Assert: both rounds evaluated on both nodes, the same model, so the weighted mean is that accuracy
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]
    model = ByomNet()
    model.load_state_dict(result.arrays.to_torch_state_dict())
    assert result.evaluate_metrics_clientapp[2]["accuracy"] == pytest.approx(byom.accuracy(model))


def test_an_empty_batch_source_is_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    app = ClientApp()
    client = DLionClient(app, ByomNet)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, DataLoader(TensorDataset(torch.zeros(0, 784), torch.zeros(0)), 4))

    grid = LocalGrid(app, 2)
    strategy = DistributedLion()
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=1)
    # Assert
    assert strategy.history[0]["num-rejected"] == 2
    assert "batches is empty: the round needs at least one batch" in caplog.text


def test_a_train_message_of_another_strategy_is_named() -> None:
    # Prepare: FedAvg's train message reaches a D-Lion client
    from flwr.serverapp.strategy import FedAvg

    grid = LocalGrid(byom.app, 2)
    (msg, _) = FedAvg().configure_train(1, initial_arrays(), ConfigRecord(), grid)
    # Execute
    (reply,) = grid.send_and_receive([msg])
    # Assert
    assert reply.has_error() and "not DistributedLion's 'dlion.config': does the ServerApp start" in reply.error.reason
