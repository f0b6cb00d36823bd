"""Stochastic signs (issue 52, item 1): their expectation, reproducibility, τ = 0 as today, and the checks.

Prepare / Execute / Assert.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flower_dlion import DistributedLion, lion, quantizers, stochastic
from flower_dlion.protocol import ClientStateError
from flower_dlion.round_records import RoundConfig

from .. import reference


@pytest.mark.parametrize("kind", stochastic.NOISE_KINDS)
def test_the_mean_of_stochastic_signs_is_the_docstrings_expectation(kind: str) -> None:
    # Prepare: one tensor of 9 values, mean |v| = 1, τ = 2 (σ = 2): the uniform band holds all of them
    v = torch.tensor([-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 1.0 * 0.0 + 0.5])
    v = v / v.abs().mean()
    sigma = 2.0 * float(v.abs().mean())
    gen = torch.Generator().manual_seed(0)
    # Execute: 40,000 draws
    draws = torch.stack(
        [stochastic.perturb_(v.clone(), sizes=[9], tau=2.0, kind=kind, generator=gen).sign() for _ in range(40_000)]
    )
    # Assert: within 5 standard errors of E = v/σ clipped (uniform) or erf(v/(σ√2)) (gaussian)
    expected = reference.expected_sign(v, sigma, kind)
    assert torch.allclose(draws.mean(0), expected, atol=5 / 40_000**0.5)
    if kind == "uniform":
        assert torch.allclose(expected[1:8], v[1:8] / sigma)  # unbiased inside the band


def test_sigma_is_per_tensor_and_tau_zero_draws_nothing() -> None:
    # Prepare: two tensors whose scales differ by 1000; uniform noise of τ = 1
    v = torch.cat([torch.full((4,), 1000.0), torch.full((4,), 1.0)])
    gen = torch.Generator().manual_seed(1)
    # Execute
    noisy = stochastic.perturb_(v.clone(), sizes=[4, 4], tau=1.0, kind="uniform", generator=gen)
    # Assert: each tensor moved by at most its own σ (1000, 1); τ = 0 gives no perturbation at all
    assert (noisy[:4] - 1000.0).abs().max() <= 1000.0 and (noisy[4:] - 1.0).abs().max() <= 1.0
    assert (noisy[4:] - 1.0).abs().max() > 0.0
    assert stochastic.perturber([8], 0.0, "uniform", gen) is None


def test_a_stochastic_lion_step_is_reproduced_by_its_seed_and_tau_zero_is_the_plain_step() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    m0, g = (torch.from_numpy(rng.standard_normal(1000).astype(np.float32)) for _ in range(2))

    def step(tau: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = m0.clone()
        perturb = stochastic.perturber([600, 400], tau, "gaussian", torch.Generator().manual_seed(seed))
        return lion.local_step_(m, g, 0.9, 0.99, perturb), m

    # Execute / Assert: the same seed gives the same signs; another seed other signs; m as the plain step's
    a, ma = step(1.0, 7)
    b, _ = step(1.0, 7)
    c, _ = step(1.0, 8)
    plain_m = m0.clone()
    plain = lion.local_step_(plain_m, g, 0.9, 0.99)
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.equal(ma, plain_m)
    assert 0 < int((a != plain).sum()) < 500  # some signs flipped, most kept
    zero, _ = step(0.0, 7)
    assert torch.equal(zero, plain)


def test_a_stochastic_ef_sign_keeps_what_it_did_not_send_as_error() -> None:
    # Prepare
    v = torch.tensor([0.5, -0.1, 0.2, -2.0])
    error = torch.zeros(4)
    perturb = stochastic.perturber([4], 3.0, "uniform", torch.Generator().manual_seed(3))
    # Execute
    levels, scales = quantizers.ef_quantize_(v, error, [4], 2, perturb)
    # Assert: the scale is mean |v| (0.7); e = v − s·(2·level − 1) exactly
    sent = quantizers.dequantize(levels, 2, scales, [4])
    assert torch.isclose(scales[0], torch.tensor(0.7))
    assert torch.equal(error, v - sent)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"sign_noise": -0.1}, r"sign_noise must be in \[0, 100\]"),
        ({"sign_noise": float("nan")}, r"sign_noise must be in \[0, 100\]"),
        ({"sign_noise": 0.5, "sign_noise_kind": "laplace"}, "sign_noise_kind must be one of"),
        ({"sign_noise": 0.5, "upload": "sum", "local_steps": 2}, "upload='sign' or 'ef-sign', got upload='sum'"),
    ],
)
def test_bad_noise_arguments_fail_before_round_1(kwargs: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        DistributedLion(**kwargs)


def test_a_client_refuses_a_hostile_noise_from_the_server() -> None:
    base = {"server-round": 1, "version": 0, "beta1": 0.9, "beta2": 0.99}
    with pytest.raises(ClientStateError, match="sign-noise"):
        RoundConfig.parse(base | {"sign-noise": 1e9}, 5)
    with pytest.raises(ClientStateError, match="sign-noise-kind"):
        RoundConfig.parse(base | {"sign-noise": 1.0, "sign-noise-kind": "cauchy"}, 5)
    assert RoundConfig.parse(base | {"sign-noise": 2.5}, 5).sign_noise == 2.5


MODES = {
    "lion-vote": {},
    "ef-sign": {"upload": "ef-sign", "local_steps": 3},  # U of 3 Lion steps, its scaled sign with error feedback
    "ef-sgd": {
        "upload": "ef-sign",
        "local_optimizer": "sgd",
        "local_lr": 0.05,
        "local_steps": 3,
        "aggregation": "mean",
        "broadcast_bits": 1,
        "lr": 1.0,
        "weight_decay": 0.0,
    },
}
