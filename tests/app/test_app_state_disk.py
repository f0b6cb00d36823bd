"""The repository app on nodes that cannot keep their state (the library's side: tests/library/test_state_disk.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flower_dlion import RunStopped
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.server_app import run_federation

from ..library.test_state_disk import NO_SPACE, _full_disk
from .test_federation import RUN_CONFIG


def test_the_app_whose_nodes_cannot_keep_state_stops_with_the_reason_in_its_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the repository app, state in files, every node's folder full from round 1
    full = _full_disk(monkeypatch, {0, 1, 2})
    full["on"] = True
    out = tmp_path / "results"
    cfg = {**RUN_CONFIG, "num-server-rounds": 4, "state-in-context": False, "client-state-dir": str(tmp_path / "s"),
           "results-dir": str(out)}  # fmt: skip
    # Execute
    with pytest.raises(RunStopped) as stopped:
        run_federation(LocalGrid(client_app, 3, run_config=cfg), cfg)
    # Assert: stopped in round 2 with the reason; the summary says so, naming the nodes and the errno
    assert stopped.value.server_round == 2
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["stopped_in_round"]) == ("stopped", 2)
    assert summary["reason"].startswith("the run cannot learn: no node can keep its state: every node that answered")
    assert NO_SPACE in summary["reason"] and "node 1002: could not write its state to " in summary["reason"]
