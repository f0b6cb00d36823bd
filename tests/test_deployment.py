"""The app on Flower's Deployment Engine: a real SuperLink and 3 SuperNodes with TLS and node auth.

Slow (about a minute: each message starts a ClientApp process that imports torch), run in CI.
"""

import json
import shutil
from pathlib import Path

import pytest

from flower_dlion.deploy import Deployment

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="needs Flower's CLI tools")
def test_three_supernodes_with_tls_and_auth_finish_and_bytes_match_the_superlinks(tmp_path: Path) -> None:
    # Prepare
    dep = Deployment(tmp_path / "work", nodes=3)
    results = tmp_path / "results"
    try:
        dep.start_superlink()
        for i in range(3):
            dep.register(i)
            dep.start_supernode(i)
        started = list(dep.procs.values())
        # Execute
        record = dep.run(f"num-server-rounds=2 eval-every=1 holdout=2000 results-dir='{results}'", timeout=900)
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
