"""The anchored downlink (issue 38): counts, anchors, coded catch-ups, bounded history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flower_dlion import codec, entropy
from flower_dlion.anchored_counts import AnchoredForm, AnchoredHistory, apply_segments, context_of, levels_to_signs
from flower_dlion.lion import anchored

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
