"""The server's side of a round: ``DistributedLion.aggregate_train`` against Flower's FedAvg.

Times the strategy's ``aggregate_train`` on n well-formed replies (``configure_train`` and the
replies are built outside the timed call): for D-Lion every reply's checks, the vote or mean
of the packed signs, applying Δ to x, encoding the broadcast, the round's metrics and the
``ArrayRecord`` of x it returns; for the reference, Flower's own ``FedAvg.aggregate_train``
on n float32 replies of the same model size (the weighted average of the ``ArrayRecord`` s),
measured in the same run. The replies' payloads are random (the vote's worst case: ties
and disagreement everywhere). Each figure is the median of ``--repeat`` rounds.

Usage::

    python benchmarks/server_aggregate.py [--sizes 281034,1e7] [--clients 10] [--repeat 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import platform
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from flower_dlion.protocol import CONFIG, HELLO, METRICS, UPLOAD, checksum
from flower_dlion.strategies import DistributedLion


class HelloGrid:
    """Just enough of a Grid for ``configure_train``: nodes 1 … n, each saying hello as a new node."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        hello = {"num-partitions": self.n, "version": -1}
        return [
            Message(RecordDict({HELLO: MetricRecord({**hello, "partition-id": m.metadata.dst_node_id})}), reply_to=m)
            for m in messages
        ]


def median_seconds(one_round: Callable[[], float], repeat: int) -> float:
    """Median of ``repeat`` rounds' timed seconds (after one warm-up round)."""
    one_round()
    return statistics.median(one_round() for _ in range(repeat))


def profile_vote(d: int, n: int, repeat: int, rng: np.random.Generator) -> None:
    """cProfile of D-Lion's vote ``aggregate_train`` over ``repeat`` rounds: the share of its main parts."""
    one_round = dlion_round(d, n, "vote", rng)
    one_round()
    profiler, real = cProfile.Profile(), DistributedLion.aggregate_train

    def profiled(self: DistributedLion, *args: object) -> tuple:
        profiler.enable()
        try:
            return real(self, *args)
        finally:
            profiler.disable()

    DistributedLion.aggregate_train = profiled  # type: ignore[method-assign]
    try:
        for _ in range(repeat):
            one_round()
    finally:
        DistributedLion.aggregate_train = real  # type: ignore[method-assign]
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    cumulative = {f"{Path(file).name}:{name}": entry[3] for (file, _, name), entry in stats.items()}
    total = cumulative["dlion.py:aggregate_train"]
    parts = ["protocol.py:message_bytes", "aggregation.py:check_reply", "votes.py:aggregate_packed"]
    parts += ["quantizers.py:apply_delta_", "downlink.py:apply", "common.py:arrays"]
    inner = ["votes.py:count_planes", "votes.py:majority_masks", "levels.py:_levels_from_planes"]
    inner += ["levels.py:encode_levels", "votes.py:_popcount"]

    def shares(keys: list[str]) -> str:
        return ", ".join(f"{key.split(':')[1]} {100 * cumulative.get(key, 0.0) / total:.0f}%" for key in keys)

    print(
        f"\nd = {d:,}, vote, {repeat} rounds under cProfile, share of aggregate_train: {shares(parts)} "
        f"(in aggregate_packed: {shares(inner)})"
    )


def dlion_round(d: int, n: int, aggregation: str, rng: np.random.Generator) -> Callable[[], float]:
    """One round of a fresh ``DistributedLion`` on d parameters: configure, n sign replies, timed aggregate."""
    x0 = np.random.default_rng(1).standard_normal(d, dtype=np.float32)
    payloads = [rng.bytes((d + 7) // 8) for _ in range(n)]
    replica = checksum(x0)

    def one_round() -> float:
        strategy = DistributedLion(aggregation=aggregation)
        sent = strategy.configure_train(1, ArrayRecord({"x": Array(x0)}), ConfigRecord({}), HelloGrid(n))
        replies = []
        for i, msg in enumerate(sent):
            metrics = {"num-examples": 64, "train-loss": 1.0, "version": msg.content[CONFIG]["version"]}
            signs = Array(dtype="bit", shape=(d,), stype="dlion.sign1", data=payloads[i])
            content = {UPLOAD: ArrayRecord({"signs": signs}), METRICS: MetricRecord({**metrics, "checksum": replica})}
            replies.append(Message(RecordDict(content), reply_to=msg))
        start = time.perf_counter()
        _, metrics = strategy.aggregate_train(1, replies)
        seconds = time.perf_counter() - start
        assert metrics is not None and metrics["num-replies"] == n, "a reply was rejected"
        return seconds

    return one_round


def fedavg_round(d: int, n: int, rng: np.random.Generator) -> Callable[[], float]:
    """Flower's ``FedAvg.aggregate_train`` on n float32 replies of d parameters, timed."""
    strategy = FedAvg()
    instructions = [Message(RecordDict({}), dst_node_id=i + 1, message_type="train") for i in range(n)]
    replies = [
        Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({"x": Array(rng.standard_normal(d, dtype=np.float32))}),
                    "metrics": MetricRecord({"num-examples": 64}),
                }
            ),
            reply_to=msg,
        )
        for msg in instructions
    ]

    def one_round() -> float:
        start = time.perf_counter()
        arrays, _ = strategy.aggregate_train(1, replies)
        seconds = time.perf_counter() - start
        assert arrays is not None
        return seconds

    return one_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="281034,1e7", help="model sizes d")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="then profile the vote's parts at each size")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0  # building messages outside a run
    print(
        f"# server aggregate_train, {args.clients} replies; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| d | FedAvg (float32 replies) | D-Lion vote | / FedAvg | D-Lion mean | / FedAvg |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for d in (int(float(s)) for s in args.sizes.split(",")):
        t_fedavg = median_seconds(fedavg_round(d, args.clients, rng), args.repeat)
        t_vote = median_seconds(dlion_round(d, args.clients, "vote", rng), args.repeat)
        t_mean = median_seconds(dlion_round(d, args.clients, "mean", rng), args.repeat)
        print(
            f"| {d:,} | {t_fedavg * 1e3:.1f} ms | {t_vote * 1e3:.1f} ms | **{t_vote / t_fedavg:.2f}×** "
            f"| {t_mean * 1e3:.1f} ms | **{t_mean / t_fedavg:.2f}×** |"
        )
    if args.profile:
        for d in (int(float(s)) for s in args.sizes.split(",")):
            profile_vote(d, args.clients, args.repeat, rng)


if __name__ == "__main__":
    main()
