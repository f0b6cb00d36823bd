"""The character-level language models (flower_dlion_app/text_models.py): sizes, causality, tying, training.

Prepare / Execute / Assert; the federation runs on the in-process grid (every message and
context serialized as on the wire), on random token batches.
"""

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.lion import lion_step_
from flower_dlion.params import Binding, ModelSpec, cross_entropy_loss
from flower_dlion.testing import LocalGrid
from flower_dlion_app.text_models import (
    TEXT_MODELS,
    CharLSTM,
    CharTransformer,
    evaluate_text,
    gpt2_small,
    sequence_loss,
)

V, T = 81, 80


@pytest.fixture(autouse=True)
def one_thread() -> None:
    """Small models on one thread: on a busy machine, torch's threads wait on each other (conftest restores it)."""
    torch.set_num_threads(1)


def lstm_size(v: int, e: int, h: int, layers: int) -> int:
    first = 4 * h * (e + h) + 2 * 4 * h  # W_ih, W_hh, b_ih, b_hh
    later = 4 * h * (h + h) + 2 * 4 * h
    return v * e + first + (layers - 1) * later + h * v + v  # embedding, LSTMs, head (with bias)


def transformer_size(v: int, context: int, dim: int, depth: int, mlp_ratio: int = 4) -> int:
    block = dim + 3 * dim * dim + dim * dim + dim + 2 * mlp_ratio * dim * dim  # norm, qkv, proj, norm, fc, out
    return v * dim + context * dim + depth * block + dim  # tied head: counted once, with the embedding


def small_transformer() -> CharTransformer:
    return CharTransformer(dim=64, depth=2)


def tokens(seed: int, n: int = 8, t: int = T, v: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, v, (n, t), generator=gen), torch.randint(0, v, (n,), generator=gen)


# ---------------------------------------------------------------- sizes
def test_parameter_counts_are_the_formulas() -> None:
    # Execute / Assert: the LEAF LSTM, the default transformer, a smaller one and GPT-2 small (on meta)
    assert lstm_size(V, 8, 256, 2) == 820_185
    assert sum(p.numel() for p in CharLSTM().parameters()) == 820_185
    assert sum(p.numel() for p in CharLSTM(80, 8, 64, 3).parameters()) == lstm_size(80, 8, 64, 3)
    assert transformer_size(V, T, 256, 4) == 3_189_248
    assert ModelSpec.from_module(CharTransformer()).d == 3_189_248
    assert ModelSpec.from_module(small_transformer()).d == transformer_size(V, T, 64, 2)
    with torch.device("meta"):
        gpt2 = gpt2_small()
    assert sum(p.numel() for p in gpt2.parameters()) == transformer_size(50257, 1024, 768, 12) == 124_337_664
    assert set(TEXT_MODELS) == {"char-lstm", "char-transformer"}


def test_every_parameter_is_floating_point() -> None:
    for make in (CharLSTM, CharTransformer):
        assert all(p.dtype.is_floating_point for p in make().parameters())


# ---------------------------------------------------------------- the forward contract
@pytest.mark.parametrize("make", [CharLSTM, small_transformer])
def test_last_only_is_the_last_position_of_all_positions(make: Callable[[], nn.Module]) -> None:
    # Prepare
    torch.manual_seed(0)
    model = make().eval()
    x, _ = tokens(1, n=3)
    # Execute
    last, every = model(x), model(x, last_only=False)
    # Assert
    assert last.shape == (3, V) and every.shape == (3, T, V)
    torch.testing.assert_close(last, every[:, -1], rtol=1e-5, atol=1e-5)


def test_the_transformer_is_causal() -> None:
    # Prepare: the same windows, changed from position t + 1 on
    torch.manual_seed(0)
    model = CharTransformer(dim=64, depth=2, last_only=False).eval()
    x, _ = tokens(2, n=2)
    t = 37
    changed = x.clone()
    changed[:, t + 1 :] = (x[:, t + 1 :] + 1 + torch.randint(0, V - 1, x[:, t + 1 :].shape)) % V
    # Execute
    with torch.no_grad():
        a, b = model(x), model(changed)
    # Assert: positions ≤ t unchanged, the next one changed
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])


def test_a_window_longer_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="input of 81 tokens, longer than the model's context of 80"):
        small_transformer()(torch.zeros(1, 81, dtype=torch.long))


# ---------------------------------------------------------------- tying
def test_the_head_is_an_alias_of_the_embedding_and_counted_once() -> None:
    # Prepare
    model = CharTransformer()
    # Execute
    spec = ModelSpec.from_module(model)
    # Assert
    assert model.head.weight is model.tok.weight
    kinds = {e.name: e.kind for e in spec.entries}
    assert list(kinds) == list(model.state_dict())
    assert kinds["head.weight"] == "alias" and spec.of_kind("alias")[0].target == "tok.weight"
    assert kinds["tok.weight"] == "trainable" and "head.weight" not in [e.name for e in spec.trainable]
    assert spec.d == sum(p.numel() for n, p in model.state_dict().items() if n != "head.weight")
    assert not spec.buffers and not spec.of_kind("frozen")


# ---------------------------------------------------------------- training
@pytest.mark.parametrize(("make", "loss_fn"), [(CharLSTM, cross_entropy_loss), (small_transformer, sequence_loss)])
def test_one_lion_step_reduces_the_loss_on_a_fixed_batch(make: Callable[[], nn.Module], loss_fn: Callable) -> None:
    # Prepare: the library's gradient at x and its Lion step (m = 0: signSGD)
    torch.manual_seed(0)
    bound = Binding(make())
    x0, y = tokens(3)
    batch = (x0, y) if loss_fn is cross_entropy_loss else (x0, torch.roll(x0, -1, 1))
    x = bound.flat_parameters()
    m = torch.zeros_like(x)
    # Execute
    before, g = bound.gradient(x, loss_fn, batch)
    lion_step_(x, m, g, lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.99)
    bound.load_x_(x)
    with torch.no_grad():
        after = loss_fn(bound.model, batch)
    # Assert
    assert torch.isfinite(before) and float(after) < float(before)


def test_one_adamw_step_reduces_the_loss_of_both_models() -> None:
    for make in (CharLSTM, small_transformer):
        # Prepare
        torch.manual_seed(0)
        model = make()
        x, y = tokens(4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # Execute
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            after = F.cross_entropy(model(x), y)
        # Assert
        assert float(after) < loss.item(), make


def test_evaluate_text_is_the_mean_loss_and_accuracy_over_targets() -> None:
    # Prepare
    torch.manual_seed(0)
    model = CharTransformer(dim=64, depth=2).train()
    x, y = tokens(5, n=10)
    seq = torch.roll(x, -1, 1)
    # Execute: batches of 4 (a partial last one)
    last = evaluate_text(model, x, y, batch_size=4)
    every = evaluate_text(model, x, seq, batch_size=4)
    # Assert: the training mode restored; as one forward pass would give
    assert model.training
    with torch.no_grad():
        logits = model.eval()(x, last_only=False)
    assert last[0] == pytest.approx(float(F.cross_entropy(logits[:, -1], y)), rel=1e-5)
    assert last[1] == pytest.approx(float((logits[:, -1].argmax(-1) == y).float().mean()))
    assert every[0] == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), seq.flatten())), rel=1e-5)
    assert every[1] == pytest.approx(float((logits.argmax(-1) == seq).float().mean()))
    with pytest.raises(ValueError, match="targets of shape"):
        evaluate_text(model, x, y[:5])


# ---------------------------------------------------------------- a federation
@pytest.mark.parametrize("make", [CharLSTM, small_transformer], ids=["char-lstm", "char-transformer"])
def test_a_distributed_lion_federation_moves_every_value_by_lr_each_round(make: Callable[[], nn.Module]) -> None:
    # Prepare: 3 nodes (an odd vote: Δ = ±1 everywhere), no weight decay, random windows per node
    app = ClientApp()
    client = DLionClient(app, make, state_in_context=True)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return client.train(msg, context, [tokens(10 + pid, n=4), tokens(20 + pid, n=4)])

    torch.manual_seed(0)
    model = make()
    x0 = Binding(model).flat_parameters()
    lr, rounds = 1e-3, 3
    strategy = DistributedLion(lr=lr, weight_decay=0.0)
    seen: list[torch.Tensor] = []
    # Execute
    result = strategy.start(
        LocalGrid(app, 3), ArrayRecord(model.state_dict()), num_rounds=rounds,
        on_round_end=lambda rnd: seen.append(strategy.x.clone()),
    )  # fmt: skip
    # Assert: every reply valid, every round; each value moved by exactly lr (to float32 rounding)
    assert [h["num-replies"] for h in strategy.history] == [3] * rounds
    assert all(h["num-rejected"] == 0 and h["checksum-mismatches"] == 0 for h in strategy.history)
    assert all(np.isfinite(h["train-loss"]) for h in strategy.history)
    assert strategy.num_parameters == x0.numel()
    for before, after in zip([x0, *seen[:-1]], seen, strict=True):
        np.testing.assert_allclose((after - before).abs().numpy(), lr, rtol=0, atol=1e-6)
    # the returned model: every state_dict entry with its shape, the tied head equal to the embedding
    final = result.arrays.to_torch_state_dict()
    start = model.state_dict()
    assert list(final) == list(start) and all(final[k].shape == start[k].shape for k in start)
    if "head.weight" in final and isinstance(model, CharTransformer):
        assert torch.equal(final["head.weight"], final["tok.weight"])
    trained = make()
    trained.load_state_dict(final)  # strict
    assert torch.equal(Binding(trained).flat_parameters(), seen[-1])
