"""The server's round costs only what it must (issue 60): no catch-up option nobody takes is coded.

``configure_train`` builds an anchored option (entropy-codes its counts) only when it can still be
the smallest (``Downlink._anchored_choice``). Every message, and every byte counted, must be what
building every option gave (``Downlink._may_win`` patched to say yes: the reference); in rounds
where every sampled node is in sync, nothing is entropy-coded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from flower_dlion import entropy
from flower_dlion.protocol import message_bytes
from flower_dlion.strategies import DistributedLion
from flower_dlion.strategies.downlink import Downlink

from .test_strategy import StubGrid, signs_reply

Wire = tuple[int, str, str, int, tuple[str, ...]]  # node, type, group, bytes, the content's object ids


def _wire(msg: Message) -> Wire:
    """A message as it goes on the wire: each object of its content by its id (a hash of its bytes), its size."""
    ids = tuple(get_all_nested_objects(msg.content).keys())
    return msg.metadata.dst_node_id, msg.metadata.message_type, msg.metadata.group_id, message_bytes(msg), ids


@contextmanager
def _counting_encodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the calls of ``entropy.encode`` (the downlink's coder) while the block runs: ``[calls]``."""
    calls, encode = [0], entropy.encode

    def counted(*args: Any, **kwargs: Any) -> bytes:
        calls[0] += 1
        return encode(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(entropy, "encode", counted)
        yield calls


def _in_sync(strategy: DistributedLion, node_ids: list[int]) -> bool:
    """Whether every node of the round holds the replica of the last round's base (it lacks only the last Δ)."""
    held = strategy.state.version_of
    return strategy.version > 0 and all(held.get(strategy.partition_of(n)) == strategy.version - 1 for n in node_ids)


# Rounds: who is connected. Round 1: three new nodes; node 2 misses rounds 3–4 (stale by 3 versions in round 5),
# node 3 is new in round 5; node 2 misses round 7 (stale by 2 in round 8); the other rounds every node is in sync.
SCHEDULE = [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]


def _stub_run(d: int, init_seed: int | None, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[int]]:
    """SCHEDULE with stub nodes (random signs, the server's replica): each round's wire, metrics and codings."""
    rng = np.random.default_rng(d)
    x0 = rng.standard_normal(d).astype(np.float32)
    strategy = DistributedLion(lr=0.01, init_seed=init_seed, anchor_every=3, state_key="cost")
    arrays = ArrayRecord({"w": Array(x0)})
    seen, in_sync_codings = [], []
    for rnd, nodes in enumerate(SCHEDULE, start=1):
        node_ids = [n + 1 for n in nodes]
        in_sync = _in_sync(strategy, node_ids)
        x = torch.from_numpy(x0.copy()) if strategy.x is None else strategy.x.clone()
        with _counting_encodes(monkeypatch) as calls:
            msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), StubGrid(node_ids)))
        if in_sync:
            in_sync_codings.append(calls[0])
        seen.append([_wire(m) for m in msgs])
        signs = [[int(v) for v in rng.choice([-1, 1], d)] for _ in msgs]
        strategy.aggregate_train(rnd, [signs_reply(m, s, x) for m, s in zip(msgs, signs, strict=True)])
        seen.append(strategy.history[-1])
    return seen, in_sync_codings


@pytest.mark.parametrize("init_seed", [None, 3])
@pytest.mark.parametrize("d", [10, 3000])  # d = 10: the float32 anchor (40 bytes) beats coded counts for stale nodes
def test_stub_nodes_get_what_every_option_built_gave(d: int, init_seed: int | None, monkeypatch) -> None:
    # Prepare / Execute: the same run, options built as they can win, then every option built (the reference)
    lazy, lazy_codings = _stub_run(d, init_seed, monkeypatch)
    monkeypatch.setattr(Downlink, "_may_win", staticmethod(lambda least, best: True))
    eager, eager_codings = _stub_run(d, init_seed, monkeypatch)
    # Assert: every message bit for bit, every byte counted; in-sync rounds code nothing without a seed option
    assert lazy == eager
    assert len(lazy_codings) == 6  # rounds 2, 3, 4, 6, 7, 9
    if init_seed is None:
        assert lazy_codings == [0] * 6 and sum(eager_codings) > 0
    # round 1 and round 5's new node get the anchor (float32) unless the seed; with d = 10 (40 bytes) round 5's
    # stale and new nodes both get it, smaller than their coded counts
    full = [h["full-syncs"] for h in lazy if isinstance(h, dict)]
    assert full == [0 if init_seed is not None else 3, 0, 0, 0, 2 if d == 10 else int(init_seed is None), 0, 0, 0, 0]


@pytest.mark.parametrize("d", [3000, (1 << 20) + 5])  # the composition; from 2²⁰ values the fused pass (numba)
def test_the_server_applies_levels_as_the_signs_gave(d: int) -> None:
    # Prepare: rounds of 2 and 3 levels, an anchor every 3; the reference does what the server did before:
    # C += L, then x = γ·xₐ − η·C (lion.anchored), the context from L (context_of), a new anchor at x
    from flower_dlion import codec
    from flower_dlion.anchored_counts import AnchoredHistory, context_of, levels_to_signs
    from flower_dlion.lion import anchored

    gen = torch.Generator().manual_seed(d)
    x0 = torch.randn(d, generator=gen)
    history = AnchoredHistory(x0.clone(), 1 - 0.01 * 0.5, 0.01, 3, entropy.blocks_of([d]), 1 << 30)
    anchor, counts, context, x = x0.clone(), torch.zeros(d, dtype=torch.int32), np.full(d, 4, np.uint8), torch.empty(d)
    for t in range(1, 8):
        num_levels = 2 + t % 2
        levels = torch.randint(0, num_levels, (d,), generator=gen).to(torch.uint8)
        packed = codec.encode_levels(levels, num_levels).numpy().tobytes()
        signs = levels_to_signs(levels, num_levels)
        # Execute: the strategy's call, into its x
        history.apply_levels(levels, num_levels, packed, out=x)
        # Assert: the same counts, x, context and anchor, bit for bit
        counts += signs
        epoch = history.epochs[-2] if history.epoch.start == t else history.epoch
        expected = anchored(anchor, counts, epoch.decay_at(t), epoch.step)
        context = context_of(signs.numpy(), context)
        if history.epoch.start == t:
            anchor, counts = expected.clone(), torch.zeros_like(counts)
        assert torch.equal(x, expected) and torch.equal(history.counts, counts) and torch.equal(history.anchor, anchor)
        assert np.array_equal(history.context, context)
