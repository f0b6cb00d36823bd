"""Bit codec: exact round trips, exact sizes, numpy-compatible layout."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flower_dlion import codec


@settings(max_examples=200, deadline=None)
@given(d=st.integers(1, 100_000), seed=st.integers(0, 2**31 - 1))
def test_sign_round_trip_any_length(d: int, seed: int) -> None:
    # Prepare
    signs = torch.where(torch.rand(d, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    # Execute
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


def test_pack_bits_hand_computed() -> None:
    # +1 −1 −1 −1 −1 −1 −1 +1 | +1 +1 (padding zeros)
    v = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, 1, 1])
    assert codec.pack_signs(v).tolist() == [0b1000_0001, 0b1100_0000]


def test_threaded_pack_returns_only_when_every_chunk_is_written() -> None:
    # Prepare: zeros in the first chunk (the first worker reports them first), 2·10⁶ values
    torch.set_num_threads(max(2, torch.get_num_threads()))
    v = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    v[:100] = 0.0
    expected = np.packbits((v > 0).numpy(), bitorder="big")[13:]  # bytes past the zeros
    for _ in range(20):
        # Execute
        packed = codec.pack_signs(v, torch.Generator().manual_seed(0)).numpy()
        # Assert: every byte past the zeros is exactly the sign bits (a returned-too-early buffer is not)
        assert np.array_equal(packed[13:], expected)


def test_zeros_are_coin_flips_not_one_side() -> None:
    zeros = torch.zeros(80_000)
    bits = codec.unpack_bits(codec.pack_signs(zeros, torch.Generator().manual_seed(0)), zeros.numel())
    assert 0.49 < bits.float().mean().item() < 0.51  # unbiased, not all one way
    again = codec.unpack_bits(codec.pack_signs(zeros, torch.Generator().manual_seed(0)), zeros.numel())
    assert torch.equal(bits, again)  # reproducible with the same generator
    nonzero = torch.tensor([-2.0, 0.5, -0.1, 3.0])  # no zeros: the generator is never used
    assert codec.unpack_signs(codec.pack_signs(nonzero), 4).tolist() == [-1.0, 1.0, -1.0, 1.0]


def test_unpack_rejects_wrong_length() -> None:
    with pytest.raises(ValueError, match="expected 2 packed bytes for 9 bits, got 3"):
        codec.unpack_bits(bytes(3), 9)


@settings(max_examples=150, deadline=None)
@given(d=st.integers(1, 20_000), num_levels=st.integers(2, 70), seed=st.integers(0, 1000))
def test_levels_round_trip_and_size(d: int, num_levels: int, seed: int) -> None:
    k = torch.randint(0, num_levels, (d,), generator=torch.Generator().manual_seed(seed))
    encoded = codec.encode_levels(k, num_levels)
    assert encoded.numel() == codec.encoded_size(d, num_levels)
    assert torch.equal(codec.decode_levels(encoded.numpy().tobytes(), num_levels, d), k.to(torch.int32))


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


def test_trit5_hand_computed() -> None:
    # levels 2,0,1,1,2 → 2 + 0·3 + 1·9 + 1·27 + 2·81 = 200
    assert codec.encode_levels(torch.tensor([2, 0, 1, 1, 2]), 3).tolist() == [200]
    with pytest.raises(ValueError, match="above 242"):
        codec.decode_levels(bytes([250]), 3, 5)


def test_corrupted_planes_are_rejected() -> None:
    # 5 levels use 3 bit planes; level 7 cannot occur
    bad = codec.encode_levels(torch.tensor([7, 0, 0]), 8)
    with pytest.raises(ValueError, match="level above 4"):
        codec.decode_levels(bad, 5, 3)


def test_levels_to_values() -> None:
    assert codec.levels_to_values(torch.tensor([0, 1]), 2).tolist() == [-1.0, 1.0]
    assert codec.levels_to_values(torch.tensor([0, 1, 2]), 3).tolist() == [-1.0, 0.0, 1.0]
    assert codec.levels_to_values(torch.tensor([0, 1, 2, 3, 4]), 5).tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]


def test_count_ones_hand_computed() -> None:
    a = codec.pack_signs(torch.tensor([1.0, 1, -1, -1, 1, -1, 1, -1, 1]))
    b = codec.pack_signs(torch.tensor([1.0, -1, -1, 1, 1, -1, -1, -1, 1]))
    c = codec.pack_signs(torch.tensor([-1.0, -1, -1, 1, 1, 1, 1, -1, 1]))
    counts = codec.count_ones([a, b.numpy().tobytes(), c.numpy()], 9)
    assert counts.tolist() == [2, 1, 0, 2, 3, 1, 2, 0, 3]
    assert codec.count_ones([], 4).tolist() == [0, 0, 0, 0]


def test_count_planes_hand_computed_are_the_bits_of_the_counts() -> None:
    # counts [2, 1, 0, 2, 3, 1, 2, 0, 3] (as above): bit 0 = [0,1,0,0,1,1,0,0,1], bit 1 = [1,0,0,1,1,0,1,0,1]
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


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 70),
    d=st.integers(1, 3000),
    chunk=st.sampled_from([1, 3, 64, 1 << 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_bit_sliced_counts_and_majority_equal_the_unpacked_sum(n: int, d: int, chunk: int, seed: int) -> None:
    # Prepare: n random bit vectors (payloads as bytes, tensors and arrays)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2, size=(n, d)).astype(bool)
    payloads = [np.packbits(b, bitorder="big") for b in bits]
    payloads = [p.tobytes() if i % 3 == 0 else torch.from_numpy(p) if i % 3 == 1 else p for i, p in enumerate(payloads)]
    # Execute
    planes = codec.count_planes(payloads, d, chunk_words=chunk)
    gt, tie = codec.majority_masks(planes, n, d)
    # Assert: the reference is the n × d sum the bit-sliced counter never builds
    expected = bits.sum(axis=0)
    assert planes.shape == (n.bit_length(), (d + 7) // 8)
    np.testing.assert_array_equal(codec.planes_to_counts(planes, d).numpy(), expected)
    np.testing.assert_array_equal(codec.unpack_bits(gt, d).numpy(), 2 * expected > n)
    np.testing.assert_array_equal(codec.unpack_bits(tie, d).numpy(), 2 * expected == n)


def test_codec_lion_and_quantizers_import_no_flwr() -> None:
    import subprocess
    import sys

    code = "import sys, flower_dlion.codec, flower_dlion.lion, flower_dlion.quantizers; print('flwr' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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
