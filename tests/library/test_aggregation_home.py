"""One home for the aggregation math (issue 50, item 5): ``lion.aggregate`` defines Δ, the rest calls it.

The packed vote/mean (``codec.aggregate_packed``) is ``lion.aggregate``'s accelerated twin for packed
1-bit sign payloads: equal to it bit for bit (levels, their number, broadcast bytes, ties, Σ|S|), for
either kernel mode. ``server_delta.choose_aggregator`` picks it once for the sign upload with an exact
broadcast (the default) and otherwise sums the uploads (``Upload.total``) and calls the definition;
for sum and ef-sign uploads and quantized broadcasts its Δ is the one the strategy computed before
the move (the old inline code is restated below as the expected value).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from flower_dlion import DistributedLion, codec, lion, quantizers
from flower_dlion.strategies.server_delta import (
    RoundDelta,
    aggregate_replies,
    choose_aggregator,
    packed_delta,
    quantized_delta,
    reference_delta,
)
from flower_dlion.strategies.server_state import ServerState
from flower_dlion.uploads import UPLOADS, Parsed, Shape

from .test_codec import MODES, kernels


def _random_payloads(rng: np.random.Generator, n: int, d: int, bias: float) -> list[bytes]:
    """n packed sign vectors (+1 with probability ``bias``), with random spare bits past d (they count for nothing)."""
    packed = [np.packbits(rng.random(d) < bias, bitorder="big") for _ in range(n)]
    for p in packed:
        p[-1] |= rng.integers(0, 256) & (0xFF >> (d % 8) if d % 8 else 0)
    return [p.tobytes() for p in packed]


def _summed_signs(payloads: list[bytes], d: int) -> torch.Tensor:
    """S = Σᵢ δᵢ of packed sign payloads, unpacked to an n × d array (the slow, obvious way)."""
    n = len(payloads)
    counts = np.stack([np.unpackbits(np.frombuffer(p, np.uint8), count=d) for p in payloads]).sum(axis=0)
    return torch.from_numpy(2 * counts.astype(np.int64) - n)


def _same(got: RoundDelta, expected: RoundDelta) -> None:
    """Bit for bit: the levels as integers (uint8 from the twin, int32 from the definition), all else exactly."""
    assert torch.equal(got.levels.to(torch.int32), expected.levels.to(torch.int32))
    assert got[1:] == expected[1:]


# ---------------------------------------------------------------- the twin against the definition
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["vote", "mean"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 10, 33])
@pytest.mark.parametrize("d", [1, 13, 1001, 70_007])
def test_the_packed_twin_equals_lion_aggregate_of_the_summed_signs(mode: str, how: str, n: int, d: int) -> None:
    # Prepare: payloads from unanimous to all ties (bias), d never a multiple of 8
    rng = np.random.default_rng(1000 * n + d)
    for bias in (0.0, 0.5, rng.random(), 1.0):
        payloads = _random_payloads(rng, n, d, bias)
        s = _summed_signs(payloads, d)
        # Execute
        with kernels(mode):
            twin = codec.aggregate_packed(payloads, d, how)  # type: ignore[arg-type]
        definition = lion.aggregate(s, n, how)  # type: ignore[arg-type]
        # Assert: the same levels and number of levels; the broadcast, ties and Σ|S| of them
        assert twin.num_levels == definition.num_levels
        assert torch.equal(twin.levels.to(torch.int32), definition.levels)
        assert twin.encoded == codec.encode_levels(definition.levels, definition.num_levels).numpy().tobytes()
        assert (twin.ties, twin.sum_abs) == (int((s == 0).sum()), int(s.abs().sum()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["vote", "mean"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_the_one_function_gives_the_same_delta_with_or_without_the_twin(
    mode: str, how: str, steps: int, n: int
) -> None:
    # Prepare: sign uploads of d = 1003 values in two scale blocks
    rng = np.random.default_rng(7 * n + steps)
    shape = Shape(1003, [1000, 3], steps)
    uploads = [Parsed(p) for p in _random_payloads(rng, n, shape.d, 0.5)]
    # Execute: the twin (chosen by default) and the definition on the summed signs
    fast = choose_aggregator(UPLOADS["sign"], how)  # type: ignore[arg-type]
    with kernels(mode):
        got = fast(uploads, shape, ServerState())
    expected = reference_delta(uploads, shape, ServerState(), kind=UPLOADS["sign"], how=how)  # type: ignore[arg-type]
    # Assert: one Δ, K as its scales for K > 1
    _same(got, expected)
    assert got.scales == ((3.0, 3.0) if steps == 3 else None) and got.clipped == 0


def test_the_default_path_is_the_packed_twin_chosen_once() -> None:
    # Assert: sign uploads broadcast exactly take the twin; the other exact ones the definition; b ≥ 1 quantizes
    assert choose_aggregator(UPLOADS["sign"], "vote").func is packed_delta  # type: ignore[attr-defined]
    assert choose_aggregator(UPLOADS["sign"], "mean").func is packed_delta  # type: ignore[attr-defined]
    assert choose_aggregator(UPLOADS["sum"], "vote").func is reference_delta  # type: ignore[attr-defined]
    assert choose_aggregator(UPLOADS["ef-sign"], "vote").func is reference_delta  # type: ignore[attr-defined]
    assert choose_aggregator(UPLOADS["sign"], "vote", broadcast_bits=1).func is quantized_delta  # type: ignore[attr-defined]
    # Assert: the strategy's choice, made once (the same object every round)
    strategy = DistributedLion()
    assert strategy.up.aggregate_replies.func is packed_delta  # type: ignore[attr-defined]
    assert strategy.up.aggregate_replies is strategy.up.aggregate_replies
    summed = DistributedLion(upload="sum", local_steps=2)
    assert summed.up.aggregate_replies.func is reference_delta  # type: ignore[attr-defined]


# ---------------------------------------------------------------- sum and ef-sign: the same as before the move
def _uploads(name: str, n: int, shape: Shape, seed: int) -> list[Parsed]:
    """n clients' random U ∈ [−K, K] encoded and parsed as the strategy parses replies."""
    kind, gen = UPLOADS[name], torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u = torch.randint(-shape.steps, shape.steps + 1, (shape.d,), generator=gen).float()
        u += torch.rand(shape.d, generator=gen) - 0.5  # non-integer U for ef-sign's scales
        u = u.clamp_(-shape.steps, shape.steps).round_() if name != "ef-sign" else u
        arrays, _ = kind.encode(u, None, shape, torch.Generator().manual_seed(seed), [])
        floats = {a: torch.from_numpy(v.numpy().copy()) for a, v in arrays.items() if v.dtype == "float32"}
        out.append(kind.parse(arrays[kind.main].data, floats, shape))
    return out


def _before(name: str, how: str, bits: int, momentum: float, uploads: list[Parsed], shape: Shape, state: Any) -> tuple:
    """The strategy's ``_aggregate`` / ``_vote_sum`` / ``_update`` before the move, restated (non-packed paths)."""
    kind, k, n = UPLOADS[name], shape.steps, len(uploads)
    votes, clipped = kind.total(uploads, shape)
    if bits == 0:
        if votes.dtype.is_floating_point:
            levels = lion.Levels((torch.sign(votes) + 1).to(torch.int32), 3)
        else:
            levels = lion.aggregate(votes, n, how, k=k)  # type: ignore[arg-type]
        scales = (float(k),) * len(shape.sizes) if k > 1 else None
    else:
        if how == "vote":
            target = torch.sign(votes).float() * k
        elif name == "sign":
            target = votes.float() * (k / n)
        else:
            target = votes.float() / n
        if momentum:
            if state.outer_momentum is None:
                state.outer_momentum = torch.zeros_like(target)
            m = state.outer_momentum.mul_(momentum).add_(target)
            target = target.add_(m, alpha=momentum)
        if state.server_error is None:
            state.server_error = torch.zeros_like(target)
        num_levels = 2 if bits == 1 else 2**bits - 1
        q, s = quantizers.ef_quantize_(target, state.server_error, shape.sizes, num_levels)
        levels, scales = lion.Levels(q, num_levels), tuple(float(v) for v in s)
    ties = int(torch.count_nonzero(votes == 0))
    sum_abs = 0 if votes.dtype.is_floating_point else int(votes.abs_().numpy().sum(dtype=np.int64))
    encoded = codec.encode_levels(levels.levels, levels.num_levels).numpy().tobytes()
    return levels.levels, levels.num_levels, encoded, ties, sum_abs, scales, clipped


CASES = [  # upload, aggregation, broadcast_bits, server_momentum, K
    ("sum", "vote", 0, 0.0, 2),
    ("sum", "mean", 0, 0.0, 3),
    ("sum", "mean", 0, 0.0, 1),
    ("ef-sign", "vote", 0, 0.0, 1),
    ("ef-sign", "vote", 0, 0.0, 3),
    ("sum", "mean", 2, 0.0, 2),
    ("ef-sign", "mean", 1, 0.0, 3),
    ("ef-sign", "vote", 3, 0.9, 2),
    ("sign", "mean", 1, 0.5, 3),
    ("sign", "vote", 2, 0.0, 1),
]


@pytest.mark.parametrize(("name", "how", "bits", "momentum", "steps"), CASES)
def test_the_one_function_gives_the_delta_of_before_for_sum_and_ef_sign(
    name: str, how: str, bits: int, momentum: float, steps: int
) -> None:
    # Prepare: 5 clients, d = 301 values in three tensors; three rounds (error feedback and momentum carry over)
    shape = Shape(301, [200, 100, 1], steps)
    state_now, state_before = ServerState(), ServerState()
    aggregator = choose_aggregator(UPLOADS[name], how, bits, momentum)  # type: ignore[arg-type]
    for round_ in range(3):
        uploads = _uploads(name, 5, shape, seed=round_)
        # Execute
        got = aggregator(uploads, shape, state_now)
        expected = _before(name, how, bits, momentum, _uploads(name, 5, shape, seed=round_), shape, state_before)
        # Assert: the same Δ bit for bit, and the same state carried to the next round
        assert torch.equal(got.levels, expected[0]) and got.levels.dtype == expected[0].dtype
        assert tuple(got[1:7]) == expected[1:]
        assert (got.limits is not None) == (name == "ef-sign" and bits > 0)  # drift correction's: test_drift.py
        for a, b in (
            (state_now.server_error, state_before.server_error),
            (state_now.outer_momentum, state_before.outer_momentum),
        ):
            assert (a is None and b is None) or torch.equal(a, b)  # type: ignore[arg-type]


def test_aggregate_replies_is_choose_then_call() -> None:
    # Prepare
    shape = Shape(50, [50], 2)
    uploads = _uploads("sum", 3, shape, seed=4)
    # Execute
    got = aggregate_replies(uploads, shape, UPLOADS["sum"], "mean")
    # Assert: the definition of the summed uploads; a quantized broadcast needs the server's state
    total, _ = UPLOADS["sum"].total(uploads, shape)
    assert torch.equal(got.levels, lion.aggregate(total, 3, "mean", k=2).levels) and got.num_levels == 13
    with pytest.raises(ValueError, match="needs the server's state"):
        aggregate_replies(uploads, shape, UPLOADS["sum"], "mean", broadcast_bits=1)
    with pytest.raises(ValueError, match="vote only"):
        aggregate_replies(_uploads("ef-sign", 2, shape, seed=1), shape, UPLOADS["ef-sign"], "mean")


def test_weighted_vote_takes_the_sign_of_a_float_sum_never_rounded() -> None:
    # Assert: 0.3 is a vote for +1 (lion.aggregate would read it as 0, a tie); exact 0 is a tie; always 3 levels
    got = lion.weighted_vote(torch.tensor([0.3, -0.2, 0.0, 5.0]))
    assert got.levels.tolist() == [2, 0, 1, 2] and got.num_levels == 3 and got.levels.dtype == torch.int32
