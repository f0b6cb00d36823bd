"""The app on Flower's Deployment Engine: a real SuperLink and 3 SuperNodes with TLS and node auth.

Slow (each message starts a ClientApp process that imports torch; the fault test waits about a
minute for the SuperLink to notice a killed node), run in CI.
"""

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from flower_dlion_app.deploy import Deployment

from ..states import rounds_in

pytestmark = pytest.mark.slow


CLI = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # the venv's tools first


@pytest.mark.skipif(shutil.which("flower-superlink", path=CLI) is None, reason="needs Flower's CLI tools")
def test_three_supernodes_with_tls_and_auth_finish_and_bytes_match_the_superlinks(tmp_path: Path) -> None:
    # Prepare: the clients keep their state in files alone (the default, in context.state, is the next test's)
    dep = Deployment(tmp_path / "work", nodes=3)
    results, state = tmp_path / "results", tmp_path / "state"
    try:
        dep.start_superlink()
        for i in range(3):
            dep.register(i)
            dep.start_supernode(i)
        started = list(dep.procs.values())
        # Execute
        record = dep.run(  # init='full': MBs on the wire, so that the connections' fixed ~7 kB stay within 5 %
            f"num-server-rounds=2 init='full' eval-every=1 holdout=2000 results-dir='{results}' "
            f"client-state-dir='{state}' state-in-context=false",
            timeout=900,
        )
    finally:
        dep.stop()
    # Assert: completed, above chance, and our byte metrics agree with the SuperLink's counters
    assert record["status"] == "finished:completed", record
    assert len(started) == 4 and all(p.poll() is not None for p in started)  # every process it started is gone
    summary = json.loads((results / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.15  # chance is 0.1
    traffic = record["network-traffic"]
    assert traffic["inbound-bytes"] == pytest.approx(summary["total_mb_up"] * 1e6, rel=0.05)
    assert traffic["outbound-bytes"] == pytest.approx(summary["total_mb_down"] * 1e6, rel=0.05)
    # each SuperNode's ClientApp kept its state in its partition's file of the last round, and only there
    folders = sorted(p.parent for p in state.rglob("*.state"))
    assert sorted({f.name for f in folders}) == [f"partition-{i}" for i in range(3)]
    assert all(rounds_in(f) == [1, 2] for f in set(folders))  # the two slots: rounds 1 and 2


def _rows(results: Path) -> list[dict]:
    path = results / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.skipif(shutil.which("flower-superlink", path=CLI) is None, reason="needs Flower's CLI tools")
def test_killed_supernode_is_left_out_and_its_restart_resyncs(tmp_path: Path) -> None:
    # Prepare: 3 SuperNodes; rounds wait at most 90 s for replies
    dep = Deployment(tmp_path / "work", nodes=3)
    results = tmp_path / "results"
    config = f"num-server-rounds=10 eval-every=100 holdout=2000 round-timeout=90.0 results-dir='{results}'"
    config += " state-in-context=true"  # the state dies with the process (files: test_faults' restart tests)
    try:
        dep.start_superlink()
        for i in range(3):
            dep.register(i)
            dep.start_supernode(i)
        # Execute: kill SuperNode 1 after round 2, start it again (empty state) after round 4
        run = threading.Thread(target=lambda: out.update(dep.run(config, timeout=1500)))
        out: dict = {}
        run.start()
        _wait_for_round(results, 2)
        dep.kill("supernode1")
        _wait_for_round(results, 4)
        dep.start_supernode(1, name="supernode1-restarted")
        run.join()
    finally:
        dep.stop()
    # Assert: the run went on without the node and took it back with the full model
    assert out["status"] == "finished:completed", out
    rows = _rows(results)
    assert [r["round"] for r in rows] == list(range(11))
    # round 3: the SuperLink's NODE_UNAVAILABLE reply (≈ 60 s: 2 missed heartbeats) stands for node 1
    assert (rows[3]["num_sent"], rows[3]["num_errors"], rows[3]["num_rejected"], rows[3]["num_failed"]) == (3, 1, 1, 0)
    assert rows[4]["num_sent"] == 2  # round 4: node 1 is no longer listed
    # the restarted node (same id under node auth) was greeted again: no state → x₀ from the seed (init = "seed")
    # and the counts since, not the float32 model
    assert sum(r["state_resets"] for r in rows[5:]) == 1 and sum(r["full_syncs"] for r in rows[5:]) == 0
    assert rows[-1]["num_replies"] == 3 and rows[-1]["num_errors"] == 0  # it contributes again


def _wait_for_round(results: Path, rnd: int, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r["round"] >= rnd for r in _rows(results)):
            return
        time.sleep(1)
    raise TimeoutError(f"round {rnd} not reached")
