"""The example apps in examples/, run as their READMEs say (``flwr run``), for a few rounds each.

Each ``flwr run`` gets its own Flower home and its own local SuperLink ports, and the SuperLink
it starts is stopped afterwards by its process group.
"""

import difflib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
CODE = ("pytorchexample/client_app.py", "pytorchexample/server_app.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quickstart_diff() -> list[str]:
    """The unified diff from the FedAvg quickstart to the D-Lion one (the Python files)."""
    lines = []
    for name in CODE:
        before = (EXAMPLES / "quickstart-pytorch-fedavg" / name).read_text().splitlines()
        after = (EXAMPLES / "quickstart-pytorch" / name).read_text().splitlines()
        lines += difflib.unified_diff(before, after, f"a/{name}", f"b/{name}", lineterm="", n=1)
    return lines


def test_the_readme_shows_the_quickstarts_diff_and_it_is_small() -> None:
    # Prepare
    diff = quickstart_diff()
    readme = (ROOT / "README.md").read_text()
    # Execute: the README's diff block
    block = re.search(r"```diff\n(.*?)```", readme, re.S)
    # Assert: the README shows exactly the diff of the two apps; the D-Lion app adds 9 lines of code
    assert block is not None and block.group(1).splitlines() == diff
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    assert len(added) <= 15, added
    assert len(added) + len(removed) <= 45, removed
    # the task, the evaluation and the data stay as they were
    for name in ("pytorchexample/task.py", "pytorchexample/__init__.py"):
        assert (EXAMPLES / "quickstart-pytorch" / name).read_text() == (
            EXAMPLES / "quickstart-pytorch-fedavg" / name
        ).read_text()


def flwr_run(
    app: Path, tmp_path: Path, run_config: str, supernodes: int, timeout: float = 900, federation: str = ""
) -> tuple[str, str]:
    """``flwr run APP`` in a simulation of ``supernodes`` nodes (and ``federation`` settings): (status, log)."""
    http, control = _free_port(), _free_port()
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control),
    }

    def flwr(*args: str, wait: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["flwr", *args], env=env, capture_output=True, text=True, timeout=wait, check=False)

    try:
        federation_config = f"num-supernodes={supernodes} {federation}".strip()
        started = flwr("run", str(app), "--run-config", run_config, "--federation-config", federation_config)
        match = re.search(r"run (\d+)", started.stdout + started.stderr)
        assert started.returncode == 0 and match, started.stdout + started.stderr
        run_id, status, deadline = match.group(1), "", time.time() + timeout
        while time.time() < deadline and not status.startswith("finished"):
            time.sleep(2)
            listed = flwr("ls", "--run-id", run_id, "--format", "json", wait=60)
            try:
                status = json.loads(listed.stdout)["runs"][0]["status"]
            except (ValueError, KeyError, IndexError):
                status = ""
        log = flwr("log", run_id, "--show", wait=60)
        return status, log.stdout + log.stderr
    finally:
        found = subprocess.run(["pgrep", "-f", f"flower-superlink.*--port {http}"], capture_output=True, text=True)
        for pid in found.stdout.split():
            try:
                os.killpg(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass


needs_cli = pytest.mark.skipif(not (BIN / "flwr").exists(), reason="needs Flower's CLI")


@pytest.mark.slow
@needs_cli
def test_quickstart_dlion_and_its_fedavg_original_run_with_flwr_run(tmp_path: Path) -> None:
    # Execute: the D-Lion app for 5 rounds with federated evaluation on; the FedAvg app for 1
    dlion, dlion_log = flwr_run(
        EXAMPLES / "quickstart-pytorch", tmp_path / "dlion", "num-server-rounds=5 fraction-evaluate=0.5", 2
    )
    fedavg, fedavg_log = flwr_run(EXAMPLES / "quickstart-pytorch-fedavg", tmp_path / "fedavg", "num-server-rounds=1", 2)
    # Assert
    assert dlion == "finished:completed", dlion_log
    assert "Starting DistributedLion strategy" in dlion_log and "eval_acc" in dlion_log  # the user's evaluate ran
    assert fedavg == "finished:completed", fedavg_log


@pytest.mark.slow
@needs_cli
def test_resnet18_example_runs_on_synthetic_images_with_its_state_in_files(tmp_path: Path) -> None:
    # Execute: no CIFAR-10 here, so the synthetic stand-in; 11M parameters, so the state goes to files. Two
    # worker processes (one CPU each, as `client-resources-num-gpus=0.5` gives two on one GPU): a node's
    # messages go to either, so its state moves between them through its file
    status, log = flwr_run(
        EXAMPLES / "resnet18-cifar10", tmp_path, "num-server-rounds=4 batch-size=8", 3, 1500,
        federation="client-resources-num-cpus=1",
    )  # fmt: skip
    # Assert: every reply of every round valid, no node resynced
    assert status == "finished:completed", log
    assert "accuracy" in log
    assert re.findall(r"'num-replies': (\d+)", log) == ["3"] * 4, log
    assert set(re.findall(r"'(?:num-rejected|state-resets|checksum-mismatches)': (\d+)", log)) == {"0"}, log
