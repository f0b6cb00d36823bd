"""The server's round cost with the app's clients (library side: tests/library/test_server_round_cost.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord

from flower_dlion.strategies import DistributedLion
from flower_dlion.strategies.downlink import Downlink

from ..library.test_server_round_cost import SCHEDULE, _counting_encodes, _in_sync, _wire
from ..states import load


def _federation(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[int], list[bool]]:
    """SCHEDULE on the real ClientApp (4 nodes, CPU): each round's wire and metrics, codings, in-sync rounds."""
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app as client_app

    from .test_federation import CPU_CONFIG, LR, WD, initial_arrays

    grid = LocalGrid(client_app, 4, run_config=CPU_CONFIG)
    everyone = list(grid.node_ids)
    # anchors at versions 5 (and 10): no catch-up here crosses one (the stub nodes' do; a real node that caught
    # up across an anchor replied with a wrong checksum to its next catch-up, with or without this change)
    strategy = DistributedLion(lr=LR, weight_decay=WD, anchor_every=5, state_key="cost")
    _, arrays = initial_arrays()
    seen, codings, in_sync_rounds, xs = [], [], [], {}
    for rnd, nodes in enumerate(SCHEDULE, start=1):
        grid.node_ids = [everyone[n] for n in nodes]  # the others are not connected this round (their state kept)
        in_sync_rounds.append(_in_sync(strategy, grid.node_ids))
        with _counting_encodes(monkeypatch) as calls:
            msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 8}), grid))
        codings.append(calls[0])
        xs.setdefault(strategy.version, strategy.x.clone())
        seen.append([_wire(m) for m in msgs])
        strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
        seen.append(strategy.history[-1])
    # every reply valid (each replica's checksum is the server's), every replica the server's x of its version
    assert all(h["num-replies"] == len(nodes) for h, nodes in zip(strategy.history, SCHEDULE, strict=True))
    assert sum(h["checksum-mismatches"] + h["num-rejected"] for h in strategy.history) == 0
    for node in everyone:
        state = load(grid.context(node))
        assert state is not None and torch.equal(state.x, xs[state.version]), node
    return seen, codings, in_sync_rounds


def test_a_federation_sends_what_every_option_built_sent_and_codes_nothing_in_sync(monkeypatch) -> None:
    # Prepare / Execute: the same federation twice, the second building every option (the reference)
    lazy, lazy_codings, in_sync = _federation(monkeypatch)
    monkeypatch.setattr(Downlink, "_may_win", staticmethod(lambda least, best: True))
    eager, eager_codings, _ = _federation(monkeypatch)
    # Assert: the same messages and bytes; in-sync rounds (2, 3, 4, 6, 7, 9) coded nothing, where the reference
    # coded the anchor's counts; the rounds with a stale node coded its catch-up
    assert lazy == eager
    assert in_sync == [False, True, True, True, False, True, True, False, True]
    assert [c for c, s in zip(lazy_codings, in_sync, strict=True) if s] == [0] * 6
    assert sum(c for c, s in zip(eager_codings, in_sync, strict=True) if s) > 0
    assert lazy_codings[4] >= 1 and lazy_codings[7] >= 1  # node 2's catch-ups (rounds 5 and 8)
