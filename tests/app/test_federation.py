"""Whole federations through the real ClientApp, with every message and context serialized.

Uses ``LocalGrid`` (in-process, no Ray) on real Fashion-MNIST.
"""

import importlib.util
import json
import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from flower_dlion.clients.state import STATE_ARRAYS
from flower_dlion.protocol import CLIENT_UPLOAD
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.data import load_fashion_mnist, partition_indices, sample_batch, to_tensor
from flower_dlion_app.model import Net, flat_gradient, flat_parameters
from flower_dlion_app.server_app import run_federation

from ..states import load, replica_after

RUN_CONFIG = {"partitioner": "iid", "batch-size": 16}
# clients on the CPU where a test compares with gradients computed here: on an H100 the GPU clients'
# momenta differed from them by up to 3e-6 (momenta of order 1e-4), flipping near-zero Lion signs
CPU_CONFIG = {**RUN_CONFIG, "device": "cpu"}
LR, WD, B1, B2 = 0.01, 0.1, 0.9, 0.99


def initial_arrays() -> tuple[Net, ArrayRecord]:
    torch.manual_seed(0)
    model = Net()
    return model, ArrayRecord(model.state_dict())


def run_rounds(strategy: DistributedLion, grid: LocalGrid, rounds: int, start: int = 1) -> None:
    _, arrays = initial_arrays()
    for rnd in range(start, start + rounds):
        replies = grid.send_and_receive(
            strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 16, "seed": 0}), grid)
        )
        strategy.aggregate_train(rnd, replies)


def gradient(x: torch.Tensor, pid: int, num_partitions: int, rnd: int) -> torch.Tensor:
    """The gradient a client computes in round ``rnd``, recomputed independently."""
    ds = load_fashion_mnist()
    parts = partition_indices(ds.y_train, partitioner="iid", num_partitions=num_partitions)
    rows = sample_batch(parts[pid], 16, seed=0, partition_id=pid, server_round=rnd)
    return flat_gradient(Net(), x.float(), to_tensor(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows]))[1]


@pytest.mark.parametrize(("how", "downlink"), [("vote", "chain"), ("mean", "chain"), ("vote", "anchored")])
def test_one_client_is_exactly_single_worker_lion(how: str, downlink: str) -> None:
    # Prepare
    grid = LocalGrid(client_app, 1, run_config=CPU_CONFIG)
    strategy = DistributedLion(
        aggregation=how, lr=LR, weight_decay=WD, min_train_nodes=1, min_available_nodes=1, downlink=downlink
    )
    model, _ = initial_arrays()
    x_ref = x0 = flat_parameters(model).double().numpy()
    m_ref, counts = np.zeros_like(x_ref), np.zeros_like(x_ref)
    # Execute: five rounds of D-Lion
    run_rounds(strategy, grid, 5)
    # Assert: single-worker Lion from the formula (SPEC §1), in float64; with the anchored downlink
    # the decay of the Δs since the anchor comes at the next anchor: x = (1 − lr·wd)ᵗ·x₀ − lr·Σδ, each
    # product rounded to float32 as the library does (a float64 x would move near-zero signs)
    for rnd in range(1, 6):
        g = gradient(torch.from_numpy(x_ref), 0, 1, rnd).double().numpy()
        delta = np.sign(B1 * m_ref + (1 - B1) * g)
        counts += delta
        if downlink == "anchored":
            f32 = np.float32
            x_ref = (f32((1 - LR * WD) ** rnd) * x0.astype(f32) - f32(LR) * counts.astype(f32)).astype(np.float64)
        else:
            x_ref = x_ref - LR * (delta + WD * x_ref)
        m_ref = B2 * m_ref + (1 - B2) * g
    x = strategy.x.double().numpy()
    assert np.linalg.norm(x - x_ref) <= 1e-6 * np.linalg.norm(x_ref)
    np.testing.assert_allclose(x, x_ref, rtol=1e-6, atol=1e-6 * np.abs(x_ref).max())


def test_momentum_persists_across_rounds_in_context_state() -> None:
    # Prepare
    grid = LocalGrid(client_app, 2, run_config=CPU_CONFIG)
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    d = strategy.num_parameters or sum(p.numel() for p in Net().parameters())
    m_ref = {n: torch.zeros(d, dtype=torch.float64) for n in grid.node_ids}
    for rnd in range(1, 5):
        # Execute one round through the real ClientApp and serialized contexts
        run_rounds(strategy, grid, 1, start=rnd)
        for pid, node in enumerate(grid.node_ids):
            state = load(grid.context(node))
            # Assert: the stored replica is the server's x before this round's Δ, and
            # the stored momentum follows m ← β₂·m + (1−β₂)·g with g at that replica
            assert state.version == rnd - 1
            g = gradient(state.x, pid, 2, rnd).double()
            m_ref[node] = B2 * m_ref[node] + (1 - B2) * g
            np.testing.assert_allclose(state.m.double().numpy(), m_ref[node].numpy(), rtol=1e-5, atol=1e-9)


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")
def test_fused_client_step_gives_the_same_federation_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    from flower_dlion.accel import numba_pack, probes

    calls = []
    fused = numba_pack.lion_pack
    monkeypatch.setattr(numba_pack, "lion_pack", lambda *args: calls.append(1) or fused(*args))
    monkeypatch.setattr(probes, "_FUSED_EXACT", {})  # the rounding probe runs once, in this test
    results = {}
    for mode in ("off", "on"):  # the composition lion.local_step_ + pack_signs, then the fused kernel
        # Prepare
        monkeypatch.setenv("FLOWER_DLION_KERNELS", mode)
        grid = LocalGrid(client_app, 3, run_config=CPU_CONFIG)
        strategy = DistributedLion(lr=LR, weight_decay=WD)
        # Execute
        run_rounds(strategy, grid, 3)
        momenta = [load(grid.context(n)).m for n in grid.node_ids]
        results[mode] = (strategy.x.clone(), momenta, len(calls))
    # Assert: the same model and momenta; the fused kernel ran only under "on": 3 clients × 3 rounds + the probe
    assert torch.equal(results["off"][0], results["on"][0])
    assert all(torch.equal(a, b) for a, b in zip(results["off"][1], results["on"][1], strict=True))
    assert results["off"][2] == 0 and results["on"][2] == 10


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")
@pytest.mark.parametrize("how", ["vote", "mean"])
def test_a_federation_on_torchs_openmp_team_equals_the_composition(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flower_dlion.accel import threads
    from flower_dlion.accel.numba_team import Team

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not run on OpenMP here")
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    runs = []
    run = Team.run
    monkeypatch.setattr(Team, "run", lambda self, *args: runs.append(1) or run(self, *args))
    results = {}
    for mode in ("off", "team"):  # torch operations and numpy, then every kernel on torch's team at every size
        # Prepare
        monkeypatch.setenv("FLOWER_DLION_KERNELS", "off" if mode == "off" else "on")
        monkeypatch.setattr(threads, "TEAM_AFTER", 0)
        monkeypatch.setattr(threads, "TEAM_GRAIN", 1 << 10)
        monkeypatch.setattr(threads, "TEAM_COUNT_GRAIN", 1 << 10)
        grid = LocalGrid(client_app, 3, run_config=CPU_CONFIG)
        strategy = DistributedLion(aggregation=how, lr=LR, weight_decay=WD)
        # Execute
        run_rounds(strategy, grid, 3)
        momenta = [load(grid.context(n)).m for n in grid.node_ids]
        results[mode] = (strategy.x.clone(), momenta, len(runs))
    # Assert: the same model and momenta bit for bit; under "team" the kernels ran there (steps, counts, applies)
    assert torch.equal(results["off"][0], results["team"][0])
    assert all(torch.equal(a, b) for a, b in zip(results["off"][1], results["team"][1], strict=True))
    assert results["off"][2] == 0 and results["team"][2] >= 3 * 3 + 3


def sync_replicas(strategy: DistributedLion, grid: LocalGrid, rnd: int) -> dict[int, torch.Tensor]:
    """Bring each client's replica to the server's version with what the server would send next."""
    out = {}
    for msg in strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid):
        node = msg.metadata.dst_node_id
        out[node] = replica_after(msg.content, grid.context(node), strategy.spec, node)
    return out


@pytest.mark.parametrize("how", ["vote", "mean"])
def test_replicas_equal_server_x_after_rounds_with_faults(how: str, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 4 clients; node 1002's reply is corrupted in round 3, node 1003 loses its state before round 5
    def hook(node_id: int, reply: Message) -> Message:
        if node_id == 1002 and reply.metadata.group_id == "3" and reply.has_content():
            reply.content[CLIENT_UPLOAD]["signs"].data = b"\x00"
        return reply

    in_context = {**RUN_CONFIG, "state-in-context": True}  # lost with the node's context
    grid = LocalGrid(client_app, 4, run_config=in_context, reply_hook=hook)
    strategy = DistributedLion(aggregation=how, lr=LR, weight_decay=WD)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    run_rounds(strategy, grid, 4)
    grid.reset_node(1003)
    run_rounds(strategy, grid, 3, start=5)
    # Assert: faults were reported, rounds went on, and every replica equals x bit for bit
    assert "rejected reply from node 1002 (partition 2): Array 'signs' has 1 bytes" in caplog.text
    assert "rejected reply from node 1003 (partition 3): client error" in caplog.text
    assert "has no replica" in caplog.text
    assert [h["num-replies"] for h in strategy.history] == [4, 4, 3, 4, 3, 4, 4]
    # node 1002 applied round 3's Δs before its reply broke: it is sent the 2 Δs since its last
    # confirmed version and skips the one it has; node 1003 lost its state: the full model
    assert [h["full-syncs"] for h in strategy.history] == [4, 0, 0, 0, 0, 1, 0]
    assert [h["catch-ups"] for h in strategy.history] == [0, 0, 0, 1, 0, 0, 0]
    assert strategy.version == 7
    for node, x in sync_replicas(strategy, grid, 8).items():
        assert torch.equal(x, strategy.x), node


def test_missing_state_is_an_error_not_a_silent_reset() -> None:
    grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, "state-in-context": True})
    strategy = DistributedLion(lr=LR)
    run_rounds(strategy, grid, 1)
    grid.reset_node(1000)
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, ArrayRecord(), ConfigRecord(), grid)}
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs.values())}
    assert replies[1000].has_error() and "node 1000 has no replica" in replies[1000].error.reason
    assert STATE_ARRAYS not in grid.context(1000).state  # nothing invented


def test_run_federation_writes_results(tmp_path) -> None:
    grid = LocalGrid(client_app, 3, run_config=RUN_CONFIG)
    cfg = {**RUN_CONFIG, "num-server-rounds": 4, "eval-every": 2, "results-dir": str(tmp_path / "out"), "lr": LR}
    run_federation(grid, cfg)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["accuracy"] is not None for r in rows] == [True, False, True, False, True]
    for r in rows[1:]:
        assert r["num_replies"] == 3 and r["train_loss"] > 0
        hello = 3 * 500 if r["round"] == 1 else 0  # round 1 also carries one small hello per node
        assert 0 < r["bytes_up"] - hello < r["bytes_up_fp32"] / 31  # 1 bit per parameter plus headers
        assert r["bytes_down"] > 0 and r["bytes_down_fp32"] >= r["bytes_down"] - hello
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final_accuracy"] == rows[-1]["accuracy"] and summary["strategy"] == "dlion-vote"
    assert summary["total_mb_up"] * 1e6 == sum(r["bytes_up"] for r in rows)
    assert summary["config"] == read_config(cfg)
    state = torch.load(tmp_path / "out" / "final_model.pt")
    Net().load_state_dict(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_clients_keep_replicas_identical_to_the_cpu_server() -> None:
    grid = LocalGrid(client_app, 3, run_config={**RUN_CONFIG, "device": "cuda"})
    strategy = DistributedLion(aggregation="mean", lr=LR, weight_decay=WD)
    run_rounds(strategy, grid, 4)
    assert [h["num-replies"] for h in strategy.history] == [3, 3, 3, 3]
    for node, x in sync_replicas(strategy, grid, 5).items():
        assert torch.equal(x, strategy.x), node  # GPU replica vs CPU server, bit for bit
