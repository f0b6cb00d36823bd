"""The upload kinds (flower_dlion/uploads.py): what a client encodes is what the server sums, exactly."""

import pytest
import torch

from flower_dlion.protocol import RejectedReply
from flower_dlion.uploads import UPLOADS, Shape, upload_kind


def _round_trip(name: str, us: list[list[float]], sizes: list[int], steps: int = 1) -> tuple[torch.Tensor, int, list]:
    """Encode each client's U, parse it as the server does, and sum."""
    kind, shape = UPLOADS[name], Shape(sum(sizes), sizes, steps)
    parsed, errors = [], []
    for u in us:
        gen = torch.Generator().manual_seed(0)
        arrays, error = kind.encode(torch.tensor(u), None, shape, gen, [])
        assert set(arrays) == set(kind.expected(shape))
        floats = {n: torch.from_numpy(a.numpy().copy()) for n, a in arrays.items() if a.dtype == "float32"}
        parsed.append(kind.parse(arrays[kind.main].data, floats, shape))
        errors.append(error)
    total, clipped = kind.total(parsed, shape)
    return total, clipped, errors


def test_sign_upload_sums_the_signs() -> None:
    # Execute: two clients' U = [1, −2, 0.5] and [−1, −1, 3]
    total, clipped, errors = _round_trip("sign", [[1, -2, 0.5], [-1, -1, 3]], [3])
    # Assert: S = [1 − 1, −1 − 1, 1 + 1]; no scales, no error state
    assert total.tolist() == [0, -2, 2] and clipped == 0 and errors == [None, None]


def test_sum_upload_sends_u_itself_and_refuses_a_level_above_2k() -> None:
    # Execute: K = 2, U = [2, −1, 0] and [1, −2, 2]
    total, _, _ = _round_trip("sum", [[2, -1, 0], [1, -2, 2]], [3], steps=2)
    # Assert: S = Σ U exactly
    assert total.tolist() == [3, -3, 2]
    with pytest.raises(RejectedReply, match="Array 'levels'"):  # levels of 5 values: a trit5 byte above 242
        UPLOADS["sum"].parse(bytes([243]), {}, Shape(3, [3], 1))


def test_ef_sign_scales_are_the_tensor_means_and_a_larger_one_is_cut_to_the_lower_median() -> None:
    # Prepare: tensors of sizes 2 and 1. Client 1: U = [1, −3 | 2] → scales (2, 2), sends [2, −2 | 2],
    # keeps e = [−1, −1 | 0]. Client 2: U = [3, 1 | −4] → scales (2, 4), sends [2, 2 | −4].
    total, clipped, errors = _round_trip("ef-sign", [[1, -3, 2], [3, 1, -4]], [2, 1])
    # Assert: client 2's scale 4 is cut to the lower median of {2, 4} = 2: S = [4, 0 | 0], one scale cut
    assert total.tolist() == [4.0, 0.0, 0.0] and clipped == 1
    assert errors[0].tolist() == [-1.0, -1.0, 0.0] and errors[1].tolist() == [1.0, -1.0, 0.0]


def test_an_unknown_kind_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match="upload must be one of 'sign', 'sum', 'ef-sign', got 'int8'"):
        upload_kind("int8")
