"""Integrity on every path: a flipped byte in any form of Δ, or a replica gone wrong, is never kept.

Every train message carries the CRC-32 of each part of its payload (``payload-crc``) and of the
server's x (``x-checksum``); the node checks both before it keeps, trains on or answers with
anything (:mod:`flower_dlion.clients.integrity`). The fault-injection matrix below flips one
byte in each wire form × each downlink × each init mode on a real federation (``LocalGrid``,
every message serialized): the node refuses the message naming itself and the round, keeps its
state as it was, and holds the server's x again after the next message it gets.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message
from flwr.common.serde import context_to_proto

from flower_dlion.clients.state import crc32
from flower_dlion.lion import anchored
from flower_dlion.protocol import CONFIG, SERVER_UPDATE
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app

from ..states import load, save_state
from .test_federation import LR, RUN_CONFIG, WD, initial_arrays

IN_SYNC, RESYNCED, BEHIND = 1000, 1001, 1002  # in round 3: one Δ; the full model or x₀'s seed; two rounds' Δs
TRAIN_CONFIG = ConfigRecord({"batch-size": 16, "seed": 0})
Tamper = Callable[[Message], None]


def _flip(record: str) -> Tamper:
    """Flip the lowest bit of the middle byte of the message's ``record`` payload."""

    def tamper(msg: Message) -> None:
        arr = msg.content[SERVER_UPDATE][record]
        data = bytearray(arr.data)
        data[len(data) // 2] ^= 1
        arr.data = bytes(data)

    return tamper


def _config(key: str, change: Callable[[float], float]) -> Tamper:
    def tamper(msg: Message) -> None:
        msg.content[CONFIG][key] = [change(v) for v in msg.content[CONFIG][key]]

    return tamper


class Federation:
    """Three nodes and a strategy; the server's x of every version, to compare the replicas with."""

    def __init__(self, downlink: str, init: str) -> None:
        self.grid = LocalGrid(client_app, 3, run_config=RUN_CONFIG)
        init_seed = 0 if init == "seed" else None
        self.strategy = DistributedLion(lr=LR, weight_decay=WD, downlink=downlink, init_seed=init_seed)
        self.arrays = initial_arrays()[1]
        self.xs: dict[int, torch.Tensor] = {}

    def round(
        self, rnd: int, tamper: dict[int, Tamper] | None = None, withhold: tuple[int, ...] = (), checked: bool = True
    ) -> tuple[dict[int, Message], dict[int, Message]]:
        """One round: the messages (tampered with), the replies; ``checked=False``: a client that checks no x."""
        msgs = self.strategy.configure_train(rnd, self.arrays, TRAIN_CONFIG, self.grid)
        self.xs[self.strategy.version] = self.strategy.x.clone()
        sent = {m.metadata.dst_node_id: m for m in msgs}
        for node, change in (tamper or {}).items():
            change(sent[node])
        if not checked:
            for m in msgs:
                m.content[CONFIG].pop("x-checksum")
        replies = self.grid.send_and_receive([m for n, m in sent.items() if n not in withhold])
        self.strategy.aggregate_train(rnd, replies)
        self.xs[self.strategy.version] = self.strategy.x.clone()
        return sent, {r.metadata.src_node_id: r for r in replies}

    def start(self, checked: bool = True) -> None:
        """Rounds 1–2 (node 1002 misses round 2), and the server forgets node 1001's replica before round 3."""
        self.round(1, checked=checked)
        self.round(2, withhold=(BEHIND,), checked=checked)
        self.strategy.state.version_of.pop(self.strategy.partition_of(RESYNCED))

    def state(self, node: int) -> bytes:
        return context_to_proto(self.grid.context(node)).SerializeToString()

    def assert_replicas_exact(self) -> None:
        """Every node's stored replica is the server's x of its version, bit for bit."""
        for node in self.grid.node_ids:
            view = load(self.grid.context(node))
            assert view is not None and torch.equal(view.x, self.xs[view.version]), node


# what each node is sent in round 3, by downlink and init: (node, the form, a tamper of it)
FORMS: dict[tuple[str, str], list[tuple[int, str, Tamper]]] = {
    ("chain", "full"): [
        (IN_SYNC, "chain: one packed Δ", _flip("payload")),
        (IN_SYNC, "chain: a Δ's rate", _config("lr", lambda v: 2 * v)),
        (BEHIND, "chain: two packed Δs", _flip("payload")),
        (RESYNCED, "the full model (float32)", _flip("payload")),
    ],
    ("chain", "seed"): [
        (IN_SYNC, "chain: one packed Δ", _flip("payload")),
        (BEHIND, "chain: two packed Δs", _flip("payload")),
        (RESYNCED, "x₀'s seed and the Δs since", _flip("payload")),
    ],
    ("anchored", "full"): [
        (IN_SYNC, "anchored: one Δ's packed levels", _flip("counts")),
        (IN_SYNC, "anchored: a segment's decay", _config("segment-decay", lambda v: 1e-30)),
        (BEHIND, "anchored: entropy-coded counts", _flip("counts")),
        (RESYNCED, "anchored: the anchor (float32)", _flip("payload")),
    ],
    ("anchored", "seed"): [
        (IN_SYNC, "anchored: one Δ's packed levels", _flip("counts")),
        (BEHIND, "anchored: entropy-coded counts", _flip("counts")),
        (RESYNCED, "anchored: x₀'s seed and the counts since", _flip("counts")),
    ],
}
MATRIX = [(down, init, node, form, tamper) for (down, init), cells in FORMS.items() for node, form, tamper in cells]


@pytest.mark.parametrize(
    ("downlink", "init", "node", "form", "tamper"), MATRIX, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in MATRIX]
)
def test_a_flipped_byte_in_any_form_of_delta_is_refused_and_resynced_next_round(
    downlink: str, init: str, node: int, form: str, tamper: Tamper
) -> None:
    # Prepare: 2 rounds; in round 3 each node gets another form of Δ; the target's is tampered with
    fed = Federation(downlink, init)
    fed.start()
    before = fed.state(node)
    # Execute
    sent, replies = fed.round(3, tamper={node: tamper})
    refused = replies[node]
    after_round_3 = fed.state(node)
    sent_4, replies_4 = fed.round(4)
    # Assert: round 3's message was the form named (the matrix covers what it says)
    cfg = sent[node].content[CONFIG]
    kinds = {"chain": {IN_SYNC: "deltas", BEHIND: "deltas"}, "anchored": {IN_SYNC: "counts", BEHIND: "counts"}}
    resync_kind = "full" if init == "full" else {"chain": "deltas", "anchored": "counts"}[downlink]
    assert cfg["kind"] == kinds[downlink].get(node, resync_kind)
    assert ("init-seed" in cfg) == (node == RESYNCED and init == "seed")
    # the node refused it by name, before keeping anything; the others' round went on
    assert refused.has_error(), form
    assert f"node {node}, round 3: " in refused.error.reason and "(a resync request)" in refused.error.reason
    assert after_round_3 == before
    assert fed.strategy.history[2]["num-replies"] == 2
    # the next message resyncs it (the full model, or x₀'s seed and what followed), and every replica is exact
    cfg_4 = sent_4[node].content[CONFIG]
    assert cfg_4["kind"] == "full" or cfg_4.get("init-seed") == 0
    assert all(not r.has_error() for r in replies_4.values()) and len(replies_4) == 3
    assert fed.strategy.history[3]["checksum-mismatches"] == 0
    fed.assert_replicas_exact()


def test_the_matrix_covers_every_wire_form_in_every_downlink_and_init_mode() -> None:
    # Assert: 2 downlinks × 2 inits; in each, the in-sync Δ, a catch-up and the resync's form, and two config values
    assert len(MATRIX) == 14
    assert {(d, i) for d, i, *_ in MATRIX} == {(d, i) for d in ("chain", "anchored") for i in ("full", "seed")}


def _corrupt_replica(fed: Federation, node: int) -> None:
    """Change one value of the node's stored replica, with checksums that fit it (its own check on loading passes)."""
    ctx = fed.grid.context(node)
    host = load(ctx).host
    if host.anchor is not None:  # the anchored downlink computes x from its anchor and counts
        host.anchor[0] += 1e-3
        host.anchor_checksum = crc32(host.anchor)
        counts = torch.from_numpy(host.counts.astype(np.int32))
        host.x = anchored(torch.from_numpy(host.anchor), counts, host.decay, host.step).numpy()
    else:
        host.x = host.x.copy()
        host.x[0] += 1e-3
    host.checksum = crc32(host.x)
    save_state(ctx, host)
    fed.grid.set_context(node, ctx)


@pytest.mark.parametrize("checked", [True, False], ids=["the client finds it", "the server finds it"])
@pytest.mark.parametrize("init", ["full", "seed"])
@pytest.mark.parametrize("downlink", ["chain", "anchored"])
def test_a_replica_gone_wrong_is_resynced_by_the_next_message_in_every_downlink_and_init(
    downlink: str, init: str, checked: bool
) -> None:
    # Prepare: 2 rounds, then node 1001's stored replica is wrong (its checksums fit it)
    fed = Federation(downlink, init)
    fed.round(1, checked=checked)
    fed.round(2, checked=checked)
    _corrupt_replica(fed, RESYNCED)
    # Execute: round 3 finds it (the node, from the server's x-checksum; or the server, from the reply's); round 4
    _, replies = fed.round(3, checked=checked)
    sent_4, _ = fed.round(4, checked=checked)
    # Assert: found in round 3
    if checked:
        reason = replies[RESYNCED].error.reason
        assert f"node {RESYNCED}, round 3: its replica at version 2 has checksum " in reason
        assert fed.strategy.history[2]["checksum-mismatches"] == 0
    else:
        assert not replies[RESYNCED].has_error()
        assert fed.strategy.history[2]["checksum-mismatches"] == 1
    assert fed.strategy.history[2]["num-replies"] == 2
    # resynced by the next message it gets: the full model, or x₀'s seed and what followed, never its wrong copy
    cfg = sent_4[RESYNCED].content[CONFIG]
    assert cfg["kind"] == "full" if init == "full" else cfg["init-seed"] == 0
    assert fed.strategy.history[3]["num-replies"] == 3 and fed.strategy.history[3]["checksum-mismatches"] == 0
    fed.assert_replicas_exact()
