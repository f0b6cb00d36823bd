"""The server's side of a round: ``DistributedLion``'s ``configure_train`` and ``aggregate_train`` against FedAvg's.

Runs a strategy for ``--repeat`` + 2 rounds with n nodes that stay in sync (round 1 sends x,
round 2 the first Δ; the others are timed: the steady state, with the anchored downlink's
counts since the anchor growing) and times, each round:

* ``configure_train``: sampling, each node's message (for an in-sync node its round's Δ; the
  catch-up options nobody takes are not built), their bytes, x's checksum;
* ``aggregate_train`` on n well-formed replies (built outside the timed call): every reply's
  checks, the vote or mean of the packed signs, applying Δ to x, the round's metrics and the
  ``ArrayRecord`` of x it returns.

The reference is Flower's own ``FedAvg`` in the same run: its ``configure_train`` on the same
nodes and its ``aggregate_train`` on n float32 replies of the same model size (the weighted
average of the ``ArrayRecord`` s). The replies' payloads are random (the vote's worst case: ties
and disagreement everywhere). The runs take their rounds in turn (FedAvg's, D-Lion's, …, the order
rotating each round), so that a busy machine slows them alike; each figure is the median over the
timed rounds, each ratio against FedAvg's median of the same run.

Usage::

    python benchmarks/server_aggregate.py [--sizes 281034,11173962] [--clients 10] [--repeat 5] [--profile]
        [--before DIR] [--raw]

``--before DIR``: also the vote of the ``flower_dlion`` package in ``DIR`` (e.g. ``git archive HEAD
flower_dlion | tar -x -C DIR``), in turn with the others: before and after a change, in one run.
``--raw``: also one JSON line per size with every timed round's seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from flower_dlion.protocol import CLIENT_UPLOAD, CONFIG, HELLO, METRICS, checksum
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


Step = Callable[[int], tuple[float, float]]  # round t → seconds of its configure_train and aggregate_train


def median_seconds(times: list[float]) -> float:
    """The median of timed seconds."""
    return statistics.median(times)


def load_package(folder: str) -> ModuleType:
    """The ``flower_dlion`` package in ``folder``, imported as ``flower_dlion_before`` (beside this one)."""
    init = Path(folder) / "flower_dlion" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "flower_dlion_before", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None, f"no flower_dlion package in {folder}"
    module = importlib.util.module_from_spec(spec)
    sys.modules["flower_dlion_before"] = module
    spec.loader.exec_module(module)
    return module


def dlion_rounds(d: int, n: int, aggregation: str, seed: int, package: ModuleType | None = None) -> Step:
    """A ``DistributedLion`` (of ``package``: default this one) on d parameters and n nodes that stay in sync.

    Each call runs round t: ``configure_train``, n sign replies (payloads of ``seed``, the server's
    replica: built outside the timed calls), ``aggregate_train``; it returns the two calls' seconds.
    """
    strategy_class = DistributedLion if package is None else package.DistributedLion
    crc = checksum if package is None else package.protocol.checksum
    x0 = np.random.default_rng(1).standard_normal(d, dtype=np.float32)
    rng = np.random.default_rng(seed)
    payloads = [rng.bytes((d + 7) // 8) for _ in range(n + 1)]
    strategy, grid, arrays = strategy_class(aggregation=aggregation), HelloGrid(n), [ArrayRecord({"x": Array(x0)})]

    def step(t: int) -> tuple[float, float]:
        replica = crc(x0 if strategy.x is None else strategy.x)
        start = time.perf_counter()
        sent = list(strategy.configure_train(t, arrays[0], ConfigRecord({}), grid))
        configured = time.perf_counter()
        replies = []
        for i, msg in enumerate(sent):
            values = {"num-examples": 64, "train-loss": 1.0, "version": msg.content[CONFIG]["version"]}
            signs = Array(dtype="bit", shape=(d,), stype="dlion.sign1", data=payloads[(i + t) % (n + 1)])
            content = {
                CLIENT_UPLOAD: ArrayRecord({"signs": signs}),
                METRICS: MetricRecord({**values, "checksum": replica}),
            }
            replies.append(Message(RecordDict(content), reply_to=msg))
        start_aggregate = time.perf_counter()
        arrays[0], metrics = strategy.aggregate_train(t, replies)
        done = time.perf_counter()
        assert metrics is not None and metrics["num-replies"] == n, "a reply was rejected"
        return configured - start, done - start_aggregate

    return step


def fedavg_rounds(d: int, n: int, seed: int) -> Step:
    """Flower's ``FedAvg``: ``configure_train`` on n nodes, ``aggregate_train`` on n float32 replies of d parameters."""
    rng = np.random.default_rng(seed)
    strategy, grid = FedAvg(), HelloGrid(n)
    arrays = ArrayRecord({"x": Array(rng.standard_normal(d, dtype=np.float32))})
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

    def step(t: int) -> tuple[float, float]:
        start = time.perf_counter()
        sent = list(strategy.configure_train(t, arrays, ConfigRecord({}), grid))
        configured = time.perf_counter()
        aggregated, _ = strategy.aggregate_train(t, replies)
        assert aggregated is not None and len(sent) == n
        return configured - start, time.perf_counter() - configured

    return step


def interleaved(steps: dict[str, Step], repeat: int) -> dict[str, list[tuple[float, float]]]:
    """Rounds 1 … repeat + 2 of every run, in turn (the order rotating each round); rounds 1 and 2 not kept.

    Round 1 sends x and round 2 the first Δ: the steady state (every node in sync) starts at round 3.
    """
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    names = list(steps)
    for t in range(1, repeat + 3):
        for name in names[t % len(names) :] + names[: t % len(names)]:
            seconds = steps[name](t)
            if t > 2:
                times[name].append(seconds)
    return times


def profile_vote(d: int, n: int, repeat: int) -> None:
    """cProfile of D-Lion's vote ``aggregate_train`` over ``repeat`` rounds: the share of its main parts."""
    profiler, real = cProfile.Profile(), DistributedLion.aggregate_train

    def profiled(self: DistributedLion, server_round: int, *args: object) -> tuple:
        if server_round > 2:
            profiler.enable()
        try:
            return real(self, server_round, *args)
        finally:
            profiler.disable()

    DistributedLion.aggregate_train = profiled  # type: ignore[method-assign]
    try:
        interleaved({"vote": dlion_rounds(d, n, "vote", 0)}, repeat)
    finally:
        DistributedLion.aggregate_train = real  # type: ignore[method-assign]
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    cumulative = {f"{Path(file).name}:{name}": entry[3] for (file, _, name), entry in stats.items()}
    total = cumulative["dlion.py:aggregate_train"]
    parts = ["protocol.py:message_bytes", "uplink.py:check_reply", "votes.py:aggregate_packed"]
    parts += ["quantizers.py:apply_delta_", "downlink.py:apply_levels", "common.py:arrays"]
    inner = ["votes.py:count_planes", "votes.py:majority_masks", "levels.py:_levels_from_planes"]
    inner += ["levels.py:encode_levels", "votes.py:_popcount"]

    def shares(keys: list[str]) -> str:
        return ", ".join(f"{key.split(':')[1]} {100 * cumulative.get(key, 0.0) / total:.0f}%" for key in keys)

    print(
        f"\nd = {d:,}, vote, {repeat} rounds under cProfile, share of aggregate_train: {shares(parts)} "
        f"(in aggregate_packed: {shares(inner)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="281034,11173962", help="model sizes d")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (after 2 untimed ones)")
    parser.add_argument("--profile", action="store_true", help="then profile the vote's parts at each size")
    parser.add_argument("--before", metavar="DIR", help="also the vote of the flower_dlion package in DIR, in turn")
    parser.add_argument("--raw", action="store_true", help="also every timed round's seconds, one JSON line a size")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0  # building messages outside a run
    before = load_package(args.before) if args.before else None
    print(
        f"# server configure_train and aggregate_train, {args.clients} nodes in sync, rounds in turn; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| d | call | FedAvg | run | D-Lion | / FedAvg |")
    print("|---|---|---|---|---|---|")
    for d in (int(float(s)) for s in args.sizes.split(",")):
        steps = {"FedAvg": fedavg_rounds(d, args.clients, 0)}
        if before is not None:
            steps["vote (before)"] = dlion_rounds(d, args.clients, "vote", 0, before)
        steps |= {"vote": dlion_rounds(d, args.clients, "vote", 0), "mean": dlion_rounds(d, args.clients, "mean", 0)}
        times = interleaved(steps, args.repeat)
        for i, call in enumerate(("configure_train", "aggregate_train")):
            reference = median_seconds([r[i] for r in times["FedAvg"]])
            for name in list(steps)[1:]:
                t = median_seconds([r[i] for r in times[name]])
                print(
                    f"| {d:,} | {call} | {reference * 1e3:.1f} ms | {name} | {t * 1e3:.1f} ms "
                    f"| **{t / reference:.2f}×** |"
                )
        if args.raw:
            print(json.dumps({"d": d, **times}))
    if args.profile:
        for d in (int(float(s)) for s in args.sizes.split(",")):
            profile_vote(d, args.clients, args.repeat)


if __name__ == "__main__":
    main()
