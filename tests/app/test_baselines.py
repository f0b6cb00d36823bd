"""The baselines: TernGrad, the gradient-averaging strategy, Signum, FedAvg's client; byte formulas."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flower_dlion import codec, lion, quantizers
from flower_dlion.protocol import bits_array, message_bytes
from flower_dlion_app.clients.gradient import encode_terngrad
from flower_dlion_app.protocol import GRAD_METRICS, GRAD_UPDATE, TERNGRAD_STYPE
from flower_dlion_app.strategies import GlobalOptimizer

from ..library.test_strategy import StubGrid

X0 = np.array([1.0, -1.0, 0.5, 2.0, -0.25], dtype=np.float32)  # w: 3 values, b: 2 values
SIZES = [3, 2]


def start(strategy: GlobalOptimizer, nodes: list[int]) -> dict[int, Message]:
    arrays = ArrayRecord({"w": Array(X0[:3].copy()), "b": Array(X0[3:].copy())})
    return {m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays, ConfigRecord(), StubGrid(nodes))}


def grad_reply(instruction: Message, payload: Array, loss: float = 1.0, examples: int = 8) -> Message:
    content = RecordDict(
        {
            GRAD_UPDATE: ArrayRecord({"payload": payload}),
            GRAD_METRICS: MetricRecord({"num-examples": examples, "train-loss": loss}),
        }
    )
    return Message(content, reply_to=instruction)


def tern_payload(scales: list[float], trits: list[int]) -> Array:
    data = np.array(scales, dtype=np.float32).tobytes()
    data += codec.encode_levels(torch.tensor(trits) + 1, 3).numpy().tobytes()
    return Array(dtype="terngrad", shape=(len(trits),), stype=TERNGRAD_STYPE, data=data)


# ---------------------------------------------------------------- TernGrad quantizer
def test_ternarize_hand_computed() -> None:
    # Prepare: one tensor, scaler max|g| = 1; P(keep) = |g| / 1
    g = torch.tensor([0.5, -1.0, 0.0, 0.25])
    u = torch.rand(4, generator=torch.Generator().manual_seed(7))  # the draws ternarize will make
    # Execute
    levels, scales = quantizers.ternarize(g, [4], generator=torch.Generator().manual_seed(7), clip=None)
    # Assert
    keep = (u < torch.tensor([0.5, 1.0, 0.0, 0.25])).float()
    assert scales.tolist() == [1.0]
    assert (levels - 1).tolist() == (torch.tensor([1.0, -1.0, 0.0, 1.0]) * keep).tolist()
    assert levels[1] == 0 and levels[2] == 1  # −1 is always kept (|g| = s), 0 never moves
    assert quantizers.unternarize(levels, scales, [4]).tolist() == (levels - 1).float().tolist()


def test_ternarize_scales_per_tensor_and_handles_zero_tensors() -> None:
    levels, scales = quantizers.ternarize(torch.tensor([0.0, 0.0, 3.0, -6.0]), [2, 2], clip=None)
    assert scales.tolist() == [0.0, 6.0] and levels[:2].tolist() == [1, 1] and levels[3] == 0


def test_ternarize_clips_to_2_5_sigma() -> None:
    g = torch.zeros(100)
    g[0] = 10.0  # std = 0.99499, so the bound is 2.4875
    _, scales = quantizers.ternarize(g, [100])
    assert scales.item() == pytest.approx(2.5 * g.std(correction=0).item())


def test_ternarize_is_unbiased() -> None:
    g = torch.tensor([0.3, -0.7, 0.05, 1.0, -0.2])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [quantizers.unternarize(*quantizers.ternarize(g, [5], generator=gen, clip=None), [5]) for _ in range(20000)]
    )
    np.testing.assert_allclose(draws.mean(0).numpy(), g.numpy(), atol=0.02)  # 4+ standard errors


# ---------------------------------------------------------------- GlobalOptimizer
def test_global_lion_step_on_hand_computed_arrays() -> None:
    # Prepare: two clients; mean gradient ĝ = [1, -1, 0.5, -2, 0]; m = 0 so δ = sign(0.1·ĝ)
    strategy = GlobalOptimizer(optimizer="lion", lr=0.1, weight_decay=0.5)
    sent = start(strategy, [1, 2])
    g1 = np.array([2.0, -1.0, 0.0, -4.0, 1.0], dtype=np.float32)
    g2 = np.array([0.0, -1.0, 1.0, 0.0, -1.0], dtype=np.float32)
    replies = [grad_reply(sent[1], Array(g1)), grad_reply(sent[2], Array(g2), loss=3.0, examples=24)]
    # Execute
    _, metrics = strategy.aggregate_train(1, replies)
    # Assert: x ← x − lr·(sign(ĝ) + wd·x); sign(0) = 0
    want = X0 - np.float32(0.1) * (np.array([1, -1, 1, -1, 0], dtype=np.float32) + np.float32(0.5) * X0)
    np.testing.assert_allclose(strategy.x.numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(strategy._m.numpy(), 0.01 * (g1 + g2) / 2, rtol=1e-6)  # m ← 0.99·0 + 0.01·ĝ
    assert metrics["num-replies"] == 2 and metrics["train-loss"] == pytest.approx((8 * 1.0 + 24 * 3.0) / 32)


def test_global_lion_uses_the_same_update_function_as_the_clients() -> None:
    strategy = GlobalOptimizer(optimizer="lion", lr=0.01, weight_decay=0.1)
    x, m = torch.from_numpy(X0.copy()), torch.zeros(5)
    for rnd, g in enumerate(([1.0, -2.0, 0.5, 0.25, -1.0], [-0.5, 1.0, 0.5, -3.0, 0.125]), start=1):
        arrays = strategy.arrays() if strategy.x is not None else ArrayRecord({"w": Array(X0[:3]), "b": Array(X0[3:])})
        msg = strategy.configure_train(rnd, arrays, ConfigRecord(), StubGrid([1, 2]))[0]
        strategy.aggregate_train(rnd, [grad_reply(msg, Array(np.array(g, dtype=np.float32)))])
        lion.lion_step_(x, m, torch.tensor(g), lr=0.01, weight_decay=0.1, beta1=0.9, beta2=0.99)
    assert torch.equal(strategy.x, x)


def test_global_adamw_first_step_is_lr_times_sign() -> None:
    # AdamW's first bias-corrected step is lr·g/(|g| + eps) ≈ lr·sign(g), after decay x·(1 − lr·wd)
    strategy = GlobalOptimizer(optimizer="adamw", lr=0.1, weight_decay=0.5, beta1=0.9, beta2=0.999)
    sent = start(strategy, [1, 2])  # node 2 does not answer
    g = np.array([2.0, -0.5, 1e-3, -4.0, 0.0], dtype=np.float32)
    strategy.aggregate_train(1, [grad_reply(sent[1], Array(g))])
    want = X0 * (1 - 0.1 * 0.5) - 0.1 * np.sign(g)
    np.testing.assert_allclose(strategy.x.numpy(), want, atol=1e-6)


def test_terngrad_sgd_step_on_hand_computed_trits() -> None:
    # Prepare: ĝ = mean(s·t) per tensor; SGD's first momentum step is x − lr·ĝ
    strategy = GlobalOptimizer(optimizer="sgd", encoding="terngrad", lr=0.5, momentum=0.9)
    sent = start(strategy, [1, 2])
    r1 = grad_reply(sent[1], tern_payload([2.0, 1.0], [1, 0, -1, 1, 1]))  # ĝ₁ = [2, 0, −2, 1, 1]
    r2 = grad_reply(sent[2], tern_payload([4.0, 0.5], [1, -1, 0, 0, -1]))  # ĝ₂ = [4, −4, 0, 0, −0.5]
    # Execute
    strategy.aggregate_train(1, [r1, r2])
    # Assert
    g = np.array([3.0, -2.0, -1.0, 0.5, 0.25], dtype=np.float32)
    np.testing.assert_array_equal(strategy.x.numpy(), X0 - np.float32(0.5) * g)


def test_terngrad_client_payload_decodes_to_the_quantizer_output() -> None:
    g = torch.tensor([0.5, -1.0, 0.0, 0.25, 3.0])
    payload = encode_terngrad(g, SIZES, torch.Generator().manual_seed(3))
    levels, scales = quantizers.ternarize(g, SIZES, generator=torch.Generator().manual_seed(3))
    assert len(payload.data) == 4 * 2 + codec.encoded_size(5, 3)
    assert np.frombuffer(payload.data[:8], dtype=np.float32).tolist() == scales.tolist()
    assert codec.decode_levels(payload.data[8:], 3, 5).tolist() == levels.tolist()


@pytest.mark.parametrize(
    ("encoding", "payload", "reason"),
    [
        ("fp32", Array(np.zeros(4, dtype=np.float32)), "expected float32 (5,)"),
        ("fp32", Array(np.zeros(5, dtype=np.float64)), "expected float32 (5,)"),
        ("fp32", Array(np.array([0, 0, np.nan, 0, 0], dtype=np.float32)), "non-finite"),
        ("terngrad", Array(np.zeros(5, dtype=np.float32)), "expected 'terngrad.v1'"),
        ("terngrad", tern_payload([1.0, -1.0], [0, 0, 0, 0, 0]), "scalers must be finite and >= 0"),
        ("terngrad", tern_payload([1.0, np.inf], [0, 0, 0, 0, 0]), "scalers must be finite and >= 0"),
        (
            "terngrad",
            Array(dtype="terngrad", shape=(5,), stype=TERNGRAD_STYPE, data=b"\0" * 8 + b"\xff"),
            "above 242",
        ),
        ("terngrad", Array(dtype="terngrad", shape=(5,), stype=TERNGRAD_STYPE, data=b"\0" * 8), "expected 9"),
    ],
)
def test_malformed_gradient_is_rejected_and_x_unchanged(
    encoding: str, payload: Array, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = GlobalOptimizer(optimizer="sgd", encoding=encoding, lr=0.5)
    sent = start(strategy, [7, 8])  # node 8 does not answer
    with caplog.at_level(logging.WARNING):
        _, metrics = strategy.aggregate_train(1, [grad_reply(sent[7], payload)])
    assert metrics["num-rejected"] == 1 and metrics["applied"] == 0
    assert "rejected reply from node 7" in caplog.text and reason in caplog.text
    np.testing.assert_array_equal(strategy.x.numpy(), X0)


def test_global_optimizer_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="optimizer must be 'lion', 'adamw' or 'sgd', got 'adam'"):
        GlobalOptimizer(optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="encoding must be 'fp32' or 'terngrad'"):
        GlobalOptimizer(encoding="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid momentum parameter: 1\.0"):
        GlobalOptimizer(momentum=1.0)


# ---------------------------------------------------------------- Signum = Lion with β₁ = β₂
def test_signum_is_lion_with_equal_betas_hand_computed() -> None:
    # Signum (Bernstein et al.): m ← β·m + (1−β)·g, send sign(m). β = 0.5, m₀ = 0:
    # g₁ = [1, −2, 4] → m₁ = [0.5, −1, 2]; g₂ = [−2, 1, −3] → m₂ = [−0.75, 0, −0.5]
    m = torch.zeros(3)
    d1 = lion.local_step_(m, torch.tensor([1.0, -2.0, 4.0]), 0.5, 0.5)
    assert d1.tolist() == [1.0, -1.0, 1.0] and m.tolist() == [0.5, -1.0, 2.0]
    d2 = lion.local_step_(m, torch.tensor([-2.0, 1.0, -3.0]), 0.5, 0.5)
    assert d2.tolist() == [-1.0, 0.0, -1.0] and m.tolist() == [-0.75, 0.0, -0.5]


# ---------------------------------------------------------------- byte formulas
def _reply_bytes(payload_array: Array, record: str, metrics: dict) -> int:
    content = RecordDict({record: ArrayRecord({"payload": payload_array}), "m": MetricRecord(metrics)})
    return message_bytes(Message(content, dst_node_id=1, message_type="train"))


@pytest.mark.parametrize(
    ("method", "make", "formula"),
    [
        ("d-lion", lambda d: bits_array(codec.pack_signs(torch.ones(d)), d, "dlion.sign1"), lambda d: -(-d // 8)),
        ("fp32", lambda d: Array(np.ones(d, dtype=np.float32)), lambda d: 4 * d),
        (
            "terngrad",
            lambda d: encode_terngrad(torch.linspace(-1, 1, d), [d // 2, d - d // 2], torch.Generator()),
            lambda d: 8 + -(-d // 5),
        ),
        (
            "d-lion-trit",
            lambda d: Array(dtype="level", shape=(d,), stype="dlion.levels", data=b"\0" * -(-d // 5)),
            lambda d: -(-d // 5),
        ),
    ],
)
def test_measured_bytes_are_the_formula_plus_a_fixed_header(method: str, make, formula) -> None:
    metrics = {"num-examples": 64, "train-loss": 0.5}
    overheads = {d: _reply_bytes(make(d), "u", metrics) - formula(d) for d in (10_000, 100_003, 1_000_001)}
    # The header is fixed up to protobuf varints: the shape d and the byte lengths take one more
    # byte per 7 bits of size (2 bytes at most from d = 10⁴ to 10⁶ here, in each of 2–3 fields).
    assert max(overheads.values()) - min(overheads.values()) <= 6, overheads
    assert all(0 < v < 1000 for v in overheads.values()), overheads  # fp32: + the .npy header
