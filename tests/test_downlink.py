"""The anchored downlink (issue 38): counts, anchors, coded catch-ups, bounded history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flower_dlion import codec, entropy
from flower_dlion.anchored_counts import AnchoredForm, AnchoredHistory, apply_segments, context_of, levels_to_signs
from flower_dlion.lion import anchored

from .states import load

D = 3000
SIZES = [1000, 1500, 500]
ENDS = entropy.blocks_of(SIZES)
LR, WD = 0.01, 0.5


def _history(anchor_every: int = 1000, max_bytes: int = 1 << 30) -> AnchoredHistory:
    x0 = torch.linspace(-1, 1, D)
    return AnchoredHistory(x0.clone(), 1 - LR * WD, LR, anchor_every, ENDS, max_bytes)


def _round(history: AnchoredHistory, t: int) -> torch.Tensor:
    """One round of a vote with ties: random levels in {0, 1, 2}, packed as the strategy packs them."""
    g = torch.Generator().manual_seed(t)
    levels = torch.randint(0, 3, (D,), generator=g, dtype=torch.int32)
    packed = codec.encode_levels(levels, 3).numpy().tobytes()
    return history.apply_levels(levels, 3, packed)


def _replica(history: AnchoredHistory) -> AnchoredForm:
    return AnchoredForm(history.anchor.clone(), history.epoch.start, history.counts.clone(), history.version)


def test_anchored_is_three_rounded_float32_operations() -> None:
    # Prepare: values whose products round
    anchor = torch.tensor([1.0, -3.0, 0.1], dtype=torch.float32)
    counts = torch.tensor([2, -5, 0], dtype=torch.int32)
    # Execute
    x = anchored(anchor, counts, 0.9, 0.01)
    # Assert: γ·xₐ and η·C each rounded to float32, then their difference rounded
    f = np.float32
    expected = np.array(
        [f(f(1.0) * f(0.9)) - f(f(2) * f(0.01)), f(f(-3.0) * f(0.9)) - f(f(-5) * f(0.01)), f(f(0.1) * f(0.9))]
    )
    assert x.numpy().tobytes() == expected.astype(np.float32).tobytes()


def test_levels_to_signs_and_context_by_hand() -> None:
    assert levels_to_signs(torch.tensor([0, 1]), 2).tolist() == [-1, 1]
    assert levels_to_signs(torch.tensor([0, 1, 2]), 3).tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="2 or 3 levels"):
        levels_to_signs(torch.tensor([0]), 5)
    # context = 3·(L + 1) + previous // 3: previous 7 = (Δ=+1, Δ'=0) → its Δ (+1 → 2) moves to the low digit
    assert context_of(np.array([-1, 0, 1]), np.array([7, 0, 4], np.uint8)).tolist() == [2, 3, 7]


def test_x_is_the_anchored_form_of_the_counts() -> None:
    # Prepare / Execute: 5 rounds
    h = _history()
    signs = []
    for t in range(5):
        x = _round(h, t)
        g = torch.Generator().manual_seed(t)
        signs.append(torch.randint(0, 3, (D,), generator=g, dtype=torch.int32) - 1)
    # Assert: x = γ₁⁵·x₀ − η·ΣL, and the counts are the sum
    total = torch.stack(signs).sum(0)
    assert torch.equal(h.counts, total.to(torch.int32))
    assert torch.equal(x, anchored(torch.linspace(-1, 1, D), total, (1 - LR * WD) ** 5, LR))


@pytest.mark.parametrize("gap", [1, 10, 100])
def test_a_replica_k_rounds_behind_is_bit_identical_after_the_catch_up(gap: int) -> None:
    # Prepare: a replica at version 20, the server 'gap' rounds on
    h = _history()
    for t in range(20):
        _round(h, t)
    replica = _replica(h)
    for t in range(20, 20 + gap):
        x = _round(h, t)
    # Execute
    segments = h.segments(20)
    caught, got = apply_segments(replica, segments, ENDS, limit=1000)
    # Assert: one segment, the same bits as the server's x, and the replica at the new version
    assert len(segments) == 1 and caught.version == 20 + gap
    assert got.numpy().tobytes() == x.numpy().tobytes()
    assert torch.equal(caught.counts, h.counts)


def test_catch_up_across_anchors_is_bit_identical() -> None:
    # Prepare: anchors every 7 rounds; a replica at version 3 and one from x₀ (a seeded new node)
    h = _history(anchor_every=7)
    for t in range(3):
        _round(h, t)
    at3 = _replica(h)
    fresh = AnchoredForm(torch.linspace(-1, 1, D), 0, torch.zeros(D, dtype=torch.int32), 0)
    for t in range(3, 23):
        x = _round(h, t)
    # Execute
    for replica, have in ((at3, 3), (fresh, 0)):
        segments = h.segments(have)
        caught, got = apply_segments(replica, segments, ENDS, limit=7)
        # Assert: anchors at 7, 14, 21 crossed; x and the new anchor as the server's
        assert [(s.end, s.refresh) for s in segments] == [(7, True), (14, True), (21, True), (23, False)]
        assert got.numpy().tobytes() == x.numpy().tobytes()
        assert caught.anchor_version == 21 and torch.equal(caught.anchor, h.anchor)


def test_a_single_round_is_coded_with_the_two_last_deltas_as_context() -> None:
    # Prepare: a replica that received rounds 1..10 one at a time
    h = _history()
    replica = _replica(h)
    for t in range(10):
        _round(h, t)
        replica, _ = apply_segments(replica, h.segments(replica.version, context=replica.depth == 2), ENDS, 1000)
    # Execute
    _round(h, 10)
    segments = h.segments(10, context=True)
    caught, got = apply_segments(replica, segments, ENDS, 1000)
    # Assert: coded with context, decoded to the server's x; the replica's context is the server's
    assert segments[0].context and replica.depth == 2
    assert got.numpy().tobytes() == h.x().numpy().tobytes()
    assert np.array_equal(caught.recent, h.context)
    # a replica without the context refuses a Δ coded with it, and is left as it was
    stale = AnchoredForm(replica.anchor, 0, replica.counts, 10)
    with pytest.raises(ValueError, match="does not hold"):
        apply_segments(stale, segments, ENDS, 1000)


def test_history_is_bounded_and_old_versions_fall_back() -> None:
    # Prepare: room for about 40 packed Δs (600 B each) and no counts snapshot
    h = _history(max_bytes=40 * codec.encoded_size(D, 3))
    for t in range(100):
        _round(h, t)
    # Assert: memory within the bound; a recent version is served, an old one is not (full or seed instead)
    assert h.memory() <= 40 * codec.encoded_size(D, 3)
    assert h.segments(95) is not None and h.segments(10) is None
    assert h.segments(0) is not None  # the anchor's version needs no history


def test_a_corrupted_or_truncated_catch_up_is_refused_and_the_replica_kept() -> None:
    h = _history()
    replica = _replica(h)
    for t in range(5):
        _round(h, t)
    segment = h.segments(0)[0]
    for bad in (segment.payload[:-3], segment.payload[:40] + bytes([segment.payload[40] ^ 1]) + segment.payload[41:]):
        broken = [type(segment)(segment.end, segment.decay, segment.step, False, False, bad)]
        with pytest.raises(entropy.CodingError, match=r"CRC-32|not a coded"):
            apply_segments(replica, broken, ENDS, 1000)
    assert replica.version == 0 and int(replica.counts.abs().sum()) == 0


def test_counts_beyond_the_epoch_are_refused() -> None:
    h = _history()
    replica = _replica(h)
    for t in range(5):
        _round(h, t)
    with pytest.raises(ValueError, match="more than 2 rounds"):
        apply_segments(replica, h.segments(0), ENDS, limit=2)


def test_checkpoint_round_trip_serves_the_same_bytes() -> None:
    # Prepare
    h = _history(anchor_every=6)
    for t in range(15):
        _round(h, t)
    # Execute
    again = AnchoredHistory.from_dict(h.to_dict())
    # Assert: the same catch-ups, byte for byte, and the same next x
    for have in (0, 4, 13, 14):
        assert [s.payload for s in again.segments(have)] == [s.payload for s in h.segments(have)]
    assert _round(again, 15).numpy().tobytes() == _round(h, 15).numpy().tobytes()


@pytest.mark.parametrize("with_context", [False, True])
def test_entropy_round_trip_by_hand(with_context: bool) -> None:
    # Prepare: two blocks of 70 000 values; 3 symbols in one, a constant in the other
    values = np.concatenate([np.tile([-1, 0, 1, 1], 17_500), np.full(70_000, 5)]).astype(np.int32)
    ends = entropy.blocks_of([70_000, 70_000])
    context = (np.arange(values.size) % 3).astype(np.uint8) if with_context else None
    # Execute
    coded = entropy.encode(values, ends, context, 3)
    # Assert: exact round trip; well under 2 bits a value (the constant block costs its header only)
    assert np.array_equal(entropy.decode(coded, values.size, ends, context, 3), values)
    assert len(coded) < 70_000 * 2 / 8
    with pytest.raises(entropy.CodingError, match="expected d="):
        entropy.decode(coded, values.size - 1, entropy.blocks_of([70_000, 69_999]), context, 3)


def test_blocks_merge_small_tensors() -> None:
    assert entropy.blocks_of([10, 20]) == [30]
    assert entropy.blocks_of([70_000, 10, 70_000, 5]) == [70_000, 140_015]
    assert entropy.blocks_of([5, 1 << 16]) == [65_541]


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


def test_a_node_behind_the_kept_history_rebuilds_x0_from_the_seed_and_history_stays_bounded() -> None:
    # Prepare: room for 5 packed Δs of d = 10; nodes 1, 2 train every round, node 3 in rounds 1 and 2
    from flwr.app import ArrayRecord, ConfigRecord

    from flower_dlion.protocol import CONFIG
    from flower_dlion.strategies import DistributedLion

    from .test_strategy import SIGNS, X0, StubGrid, first_round, signs_reply

    strategy = DistributedLion(lr=0.01, init_seed=3, max_history_bytes=10)
    sent = first_round(strategy, [1, 2, 3])
    x = torch.from_numpy(X0.copy())
    strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[n - 1], x) for n in (1, 2, 3)])
    for rnd in range(2, 30):
        x = strategy.x.clone()
        msgs = strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3] if rnd == 2 else [1, 2]))
        strategy.aggregate_train(rnd, [signs_reply(m, SIGNS[i], x) for i, m in enumerate(msgs)])
    assert strategy.state.version_of[3] == 1
    # Execute
    msgs = {
        m.metadata.dst_node_id: m
        for m in strategy.configure_train(30, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    }
    # Assert: node 3's version (1) is no longer kept: x₀ from the seed and the counts since 0, not the model
    cfg = msgs[3].content[CONFIG]
    assert cfg["kind"] == "counts" and cfg["base-version"] == 0 and cfg["init-seed"] == 3
    assert msgs[1].content[CONFIG]["base-version"] == 28  # the others, one round behind
    history = strategy.state.anchored
    assert history.memory() <= 10 and history.counts_at(1) is None


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
