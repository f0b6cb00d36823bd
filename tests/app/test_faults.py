"""Real federations (issue 5): sampling by partition, failures, Byzantine clients, restarts, checkpoints.

Whole federations run through the real ClientApp on ``LocalGrid`` (every message and
context serialized); the strategy-level cases use mock replies (``test_strategy``).
"""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion import codec
from flower_dlion.clients.state import crc32
from flower_dlion.clients.state_store import STATE_WHERE, read_state_file
from flower_dlion.lion import anchored
from flower_dlion.protocol import CLIENT_UPLOAD
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.checkpoint import check_resumable, load_checkpoint, save_checkpoint
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.client_app import dlion
from flower_dlion_app.clients.common import inject_failure
from flower_dlion_app.clients.fedavg import _attack
from flower_dlion_app.config import read_config
from flower_dlion_app.model import Net, flat_parameters
from flower_dlion_app.server_app import run_federation

from ..library.test_strategy import SIGNS, StubGrid, expected_x, first_round, signs_reply
from ..states import load, newest_file, rounds_in, save_state
from .test_federation import LR, RUN_CONFIG, WD, gradient, initial_arrays, run_rounds, sync_replicas

CPU = torch.device("cpu")
D = sum(p.numel() for p in Net().parameters())


def play(strategy: DistributedLion, grid: LocalGrid, rounds: range) -> dict[int, torch.Tensor]:
    """Run rounds; return the server's x after each version."""
    _, arrays = initial_arrays()
    xs = {}
    for rnd in rounds:
        msgs = strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 8, "seed": 0}), grid)
        if strategy.x is not None and strategy.version not in xs:
            xs[strategy.version] = strategy.x.clone()
        strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
        xs[strategy.version] = strategy.x.clone()
    return xs


# ---------------------------------------------------------------- 1. partial participation
def test_partial_participation_by_partition_keeps_every_replica_exact_for_50_rounds() -> None:
    # Prepare: 10 clients, 3 sampled per round, node ids unlike partition ids
    grid = LocalGrid(client_app, 10, run_config=RUN_CONFIG, first_node_id=5000)
    strategy = DistributedLion(lr=LR, weight_decay=WD, fraction_train=0.3, sample_seed=7)
    sampled: list[list[int]] = []
    _, arrays = initial_arrays()
    xs: dict[int, torch.Tensor] = {}
    # Execute
    for rnd in range(1, 51):
        msgs = strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 8, "seed": 0}), grid)
        xs.setdefault(strategy.version, strategy.x.clone())
        sampled.append(sorted(strategy.partition_of(m.metadata.dst_node_id) for m in msgs))
        strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
    # Assert: the sample is a function of (seed, round) over partition ids, not of node ids
    expected = [sorted(np.random.default_rng([7, t]).choice(np.arange(10), 3, replace=False)) for t in range(1, 51)]
    assert sampled == expected
    # every client that trained holds exactly the server's x of its version, bit for bit
    for node in grid.node_ids:
        state = load(grid.context(node))
        assert state is not None, node  # all 10 trained at least once in 50 rounds
        assert torch.equal(state.x, xs[state.version]), node
    # the full model went to each partition once; stale clients got the Δs they missed
    assert sum(h["full-syncs"] for h in strategy.history) == 10
    assert sum(h["catch-ups"] for h in strategy.history) > 10
    assert all(h["num-replies"] == 3 for h in strategy.history)


def test_a_replica_gone_wrong_is_refused_by_its_node_and_resynced_by_a_logged_full_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: node 1001's replica is silently corrupted after round 2, with checksums that fit it (so the
    # client's own check on loading passes: the server's x-checksum in the round-3 message is the one that finds it;
    # tests/app/test_integrity.py has the server's check on the reply, for a client that does not check)
    grid = LocalGrid(client_app, 3, run_config=RUN_CONFIG)
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    run_rounds(strategy, grid, 2)
    ctx = grid.context(1001)
    host = load(ctx).host
    host.anchor[0] += 1e-3  # the anchored downlink computes x from its anchor and counts
    host.anchor_checksum = crc32(host.anchor)
    counts = torch.from_numpy(host.counts.astype(np.int32))
    host.checksum = crc32(anchored(torch.from_numpy(host.anchor), counts, host.decay, host.step).numpy())
    save_state(ctx, host)
    grid.set_context(1001, ctx)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    run_rounds(strategy, grid, 3, start=3)
    # Assert: refused by the node (not kept, not trained on), full model next round, then equal to the server's x
    assert "rejected reply from node 1001 (partition 1): client error" in caplog.text
    assert "node 1001, round 3: its replica at version 2 has checksum " in caplog.text
    assert [h["checksum-mismatches"] for h in strategy.history] == [0, 0, 0, 0, 0]
    assert [h["full-syncs"] for h in strategy.history] == [3, 0, 0, 1, 0]
    assert [h["num-replies"] for h in strategy.history] == [3, 3, 2, 3, 3]
    for node, x in sync_replicas(strategy, grid, 6).items():
        assert torch.equal(x, strategy.x), node


# ---------------------------------------------------------------- 2. failures
def test_lost_reply_and_departed_node_leave_the_round_to_the_others(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: node 1001's reply of round 2 is lost on the way; node 1002 leaves before round 4
    def hook(node_id, reply):
        return None if node_id == 1001 and reply.metadata.group_id == "2" else reply

    grid = LocalGrid(client_app, 3, run_config=RUN_CONFIG, reply_hook=hook)
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    run_rounds(strategy, grid, 3)
    grid.disconnect(1002)
    run_rounds(strategy, grid, 2, start=4)
    # Assert
    assert "round 2: no reply from node 1001 (partition 1)" in caplog.text
    assert [h["num-failed"] for h in strategy.history] == [0, 1, 0, 0, 0]
    assert [h["num-replies"] for h in strategy.history] == [3, 2, 3, 2, 2]
    assert [h["num-sampled"] for h in strategy.history] == [3, 3, 3, 2, 2]
    # node 1001 applied Δ₁ before its reply was lost: round 3 sends it Δ₁Δ₂ and it skips Δ₁
    assert [h["catch-ups"] for h in strategy.history] == [0, 0, 1, 0, 0]
    assert [h["full-syncs"] for h in strategy.history] == [3, 0, 0, 0, 0]
    for node, x in sync_replicas(strategy, grid, 6).items():
        assert torch.equal(x, strategy.x), node


def test_injected_failures_are_seeded_and_the_round_goes_on() -> None:
    # Prepare: half the clients fail at random each round
    cfg = {**RUN_CONFIG, "fail-fraction": 0.5}
    grid = LocalGrid(client_app, 4, run_config=cfg)
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    settings = read_config(cfg)

    def fails(pid: int, rnd: int) -> bool:
        try:
            inject_failure(settings, pid, rnd)
        except RuntimeError:
            return True
        return False

    # Execute
    run_rounds(strategy, grid, 6)
    # Assert: exactly the predicted partitions failed; rounds with no valid reply left x alone
    failing = [sum(fails(pid, rnd) for pid in range(4)) for rnd in range(1, 7)]
    assert 0 < sum(failing) < 24
    assert [h["num-replies"] for h in strategy.history] == [4 - f for f in failing]
    assert [h["applied"] for h in strategy.history] == [int(f < 4) for f in failing]
    for node, x in sync_replicas(strategy, grid, 7).items():
        assert torch.equal(x, strategy.x), node


# ---------------------------------------------------------------- 3. Byzantine clients
@pytest.mark.parametrize("how", ["vote", "mean"])
def test_a_sign_flipping_minority_is_outvoted_exactly(how: str) -> None:
    # Prepare: 3 honest clients agree on h; 2 Byzantine clients send −h; a twin strategy hears only the honest
    h = SIGNS[0]
    attacked, honest = (DistributedLion(aggregation=how, lr=0.01, weight_decay=0.1) for _ in range(2))
    sent = first_round(attacked, [1, 2, 3, 4, 5])
    sent_honest = first_round(honest, [1, 2, 3])
    replies = [signs_reply(sent[n], h) for n in (1, 2, 3)] + [signs_reply(sent[n], [-s for s in h]) for n in (4, 5)]
    # Execute
    _, metrics = attacked.aggregate_train(1, replies)
    honest.aggregate_train(1, [signs_reply(sent_honest[n], h) for n in (1, 2, 3)])
    # Assert: the vote moves x exactly as without the attackers; the mean is shrunk to (3 − 2)/5 of it
    if how == "vote":
        assert torch.equal(attacked.x, honest.x)
        assert metrics["agreement"] == pytest.approx(1 / 5)  # |S| = 1 everywhere, n = 5
    else:
        np.testing.assert_allclose(attacked.x.numpy(), expected_x([s / 5 for s in h], 0.01, 0.1), rtol=1e-6)


def test_byzantine_client_uploads_the_flipped_sign_of_its_honest_direction() -> None:
    # Prepare: the same 2-client round, honest and with partition 0 Byzantine (k = ⌊0.5·2 + ½⌋ = 1)
    uploads = {}
    for name, extra in (("honest", {}), ("flip", {"byzantine-fraction": 0.5})):
        grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, **extra})
        strategy = DistributedLion(lr=LR, weight_decay=WD)
        msgs = strategy.configure_train(1, initial_arrays()[1], ConfigRecord({"batch-size": 16, "seed": 0}), grid)
        replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
        uploads[name] = {n: codec.unpack_bits(r.content[CLIENT_UPLOAD]["signs"].data, D) for n, r in replies.items()}
    # Assert: round 1 has m = 0, so δ = sign(g); partition 0 sends −δ wherever g ≠ 0, partition 1 is unchanged
    g = gradient(flat_parameters(initial_arrays()[0]), 0, 2, 1)
    nonzero = g != 0
    assert torch.equal(uploads["flip"][1001], uploads["honest"][1001])
    assert torch.equal(uploads["flip"][1000][nonzero], ~uploads["honest"][1000][nonzero])
    assert nonzero.float().mean() > 0.5


def test_fedavg_attacker_flips_or_randomizes_its_update_scaled() -> None:
    sent = {"w": torch.tensor([1.0, 2.0, 3.0])}
    trained = {"w": torch.tensor([1.5, 1.0, 3.0])}  # u = (0.5, −1, 0)
    rng = np.random.default_rng(0)
    flip = _attack(sent, trained, {"byzantine-scale": 10.0, "byzantine-mode": "flip"}, rng)
    torch.testing.assert_close(flip["w"], torch.tensor([-4.0, 12.0, 3.0]))  # x − 10·u
    rand = _attack(sent, trained, {"byzantine-scale": 2.0, "byzantine-mode": "random"}, rng)
    torch.testing.assert_close((rand["w"] - sent["w"]).norm(), 2.0 * torch.tensor([0.5, -1.0, 0.0]).norm())


# ---------------------------------------------------------------- 5. restarts and checkpoints
def test_restarted_node_without_state_gets_full_model_and_fresh_momentum(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    grid = LocalGrid(client_app, 3, run_config={**RUN_CONFIG, "state-in-context": True})  # lost with the process
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    run_rounds(strategy, grid, 2)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute: the SuperNode of partition 1 restarts (new node id, empty state)
    grid.restart_node(1001, 7001)
    run_rounds(strategy, grid, 1, start=3)
    # Assert: detected by its hello, logged, counted; it trained from the full model with m = 0
    assert "partition 1: node 7001 replaces node 1001" in caplog.text
    assert "partition 1 (node 7001) has no state (a restarted SuperNode?): it gets the full model" in caplog.text
    assert strategy.history[-1]["state-resets"] == 1 and strategy.history[-1]["full-syncs"] == 1
    assert strategy.history[-1]["num-replies"] == 3
    state = load(grid.context(7001))
    g = gradient(state.x, 1, 3, 3)
    torch.testing.assert_close(state.m, (1 - 0.99) * g)  # fresh momentum after one step
    for node, x in sync_replicas(strategy, grid, 4).items():
        assert torch.equal(x, strategy.x), node


def test_killed_node_reported_by_the_superlink_then_restarted_under_the_same_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: node 1001's process dies after round 2; under SuperNode authentication it
    # restarts with the same node id (its key) and an empty state
    grid = LocalGrid(client_app, 3, run_config={**RUN_CONFIG, "state-in-context": True})  # lost with the process
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    run_rounds(strategy, grid, 2)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute: round 3 gets the SuperLink's NODE_UNAVAILABLE reply for it; round 4 without it
    grid.kill(1001)
    run_rounds(strategy, grid, 2, start=3)
    grid.restart_node(1001, 1001)
    run_rounds(strategy, grid, 1, start=5)
    # Assert: the SuperLink's reply (sender node 1) is the killed node's, by reply_to_message_id
    assert "round 3: rejected reply from node 1001 (partition 1): the SuperLink reports" in caplog.text
    assert "Node Unavailable" in caplog.text and "from node 1 " not in caplog.text
    assert [h["num-sampled"] for h in strategy.history] == [3, 3, 3, 2, 3]
    assert [h["num-replies"] for h in strategy.history] == [3, 3, 2, 2, 3]
    assert [h["num-rejected"] for h in strategy.history] == [0, 0, 1, 0, 0]
    # the node was forgotten, so its return (same id) is greeted: no state → full model at once
    assert "partition 1 (node 1001) has no state (a restarted SuperNode?): it gets the full model" in caplog.text
    assert strategy.history[-1]["state-resets"] == 1 and strategy.history[-1]["full-syncs"] == 1
    for node, x in sync_replicas(strategy, grid, 6).items():
        assert torch.equal(x, strategy.x), node


def _run_both(grids: list[LocalGrid], strategies: list[DistributedLion], rounds: int, start: int = 1) -> None:
    for grid, strategy in zip(grids, strategies, strict=True):
        run_rounds(strategy, grid, rounds, start=start)


def _twin_federations(configs: list[dict]) -> tuple[list[LocalGrid], list[DistributedLion]]:
    """Two 3-node federations, one per run config (state keys run0 and run1), after 2 rounds each."""
    grids = [LocalGrid(client_app, 3, run_config=cfg) for cfg in configs]
    strategies = [DistributedLion(lr=LR, weight_decay=WD, state_key=f"run{i}") for i in range(len(configs))]
    _run_both(grids, strategies, 2)
    return grids, strategies


def test_restarted_node_with_state_files_continues_exactly(tmp_path: Path) -> None:
    # Prepare: twin federations with state files; in one, partition 1's SuperNode restarts after round 2
    cfg = {**RUN_CONFIG, "client-state-dir": str(tmp_path)}
    grids, strategies = _twin_federations([cfg, cfg])
    # Execute
    grids[1].restart_node(1001, 7001)
    _run_both(grids, strategies, 3, start=3)
    # Assert: its file gave it back replica and momentum; nothing differs from the twin
    assert strategies[1].history[2]["state-resets"] == 0 and strategies[1].history[2]["full-syncs"] == 0
    assert torch.equal(strategies[0].x, strategies[1].x)
    twin, restarted = (load(g.context(n)) for g, n in ((grids[0], 1001), (grids[1], 7001)))
    assert torch.equal(twin.m, restarted.m)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_in_files_only_trains_like_state_in_context_and_survives_a_restart(tmp_path: Path, dtype: str) -> None:
    # Prepare: twin federations with state files; one keeps the state in them alone
    cfg = {**RUN_CONFIG, "client-state-dir": str(tmp_path), "momentum-dtype": dtype}
    grids, strategies = _twin_federations([{**cfg, "state-in-context": ctx} for ctx in (True, False)])
    # Execute: partition 1's SuperNode restarts in the files-only federation
    grids[1].restart_node(1001, 7001)
    _run_both(grids, strategies, 2, start=3)
    # Assert: no model-sized state in the files-only contexts; the same model, the same momenta
    assert all("dlion.state" not in grids[1].context(n).state for n in grids[1].node_ids)
    assert all(
        h["state-resets"] == 0 and h["full-syncs"] == (3 if h["round"] == 1 else 0) for h in strategies[1].history
    )
    assert torch.equal(strategies[0].x, strategies[1].x)
    dlion.wait()  # the last round's files are written after the replies
    for pid, node in enumerate(grids[0].node_ids):
        saved = [read_state_file(newest_file(tmp_path / f"run{i}" / f"partition-{pid}")) for i in (0, 1)]
        m = saved[1][1]["m"]
        assert m.dtype == (np.uint16 if dtype == "bfloat16" else np.float32)  # bfloat16: 2 bytes per value on disk
        assert np.array_equal(saved[0][1]["m"], m) and np.array_equal(saved[0][1]["counts"], saved[1][1]["counts"])
        assert saved[0][0]["checksum"] == saved[1][0]["checksum"]  # the same replica
        assert np.array_equal(load(grids[0].context(node)).host.m, m)
    assert rounds_in(tmp_path / "run1" / "partition-0") == [3, 4]  # the two slots
    assert len(list((tmp_path / "run1" / "anchors").iterdir())) == 1  # one anchor file for the run's nodes


def test_state_in_files_only_without_a_state_key_keeps_it_under_the_strategys_own_key(tmp_path: Path) -> None:
    # Prepare: files only, and a strategy built without a state key (a user's ServerApp without resume)
    cfg = {**RUN_CONFIG, "client-state-dir": str(tmp_path), "state-in-context": False}
    grid = LocalGrid(client_app, 2, run_config=cfg, run_id=77)
    strategy = DistributedLion(lr=LR, weight_decay=WD)
    # Execute
    run_rounds(strategy, grid, 3)
    # Assert: every round trained; each node's newest state is in <dir>/<run key>/partition-<id>, none in a context
    assert [h["num-replies"] for h in strategy.history] == [2, 2, 2] and strategy.version == 3
    dlion.wait()
    for pid, node in enumerate(grid.node_ids):
        assert rounds_in(tmp_path / strategy.run_key / f"partition-{pid}") == [2, 3]
        assert list(grid.context(node).state.keys()) == [STATE_WHERE]  # where the files are, nothing else


RESUME_CFG = {
    "partitioner": "iid",
    "batch-size": 16,
    "lr": LR,
    "num-server-rounds": 9,
    "eval-every": 3,
    "holdout": 1000,
    "fraction-train": 0.5,
    "checkpoint-every": 3,
}

KILLED_RUN = """
import os, signal, sys, json
from flower_dlion_app.client_app import app
from flower_dlion.testing import LocalGrid
from flower_dlion_app.server_app import run_federation
cfg = json.loads(sys.argv[1])
def hook(node_id, reply):
    if reply.metadata.group_id == "8":  # killed in round 8, after a client has trained (and saved its state)
        os.kill(os.getpid(), signal.SIGKILL)
    return reply
run_federation(LocalGrid(app, 4, run_config=cfg, reply_hook=hook), cfg)
"""


@pytest.mark.parametrize("in_context", [True, False])
def test_server_killed_mid_run_and_resumed_reaches_the_same_x(tmp_path: Path, in_context: bool) -> None:
    # Prepare: an uninterrupted run, and one killed (SIGKILL) in round 8 with a checkpoint after round 6
    # (its clients' state in context.state and files, or in files alone)
    full = {**RESUME_CFG, "results-dir": str(tmp_path / "full"), "client-state-dir": str(tmp_path / "full-state")}
    reference = run_federation(LocalGrid(client_app, 4, run_config=full), full)
    killed = {**RESUME_CFG, "results-dir": str(tmp_path / "run"), "client-state-dir": str(tmp_path / "state")}
    killed["state-in-context"] = in_context
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, json.dumps(killed)], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["round"] == 6
    # Execute: resume in a new "run" (new node ids, empty contexts: the clients' state comes from their files)
    resumed_cfg = {**killed, "resume": str(tmp_path / "run" / "checkpoint.pt")}
    resumed = run_federation(LocalGrid(client_app, 4, run_config=resumed_cfg, first_node_id=9000), resumed_cfg)
    # Assert: the same final x, bit for bit, and the same accuracy in every evaluated round
    for name, arr in reference.arrays.items():
        np.testing.assert_array_equal(resumed.arrays[name].numpy(), arr.numpy(), err_msg=name)
    rows = [[json.loads(x) for x in (tmp_path / d / "results.jsonl").read_text().splitlines()] for d in ("full", "run")]
    assert [r["round"] for r in rows[1]] == list(range(10))
    assert [(r["accuracy"], r["loss"]) for r in rows[0]] == [(r["accuracy"], r["loss"]) for r in rows[1]]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from_round"] == 6 and summary["final_accuracy"] == rows[0][-1]["accuracy"]


def test_resume_without_state_files_resets_clients_and_finishes(tmp_path: Path, caplog) -> None:
    cfg = {**RESUME_CFG, "num-server-rounds": 3, "results-dir": str(tmp_path), "state-in-context": True}
    run_federation(LocalGrid(client_app, 4, run_config=cfg), cfg)
    caplog.set_level(logging.WARNING, logger="flwr")
    more = {**cfg, "num-server-rounds": 5, "resume": str(tmp_path / "checkpoint.pt")}
    run_federation(LocalGrid(client_app, 4, run_config=more, first_node_id=9000), more)
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(6))
    # new contexts: x₀ from the seed (init = "seed") and the counts since, no float model; m = 0
    assert rows[4]["state_resets"] >= 1 and rows[4]["full_syncs"] == 0 and rows[4]["bytes_down"] < 4 * D
    assert "has no state (a restarted SuperNode?)" in caplog.text


def test_resume_refuses_a_different_run_config() -> None:
    saved = read_config({"lr": 0.002})
    check_resumable(saved, {**saved, "num-server-rounds": 500, "resume": "x"})  # fine
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in lr: 0.002 → 0.003"):
        check_resumable(saved, read_config({"lr": 0.003}))


def test_checkpoint_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"round": 3})
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"round": 6})
    assert load_checkpoint(path)["round"] == 3  # the previous checkpoint, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable flower-dlion checkpoint"):
        load_checkpoint(path)


def test_strategy_state_dict_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    # Prepare: two rounds with a missing client (so the state has versions, history, a stale node)
    strategy = DistributedLion(lr=0.01, weight_decay=0.1, broadcast_bits=1, upload="ef-sign", local_steps=2)
    options = {"local-steps": 2, "upload": "ef-sign", "broadcast-bits": 1}
    grid = LocalGrid(client_app, 3, run_config={**RUN_CONFIG, **options})
    play(strategy, grid, range(1, 3))
    save_checkpoint(tmp_path / "c.pt", {"s": strategy.state_dict()})
    # Execute
    other = DistributedLion(lr=0.01, weight_decay=0.1, broadcast_bits=1, upload="ef-sign", local_steps=2)
    other.load_state_dict(load_checkpoint(tmp_path / "c.pt")["s"])
    # Assert: the restored strategy sends the same next messages and has the same buffers
    a = {m.metadata.dst_node_id: m for m in strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid)}
    b = {m.metadata.dst_node_id: m for m in other.configure_train(3, ArrayRecord(), ConfigRecord(), grid)}
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].content["dlion.config"] == b[n].content["dlion.config"]
    assert torch.equal(strategy.x, other.x) and torch.equal(strategy.state.server_error, other.state.server_error)


@pytest.mark.parametrize(("version", "kind"), [(0, "counts"), (-1, "full")])
def test_a_node_under_a_new_id_keeps_its_partitions_version_only_if_it_holds_it(version: int, kind: str) -> None:
    # Prepare: partitions 4 and 9 train round 1
    strategy = DistributedLion(lr=0.01)
    sent = first_round(strategy, [4, 9])
    assert [strategy.partition_of(n) for n in (4, 9, 5)] == [4, 9, -1]
    strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[0]) for n in (4, 9)])
    # Execute: partition 9 comes back as node 19, saying it holds version 0 (its files) or nothing
    grid = StubGrid([4, 19], versions={19: version}, partitions={19: 9})
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, ArrayRecord(), ConfigRecord(), grid)}
    # Assert
    assert strategy.partition_of(19) == 9 and strategy.partition_of(9) == -1
    assert msgs[19].content["dlion.config"]["kind"] == kind
    assert msgs[4].content["dlion.config"]["kind"] == "counts"


def test_gradient_baseline_resumes_exactly_without_client_state(tmp_path: Path) -> None:
    # Prepare: global AdamW keeps its optimizer state on the server; its clients are stateless
    cfg = {**RESUME_CFG, "strategy": "global-adamw", "lr": 0.001, "weight-decay": 0.01, "num-server-rounds": 5}
    reference = run_federation(LocalGrid(client_app, 4, run_config=cfg), {**cfg, "results-dir": str(tmp_path / "a")})
    first = {**cfg, "num-server-rounds": 3, "results-dir": str(tmp_path / "b")}
    run_federation(LocalGrid(client_app, 4, run_config=first), first)
    # Execute: resume after round 3 (a new grid, new node ids) and run to round 5
    more = {**cfg, "resume": str(tmp_path / "b" / "checkpoint.pt"), "results-dir": str(tmp_path / "b")}
    resumed = run_federation(LocalGrid(client_app, 4, run_config=more, first_node_id=9000), more)
    # Assert: AdamW's moments and step count came back with x
    for name, arr in reference.arrays.items():
        np.testing.assert_array_equal(resumed.arrays[name].numpy(), arr.numpy(), err_msg=name)


def test_bfloat16_momentum_halves_the_stored_momentum_and_keeps_replicas_exact() -> None:
    # Prepare: the same federation with float32 and bfloat16 momentum storage
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, "momentum-dtype": dtype, "state-in-context": True})
        strategy = DistributedLion(lr=LR, weight_decay=WD)
        # Execute
        run_rounds(strategy, grid, 3)
        # Assert: m is stored in 2 bytes per value and holds bfloat16 values; replicas stay exact
        ctx = grid.context(1000)
        sizes[dtype] = len(ctx.state["dlion.state"]["m"].data)
        state = load(ctx)
        assert torch.equal(state.m, state.m.to(torch.bfloat16).float()) == (dtype == "bfloat16")
        for node, x in sync_replicas(strategy, grid, 4).items():
            assert torch.equal(x, strategy.x), node
    assert sizes["bfloat16"] < 0.51 * sizes["float32"]
