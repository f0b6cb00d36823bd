"""Per-block scales (Lion Cub, issue 30): ``scale_block`` B gives the ef-sign upload and the quantized
broadcast one float32 scale per B values of each tensor instead of one per tensor.
"""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from flower_dlion import quantizers
from flower_dlion.protocol import CONFIG
from flower_dlion.strategies import DistributedLion

from ..replies import with_arrays
from ..states import apply, node_at
from .test_strategy import X0, StubGrid, first_round, signs_reply

BLOCKS = [4, 2, 4]  # scale_block 4 on the tensors "w" (6 values) and "b" (4)


def test_scale_blocks_cut_each_tensor_into_blocks_of_b_values() -> None:
    assert quantizers.scale_blocks([6, 4], 4) == BLOCKS
    assert quantizers.scale_blocks([6, 4], 0) == [6, 4]  # one per tensor
    assert quantizers.scale_blocks([6, 4], 100) == [6, 4]
    assert quantizers.scale_blocks([3], 1) == [1, 1, 1]
    with pytest.raises(ValueError, match=r"block must be >= 0 \(0: one scale per tensor\), got -1"):
        quantizers.scale_blocks([6, 4], -1)


def test_ef_sign_with_block_scales_hand_computed_and_the_replica_follows() -> None:
    # Prepare: 3 clients send scaled signs with a scale per block; the third lies about block 1
    strategy = DistributedLion(
        aggregation="mean", lr=0.1, weight_decay=0.0, upload="ef-sign", broadcast_bits=1, scale_block=4
    )
    sent = first_round(strategy, [1, 2, 3])
    assert sent[1].content[CONFIG]["scale-block"] == 4
    signs = [[1, 1, -1, -1, 1, -1, 1, 1, -1, 1], [1, -1, -1, 1, 1, -1, -1, 1, -1, 1], [-1] * 10]
    claimed = [np.array(c, np.float32) for c in ([2.0, 1.0, 0.5], [1.0, 3.0, 0.25], [1e30, 5.0, 1.0])]
    replies = [
        with_arrays(sent[n], signs_reply(sent[n], signs[n - 1]), scales=Array(claimed[n - 1])) for n in (1, 2, 3)
    ]
    # Execute
    _, metrics = strategy.aggregate_train(1, replies)
    nxt = strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    # Assert: each block's scales cut to the block's lower median (2, 3, 0.5): the liar's first two
    # blocks are cut; the mean of the scaled signs, then a scaled sign per block (mean |·| of the block)
    assert metrics["clipped-scales"] == 3  # the liar's three: 1e30 > 2, 5 > 3, 1 > 0.5
    cut = [np.minimum(c, [2.0, 3.0, 0.5]).astype(np.float32) for c in claimed]
    mean = sum(np.array(s) * np.repeat(c, BLOCKS) for s, c in zip(signs, cut, strict=True)).astype(np.float32) / 3
    scales = [np.abs(mean[a : a + n]).mean() for a, n in zip((0, 4, 6), BLOCKS, strict=True)]
    sent_delta = np.where(mean >= 0, 1.0, -1.0) * np.repeat(np.array(scales, np.float32), BLOCKS)
    np.testing.assert_allclose(strategy.x.numpy(), X0 - 0.1 * sent_delta, rtol=1e-6)
    # … the broadcast carries 3 scales, and a replica applies it to exactly the server's x
    cfg = nxt[0].content[CONFIG]
    assert cfg["scale-block"] == 4 and len(cfg["scales"]) == 3
    state = apply(nxt[0].content, node_at(X0), strategy.spec)
    assert torch.equal(state.replica.x, strategy.x)


def test_a_reply_with_one_scale_per_tensor_is_rejected_under_block_scales() -> None:
    strategy = DistributedLion(aggregation="mean", lr=0.1, upload="ef-sign", broadcast_bits=1, scale_block=4)
    sent = first_round(strategy, [1, 2])
    good = with_arrays(sent[1], signs_reply(sent[1], [1] * 10), scales=Array(np.ones(3, np.float32)))
    per_tensor = with_arrays(sent[2], signs_reply(sent[2], [1] * 10), scales=Array(np.ones(2, np.float32)))
    # Execute
    _, metrics = strategy.aggregate_train(1, [good, per_tensor])
    # Assert
    assert metrics["num-replies"] == 1 and metrics["num-rejected"] == 1
