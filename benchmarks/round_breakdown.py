"""Where the wall time of a federation goes: client compute, evaluation, messaging, client state.

Runs one cell in-process (``LocalGrid``: every message and every node context goes through
Flower's protobuf serialization, as on a SuperLink, minus the network) and times, exclusively
(a nested timer's time is not counted twice), each part of a round:

* ``gradient``: the clients' forward and backward passes (``params.Binding.gradient``; FedAvg's
  local SGD loop is all in ``fedavg local training``);
* ``client Lion/codec``: δ, momentum, packing, applying the received Δs;
* ``client state (de)serialization``: ``context.state`` ↔ protobuf, both ways, every message;
* ``message (de)serialization``: messages ↔ protobuf, both ways;
* ``byte measurement``: ``protocol.message_bytes`` (our accounting; strategy and meter);
* ``server strategy``: ``configure_train`` + ``aggregate_train`` (validation, vote, update);
* ``evaluation``: the server's test-set evaluation every ``eval-every`` rounds;
* ``other``: the rest (Flower's loop and logging, data loading, Python).

Usage::

    python benchmarks/round_breakdown.py [--strategy dlion-vote] [--clients 10] [--rounds 200]
        [--eval-every 20] [--batch-size 64]

The reference is the training compute itself: the share of the wall time spent outside it
is printed as the overhead ratio.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flower_dlion import codec, lion, params
from flower_dlion import testing as local_grid
from flower_dlion.clients import dlion as dlion_client
from flower_dlion.clients import state_store
from flower_dlion.strategies import dlion as dlion_strategy
from flower_dlion.strategies import downlink as server_downlink
from flower_dlion.strategies import reply_check
from flower_dlion_app import metering, server_app
from flower_dlion_app.clients import fedavg as fedavg_client
from flower_dlion_app.clients import gradient as gradient_client
from flower_dlion_app.strategies import global_opt

EXCLUSIVE: dict[str, float] = defaultdict(float)
_stack: list[list[float]] = []  # per open timer: [time spent in nested timers]


def timed(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that its exclusive time is added to ``category``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stack.append([0.0])
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            nested = _stack.pop()[0]
            EXCLUSIVE[category] += elapsed - nested
            if _stack:
                _stack[-1][0] += elapsed

    return wrapper


def patch(obj: Any, name: str, category: str) -> None:
    """Replace ``obj.name`` with a timed wrapper."""
    setattr(obj, name, timed(category, getattr(obj, name)))


def instrument() -> None:
    """Put timers on every part of a round (module-level names, as the code calls them)."""
    patch(gradient_client, "flat_gradient", "gradient")
    patch(params.Binding, "gradient", "gradient")
    patch(fedavg_client, "train", "fedavg local training")
    for name in ("apply_message",):
        patch(dlion_client, name, "client Lion/codec")
    patch(lion, "local_step_", "client Lion/codec")
    patch(codec, "pack_signs", "client Lion/codec")
    patch(codec, "pack_local_step_", "client Lion/codec")
    patch(gradient_client, "encode_terngrad", "client Lion/codec")
    for name in ("load", "save"):
        patch(state_store.StateStore, name, "client state (de)serialization")
    for name in ("context_to_proto", "context_from_proto"):
        patch(local_grid, name, "client state (de)serialization")
    patch(local_grid, "_roundtrip", "message (de)serialization")
    for mod in (server_downlink, reply_check, metering):
        patch(mod, "message_bytes", "byte measurement")
    for cls in (dlion_strategy.DistributedLion, global_opt.GlobalOptimizer):
        patch(cls, "configure_train", "server strategy")
        patch(cls, "aggregate_train", "server strategy")
    patch(server_app, "evaluate", "evaluation")


def main() -> None:
    """Run one cell with timers and print the breakdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="dlion-vote")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    instrument()
    from flower_dlion_app.client_app import app as client_app

    with tempfile.TemporaryDirectory() as tmp:
        cfg = {
            "strategy": args.strategy,
            "num-server-rounds": args.rounds,
            "eval-every": args.eval_every,
            "batch-size": args.batch_size,
            "results-dir": tmp,
        }
        grid = local_grid.LocalGrid(client_app, args.clients, run_config=cfg)
        t0 = time.perf_counter()
        server_app.run_federation(grid, cfg, save_model=False)
        wall = time.perf_counter() - t0
    parts = dict(EXCLUSIVE)
    parts["other"] = wall - sum(parts.values())
    training = parts.get("gradient", 0.0) + parts.get("fedavg local training", 0.0)
    print(
        f"# {args.strategy}, {args.clients} clients, {args.rounds} rounds, batch {args.batch_size}, "
        f"eval every {args.eval_every}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'part':34s} {'seconds':>8s} {'share':>7s} {'ms/round':>9s}")
    for name, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{name:34s} {sec:8.2f} {sec / wall:7.1%} {1e3 * sec / args.rounds:9.1f}")
    print(f"{'wall':34s} {wall:8.2f} {1:7.1%} {1e3 * wall / args.rounds:9.1f}")
    print(f"overhead (everything but training compute) / wall = {(wall - training) / wall:.1%}")


if __name__ == "__main__":
    main()
