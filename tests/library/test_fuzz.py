"""Hostile replies (issue 5.4): hypothesis fuzzes the replies' contents; the server never crashes.

Each example takes a round of well-formed mock replies (``test_strategy``), breaks some of
them in one of many ways (records, arrays, bytes, metrics, errors, rounds, senders), and
checks that ``aggregate_train`` rejects exactly the broken ones, counts them, and moves x
exactly as a twin strategy that only ever saw the intact replies.
"""

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flower_dlion import codec
from flower_dlion.protocol import CLIENT_UPLOAD, METRICS
from flower_dlion.strategies import DistributedLion

from .test_strategy import SIGNS, first_round, signs_reply

NODES = [1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _quiet_flwr_logger():
    """Thousands of rejections log thousands of lines; the rejection logs are tested elsewhere."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


metric_values = st.one_of(
    st.integers(min_value=-(2**62), max_value=2**62),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.lists(st.floats(allow_nan=True), max_size=3),
)
names = st.text(min_size=0, max_size=12)
any_bytes = st.one_of(st.binary(max_size=64), st.integers(0, 200_000).map(lambda n: b"\x7f" * n))


@st.composite
def breakage(draw: st.DrawFn) -> tuple[str, object]:
    """One way to break a reply: (kind, parameters)."""
    kind = draw(
        st.sampled_from(
            [
                "extra-record",
                "missing-record",
                "record-type",
                "array-name",
                "extra-array",
                "array-dtype",
                "array-stype",
                "array-shape",
                "array-bytes",
                "metric-value",
                "metric-missing",
                "metric-extra",
                "error",
                "round",
                "stranger",
                "duplicate",
                "version",
                "checksum",
            ]
        )
    )
    return kind, draw(
        st.fixed_dictionaries(
            {
                "name": names,
                "text": st.text(max_size=40),
                "value": metric_values,
                "bytes": any_bytes,
                "shape": st.lists(st.integers(0, 40), max_size=3),
                "metric": st.sampled_from(["num-examples", "train-loss", "version", "checksum"]),
            }
        )
    )


def broken(reply: Message, instruction: Message, kind: str, p: dict) -> Message | None:
    """``reply`` broken as ``kind`` says; None when the draw happens to leave it valid."""
    content = reply.content
    delta, metrics = content[CLIENT_UPLOAD], content[METRICS]
    signs = delta["signs"]
    if kind == "extra-record":
        content[p["name"] or "x"] = (
            ConfigRecord({"a": 1}) if p["name"] not in (CLIENT_UPLOAD, METRICS) else content[CLIENT_UPLOAD]
        )
        if p["name"] in (CLIENT_UPLOAD, METRICS):
            return None
    elif kind == "missing-record":
        del content[CLIENT_UPLOAD if p["text"] < "m" else METRICS]
    elif kind == "record-type":
        content[CLIENT_UPLOAD] = MetricRecord({"signs": 1})
    elif kind == "array-name":
        if p["name"] == "signs":
            return None
        content[CLIENT_UPLOAD] = ArrayRecord({p["name"]: signs})
    elif kind == "extra-array":
        delta[p["name"] + "!"] = Array(np.zeros(2, dtype=np.float32))
    elif kind == "array-dtype":
        if p["text"] == "bit":
            return None
        delta["signs"] = Array(dtype=p["text"], shape=tuple(signs.shape), stype=signs.stype, data=signs.data)
    elif kind == "array-stype":
        if p["text"] == signs.stype:
            return None
        delta["signs"] = Array(dtype="bit", shape=tuple(signs.shape), stype=p["text"], data=signs.data)
    elif kind == "array-shape":
        if tuple(p["shape"]) == tuple(signs.shape):
            return None
        delta["signs"] = Array(dtype="bit", shape=tuple(p["shape"]), stype=signs.stype, data=signs.data)
    elif kind == "array-bytes":  # wrong length (oversized up to 200 kB, or short)
        if len(p["bytes"]) == len(signs.data):
            return None
        delta["signs"] = Array(dtype="bit", shape=tuple(signs.shape), stype=signs.stype, data=p["bytes"])
    elif kind == "metric-value":
        values = dict(metrics)
        values[p["metric"]] = p["value"]
        if isinstance(p["value"], (int, float)) and p["value"] == metrics[p["metric"]]:
            return None
        v = p["value"]
        if p["metric"] == "train-loss" and isinstance(v, (int, float)) and np.isfinite(v) and abs(v) < 2**53:
            return None  # any finite loss is a valid report
        if p["metric"] == "num-examples" and isinstance(v, int) and 1 <= v < 2**53:
            return None  # so is any count of examples
        content[METRICS] = MetricRecord(values)
    elif kind == "metric-missing":
        values = dict(metrics)
        del values[p["metric"]]
        content[METRICS] = MetricRecord(values)
    elif kind == "metric-extra":
        if p["name"] in metrics:
            return None
        content[METRICS] = MetricRecord({**dict(metrics), p["name"]: 1})
    elif kind == "error":
        return Message(Error(code=2, reason=p["text"]), reply_to=instruction)
    elif kind == "round":
        if p["text"] == reply.metadata.group_id:
            return None
        reply.metadata.group_id = p["text"]
    elif kind == "stranger":  # a reply from a node that was not asked (instead of this node's)
        to_99 = Message(RecordDict(), dst_node_id=99, message_type=MessageType.TRAIN, group_id="1")
        return Message(reply.content, reply_to=to_99)
    elif kind in ("version", "checksum"):
        values = dict(metrics)
        values[kind] = int(metrics[kind]) + 1
        content[METRICS] = MetricRecord(values)
    return reply


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    signs=st.lists(st.sampled_from(SIGNS), min_size=4, max_size=4),
    breaks=st.lists(st.tuples(st.sampled_from(NODES), breakage()), min_size=1, max_size=4),
    how=st.sampled_from(["vote", "mean"]),
)
def test_hostile_replies_are_rejected_and_never_change_x(signs, breaks, how) -> None:
    # Prepare: a twin that only sees intact replies
    strategy, twin = (DistributedLion(aggregation=how, lr=0.01, weight_decay=0.1) for _ in range(2))
    sent, sent_twin = first_round(strategy, NODES), first_round(twin, NODES)
    replies = {n: signs_reply(sent[n], s) for n, s in zip(NODES, signs, strict=True)}
    duplicated, broken_nodes = set(), set()
    for node, (kind, p) in breaks:
        if node in broken_nodes:
            continue
        if kind == "duplicate":
            duplicated.add(node)
            continue
        out = broken(replies[node], sent[node], kind, p)
        if out is not None:
            replies[node] = out
            broken_nodes.add(node)
    intact = [n for n in NODES if n not in broken_nodes]
    # a second copy of an intact reply: the first counts, the copy is rejected
    extra = [signs_reply(sent[n], signs[NODES.index(n)]) for n in sorted(duplicated) if n in intact]
    # Execute
    _, metrics = strategy.aggregate_train(1, [*replies.values(), *extra])
    twin.aggregate_train(1, [signs_reply(sent_twin[n], signs[NODES.index(n)]) for n in intact])
    # Assert
    assert metrics["num-replies"] == len(intact)
    assert metrics["num-rejected"] == len(broken_nodes) + len(extra)
    assert strategy.version == twin.version == (1 if intact else 0)
    assert torch.equal(strategy.x, twin.x)


def test_fuzz_sanity_an_intact_round_is_accepted() -> None:
    strategy = DistributedLion(lr=0.01)
    sent = first_round(strategy, NODES)
    _, metrics = strategy.aggregate_train(1, [signs_reply(sent[n], SIGNS[i]) for i, n in enumerate(NODES)])
    assert metrics["num-replies"] == 4 and metrics["num-rejected"] == 0
    assert codec.packed_size(10) == 2
