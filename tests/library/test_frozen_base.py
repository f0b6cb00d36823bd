"""Frozen parameters are named by reference: a LoRA run's base never crosses the wire (issue 61).

A Hugging Face causal LM built from a config (offline) and wrapped in a ``peft`` LoRA adapter
goes through ``DLionClient`` unchanged: only the adapters are trained and voted. The base is
named by a checksum each side computes from its own copy; a copy that differs is refused before
round 1, naming the tensor, and nothing trains on it. Bytes are measured on the messages sent.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from flower_dlion import DistributedLion, DLionClient, params
from flower_dlion.params import LayoutError, ModelSpec, tensor_checksum
from flower_dlion.protocol import RejectedReply
from flower_dlion.strategies.nodes import described_model
from flower_dlion.testing import LocalGrid

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, CONTEXT, BATCH = 81, 32, 4


def base_model(seed: int = 0) -> nn.Module:
    """The pretrained base every node loads: a GPT-2-shaped causal LM, 4 layers of 320, from ``seed``."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=320, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(config)


def lora_model(seed: int = 0) -> nn.Module:
    """The base wrapped in rank-8 LoRA adapters on the attention projections (B = 0, A from seed 1)."""
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return peft.get_peft_model(base_model(seed), config)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A Hugging Face causal LM's own loss: labels are the inputs, shifted inside the model."""
    return model(**batch).loss


def batches(node_id: int, server_round: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(node_id * 1000 + server_round)
    ids = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=gen)
    return [{"input_ids": ids, "labels": ids}]


def make_app(model_fn) -> ClientApp:
    app = ClientApp()
    dlion = DLionClient(app, model_fn, lm_loss, state_in_context=True)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return dlion.train(msg, context, batches(context.node_id, int(msg.metadata.group_id)))

    return app


def adapters(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- the description
def test_a_lora_model_lists_its_base_as_frozen_with_checksums_that_survive_the_wire() -> None:
    # Prepare
    model = lora_model()
    # Execute
    spec = ModelSpec.from_module(model)
    # Assert: the adapters are x; the base is frozen, each tensor with its own checksum; lm_head is wte's alias
    frozen = spec.of_kind("frozen")
    assert {e.name.split(".")[-3] for e in spec.trainable} == {"lora_A", "lora_B"}
    assert sum(e.size for e in frozen) >= 100 * spec.d  # the base is at least 100× the adapters
    state = model.state_dict()
    assert all(e.checksum == tensor_checksum(state[e.name]) for e in frozen)
    assert [e.target for e in spec.of_kind("alias")] == ["base_model.model.transformer.wte.weight"]
    assert spec.rest == ()  # nothing besides x travels in a full message
    assert ModelSpec.decode(spec.encode()) == spec


def test_a_checksum_is_the_same_for_bfloat16_and_the_float32_array_flower_carries() -> None:
    # Prepare: bfloat16 → float32 is exact; one value changed by one bfloat16 step is not the same tensor
    t = torch.randn(1000, 33).to(torch.bfloat16)
    other = t.clone()
    other.view(torch.int16)[7, 3] += 1
    # Execute / Assert
    assert tensor_checksum(t) == tensor_checksum(t.float().numpy())
    assert tensor_checksum(other) != tensor_checksum(t)
    assert tensor_checksum(np.arange(5, dtype=np.int32)) == tensor_checksum(torch.arange(5))


def test_a_description_without_checksums_is_refused_naming_the_entry_and_the_version() -> None:
    # Prepare: a hello from a client that sent frozen entries by value (flower-dlion 0.2)
    import json
    import zlib

    rows = [["w", "trainable", "float32", [2]], ["base", "frozen", "float32", [3]]]
    old = zlib.compress(json.dumps(rows).encode())
    # Execute / Assert
    with pytest.raises(ValueError, match=r"frozen entry 'base' comes without its checksum: .* older than 0\.3"):
        ModelSpec.decode(old)


def test_a_node_whose_base_differs_from_the_federations_is_refused_naming_the_tensor() -> None:
    # Prepare: the federation's model (the first node's), and a node that loaded another base
    ours, theirs = ModelSpec.from_module(lora_model(0)), ModelSpec.from_module(lora_model(5))
    record = {"model": theirs.encode()}
    # Execute
    with pytest.raises(RejectedReply) as err:
        described_model(7, record, ours, None)
    # Assert: for good, naming the first base tensor and both checksums
    wte = "base_model.model.transformer.wte.weight"
    assert err.value.final
    want = ours.of_kind("frozen")[0].checksum
    assert f"tensor '{wte}'" in str(err.value) and f"checksum {want:#010x} on the server" in str(err.value)


def test_initial_arrays_with_another_base_are_refused_naming_the_tensor_and_both_checksums() -> None:
    # Prepare
    spec = ModelSpec.from_module(lora_model(0))
    arrays = {k: v.numpy() for k, v in lora_model(3).state_dict().items()}
    # Execute / Assert
    with pytest.raises(LayoutError, match=r"tensor 'base_model.model.transformer.wte.weight': a frozen parameter"):
        spec.check_arrays(arrays)
    del arrays["base_model.model.transformer.wte.weight"]  # the server may hold no copy of a frozen tensor
    with pytest.raises(LayoutError, match=r"tensor 'base_model.model.transformer.wpe.weight': a frozen"):
        spec.check_arrays(arrays)
    spec.check_arrays({k: v for k, v in arrays.items() if k in {e.name for e in spec.trainable}})  # adapters only


def test_a_server_whose_base_differs_from_every_node_stops_before_round_1_naming_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server loaded the base of seed 3, the nodes that of seed 0; the server's checksums counted
    initial = ArrayRecord(lora_model(3).state_dict())
    grid = LocalGrid(make_app(lora_model), 3)
    strategy = DistributedLion(lr=1e-3)
    caplog.set_level(logging.WARNING)
    server_side: list[tuple[int, ...]] = []

    def counted(value):  # the server's copies are numpy arrays, the nodes' torch tensors
        if isinstance(value, np.ndarray):
            server_side.append(value.shape)
        return tensor_checksum(value)

    monkeypatch.setattr(params, "tensor_checksum", counted)
    # Execute
    with pytest.raises(ValueError, match="no node can take part") as err:
        strategy.start(grid, initial, num_rounds=2)
    # Assert: no round trained; the reason names the tensor
    said = str(err.value) + " ".join(r.getMessage() for r in caplog.records)
    assert "tensor 'base_model.model.transformer.wte.weight': a frozen parameter" in said
    assert not any(h.get("num-replies") for h in strategy.history)
    assert len(server_side) == 1  # three refused hellos, the server's copy of the first tensor read once


def test_a_server_without_the_base_takes_the_first_nodes_checksums_and_returns_the_adapters() -> None:
    # Prepare: FlowerTune's way: the server's initial arrays are the adapters alone
    model = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    initial = ArrayRecord({k: v for k, v in model.state_dict().items() if k in trainable})
    grid = LocalGrid(make_app(lora_model), 2)
    strategy = DistributedLion(lr=1e-3)
    # Execute
    result = strategy.start(grid, initial, num_rounds=2)
    # Assert
    assert [h["num-replies"] for h in strategy.history] == [2, 2]
    assert set(result.arrays.keys()) == trainable
    state = model.state_dict()
    assert [e.checksum for e in strategy.spec.of_kind("frozen")] == [
        tensor_checksum(state[e.name]) for e in strategy.spec.of_kind("frozen")
    ]
