"""The edge example: its scripts use the app's data and deploy tools (library side: tests/library/test_examples.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from ..library.test_examples import BIN, EXAMPLES


@pytest.mark.slow
@pytest.mark.skipif(not (BIN / "flower-superlink").exists(), reason="needs Flower's CLI")
@pytest.mark.parametrize("args", [("2", "3"), ("3", "3", "secure=true min-train-nodes=3")], ids=["plain", "secure"])
def test_edge_scripts_run_a_tls_federation_of_devices_without_partition_ids(args: tuple[str, ...]) -> None:
    # Execute: the README's try-out (2 devices, 3 rounds) and its secure variant (3 devices: masked signs)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", str(EXAMPLES / "edge" / "try-it-here.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    # Assert
    assert done.returncode == 0, done.stdout + done.stderr
    assert "finished:completed" in done.stdout and "round 3: test accuracy" in done.stdout
