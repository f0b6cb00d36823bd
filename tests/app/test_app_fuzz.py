"""Hostile replies to the repository app's gradient baseline (the library's side: tests/library/test_fuzz.py)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from flower_dlion_app.strategies import GlobalOptimizer

from ..library.test_fuzz import _quiet_flwr_logger, any_bytes, names  # noqa: F401 (the autouse fixture)


@settings(max_examples=500, deadline=None)
@given(data=any_bytes, shape=st.lists(st.integers(0, 20), max_size=2), dtype=st.text(max_size=8), stype=names)
def test_hostile_gradient_replies_never_crash_the_baseline_server(data, shape, dtype, stype) -> None:
    strategy = GlobalOptimizer(optimizer="lion", lr=0.01, min_train_nodes=1, min_available_nodes=1)
    arrays = ArrayRecord({"w": Array(np.ones(5, dtype=np.float32))})
    (msg,) = strategy.configure_train(1, arrays, ConfigRecord(), _StubOne())
    payload = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
    reply = Message(
        RecordDict(
            {
                "grad.update": ArrayRecord({"payload": payload}),
                "grad.metrics": MetricRecord({"num-examples": 1, "train-loss": 0.5}),
            }
        ),
        reply_to=msg,
    )
    x0 = strategy.x.clone()
    _, metrics = strategy.aggregate_train(1, [reply])
    assert metrics["num-rejected"] == 1 and torch.equal(strategy.x, x0)


class _StubOne:
    """A grid of one node (id 1, partition 0)."""

    def get_node_ids(self) -> list[int]:
        return [1]

    def send_and_receive(self, messages, *, timeout=None):
        hello = RecordDict({"hello": MetricRecord({"partition-id": 0, "version": -1})})
        return [Message(hello, reply_to=m) for m in messages]
