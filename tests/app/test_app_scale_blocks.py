"""Scale blocks in the repository app (library side: tests/library/test_scale_blocks.py)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion import codec, quantizers
from flower_dlion.protocol import message_bytes
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.model import Net
from flower_dlion_app.server_app import build_strategy


def test_block_scales_cost_four_bytes_per_block_measured_on_the_messages() -> None:
    # Prepare: the repository CNN, K = 2, ef-sign, per tensor and per 1024 values
    d, sizes = 281_034, [p.numel() for p in Net().parameters()]
    sent = {}
    for block in (0, 1024):
        run_config = {
            "partitioner": "iid",
            "batch-size": 8,
            "strategy": "dlion-mean",
            "local-steps": 2,
            "upload": "ef-sign",
            "broadcast-bits": 1,
            "scale-block": block,
        }
        strategy = build_strategy(read_config(run_config))
        grid = LocalGrid(client_app, 2, run_config=run_config)
        torch.manual_seed(0)
        arrays = ArrayRecord(Net().state_dict())
        # Execute
        replies = grid.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord({"batch-size": 8}), grid))
        sent[block] = [message_bytes(r) for r in replies]
    # Assert: 4 bytes for each extra scale (and a few of the Array's header: its shape and length grow)
    extra = 4 * (len(quantizers.scale_blocks(sizes, 1024)) - len(sizes))
    assert len(quantizers.scale_blocks(sizes, 1024)) == sum(-(-s // 1024) for s in sizes) > 200
    assert all(extra <= b - a <= extra + 8 for a, b in zip(sent[0], sent[1024], strict=True))
    assert all(codec.packed_size(d) < b for b in sent[0])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scale-block": -1}, r"'scale-block' must be >= 0 \(0: one scale per tensor\), got -1"),
        ({"scale-block": 1024}, "'scale-block' = 1024 needs scales: upload = 'ef-sign' or 'broadcast-bits' >= 1"),
        (
            {"strategy": "fedavg", "upload": "ef-sign", "scale-block": 1024},
            r"'scale-block', 'upload'\] apply to .* only, not to 'fedavg'",
        ),
    ],
)
def test_scale_block_run_config_fails_with_name_value_and_range(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_config(changes)


def test_scale_block_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"scale_block must be >= 0 \(0: one scale per tensor\), got -2"):
        DistributedLion(upload="ef-sign", scale_block=-2)
    with pytest.raises(ValueError, match="scale_block=64 needs scales: upload='ef-sign' or broadcast_bits >= 1"):
        DistributedLion(scale_block=64)
    assert build_strategy(read_config({"upload": "ef-sign", "scale-block": 64})).scale_block == 64
