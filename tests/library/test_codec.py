"""Bit codec: exact round trips, exact sizes, numpy-compatible layout; numpy and the kernels alike."""

import functools
import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flower_dlion
from flower_dlion import accel, codec, lion
from flower_dlion.accel import probes, threads

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# every CPU path of pack and count runs twice: numpy ("off") and the fused kernels at any size ("on")
MODES = ["off", pytest.param("on", marks=pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed"))]


@contextmanager
def kernels(mode: str) -> Iterator[None]:
    """Run the codec with FLOWER_DLION_KERNELS=mode (hypothesis tests cannot use monkeypatch)."""
    old = os.environ.get(accel.KERNELS_ENV)
    os.environ[accel.KERNELS_ENV] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ[accel.KERNELS_ENV]
        else:
            os.environ[accel.KERNELS_ENV] = old


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=200, deadline=None)
@given(d=st.integers(1, 100_000), seed=st.integers(0, 2**31 - 1))
def test_sign_round_trip_any_length(mode: str, d: int, seed: int) -> None:
    # Prepare
    signs = torch.where(torch.rand(d, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    # Execute
    with kernels(mode):
        packed = codec.pack_signs(signs)
    # Assert
    assert packed.dtype == torch.uint8
    assert packed.numel() == (d + 7) // 8
    assert torch.equal(codec.unpack_signs(packed, d), signs)
    assert torch.equal(codec.unpack_signs(packed.numpy().tobytes(), d), signs)


@given(d=st.integers(1, 4096))
def test_layout_matches_numpy_packbits(d: int) -> None:
    bits = torch.rand(d, generator=torch.Generator().manual_seed(d)) < 0.5
    assert np.array_equal(codec.pack_bits(bits).numpy(), np.packbits(bits.numpy(), bitorder="big"))


@pytest.mark.parametrize("mode", MODES)
def test_pack_bits_hand_computed(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # +1 −1 −1 −1 −1 −1 −1 +1 | +1 +1 (padding zeros)
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    v = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, 1, 1])
    assert codec.pack_signs(v).tolist() == [0b1000_0001, 0b1100_0000]


@pytest.mark.parametrize("mode", MODES)
def test_threaded_pack_returns_only_when_every_chunk_is_written(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: zeros in the first chunk (the first worker reports them first), 2·10⁶ values
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    v = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    v[:100] = 0.0
    expected = np.packbits((v > 0).numpy(), bitorder="big")[13:]  # bytes past the zeros
    for _ in range(20):
        # Execute
        packed = codec.pack_signs(v, torch.Generator().manual_seed(0)).numpy()
        # Assert: every byte past the zeros is exactly the sign bits (a returned-too-early buffer is not)
        assert np.array_equal(packed[13:], expected)


@pytest.mark.parametrize("mode", MODES)
def test_zeros_are_coin_flips_not_one_side(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    zeros = torch.zeros(80_000)
    bits = codec.unpack_bits(codec.pack_signs(zeros, torch.Generator().manual_seed(0)), zeros.numel())
    assert 0.49 < bits.float().mean().item() < 0.51  # unbiased, not all one way
    again = codec.unpack_bits(codec.pack_signs(zeros, torch.Generator().manual_seed(0)), zeros.numel())
    assert torch.equal(bits, again)  # reproducible with the same generator
    nonzero = torch.tensor([-2.0, 0.5, -0.1, 3.0])  # no zeros: the generator is never used
    assert codec.unpack_signs(codec.pack_signs(nonzero), 4).tolist() == [-1.0, 1.0, -1.0, 1.0]


def _expected_cpu_pack(v: torch.Tensor, seed: int) -> np.ndarray:
    """The CPU pack by hand: the bits of v > 0, and the zeros' coins from a generator seeded with ``seed``.

    The j-th group of 64 values that holds a zero (ascending) takes the j-th uniform 64-bit word w drawn;
    the zero at value 64k + i takes the bit of w's little-endian bytes where the pack puts value i: bit
    7 − i mod 8 of byte ⌊i/8⌋, that is bit 8·⌊i/8⌋ + 7 − i mod 8 of w.
    """
    where = np.flatnonzero(v.numpy() == 0)
    groups = np.unique(where // 64).tolist()
    gen = torch.Generator().manual_seed(seed)
    drawn = torch.empty(len(groups), dtype=torch.int64).random_(-(2**63), None, generator=gen).tolist()
    word = {k: w % 2**64 for k, w in zip(groups, drawn, strict=True)}
    bits = (v > 0).numpy()
    bits[where] = [(word[i // 64] >> (8 * (i % 64 // 8) + 7 - i % 8)) & 1 for i in where.tolist()]
    return np.packbits(bits)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("every", [2, 3, 31, 64, 1000, 5003])  # dense and sparse; 5003: 0 and 10,006 only
def test_zeros_take_their_bits_of_their_groups_64_bit_word(mode: str, every: int) -> None:
    # Prepare: 10,007 alternating signs (a partial last group of 23) with an exact zero at every `every`-th
    # value, and −0 last (in the partial group)
    d = 10_007
    v = torch.where(torch.arange(d) % 2 == 0, 1.5, -1.5)
    v[::every] = 0.0
    v[d - 1] = -0.0
    # Execute
    with kernels(mode):
        packed = codec.pack_signs(v, torch.Generator().manual_seed(5))
    # Assert
    assert np.array_equal(packed.numpy(), _expected_cpu_pack(v, 5))


@pytest.mark.parametrize("mode", MODES)
def test_zero_masks_from_every_thread_and_chunk(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 3·2²⁰ + 13 values on two threads (several numpy chunks; kernel parts on the team from the
    # fourth call on), zeros scattered over all of them, half of one 64-value group and its neighbours zero
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(3)
    d = 3 * 2**20 + 13
    v = torch.randn(d, generator=gen)
    v[torch.randint(0, d, (500,), generator=gen)] = 0.0
    v[2**20 - 40 : 2**20 + 90 : 2] = -0.0
    v[d - 5 :] = 0.0
    expected = _expected_cpu_pack(v, 9)
    for _ in range(5):
        # Execute
        packed = codec.pack_signs(v, torch.Generator().manual_seed(9))
        # Assert: every call, on whichever threads, the same bytes as by hand
        assert np.array_equal(packed.numpy(), expected)


def test_unpack_rejects_wrong_length() -> None:
    with pytest.raises(ValueError, match="expected 2 packed bytes for 9 bits, got 3"):
        codec.unpack_bits(bytes(3), 9)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=150, deadline=None)
@given(
    d=st.integers(1, 20_000),
    num_levels=st.integers(2, 70) | st.sampled_from([255, 256, 257, 1000]),  # byte-wide CPU path and beyond
    seed=st.integers(0, 1000),
)
def test_levels_round_trip_and_size(mode: str, d: int, num_levels: int, seed: int) -> None:
    k = torch.randint(0, num_levels, (d,), generator=torch.Generator().manual_seed(seed))
    with kernels(mode):
        encoded = codec.encode_levels(k, num_levels)
        wide = codec.decode_levels(encoded.numpy().tobytes(), num_levels, d)
        narrow = codec.decode_levels(encoded, num_levels, d, torch.uint8) if num_levels <= 256 else None
    assert encoded.numel() == codec.encoded_size(d, num_levels)
    assert wide.dtype == torch.int32 and torch.equal(wide, k.to(torch.int32))
    if narrow is not None:  # the same levels as bytes
        assert narrow.dtype == torch.uint8 and torch.equal(narrow.to(torch.int64), k)
    fmt, b = codec.level_format(num_levels)
    if fmt.startswith("planes"):  # the wire format itself: plane j = bit j of every level, packbits order
        planes = [np.packbits((k.numpy() >> j) & 1, bitorder="big") for j in range(b)]
        np.testing.assert_array_equal(encoded.numpy(), np.concatenate(planes))


@pytest.mark.parametrize(
    ("num_levels", "d", "size"),
    [(2, 10, 2), (3, 10, 2), (3, 11, 3), (3, 100_000, 20_000), (5, 10, 6), (11, 16, 8), (11, 17, 12)],
)
def test_encoded_sizes(num_levels: int, d: int, size: int) -> None:
    # 2 levels: 1 bit; 3 levels: 5 per byte (1.6 bits); L > 3: ⌈log2 L⌉ bit planes of ⌈d/8⌉ bytes
    assert codec.encoded_size(d, num_levels) == size


def test_mean_bits_per_value_is_ceil_log2_n_plus_1() -> None:
    d = 80_000
    for n in (1, 2, 3, 4, 7, 8, 10, 16, 31, 32):
        bits = 8 * codec.encoded_size(d, n + 1) / d
        expected = 1.6 if n == 2 else np.ceil(np.log2(n + 1))
        assert bits == pytest.approx(expected)


@pytest.mark.parametrize("mode", MODES)
def test_trit5_hand_computed(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # levels 2,0,1,1,2 → 2 + 0·3 + 1·9 + 1·27 + 2·81 = 200; 242 = 22222₃; 13 = 111₃ (levels 1,1,1,0,0)
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    assert codec.encode_levels(torch.tensor([2, 0, 1, 1, 2]), 3).tolist() == [200]
    assert codec.decode_levels(bytes([200, 242, 13]), 3, 13).tolist() == [2, 0, 1, 1, 2] + [2] * 5 + [1, 1, 1]
    with pytest.raises(ValueError, match="above 242"):
        codec.decode_levels(bytes([0, 250]), 3, 10)


@pytest.mark.parametrize("mode", MODES)
def test_corrupted_planes_are_rejected(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 levels use 3 bit planes; level 7 cannot occur (likewise 300 levels: 9 planes, level 511)
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    bad = codec.encode_levels(torch.tensor([7, 0, 0]), 8)
    with pytest.raises(ValueError, match="level above 4"):
        codec.decode_levels(bad, 5, 3)
    bad = codec.encode_levels(torch.tensor([0, 511, 0]), 512)
    with pytest.raises(ValueError, match="level above 299"):
        codec.decode_levels(bad, 300, 3)
    with pytest.raises(ValueError, match="level above 4"):  # as bytes too
        codec.decode_levels(codec.encode_levels(torch.tensor([7, 0, 0]), 8), 5, 3, torch.uint8)
    with pytest.raises(ValueError, match="uint8 for at most 256 levels"):
        codec.decode_levels(codec.encode_levels(torch.tensor([0, 1, 0]), 300), 300, 3, torch.uint8)


def test_levels_to_values() -> None:
    assert codec.levels_to_values(torch.tensor([0, 1]), 2).tolist() == [-1.0, 1.0]
    assert codec.levels_to_values(torch.tensor([0, 1, 2]), 3).tolist() == [-1.0, 0.0, 1.0]
    assert codec.levels_to_values(torch.tensor([0, 1, 2, 3, 4]), 5).tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_levels_to_values_is_correctly_rounded_on_every_device(device: str) -> None:
    # Prepare: every level of L = 2 … 300; the reference is numpy's float32 division (IEEE, one rounding),
    # which a multiplication by the rounded reciprocal 1/(L−1) misses at some levels from L − 1 = 7 on
    for num_levels in range(2, 301):
        top = num_levels - 1
        expected = np.arange(-top, top + 1, 2, dtype=np.float32) / np.float32(top)
        # Execute
        got = codec.levels_to_values(torch.arange(num_levels, device=device), num_levels)
        # Assert: the same float32 bits (a GPU replica applies the server's Δ exactly)
        assert np.array_equal(got.cpu().numpy().view(np.int32), expected.view(np.int32)), num_levels


@pytest.mark.parametrize("mode", MODES)
def test_count_ones_hand_computed(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    a = codec.pack_signs(torch.tensor([1.0, 1, -1, -1, 1, -1, 1, -1, 1]))
    b = codec.pack_signs(torch.tensor([1.0, -1, -1, 1, 1, -1, -1, -1, 1]))
    c = codec.pack_signs(torch.tensor([-1.0, -1, -1, 1, 1, 1, 1, -1, 1]))
    counts = codec.count_ones([a, b.numpy().tobytes(), c.numpy()], 9)
    assert counts.tolist() == [2, 1, 0, 2, 3, 1, 2, 0, 3]
    assert codec.count_ones([], 4).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_count_planes_hand_computed_are_the_bits_of_the_counts(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # counts [2, 1, 0, 2, 3, 1, 2, 0, 3] (as above): bit 0 = [0,1,0,0,1,1,0,0,1], bit 1 = [1,0,0,1,1,0,1,0,1]
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    a = codec.pack_signs(torch.tensor([1.0, 1, -1, -1, 1, -1, 1, -1, 1]))
    b = codec.pack_signs(torch.tensor([1.0, -1, -1, 1, 1, -1, -1, -1, 1]))
    c = codec.pack_signs(torch.tensor([-1.0, -1, -1, 1, 1, 1, 1, -1, 1]))
    planes = codec.count_planes([a, b, c], 9)
    assert planes.shape == (2, 2)
    assert codec.unpack_bits(planes[0].contiguous(), 9).int().tolist() == [0, 1, 0, 0, 1, 1, 0, 0, 1]
    assert codec.unpack_bits(planes[1].contiguous(), 9).int().tolist() == [1, 0, 0, 1, 1, 0, 1, 0, 1]
    # with n = 3 (4 levels) the planes are exactly the wire encoding of the counts
    counts = torch.tensor([2, 1, 0, 2, 3, 1, 2, 0, 3])
    assert torch.equal(planes.reshape(-1), codec.encode_levels(counts, 4))
    gt, tie = codec.majority_masks(planes, 3, 9)  # count > 3/2: the vote's +1
    assert codec.unpack_bits(gt, 9).int().tolist() == [1, 0, 0, 1, 1, 0, 1, 0, 1]
    assert not codec.unpack_bits(tie, 9).any()  # no ties between 3 voters


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 70),
    d=st.integers(1, 3000),
    chunk=st.sampled_from([1, 3, 64, 1 << 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_bit_sliced_counts_and_majority_equal_the_unpacked_sum(
    mode: str, n: int, d: int, chunk: int, seed: int
) -> None:
    # Prepare: n random bit vectors (payloads as bytes, tensors, arrays, and a tensor 1 byte off alignment)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2, size=(n, d)).astype(bool)
    payloads = [np.packbits(b, bitorder="big") for b in bits]

    def misaligned(p: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([[0], p]).astype(np.uint8))[1:]

    kinds = (bytes, torch.from_numpy, np.asarray, misaligned)
    payloads = [kinds[i % 4](p.tobytes() if i % 4 == 0 else p) for i, p in enumerate(payloads)]
    # Execute
    with kernels(mode):
        planes = codec.count_planes(payloads, d, chunk_words=chunk)
        gt, tie = codec.majority_masks(planes, n, d)
        counts = codec.count_ones(payloads, d)
    # Assert: the reference is the n × d sum the bit-sliced counter never builds
    expected = bits.sum(axis=0)
    assert planes.shape == (n.bit_length(), (d + 7) // 8)
    np.testing.assert_array_equal(codec.planes_to_counts(planes, d).numpy(), expected)
    np.testing.assert_array_equal(counts.numpy(), expected)
    np.testing.assert_array_equal(codec.unpack_bits(gt, d).numpy(), 2 * expected > n)
    np.testing.assert_array_equal(codec.unpack_bits(tie, d).numpy(), 2 * expected == n)


def _aggregate_by_the_sum(payloads: list[bytes], d: int, how: str) -> codec.PackedAggregate:
    """The reference of aggregate_packed: S = 2·count − n unpacked, lion.aggregate, encode_levels."""
    n = len(payloads)
    counts = np.stack([np.unpackbits(np.frombuffer(p, np.uint8), count=d) for p in payloads]).sum(axis=0)
    s = torch.from_numpy(2 * counts.astype(np.int64) - n)
    levels = lion.aggregate(s, n, how)
    encoded = codec.encode_levels(levels.levels, levels.num_levels).numpy().tobytes()
    return codec.PackedAggregate(levels.levels, levels.num_levels, encoded, int((s == 0).sum()), int(s.abs().sum()))


def test_aggregate_packed_hand_computed() -> None:
    # Prepare: four voters on d = 5 coordinates; S = (4, 0, −2, 2, −4)
    signs = [[1, 1, -1, 1, -1], [1, -1, -1, 1, -1], [1, 1, 1, 1, -1], [1, -1, -1, -1, -1]]
    payloads = [codec.pack_signs(torch.tensor(s, dtype=torch.float32)) for s in signs]
    # Execute
    vote = codec.aggregate_packed(payloads, 5, "vote")
    mean = codec.aggregate_packed(payloads, 5, "mean")
    # Assert: vote levels sign(S) + 1, mean levels (S + 4)/2 = the counts; one tie; Σ|S| = 12
    assert vote.levels.tolist() == [2, 1, 0, 2, 0] and vote.num_levels == 3
    assert vote.encoded == bytes([2 + 1 * 3 + 0 * 9 + 2 * 27 + 0 * 81])  # trit5: five levels, one byte
    assert mean.levels.tolist() == [4, 2, 1, 3, 0] and mean.num_levels == 5
    assert mean.encoded == bytes([0b00110000, 0b01010000, 0b10000000])  # planes3: bits 0, 1, 2 of the counts
    assert (vote.ties, vote.sum_abs) == (mean.ties, mean.sum_abs) == (1, 12)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 2000),
    how=st.sampled_from(["vote", "mean"]),
    bias=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_aggregate_packed_equals_the_aggregate_of_the_sum(
    mode: str, n: int, d: int, how: str, bias: float, seed: int
) -> None:
    # Prepare: n packed sign vectors, +1 with probability `bias` (unanimous coordinates to all ties), and
    # random spare bits past d (they count for nothing)
    rng = np.random.default_rng(seed)
    packed = [np.packbits(rng.random(d) < bias, bitorder="big") for _ in range(n)]
    for p in packed:
        p[-1] |= rng.integers(0, 256) & (0xFF >> (d % 8) if d % 8 else 0)
    payloads = [p.tobytes() for p in packed]
    # Execute
    with kernels(mode):
        got = codec.aggregate_packed(payloads, d, how)
    # Assert: levels (as bytes), broadcast bytes, ties and Σ|S| of the composition from S
    expected = _aggregate_by_the_sum(payloads, d, how)
    assert got.levels.dtype == torch.uint8
    assert torch.equal(got.levels.to(torch.int32), expected.levels.to(torch.int32))
    assert got[1:] == expected[1:]


def test_aggregate_packed_beyond_256_levels_and_without_bitwise_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 300 voters (mean: 301 levels, int32), and numpy < 2's popcount (a table)
    rng = np.random.default_rng(3)
    d = 1001
    payloads = [rng.integers(0, 256, codec.packed_size(d), dtype=np.uint8).tobytes() for _ in range(300)]
    monkeypatch.delattr(np, "bitwise_count", raising=False)
    # Execute
    mean, vote = codec.aggregate_packed(payloads, d, "mean"), codec.aggregate_packed(payloads, d, "vote")
    # Assert
    for got, how in ((mean, "mean"), (vote, "vote")):
        expected = _aggregate_by_the_sum(payloads, d, how)
        assert torch.equal(got.levels.to(torch.int32), expected.levels.to(torch.int32))
        assert got[1:] == expected[1:]
    assert mean.levels.dtype == torch.int32 and mean.num_levels == 301


def test_aggregate_packed_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one payload"):
        codec.aggregate_packed([], 8, "vote")
    with pytest.raises(ValueError, match="'vote' or 'mean'"):
        codec.aggregate_packed([b"\x00"], 8, "median")


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 300_000), zeros=st.integers(0, 50), seed=st.integers(0, 2**31 - 1))
def test_kernel_pack_is_bit_identical_to_numpy(d: int, zeros: int, seed: int) -> None:
    # Prepare: random floats with exact zeros (+0.0 and −0.0), a NaN and infinities
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=gen)
    idx = torch.randint(0, d, (zeros,), generator=gen)
    v[idx] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")]).repeat(zeros)[:zeros]
    # Execute: the same coin-flip generator on both paths
    with kernels("off"):
        expected = codec.pack_signs(v, torch.Generator().manual_seed(7))
    with kernels("on"):
        got = codec.pack_signs(v, torch.Generator().manual_seed(7))
    # Assert
    assert torch.equal(got, expected)


def _host_has_avx2() -> bool:
    """Whether this is x86-64 with AVX2 (the kernels' AVX2 packs compile here)."""
    import llvmlite.binding

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and bool(llvmlite.binding.get_host_cpu_features().get("avx2"))


SPECIALS = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3e38, -3e38]


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize(
    "avx2", [False, pytest.param(True, marks=pytest.mark.skipif(not _host_has_avx2(), reason="needs AVX2"))]
)
def test_both_pack_formulations_equal_numpy_and_the_composition(avx2: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import numba

    from flower_dlion.accel import numba_pack as real

    # Prepare: both ways of packing 64 signs, compiled afresh (the codec's kernels use the one for this CPU).
    # Group 0 is hand-computed; groups 1–640 hold one special value each, at every lane in turn (these
    # groups take the exact path); the rest are random (the sign-bit path); 13 values in a partial group.
    monkeypatch.setattr(real, "_AVX2_PACKS", avx2)
    pack, lion_pack = numba.njit(real.pack_positive.py_func), numba.njit(real.lion_pack.py_func)
    d = 64 * (1 + 64 * len(SPECIALS) + 100) + 13
    at = np.array([64 * (1 + 64 * j + lane) + lane for j in range(len(SPECIALS)) for lane in range(64)])
    specials = np.repeat(np.array(SPECIALS, np.float32), 64)
    v = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    v[:64] = np.where(np.arange(64) % 9 == 0, 2.0, -0.5)  # > 0 at 0, 9, 18, …, 63
    v[at] = specials
    v[d - 3] = -0.0  # and one in the partial group
    out, zeros = np.zeros(codec.packed_size(d), np.uint8), np.full(-(-d // 64), 2**64 - 1, np.uint64)  # garbage
    # Execute
    has_zero = pack(v, out, 0, zeros.size)
    real.zero_masks(v, zeros, 0, zeros.size)
    # Assert: group 0 byte by byte; all of it numpy's packbits; the masks of exact zeros (NaN is no zero)
    # packed the same way, every word written (0 where no zero)
    assert out[:8].tolist() == [0b1000_0000, 0b0100_0000, 0b0010_0000, 0b0001_0000,
                                0b0000_1000, 0b0000_0100, 0b0000_0010, 0b0000_0001]  # fmt: skip
    assert np.array_equal(out, np.packbits(v > 0)) and has_zero
    expected_masks = np.zeros(64 * zeros.size, np.uint8)
    expected_masks[:d] = v == 0
    assert np.array_equal(zeros.view(np.uint8), np.packbits(expected_masks))
    assert np.count_nonzero(zeros) == 2 * 64 + 1
    v[v == 0] = 1.0
    real.zero_masks(v, zeros, 0, zeros.size)
    assert not pack(v, out, 0, zeros.size) and np.array_equal(out, np.packbits(v > 0)) and not zeros.any()

    # Prepare: the fused step with the same special values in the mix (m = 0 there; 0.1·1e-45 is 0)
    m, g = (np.random.default_rng(seed).standard_normal(d).astype(np.float32) for seed in (1, 2))
    m[at], g[at] = 0.0, specials
    m_ref = torch.from_numpy(m.copy())
    mix = lion.local_step_(m_ref, torch.from_numpy(g), 0.9, 0.99).numpy()
    out, zeros = np.zeros(codec.packed_size(d), np.uint8), np.full(-(-d // 64), 2**64 - 1, np.uint64)
    # Execute
    found = lion_pack(m, g, probes.lion_coefs(0.9, 0.99), out, zeros, 0, zeros.size)
    # Assert: δ's bits, the zero directions (mix 0 or NaN; packed as the bits are), the momentum
    tie = np.unpackbits(zeros.view(np.uint8))[:d].astype(bool)
    assert np.array_equal(out, np.packbits(mix > 0))
    assert np.array_equal(tie, (mix == 0) | np.isnan(mix)) and found and tie.sum() > 5 * 64
    assert _same_floats(torch.from_numpy(m), m_ref)


def test_avx2_packs_are_chosen_by_the_cpu_numba_compiles_for(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    import numba

    from flower_dlion.accel import numba_pack as real

    # Execute / Assert: AVX2 without AVX-512 BW only, on x86-64 only
    monkeypatch.setattr(real.platform, "machine", lambda: "x86_64")
    for features, expected in [("+avx2,-avx512bw", True), ("+avx2,+avx512bw", False), ("-avx2,+sse4.2", False)]:
        monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
        assert real._packs_with_avx2() is expected
    monkeypatch.setattr(real.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx2")
    assert real._packs_with_avx2() is False


def _record_thread_parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Make ``threads.on_threads`` record (items, parts) of every call into the returned list."""
    calls: list[tuple[int, int]] = []
    real = threads.on_threads

    def spy(work: Callable[[int, int], object], total: int, grain: int) -> list[object]:
        out = real(work, total, grain)
        calls.append((total, len(out)))
        return out

    monkeypatch.setattr(threads, "on_threads", spy)
    return calls


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("n", [1, 2, 5, 8, 9, 64])
def test_kernel_counts_on_two_threads_with_a_partial_last_word(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: d = 10⁶ + 3 (⌈d/8⌉ = 125,001 bytes: one partial word), two threads even for a few payloads
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    monkeypatch.setattr(accel.cpu, "_COUNT_GRAIN", 1 << 15)
    monkeypatch.setattr(threads, "TEAM_AFTER", 1 << 30)  # the codec's own threads (torch's team: its own test)
    d = 1_000_003
    rng = np.random.default_rng(n)
    payloads = [rng.integers(0, 256, codec.packed_size(d), dtype=np.uint8).tobytes() for _ in range(n)]
    with kernels("off"):
        expected = (codec.count_planes(payloads, d), codec.count_ones(payloads, d))
    parts = _record_thread_parts(monkeypatch)
    # Execute
    with kernels("on"):
        got = (codec.count_planes(payloads, d), codec.count_ones(payloads, d))
    # Assert: each count ran on two parts, and the results are numpy's
    assert parts == [(codec.packed_size(d) // 8, 2)] * 2  # the whole words; the partial one after them
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("num_levels", [3, 5, 11, 16, 129, 256])
def test_kernel_decodes_levels_on_two_threads(num_levels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: d = 5·2¹⁹ + 3 levels (a partial last byte), two threads; the reference is the numpy path
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    d = 5 * (1 << 19) + 3
    k = torch.randint(0, num_levels, (d,), generator=torch.Generator().manual_seed(num_levels), dtype=torch.int32)
    encoded = codec.encode_levels(k, num_levels)
    calls = _record_thread_parts(monkeypatch)
    # Execute
    with kernels("on"):
        got = codec.decode_levels(encoded, num_levels, d, torch.uint8)
    with kernels("off"):
        expected = codec.decode_levels(encoded, num_levels, d, torch.uint8)
    # Assert
    assert len(calls) == 1 and calls[0][1] == 2  # one threaded pass over the encoded bytes, in two parts
    assert torch.equal(got, expected) and torch.equal(got.to(torch.int32), k)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_kernel_encodes_trit5_on_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: d = 5·2¹⁹ + 3 levels in {0, 1, 2} (a partial last group), two threads
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    d = 5 * (1 << 19) + 3
    k = torch.randint(0, 3, (d,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    with kernels("off"):
        expected = codec.encode_levels(k, 3)
    calls = _record_thread_parts(monkeypatch)
    # Execute
    with kernels("on"):
        got = codec.encode_levels(k.to(torch.uint8), 3)
    # Assert: one threaded pass in two parts, the bytes of the tensor-operation path
    assert calls == [(1 << 19, 2)]
    assert torch.equal(got, expected)


def _step_inputs(d: int, zeros: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum and gradient spanning many magnitudes, with zero directions, −0.0, NaN and ±inf."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(30).sub(15).exp2()
    g = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(30).sub(15).exp2()
    idx = torch.randint(0, d, (zeros,), generator=gen)
    m[idx] = torch.tensor([0.0, -0.0, 0.0, 1.0, -1.0]).repeat(zeros)[:zeros]
    g[idx] = torch.tensor([0.0, 0.0, float("nan"), float("inf"), -float("inf")]).repeat(zeros)[:zeros]
    return m, g


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any two NaNs match."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 200_000),
    zeros=st.integers(0, 40),
    seed=st.integers(0, 2**31 - 1),
    betas=st.sampled_from([(0.9, 0.99), (0.95, 0.98), (0.0, 0.5), (0.5, 0.0)]),
)
def test_fused_step_and_pack_equal_the_composition(
    mode: str, d: int, zeros: int, seed: int, betas: tuple[float, float]
) -> None:
    # Prepare: the reference is lion.local_step_ followed by pack_signs, with the same coin generator
    m, g = _step_inputs(d, zeros, seed)
    m_ref = m.clone()
    expected = codec.pack_signs(lion.local_step_(m_ref, g, *betas), torch.Generator().manual_seed(7))
    # Execute
    with kernels(mode):
        got = codec.pack_local_step_(m, g, *betas, torch.Generator().manual_seed(7))
    # Assert: the same bytes (coin flips included) and the same momentum, bit for bit
    assert torch.equal(got, expected)
    assert _same_floats(m, m_ref)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_fused_step_on_two_threads_with_zero_directions_and_a_partial_group() -> None:
    # Prepare: d = 2·10⁶ + 13 on two threads; zero directions at both ends and at a thread boundary
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    d = 2_000_013
    m, g = _step_inputs(d, 0, 3)
    for i in (0, 1, 63, 64, d // 2 - 1, d // 2, d - 1):
        m[i], g[i] = 0.0, 0.0
    m_ref = m.clone()
    expected = codec.pack_signs(lion.local_step_(m_ref, g, 0.9, 0.99), torch.Generator().manual_seed(1))
    # Execute
    with kernels("on"):
        got = codec.pack_local_step_(m, g, 0.9, 0.99, torch.Generator().manual_seed(1))
    # Assert
    assert torch.equal(got, expected)
    assert _same_floats(m, m_ref)


@pytest.fixture
def team(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernels on torch's OpenMP team from the first call, two threads from 64 values; counts its runs."""
    from flower_dlion.accel.numba_team import Team

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not run on OpenMP here")
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    monkeypatch.setenv(accel.KERNELS_ENV, "on")
    monkeypatch.setattr(threads, "TEAM_AFTER", 0)
    monkeypatch.setattr(threads, "TEAM_GRAIN", 32)
    monkeypatch.setattr(threads, "TEAM_COUNT_GRAIN", 1 << 10)
    runs: list[int] = []
    run = Team.run

    def counted(self: object, launch: object, task: object, threads: int, *operands: object) -> object:
        runs.append(threads)
        return run(self, launch, task, threads, *operands)

    monkeypatch.setattr(Team, "run", counted)
    return runs


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("d", [64, 65, 1_000, 100_003, 2_000_013])
@pytest.mark.parametrize("zeros", [0, 7])
def test_kernels_on_torchs_team_equal_the_composition(d: int, zeros: int, team: list[int]) -> None:
    # Prepare: the references are the compositions without the kernels, with the same coin generator
    m, g = _step_inputs(d, zeros, d)
    v = lion.direction(m, g, 0.9)
    m_ref = m.clone()
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    x8 = x.clone()
    levels = torch.randint(0, 11, (d,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    with kernels("off"):
        expected_pack = codec.pack_signs(v, torch.Generator().manual_seed(5))
        expected_step = codec.pack_signs(lion.local_step_(m_ref, g, 0.9, 0.99), torch.Generator().manual_seed(5))
    expected_x = lion.apply_update_(x.clone(), codec.levels_to_values(levels, 11), 0.01, 0.1)
    # Execute: the pack, the fused step and the apply (int32 and uint8 levels), each on the team
    packed = codec.pack_signs(v, torch.Generator().manual_seed(5))
    step = codec.pack_local_step_(m, g, 0.9, 0.99, torch.Generator().manual_seed(5))
    codec.apply_levels_(x, levels, 11, 0.01, 0.1)
    codec.apply_levels_(x8, levels.to(torch.uint8), 11, 0.01, 0.1)
    # Assert: four runs on two threads (five with zeros: their masks are a second run); the same bytes
    # (coins included) and floats bit for bit
    assert team == [2] * (5 if zeros else 4)
    assert torch.equal(packed, expected_pack)
    assert torch.equal(step, expected_step) and _same_floats(m, m_ref)
    assert _same_floats(x, expected_x) and _same_floats(x8, expected_x)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("n", [3, 8, 9, 64])
def test_vote_counts_on_torchs_team_equal_numpys(n: int, team: list[int]) -> None:
    # Prepare: d = 10⁶ + 3 (a partial last word), n payloads as Flower delivers them (bytes)
    d = 1_000_003
    rng = np.random.default_rng(n)
    payloads = [rng.integers(0, 256, codec.packed_size(d), dtype=np.uint8).tobytes() for _ in range(n)]
    with kernels("off"):
        planes = codec.count_planes(payloads, d)
    # Execute: the planes (the vote and the mean come from them) on the team
    got = codec.count_planes(payloads, d)
    # Assert: one run on two threads; numpy's planes
    assert team == [2]
    assert torch.equal(got, planes)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize(("bad", "dtype"), [(-1, torch.int32), (11, torch.int32), (255, torch.uint8)])
def test_apply_on_torchs_team_rejects_a_level_out_of_range(bad: int, dtype: torch.dtype, team: list[int]) -> None:
    # Prepare: 10⁵ levels of 0…10 with one bad level near the end
    levels = torch.randint(0, 11, (100_003,), generator=torch.Generator().manual_seed(0)).to(dtype)
    levels[99_000] = bad
    # Execute / Assert: the team's run finds it
    with pytest.raises(ValueError, match="level outside 0…10: corrupted update"):
        codec.apply_levels_(torch.zeros(100_003), levels, 11, 0.1, 0.0)
    assert team == [2]


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_kernels_on_torchs_team_from_many_threads_at_once(team: list[int]) -> None:
    # Prepare: 8 Python threads, each packing its own vector 10 times (each call gets a team of its own)
    from concurrent.futures import ThreadPoolExecutor

    vectors = [torch.randn(100_003, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [np.packbits((v > 0).numpy(), bitorder="big") for v in vectors]
    # Execute
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: [codec.pack_signs(vectors[i]).numpy() for _ in range(10)], range(8)))
    # Assert: every call on the team, every result right
    assert len(team) == 80
    assert all(np.array_equal(r, expected[i]) for i in range(8) for r in got[i])


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_kernels_move_onto_the_team_only_after_some_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    from flower_dlion.accel import numba_team

    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    monkeypatch.setattr(threads, "_TEAM_CALLS", {})
    # Execute: the first TEAM_AFTER calls of a kernel, a call too small for two threads, then one more
    first = [threads.team("pack", 1 << 20) for _ in range(threads.TEAM_AFTER)]
    small, later = threads.team("pack", threads.TEAM_GRAIN), threads.team("pack", 1 << 20)
    # Assert: threads of their own (None) until then, and for one thread's work; then the team (with OpenMP)
    assert first == [None] * threads.TEAM_AFTER and small is None
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert later is not None and later[1] == 2
    monkeypatch.setattr(threads, "_TEAM", [None])  # torch without OpenMP: the codec's own threads
    assert threads.team("pack", 1 << 20) is None

    def no_dlopen(name: object) -> None:
        raise OSError("no dlopen(NULL) here")  # as on Windows

    monkeypatch.setattr(threads, "_TEAM", [])
    monkeypatch.setattr(numba_team.ctypes, "CDLL", no_dlopen)
    assert threads.team("pack", 1 << 20) is None and threads._TEAM == [None]


def test_fused_step_hand_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: β₁ = 0.5, β₂ = 0.75: mix = (m + g)/2, m ← (3m + g)/4, all exact in float32
    monkeypatch.setenv(accel.KERNELS_ENV, "on" if HAVE_NUMBA else "off")
    m = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, 0.0, 4.0, -4.0, 1.0])
    g = torch.tensor([1.0, 1.0, -4.0, 0.0, -0.25, 1.0, 0.0, 8.0, -3.0])
    # Execute
    packed = codec.pack_local_step_(m, g, 0.5, 0.75)
    # Assert: mix = 1, 0, −1, −1, 0.125, 0.5, 2, 2, −1 → bits 1 ? 0 0 1 1 1 1 | 0 (? a coin flip)
    assert packed[0].item() & 0b1011_1111 == 0b1000_1111 and packed[1].item() == 0
    assert m.tolist() == [1.0, -0.5, 0.5, -1.5, 0.3125, 0.25, 3.0, -1.0, 0.0]


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_fused_step_runs_only_where_it_rounds_like_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from flower_dlion.accel import cpu, numba_pack

    # Prepare: a kernel that rounds the mix and the momentum twice (no FMA), as some CPUs would
    def unfused(
        m: np.ndarray, g: np.ndarray, coefs: tuple, out: np.ndarray, zeros: np.ndarray, first: int, last: int
    ) -> bool:
        b1, a1, b2, a2 = coefs
        mix = m * b1 + a1 * g
        m[:] = m * b2 + a2 * g
        out[:] = np.packbits(mix > 0, bitorder="big")
        return False

    fake = type(sys)("fake_kernels")
    fake.__dict__.update(vars(numba_pack), lion_pack=unfused)  # the real kernels but this one
    m, g = _step_inputs(5_000, 0, 11)
    m_ref = m.clone()
    expected = codec.pack_signs(lion.local_step_(m_ref, g, 0.9, 0.99))
    monkeypatch.setattr(probes, "_FUSED_EXACT", {})
    monkeypatch.setattr(cpu, "kernels", fake)
    monkeypatch.setenv(accel.KERNELS_ENV, "on")
    # Execute
    got = codec.pack_local_step_(m, g, 0.9, 0.99)
    # Assert: the probe catches the other rounding and the composition runs instead; the real kernel passes it
    assert probes._FUSED_EXACT == {("cpu", 0.9, 0.99): False}
    assert torch.equal(got, expected) and _same_floats(m, m_ref)
    probes._FUSED_EXACT.clear()
    monkeypatch.setattr(cpu, "kernels", numba_pack)
    fused = functools.partial(cpu._lion_pack_one_thread, probes.lion_coefs(0.9, 0.99))
    assert probes.fused_step_matches_torch(fused, lion.local_step_, 0.9, 0.99, torch.device("cpu"))


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 100_000),
    num_levels=st.just(2) | st.integers(1, 128).map(lambda h: 2 * h + 1),  # 2, or 3 … 257 (odd)
    lr=st.floats(1e-6, 1.0),
    weight_decay=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    narrow=st.booleans(),
)
def test_apply_levels_equals_apply_update_of_the_values(
    mode: str, d: int, num_levels: int, lr: float, weight_decay: float, seed: int, narrow: bool
) -> None:
    # Prepare: x over many magnitudes with ±0 and ±inf; the reference is lion.apply_update_ of levels_to_values
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(40).sub(20).exp2()
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])[: min(4, d)]
    levels = torch.randint(0, num_levels, (d,), generator=gen, dtype=torch.int32)
    expected = lion.apply_update_(x.clone(), codec.levels_to_values(levels, num_levels), lr, weight_decay)
    if narrow and num_levels <= 256:  # the levels as decode_levels(..., torch.uint8) gives them to a client
        levels = levels.to(torch.uint8)
    # Execute
    with kernels(mode):
        got = codec.apply_levels_(x, levels, num_levels, lr, weight_decay)
    # Assert: bit for bit, in place
    assert got is x and _same_floats(x, expected)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize(("num_levels", "lr"), [(2, 0.01), (3, 3e-4), (11, 0.1), (257, 1e-3)])
def test_apply_levels_runs_the_kernel_on_two_threads(
    num_levels: int, lr: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flower_dlion.accel import numba_pack as real

    # Prepare: 2·10⁶ + 5 values on two of the codec's own threads (torch's team has its own test); count the calls
    torch.set_num_threads(2)  # exactly two, also on a many-core machine
    monkeypatch.setattr(threads, "TEAM_AFTER", 1 << 30)
    calls = []
    fused = real.apply_levels
    monkeypatch.setattr(real, "apply_levels", lambda *args: calls.append(1) or fused(*args))
    d = 2_000_005
    x = torch.randn(d, generator=torch.Generator().manual_seed(num_levels))
    levels = torch.randint(0, num_levels, (d,), dtype=torch.int32)
    expected = lion.apply_update_(x.clone(), codec.levels_to_values(levels, num_levels), lr, 0.1)
    # Execute
    with kernels("on"):
        codec.apply_levels_(x, levels, num_levels, lr, 0.1)
    # Assert: the same x, from the kernel (one call per thread), not from the composition
    assert torch.equal(x, expected)
    assert len(calls) == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [3, -1])
def test_apply_levels_rejects_a_level_out_of_range(mode: str, bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    levels = torch.tensor([0, 1, 2, bad, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="level outside 0…2: corrupted update"):
        codec.apply_levels_(torch.ones(5), levels, 3, 0.1, 0.0)


def test_kernels_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(accel.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="FLOWER_DLION_KERNELS must be 'auto', 'on' or 'off', got 'fast'"):
        codec.pack_signs(torch.ones(3))
    monkeypatch.setitem(sys.modules, "flower_dlion.accel.cpu", None)  # as if numba were not installed
    monkeypatch.delattr(flower_dlion.accel, "cpu", raising=False)
    monkeypatch.setattr(accel, "_CHOSEN", {})
    monkeypatch.setenv(accel.KERNELS_ENV, "auto")
    assert codec.pack_signs(torch.ones(2_000_000)).numel() == 250_000  # auto: numpy instead
    assert accel.choose("pack_signs", torch.device("cpu"), 2_000_000) is None
    monkeypatch.setenv(accel.KERNELS_ENV, "on")
    with pytest.raises(ImportError, match=r"FLOWER_DLION_KERNELS=on needs numba: pip install 'flower-dlion\[fast\]'"):
        codec.pack_signs(torch.ones(3))
    monkeypatch.setitem(sys.modules, "flower_dlion.accel.gpu", None)  # as if Triton were not installed
    monkeypatch.delattr(flower_dlion.accel, "gpu", raising=False)
    with pytest.raises(ImportError, match="FLOWER_DLION_KERNELS=on needs Triton on a CUDA device"):
        accel.choose("pack_signs", torch.device("cuda"), 3)
    monkeypatch.setenv(accel.KERNELS_ENV, "auto")
    assert accel.choose("pack_signs", torch.device("cuda"), 3) is None  # auto: tensor operations instead


def _philox_words(seed: int, counter: int, n: int) -> np.ndarray:
    """Philox4x32-10's first output word at counters counter … counter + n − 1, by hand (as uint64).

    Philox4x32-10 (Salmon et al., 2011) with key (seed low, seed high) and counter (c low, c high, 0, 0),
    as Triton's ``tl.randint`` runs it; numpy's uint64 holds every 32 × 32-bit product exactly.
    """
    c = np.uint64(counter) + np.arange(n, dtype=np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = c & mask, c >> np.uint64(32), np.zeros_like(c), np.zeros_like(c)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        a, b = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # the two 64-bit products of a round
        c0, c1, c2, c3 = (b >> np.uint64(32)) ^ c1 ^ k0, b & mask, (a >> np.uint64(32)) ^ c3 ^ k1, a & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c0


def _philox_coins(seed: int, counter: int, nbytes: int) -> np.ndarray:
    """The GPU pack's coin bytes: the low 8 bits of Philox's first word at counter + b for byte b."""
    return (_philox_words(seed, counter, nbytes) & np.uint64(255)).astype(np.uint8)


def _expected_gpu_pack(positive: torch.Tensor, zero: torch.Tensor, gen: torch.Generator) -> np.ndarray:
    """A GPU pack's bytes: the bits of ``positive``, and at ``zero`` the coins of ``gen``'s next window."""
    twin = torch.Generator().set_state(gen.get_state())  # the same draw, leaving gen for the call under test
    from flower_dlion.accel import triton_kernels

    nbytes = codec.packed_size(positive.numel())
    coins = _philox_coins(*triton_kernels.coin_stream(twin, torch.device("cpu"), nbytes), nbytes)
    return np.packbits(positive.numpy(), bitorder="big") | (np.packbits(zero.numpy(), bitorder="big") & coins)


def test_philox_reference_matches_the_published_known_answer() -> None:
    # Philox4x32-10's known-answer test (Random123's kat_vectors): counter 0, key 0 → first word 0x6627e8d5
    assert _philox_words(0, 0, 1)[0] == 0x6627E8D5


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@settings(max_examples=40, deadline=None)
@given(d=st.integers(0, 40_000), zeros=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_triton_pack_kernel_matches_numpy_packbits_and_philox_coins(d: int, zeros: int, seed: int) -> None:
    # Prepare: random floats with +0.0, −0.0, NaN and infinities at random places (tiles of 8,192 values);
    # on the GPU if there is one, else in Triton's interpreter (conftest sets TRITON_INTERPRET)
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=gen)
    if d:
        idx = torch.randint(0, d, (zeros,), generator=gen)
        v[idx] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")])[:zeros]
    coins = torch.Generator().manual_seed(seed + 1)
    expected = _expected_gpu_pack(v > 0, v == 0, coins)
    from flower_dlion.accel import triton_kernels

    # Execute
    packed = triton_kernels.pack_positive(v.to("cuda" if torch.cuda.is_available() else "cpu"), coins)
    # Assert: the bits of v > 0, MSB first; at each exact zero, its byte's Philox coin
    assert np.array_equal(packed.cpu().numpy(), expected)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
def test_triton_pack_flips_fair_reproducible_coins_at_zeros() -> None:
    # Prepare: 40,000 values, every third an exact zero (±0), on the GPU if there is one, else interpreted
    from flower_dlion.accel import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    v = torch.where(torch.arange(40_000) % 2 == 0, 1.0, -1.0)
    v[::3] = torch.tensor([0.0, -0.0]).repeat(7000)[: v[::3].numel()]
    zero = (v == 0).numpy()
    # Execute: twice from one seed, once from the generator after those
    gen = torch.Generator().manual_seed(7)
    first = triton_kernels.pack_positive(v.to(device), torch.Generator().manual_seed(7))
    again, later = triton_kernels.pack_positive(v.to(device), gen), triton_kernels.pack_positive(v.to(device), gen)
    bits = [np.unpackbits(p.cpu().numpy())[:40_000] for p in (first, again, later)]
    # Assert: the nonzero values' bits exact; at the 13,334 zeros about half ones (±3σ = ±173), the same coins
    # from the same seed, other coins from the generator's next draw
    assert all(np.array_equal(b[~zero], (v[~zero] > 0).numpy()) for b in bits)
    assert abs(int(bits[0][zero].sum()) - 13_334 / 2) < 173
    assert np.array_equal(bits[0], bits[1]) and not np.array_equal(bits[1], bits[2])


class _CudaGenerator:
    """Stands in for a CUDA generator: a seed, and torch's Philox offset (multiples of 4)."""

    device = torch.device("cuda", 0)

    def __init__(self, seed: int, offset: int) -> None:
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        assert offset % 4 == 0  # as torch's CUDA generator requires
        self.offset = offset


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
def test_coin_stream_takes_a_cuda_generators_seed_and_advances_its_offset() -> None:
    from flower_dlion.accel import triton_kernels

    gen = _CudaGenerator(2**64 - 3, 8)  # torch's seeds are 64-bit
    device = torch.device("cuda", 0)
    # Execute: windows of 125,000 bytes, 5 bytes, 1 byte
    windows = [triton_kernels.coin_stream(gen, device, n) for n in (125_000, 5, 1)]  # type: ignore[arg-type]
    # Assert: the seed's low 62 bits and the offsets 8, 125,008, 125,016, each with bit 62 set (typed int64)
    key = (2**64 - 3) % 2**62 | 2**62
    assert windows == [(key, 8 | 2**62), (key, 125_008 | 2**62), (key, 125_016 | 2**62)]
    assert gen.offset == 125_020


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
def test_triton_apply_flags_need_no_reset_between_calls() -> None:
    # Prepare: good levels and one out of range, on the GPU if there is one, else interpreted
    from flower_dlion.accel import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = torch.tensor([-0.5, 0.0, 0.5], device=device)
    good = torch.tensor([0, 1, 2, 1], dtype=torch.uint8, device=device)
    bad = torch.tensor([0, 1, 3, 1], dtype=torch.uint8, device=device)
    x = torch.ones(4, device=device)
    # Execute: good, bad, good again, on the one flag of the device
    first = triton_kernels.apply_levels(x, good, steps, 1.0)
    before = first.read()
    second = triton_kernels.apply_levels(x, bad, steps, 1.0)
    third = triton_kernels.apply_levels(x, good, steps, 1.0)
    # Assert: one tensor, rising epochs; each call reads its own result; an earlier call's flag reads raised
    # once a later call raised it (the conservative side: the codec then checks exactly)
    assert first.tensor is second.tensor is third.tensor and first.epoch < second.epoch < third.epoch
    assert (before, second.read(), third.read()) == (False, True, False)
    assert first.read()


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 20_000), n=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_triton_vote_count_kernel_matches_the_numpy_path(d: int, n: int, seed: int) -> None:
    # Prepare: n random payloads (padding bits too), on the GPU if there is one, else interpreted
    rng = np.random.default_rng(seed)
    payloads = [torch.from_numpy(rng.integers(0, 256, codec.packed_size(d), dtype=np.uint8)) for _ in range(n)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from flower_dlion.accel import triton_kernels

    with kernels("off"):
        counts, planes = codec.count_ones(payloads, d), codec.count_planes(payloads, d)
    # Execute
    on_device = [p.to(device) for p in payloads]
    got_counts, got_planes = triton_kernels.count_ones(on_device, d), triton_kernels.count_planes(on_device, d)
    # Assert: the same counts and planes as the numpy path
    assert torch.equal(got_counts.cpu(), counts)
    assert torch.equal(got_planes.cpu(), planes)


def _dyadic(d: int, gen: torch.Generator) -> torch.Tensor:
    """Small multiples of powers of two (k·2ᵉ, |k| ≤ 64, −6 ≤ e ≤ 6): every mix and momentum below is exact."""
    k = torch.randint(-64, 65, (d,), generator=gen).float()
    return k * torch.randint(-6, 7, (d,), generator=gen).float().exp2()


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(0, 20_000),
    specials=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
    betas=st.sampled_from([(0.5, 0.75), (0.75, 0.5), (0.0, 0.875), (0.5, 0.0)]),
)
def test_triton_fused_step_matches_the_composition(
    d: int, specials: int, seed: int, betas: tuple[float, float]
) -> None:
    # Prepare: dyadic m and g with dyadic β (no rounding anywhere, so FMA or not does not matter: Triton's
    # interpreter rounds its FMA twice), many zero directions (g = −m), ±0, NaN and ±inf at random places;
    # on the GPU if there is one, else interpreted. The reference is lion.local_step_ on the CPU.
    gen = torch.Generator().manual_seed(seed)
    m, g = _dyadic(d, gen), _dyadic(d, gen)
    if d:
        flip = torch.rand(d, generator=gen) < 0.1
        g[flip] = -m[flip]
        idx = torch.randint(0, d, (specials,), generator=gen)
        m[idx] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1.0, -0.0])[:specials]
        g[idx] = torch.tensor([-0.0, 0.0, 1.0, -float("inf"), float("nan"), -0.0])[:specials]
    m_ref = m.clone()
    delta = lion.local_step_(m_ref, g, *betas)
    from flower_dlion.accel import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    m_dev = m.to(device)
    coefs = tuple(float(c) for c in probes.lion_coefs(*betas))
    gen = torch.Generator().manual_seed(seed + 1)
    expected = _expected_gpu_pack(delta > 0, delta == 0, gen)
    composed = triton_kernels.pack_positive(delta.to(device), torch.Generator().set_state(gen.get_state()))
    # Execute
    packed = triton_kernels.lion_pack(m_dev, g.to(device), coefs, gen)
    # Assert: bits of δ > 0 (MSB first) and the Philox coins at δ = 0, as the kernel pack of δ gives them;
    # the momentum bit for bit (NaNs alike)
    assert np.array_equal(packed.cpu().numpy(), expected)
    assert torch.equal(packed, composed)
    assert _same_floats(m_dev.cpu(), m_ref)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(0, 20_000),
    num_levels=st.integers(2, 300),
    lr=st.floats(1e-6, 1.0),
    weight_decay=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    narrow=st.booleans(),
)
def test_triton_apply_matches_apply_update_of_the_values(
    d: int, num_levels: int, lr: float, weight_decay: float, seed: int, narrow: bool
) -> None:
    # Prepare: x over many magnitudes with ±0, ±inf and NaN; levels as uint8 (L ≤ 256) or int32;
    # the reference is lion.apply_update_ of levels_to_values on the CPU
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(60).sub(30).exp2()
    x[: min(d, 5)] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])[: min(d, 5)]
    levels = torch.randint(0, num_levels, (d,), generator=gen, dtype=torch.int32)
    if narrow and num_levels <= 256:
        levels = levels.to(torch.uint8)
    expected = lion.apply_update_(x.clone(), codec.levels_to_values(levels, num_levels), lr, weight_decay)
    from flower_dlion.accel import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x_dev = x.to(device)
    steps = codec.levels_to_values(torch.arange(num_levels, device=device), num_levels) * lr
    # Execute
    bad = triton_kernels.apply_levels(x_dev, levels.to(device), steps, float(np.float32(1.0 - lr * weight_decay)))
    # Assert: the same floats bit for bit; no level flagged
    assert not bad.read()
    assert _same_floats(x_dev.cpu(), expected)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@pytest.mark.parametrize("bad", [3, -1, 255])
def test_triton_apply_flags_a_level_out_of_range(bad: int) -> None:
    from flower_dlion.accel import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    levels = torch.tensor([0, 2, 1, bad, 0], dtype=torch.uint8 if bad == 255 else torch.int32, device=device)
    steps = torch.tensor([-0.5, 0.0, 0.5], device=device)
    with pytest.raises(ValueError, match=r"levels must be contiguous uint8 or int32 of shape \(4,\)"):
        triton_kernels.apply_levels(torch.ones(4, device=device), levels, steps, 1.0)
    x = torch.ones(5, device=device)
    # Execute
    flag = triton_kernels.apply_levels(x, levels, steps, 1.0)
    # Assert: flagged; the good values are applied
    assert flag.read()
    assert x.cpu()[:3].tolist() == [1.5, 0.5, 1.0]


def _check_triton_vote(d: int, n: int, seed: int, majority: float) -> None:
    """The Triton kernel's count planes of n random payloads against the numpy path's."""
    rng = np.random.default_rng(seed)
    payloads = [torch.from_numpy(np.packbits(rng.random(8 * codec.packed_size(d)) < majority)) for _ in range(n)]
    with kernels("off"):
        planes = codec.count_planes(payloads, d)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from flower_dlion.accel import triton_kernels

    got_planes = triton_kernels.count_planes([p.to(device) for p in payloads], d)
    assert torch.equal(got_planes.cpu(), planes)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@settings(max_examples=10, deadline=None)
@given(
    d=st.integers(1, 3_000),
    n=st.sampled_from([31, 32, 63, 127, 255, 256, 257]),
    seed=st.integers(0, 2**31 - 1),
    majority=st.floats(0.0, 1.0),
)
def test_triton_vote_kernels_for_many_payloads(d: int, n: int, seed: int, majority: float) -> None:
    # Prepare: n payloads whose bits are 1 with probability `majority` (counts near n/2, ties included, or
    # near 0 or n), counted in 5 … 9 bit-sliced planes; Execute and Assert: the numpy path's masks and planes
    _check_triton_vote(d, n, seed, majority)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@pytest.mark.parametrize(
    ("n", "majority"),
    [
        (1023, 0.5),
        pytest.param(4095, 0.5, marks=CUDA),  # 35 s each in the interpreter
        pytest.param(4095, 0.9, marks=CUDA),
        (4096, 0.5),
    ],
)
def test_triton_vote_kernels_at_the_most_planes(n: int, majority: float) -> None:
    # 10 and 12 bit-sliced planes (the most), then 4,096 payloads: 13 planes, per-value counters instead
    _check_triton_vote(100, n, n, majority)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
def test_triton_vote_count_kernel_rejects_a_wrong_size() -> None:
    from flower_dlion.accel import triton_kernels

    with pytest.raises(ValueError, match=r"expected 2 packed bytes \(contiguous 1-D uint8\), got torch.uint8 \(3,\)"):
        triton_kernels.count_ones([torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)], 9)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
def test_triton_pack_kernel_rejects_what_it_cannot_read() -> None:
    from flower_dlion.accel import triton_kernels

    with pytest.raises(ValueError, match=r"needs a contiguous 1-D float32 tensor, got torch.float64 \(4,\)"):
        triton_kernels.pack_positive(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"contiguous 1-D float32 tensors, got g: torch.float64 \(4,\)"):
        triton_kernels.lion_pack(torch.ones(4), torch.ones(4, dtype=torch.float64), (0.5, 0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"m \(4 on cpu\) and g \(3 on cpu\) differ"):
        triton_kernels.lion_pack(torch.ones(4), torch.ones(3), (0.5, 0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"contiguous 1-D float32 x, got torch.float64 \(4,\)"):
        triton_kernels.apply_levels(torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.uint8),
                                 torch.ones(2), 1.0)  # fmt: skip


def test_codec_lion_quantizers_and_downlink_import_no_flwr() -> None:
    import subprocess
    import sys

    modules = "flower_dlion.codec, flower_dlion.lion, flower_dlion.quantizers"
    modules += ", flower_dlion.anchored_counts, flower_dlion.entropy"
    modules += ", flower_dlion.accel, flower_dlion.accel.threads, flower_dlion.accel.probes"
    modules += ", flower_dlion.accel.cpu, flower_dlion.accel.numba_team" * HAVE_NUMBA
    modules += ", flower_dlion.accel.gpu" * HAVE_TRITON
    code = f"import sys, {modules}; print('flwr' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@CUDA
@pytest.mark.parametrize("d", [1, 7, 8, 8193, 1_000_003])
@pytest.mark.parametrize("zeros", [0, 5])
def test_cuda_pack_kernel_and_tensor_path_agree(d: int, zeros: int) -> None:
    # Prepare: on the GPU, with and without exact zeros; a fresh CUDA generator seeded 3 hands out
    # Philox key 3 and counters from its offset 0 to the kernel (the tensor path draws torch.randint coins)
    gen = torch.Generator().manual_seed(d)
    v = torch.randn(d, generator=gen)
    v[torch.randint(0, d, (zeros,), generator=gen)] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 0.0])[:zeros]
    nbytes = codec.packed_size(d)
    coins = _philox_coins(3 | 2**62, 2**62, nbytes)
    expected = np.packbits((v > 0).numpy()) | (np.packbits((v == 0).numpy()) & coins)
    out, gens = {}, {}
    for mode in ("on", "off"):
        gens[mode] = torch.Generator(device="cuda").manual_seed(3)
        # Execute
        with kernels(mode):
            out[mode] = codec.pack_signs(v.cuda(), gens[mode])
    # Assert: the kernel's bytes by hand (its coins from Philox), the generator past the call's counters;
    # the tensor path's bits alike except at zeros; without zeros, the CPU's bytes too
    assert out["on"].is_cuda and np.array_equal(out["on"].cpu().numpy(), expected)
    assert gens["on"].get_offset() == -(-nbytes // 4) * 4
    nonzero = torch.from_numpy(np.packbits((v != 0).numpy())).cuda()
    assert torch.equal(out["on"] & nonzero, out["off"] & nonzero)
    if not bool((v == 0).any()):
        assert torch.equal(out["on"].cpu(), codec.pack_signs(v))


@CUDA
@pytest.mark.parametrize("d", [1, 7, 8193, 1_000_003])
@pytest.mark.parametrize("zeros", [0, 5])
def test_cuda_fused_step_equals_the_composition_and_the_cpu(d: int, zeros: int) -> None:
    # Prepare: on the GPU, with and without zero directions (coin flips from equally seeded CUDA generators)
    m, g = _step_inputs(d, zeros, d)
    out, momenta = {}, {}
    probes._FUSED_EXACT.pop(("cuda", 0.9, 0.99), None)
    for path in ("fused", "composed", "tensor ops"):  # the Triton step; local_step_ + the Triton pack; no kernels
        m_dev, gen = m.cuda(), torch.Generator(device="cuda").manual_seed(3)
        # Execute
        with kernels("off" if path == "tensor ops" else "on"):
            if path == "composed":
                out[path] = codec.pack_signs(lion.local_step_(m_dev, g.cuda(), 0.9, 0.99), gen)
            else:
                out[path] = codec.pack_local_step_(m_dev, g.cuda(), 0.9, 0.99, gen)
        momenta[path] = m_dev.cpu()
    # Assert: the probe let the kernel run; the fused step's bytes are the composition's, coins too; the tensor
    # path's bits alike except at zero directions; the same momenta everywhere, the CPU's too
    assert probes._FUSED_EXACT[("cuda", 0.9, 0.99)]
    assert out["fused"].is_cuda and torch.equal(out["fused"], out["composed"])
    m_ref = m.clone()
    nonzero = codec.pack_bits(lion.local_step_(m_ref, g, 0.9, 0.99) != 0).cuda()
    assert torch.equal(out["fused"] & nonzero, out["tensor ops"] & nonzero)
    assert all(_same_floats(momenta[path], m_ref) for path in out)
    if not zeros:
        assert torch.equal(out["fused"].cpu(), codec.pack_local_step_(m.clone(), g, 0.9, 0.99))


@CUDA
def test_cuda_pack_and_fused_step_never_wait_for_the_device() -> None:
    # Prepare: zero directions and exact zeros (the coins are drawn on the device); the probe run first
    m, g = _step_inputs(100_003, 5, 4)
    m_dev, g_dev = m.cuda(), g.cuda()
    codec.pack_local_step_(m_dev.clone(), g_dev, 0.9, 0.99)
    v = m_dev.clone()
    v[:3] = 0.0
    gen = torch.Generator(device="cuda").manual_seed(3)
    # Execute: with torch raising on any synchronizing operation
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = codec.pack_signs(v, gen)
        fused = codec.pack_local_step_(m_dev, g_dev, 0.9, 0.99, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Assert: both ran without a sync; their bytes are on the device
    assert packed.is_cuda and fused.is_cuda and fused.numel() == packed.numel() == 12_501


@CUDA
def test_cuda_codec_checks_a_raised_flag_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: every flag reads raised, as when a call on another stream raised it; good levels
    from flower_dlion.accel import triton_kernels

    monkeypatch.setattr(triton_kernels.Flag, "read", lambda self: True)
    m = torch.randn(10_007, generator=torch.Generator().manual_seed(1))
    levels = torch.randint(0, 3, (m.numel(),), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    x_dev = m.cuda()
    # Execute
    codec.apply_levels_(x_dev, levels.cuda(), 3, 0.01, 0.1)
    # Assert: the apply raised nothing and is the CPU's
    assert torch.equal(x_dev.cpu(), codec.apply_levels_(m.clone(), levels, 3, 0.01, 0.1))


@CUDA
@pytest.mark.parametrize("num_levels", [2, 3, 8, 13, 65, 257])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_cuda_apply_levels_matches_the_cpu(num_levels: int, dtype: torch.dtype) -> None:
    # Prepare: d = 10⁶ + 3 values; L − 1 = 7 and 12 are where a reciprocal multiplication would be 1 ulp off
    if dtype == torch.uint8 and num_levels > 256:
        pytest.skip("uint8 holds at most 256 levels")
    gen = torch.Generator().manual_seed(num_levels)
    x = torch.randn(1_000_003, generator=gen)
    levels = torch.randint(0, num_levels, (x.numel(),), generator=gen).to(dtype)
    expected = codec.apply_levels_(x.clone(), levels, num_levels, 0.01, 0.1)
    for mode in ("on", "off"):  # the Triton apply, then lion.apply_update_ of levels_to_values
        x_dev = x.cuda()
        # Execute
        with kernels(mode):
            codec.apply_levels_(x_dev, levels.cuda(), num_levels, 0.01, 0.1)
        # Assert: the CPU's x bit for bit (replicas on any device stay identical)
        assert torch.equal(x_dev.cpu().view(torch.int32), expected.view(torch.int32)), mode


@CUDA
@pytest.mark.parametrize("n", [1, 4, 64])
def test_cuda_vote_counts_match_the_cpu(n: int) -> None:
    # Prepare: n payloads of d = 10⁶ + 3 values (a partial last byte) on the GPU
    d = 1_000_003
    rng = np.random.default_rng(n)
    payloads = [torch.from_numpy(rng.integers(0, 256, codec.packed_size(d), dtype=np.uint8)) for _ in range(n)]
    expected = codec.count_ones(payloads, d), codec.count_planes(payloads, d)
    for mode in ("on", "off"):  # the Triton kernel and the tensor operations
        # Execute
        with kernels(mode):
            on_gpu = [p.cuda() for p in payloads]
            got = codec.count_ones(on_gpu, d), codec.count_planes(on_gpu, d)
        # Assert
        assert got[0].is_cuda and torch.equal(got[0].cpu(), expected[0]), mode
        assert torch.equal(got[1].cpu(), expected[1]), mode


@CUDA
def test_cuda_codec_matches_cpu_and_stays_on_device() -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(1_000_003, generator=gen)
    packed = codec.pack_signs(v.cuda())
    assert packed.is_cuda and torch.equal(packed.cpu(), codec.pack_signs(v))
    assert torch.equal(codec.unpack_signs(packed, v.numel()).cpu(), codec.unpack_signs(codec.pack_signs(v), v.numel()))
    for num_levels in (2, 3, 5, 11):
        k = torch.randint(0, num_levels, (100_001,), generator=gen)
        enc = codec.encode_levels(k.cuda(), num_levels)
        assert enc.is_cuda and torch.equal(enc.cpu(), codec.encode_levels(k, num_levels))
        dec = codec.decode_levels(enc, num_levels, k.numel())
        assert dec.is_cuda and torch.equal(dec.cpu(), k.to(torch.int32))


@pytest.mark.parametrize("mode", ["off", "on"])
def test_pack_paths_count_their_coin_flips(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 7 exact zeros in the vector; the Lion mix of m = 0 is 0 where g is 0 (5 of them)
    if mode == "on" and not HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setenv("FLOWER_DLION_KERNELS", mode)
    v = torch.randn(3000)
    v[[0, 5, 63, 64, 1000, 2998, 2999]] = 0.0
    g = torch.randn(3000)
    g[[3, 70, 700, 1500, 2999]] = 0.0
    flips_v: list[int] = []
    flips_g: list[int] = []
    # Execute
    codec.pack_signs(v, torch.Generator().manual_seed(0), flips=flips_v)
    codec.pack_local_step_(torch.zeros(3000), g, 0.9, 0.99, torch.Generator().manual_seed(0), flips=flips_g)
    codec.pack_signs(torch.ones(3000), flips=flips_v)  # none
    # Assert
    assert flips_v == [7, 0] and flips_g == [5]
