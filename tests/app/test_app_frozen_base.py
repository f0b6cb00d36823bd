"""LoRA through D-Lion, bytes measured by the app's meter (library side: tests/library/test_frozen_base.py)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from flower_dlion import DistributedLion
from flower_dlion.params import ModelSpec
from flower_dlion.testing import LocalGrid
from flower_dlion_app.metering import MeteredGrid

from ..library.test_frozen_base import lora_model, make_app


# ---------------------------------------------------------------- a federation
def test_lora_through_dlion_trains_only_the_adapters_and_never_sends_the_base() -> None:
    # Prepare: 3 nodes; the server holds the same base; bytes measured on every message
    torch.manual_seed(0)
    server_model = lora_model()
    initial = ArrayRecord(server_model.state_dict())
    grid = MeteredGrid(LocalGrid(make_app(lora_model), 3))
    strategy = DistributedLion(lr=1e-3, weight_decay=0.0)
    # Execute
    result = strategy.start(grid, initial, num_rounds=3)
    # Assert: every reply valid in every round (replicas exact); the adapters moved, the base did not
    spec = ModelSpec.from_module(server_model)
    d, base_values = spec.d, sum(e.size for e in spec.of_kind("frozen"))
    assert [h["num-replies"] for h in strategy.history] == [3, 3, 3]
    assert all(h["num-rejected"] == 0 and h["checksum-mismatches"] == 0 for h in strategy.history)
    final = result.arrays.to_torch_state_dict()
    start = initial.to_torch_state_dict()
    assert list(final) == list(start)
    for e in spec.of_kind("frozen"):
        assert torch.equal(final[e.name], start[e.name]), e.name
    b = [e.name for e in spec.trainable if "lora_B" in e.name]
    assert all(not torch.equal(final[n], start[n]) for n in b)
    # round 1: the adapters in fp32 and the config, no base: at most 4·d + 1 % per message
    train = [x for x in grid.exchanges if x.message_type == "train"]
    assert len(train) == 3 and base_values >= 100 * d
    assert train[0].bytes_down / 3 <= 4 * d * 1.01
    # rounds 2–3: 1 bit per adapter value up and down, plus the reply's metrics or the round's config
    # (about 0.9 and 1.1 KB a message)
    for x in train[1:]:
        assert d / 8 < x.bytes_up / 3 <= d / 8 + 1200
        assert d / 8 < x.bytes_down / 3 <= d / 8 + 1200
