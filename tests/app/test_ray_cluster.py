"""The default app on a two-node Ray cluster (benchmarks/ray_cluster.py at small size): client state and moves.

Each Ray node has its own ``FLOWER_DLION_STATE_DIR``, so a virtual client that Ray serves on the
other node next round does not find its state files there. The run must still complete every
round, and every reply of such a client must be either accepted after it resynced or counted as
rejected; with one folder for both nodes (run config ``client-state-dir``: shared storage) no
client may report a missing state.

Costs minutes (two ``ray start``s, two ``flwr run``s): run with
``FLOWER_DLION_RAY_CLUSTER_TEST=1 pytest -m slow tests/app/test_ray_cluster.py``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("FLOWER_DLION_RAY_CLUSTER_TEST") != "1",
        reason="a two-node Ray cluster costs minutes: set FLOWER_DLION_RAY_CLUSTER_TEST=1",
    ),
]

NODES, ROUNDS = 4, 5
FAST = {"holdout": 1000}  # evaluate on 1,000 held-out training images, not the 10,000 test images (minutes on 2 cores)


def load_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ray_cluster.py"
    spec = importlib.util.spec_from_file_location("ray_cluster_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs():
    bench = load_benchmark()
    out = Path(tempfile.mkdtemp(prefix="dlion-ray-t", dir="/tmp"))
    dirs = [out / "state-node0", out / "state-node1"]
    shared = out / "state-shared"
    t0 = time.perf_counter()
    try:
        with bench.RayCluster(out / "cluster", dirs) as cluster:
            started = time.perf_counter() - t0
            kw = {"num_supernodes": NODES, "rounds": ROUNDS, "ray_address": cluster.address, "timeout": 300}
            separate = bench.run_flwr("separate", out, run_config=FAST, **kw)
            together = bench.run_flwr("shared", out, run_config={**FAST, "client-state-dir": f"'{shared}'"}, **kw)
            t1 = time.perf_counter()
        separate.nodes_moved = bench.moved_nodes(dirs)
        print(
            f"\n[ray cluster] start {started:.0f} s, runs {separate.wall_s:.0f} + {together.wall_s:.0f} s, "
            f"stop {time.perf_counter() - t1:.0f} s; separate folders: {separate.rejected} replies rejected "
            f"{separate.rejected_why}, {separate.resynced} resynced later, {separate.nodes_moved} nodes moved"
        )
        yield separate, together, dirs, shared
    finally:
        shutil.rmtree(out, ignore_errors=True)


def completed(run) -> None:
    assert run.status == "finished:completed", (run.status, run.log)
    assert run.rounds_completed == ROUNDS
    train = [r for r in run.rows if r["round"] >= 1]
    # a round leaves x unchanged only when every reply of it was rejected (min-replies = 1)
    assert all(r["applied"] or r["num_rejected"] == r["num_sent"] for r in train), train
    assert [r["num_sent"] for r in train] == [NODES] * ROUNDS  # every node sampled every round
    assert run.failed == 0  # every sampled node answered
    assert run.final_accuracy is not None and run.final_accuracy > 0.2


def test_separate_state_folders(runs):
    run, _, dirs, _ = runs
    completed(run)
    assert all(any(d.glob("*/partition-*/*.state")) for d in dirs), "both Ray nodes served clients"
    assert run.nodes_moved > 0, "no client moved between the Ray nodes: the test shows nothing"
    # every rejected reply is counted, in the server's log and in results.jsonl alike
    assert run.rejected_in_log == run.rejected
    assert sum(r["num_errors"] for r in run.rows) == run.rejected
    # ... for a missing state only, and each was accepted in a later round (resynced) or came in the last one
    assert set(run.rejected_why) <= {"no replica", "stale replica", "state refused"}, run.rejected_why
    assert run.resynced + run.rejected_in_last_round >= run.rejected
    assert run.catch_ups + run.full_syncs + run.state_resets >= run.rejected - run.rejected_in_last_round


def test_shared_state_folder(runs):
    _, run, _, shared = runs
    completed(run)
    assert any(shared.glob("*/partition-*/*.state"))
    assert run.rounds_applied == ROUNDS
    assert run.rejected == run.rejected_in_log == 0
    assert run.client_no_replica == run.client_starts_anew == 0, "a client reported a missing state"
    assert run.state_resets == 0
