"""Lion math on hand-computed arrays and against the formula."""

import numpy as np
import pytest
import torch

from flower_dlion import codec, lion


def delta_of(votes: list[int], n: int, how: str) -> list[float]:
    return codec.levels_to_values(*lion.aggregate(torch.tensor(votes), n, how)).tolist()


def test_vote_is_sign_of_sum_with_ties_to_zero() -> None:
    # four clients, three coordinates: S = (4, 0, −2)
    deltas = torch.tensor([[1, 1, -1], [1, -1, -1], [1, 1, 1], [1, -1, -1]])
    votes = deltas.sum(0)
    assert votes.tolist() == [4, 0, -2]
    assert delta_of(votes.tolist(), 4, "vote") == [1.0, 0.0, -1.0]
    assert lion.aggregate(votes, 4, "vote").num_levels == 3


def test_vote_with_odd_n_needs_two_levels() -> None:
    update = lion.aggregate(torch.tensor([3, 1, -1, -3]), 3, "vote")
    assert update.num_levels == 2
    assert codec.levels_to_values(*update).tolist() == [1.0, 1.0, -1.0, -1.0]


def test_mean_is_sum_over_n() -> None:
    assert delta_of([4, 2, 0, -2, -4], 4, "mean") == [1.0, 0.5, 0.0, -0.5, -1.0]
    assert delta_of([3, 1, -1, -3], 3, "mean") == pytest.approx([1.0, 1 / 3, -1 / 3, -1.0])
    assert lion.aggregate(torch.tensor([3, 1]), 3, "mean").num_levels == 4


def test_aggregate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="aggregation must be 'vote' or 'mean', got 'median'"):
        lion.aggregate(torch.tensor([1]), 1, "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be >= 1"):
        lion.aggregate(torch.tensor([1]), 0, "vote")


def test_local_step_uses_old_momentum_then_updates_it() -> None:
    m = torch.tensor([1.0, -1.0, 0.0, 0.2])
    g = torch.tensor([-20.0, 5.0, -3.0, -1.0])
    delta = lion.local_step_(m, g, beta1=0.9, beta2=0.99)
    # c = 0.9·m + 0.1·g = (−1.1, −0.4, −0.3, 0.08)
    assert delta.tolist() == [-1.0, -1.0, -1.0, 1.0]
    # m ← 0.99·m + 0.01·g
    assert m.tolist() == pytest.approx([0.79, -0.94, -0.03, 0.188])


def test_apply_update_hand_computed() -> None:
    x = torch.tensor([1.0, -2.0, 0.5])
    lion.apply_update_(x, torch.tensor([1.0, -1.0, 0.0]), lr=0.1, weight_decay=0.5)
    # x − 0.1·(Δ + 0.5·x)
    assert x.tolist() == pytest.approx([0.85, -1.8, 0.475])


def test_lion_step_matches_formula_in_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen)
    m = torch.zeros(1000)
    xr, mr = x.double().numpy().copy(), np.zeros(1000)
    lr, wd, b1, b2 = 1e-3, 0.1, 0.9, 0.99
    for _ in range(5):
        g = torch.randn(1000, generator=gen)
        lion.lion_step_(x, m, g, lr=lr, weight_decay=wd, beta1=b1, beta2=b2)
        gr = g.double().numpy()
        xr = xr - lr * (np.sign(b1 * mr + (1 - b1) * gr) + wd * xr)
        mr = b2 * mr + (1 - b2) * gr
    np.testing.assert_allclose(x.numpy(), xr, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m.numpy(), mr, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_update_is_bit_identical_on_cuda_and_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1_000_000, generator=gen)
    k = torch.randint(0, 11, (1_000_000,), generator=gen)
    delta = codec.levels_to_values(k, 11)
    x_gpu = lion.apply_update_(x.cuda(), codec.levels_to_values(k.cuda(), 11), 3e-3, 0.1)
    assert torch.equal(x_gpu.cpu(), lion.apply_update_(x.clone(), delta, 3e-3, 0.1))
