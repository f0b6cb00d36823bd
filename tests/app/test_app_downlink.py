"""The anchored downlink with the repository app's clients (the library's side: tests/library/test_downlink.py)."""

from __future__ import annotations

import pytest
import torch

from ..states import load


# ---------------------------------------------------------------- whole federations
def test_anchored_partial_participation_keeps_every_replica_exact_across_anchors() -> None:
    # Prepare: 10 clients, 5 sampled per round, anchors every 9 rounds, x₀ from seed 0
    from flwr.app import ConfigRecord

    from flower_dlion.protocol import CONFIG
    from flower_dlion.strategies import DistributedLion
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app as client_app

    from .test_federation import LR, RUN_CONFIG, WD, initial_arrays

    # a slow link (1 kbit/s): the clients ask for context-coded Δs, which then save time
    grid = LocalGrid(client_app, 10, run_config={**RUN_CONFIG, "link-mbps": 0.001}, first_node_id=5000)
    strategy = DistributedLion(lr=LR, weight_decay=WD, fraction_train=0.5, sample_seed=7, init_seed=0, anchor_every=9)
    _, arrays = initial_arrays()
    xs: dict[int, torch.Tensor] = {}
    configs = []
    # Execute
    for rnd in range(1, 41):
        msgs = strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 8}), grid)
        xs.setdefault(strategy.version, strategy.x.clone())
        configs += [m.content[CONFIG] for m in msgs]
        strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
    # Assert: every replica holds the server's x of its version, bit for bit, and its anchor
    for node in grid.node_ids:
        state = load(grid.context(node))
        assert state is not None and torch.equal(state.x, xs[state.version]), node
    # nothing but seeds and counts went down: no full model, no mismatch; catch-ups crossed anchors
    assert sum(h["full-syncs"] + h["checksum-mismatches"] for h in strategy.history) == 0
    assert all(c["kind"] in ("counts", "none") for c in configs)
    segmented = [c for c in configs if "segment-end" in c]
    crossed = [c for c in segmented if sum(c["segment-refresh"]) >= 1 and len(c["segment-end"]) > 1]
    assert crossed, "no catch-up crossed an anchor"
    assert any(c["segment-context"] == [1] for c in segmented)  # in-sync clients got context-coded Δs


def test_in_sync_clients_get_the_packed_delta_unless_their_link_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 3 clients in sync for 6 rounds; their link unknown (the default), 10 Gbit/s, 1 kbit/s
    from flower_dlion.clients.link import DecodeCost
    from flower_dlion.protocol import CONFIG
    from flower_dlion.strategies import DistributedLion
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app import client_app as repository_app
    from flower_dlion_app.client_app import app as client_app

    from .test_federation import LR, RUN_CONFIG, WD, run_rounds

    seen = {}
    for link in (0.0, 10_000.0, 0.001):
        monkeypatch.setattr(repository_app.dlion, "_decode_cost", DecodeCost())  # a process that has measured nothing
        monkeypatch.setattr(repository_app.dlion, "_choices", {})
        grid = LocalGrid(client_app, 3, run_config={**RUN_CONFIG, "link-mbps": link})
        strategy = DistributedLion(lr=LR, weight_decay=WD)
        sent, send = [], grid.send_and_receive
        grid.send_and_receive = lambda msgs, *a, sent=sent, send=send, **k: send(sent.extend(msgs) or msgs, *a, **k)
        # Execute
        run_rounds(strategy, grid, 6)
        assert all(h["num-replies"] == 3 and h["checksum-mismatches"] == 0 for h in strategy.history)
        configs = [m.content[CONFIG] for m in sent if CONFIG in m.content]
        in_sync = [c for c in configs if "segment-end" in c]  # rounds 2–6
        seen[link] = [(c.get("segment-levels", [0])[0], c["segment-context"][0]) for c in in_sync]
    # Assert: without a link, each round's Δ as its packed levels, never entropy-coded; on a fast link the
    # clients measured one context-coded Δ (round 4, once two Δs give the context), found its decode
    # slower than its bytes, and went back; on a slow link they keep asking
    assert len(seen[0.0]) == 15 and all(levels in (2, 3) and not context for levels, context in seen[0.0])
    assert sum(context for _, context in seen[10_000.0]) == 3
    assert sum(context for _, context in seen[0.001]) == 9  # rounds 4, 5, 6 of each client


def test_a_corrupted_delta_is_refused_naming_node_and_round_and_the_state_kept() -> None:
    # Prepare: two rounds with both nodes, then node 1000's round-3 Δ (packed trits) gets a byte no trits make
    from flwr.app import ConfigRecord
    from flwr.common.serde import context_to_proto

    from flower_dlion.protocol import CONFIG, SERVER_UPDATE
    from flower_dlion.strategies import DistributedLion
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app as client_app

    from .test_federation import RUN_CONFIG, initial_arrays

    grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, "device": "cpu"})
    strategy = DistributedLion(lr=0.01, init_seed=0)
    _, arrays = initial_arrays()
    for rnd in (1, 2):
        strategy.aggregate_train(
            rnd, grid.send_and_receive(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
        )
    msgs = strategy.configure_train(3, arrays, ConfigRecord(), grid)
    msg = next(m for m in msgs if m.metadata.dst_node_id == 1000)
    arr = msg.content[SERVER_UPDATE]["counts"]
    assert msg.content[CONFIG]["segment-levels"] == [3]
    arr.data = arr.data[:50] + bytes([255]) + arr.data[51:]
    before = context_to_proto(grid.context(1000)).SerializeToString()
    # Execute
    replies = grid.send_and_receive(msgs)
    strategy.aggregate_train(3, replies)
    # Assert: an error reply naming the node, the round and the problem; the state untouched; the round went on
    bad = next(r for r in replies if r.metadata.src_node_id == 1000)
    said = "node 1000, round 3: count segment 1 of 1 fails its checksum (CRC-32 "  # before it is decoded
    assert bad.has_error() and said in bad.error.reason, bad.error.reason
    assert context_to_proto(grid.context(1000)).SerializeToString() == before
    assert strategy.history[-1]["num-replies"] == 1 and strategy.history[-1]["applied"] == 1
    # next round the node rebuilds x₀ from the seed and gets the counts since (no float), and is exact again
    nxt = strategy.configure_train(4, arrays, ConfigRecord(), grid)
    resync = next(m for m in nxt if m.metadata.dst_node_id == 1000).content[CONFIG]
    assert resync["kind"] == "counts" and resync["base-version"] == 0 and resync["init-seed"] == 0
    strategy.aggregate_train(4, grid.send_and_receive(nxt))
    assert strategy.history[-1]["num-replies"] == 2 and strategy.history[-1]["checksum-mismatches"] == 0


def test_options_are_checked_before_round_1() -> None:
    from flower_dlion.strategies import DistributedLion
    from flower_dlion_app.config import read_config

    with pytest.raises(ValueError, match="downlink='anchored' needs integer Δs"):
        DistributedLion(aggregation="mean", downlink="anchored")
    with pytest.raises(ValueError, match="downlink must be 'auto', 'anchored' or 'chain', got 'zip'"):
        DistributedLion(downlink="zip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="anchor_every must be >= 1"):
        DistributedLion(anchor_every=0)
    assert not DistributedLion(aggregation="mean").options.anchored and DistributedLion().options.anchored  # "auto"
    with pytest.raises(ValueError, match="run-config 'anchor-every' must be >= 1, got 0"):
        read_config({"anchor-every": 0})
    with pytest.raises(ValueError, match="run-config downlink='anchored' needs integer Δs"):
        read_config({"strategy": "dlion-mean", "downlink": "anchored"})
    with pytest.raises(ValueError, match="'downlink' must be one of"):
        read_config({"downlink": "lzma"})


@pytest.mark.parametrize("link", [0.001, 0.0])
def test_a_lost_reply_after_a_delta_is_taken_back_off_not_resynced(link: float) -> None:
    # Prepare: 2 clients every round; on a slow link node 1001 holds the two last Δs by round 5, so its round-5
    # Δ is coded with them as context (link unknown: the packed Δ), and its round-5 reply is lost after it
    # applied that Δ
    from flwr.app import ConfigRecord

    from flower_dlion.protocol import CONFIG
    from flower_dlion.strategies import DistributedLion
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app as client_app

    from .test_federation import LR, RUN_CONFIG, WD, initial_arrays

    def hook(node_id, reply):
        return None if node_id == 1001 and reply.metadata.group_id == "5" else reply

    grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, "link-mbps": link}, reply_hook=hook)
    strategy = DistributedLion(lr=LR, weight_decay=WD, init_seed=0)
    _, arrays = initial_arrays()
    sent = {}
    # Execute
    for rnd in range(1, 8):
        msgs = strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 8}), grid)
        sent[rnd] = {m.metadata.dst_node_id: m.content[CONFIG] for m in msgs}
        strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
    # Assert: round 5 sent node 1001 a context-coded Δ (3 → 4); round 6 sent it the counts from version 3 (its
    # last confirmed), which it applied after taking round 5's Δ back off: no error, no resync, and its
    # replica's checksum equal to the server's x in rounds 6 and 7 (else the reply would be rejected)
    if link:
        assert sent[5][1001]["segment-context"] == [1] and sent[5][1001]["base-version"] == 3
    else:
        assert sent[5][1001]["segment-levels"] == [3] and sent[5][1001]["base-version"] == 3
    assert sent[6][1001]["base-version"] == 3 and sent[6][1001]["version"] == 5
    assert [h["num-replies"] for h in strategy.history] == [2, 2, 2, 2, 1, 2, 2]
    assert sum(h["full-syncs"] + h["checksum-mismatches"] + h["num-rejected"] for h in strategy.history) == 0
    state = load(grid.context(1001))
    assert state.version == 6 and state.previous == 5 and state.undo  # ready to take round 7's Δ back off
