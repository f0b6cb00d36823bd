"""What the integrity checks cost: a ResNet-18 client round (11,173,962 values) with its checks timed.

    .venv/bin/python benchmarks/integrity_cost.py [--rounds 4] [--nodes 2] [--batch-size 32]

Runs ``benchmarks/resnet18_round.py``'s federation (the example's model and client code,
DLionClient, the in-process grid, every message serialized) and times, inside it, what a node
does to check a train message (:mod:`flower_dlion.clients.integrity`: the CRC-32 of each part
of the payload, each segment's range, x against the server's ``x-checksum``), and what the
server does to send the parts' CRC-32s (``server_downlink.payload_crc``). The ratio is the
checks' time over the client's whole round (message in → reply out), rounds 2… only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.supercore.task_identity import TaskIdentity

sys.path.insert(0, str(Path(__file__).resolve().parent))

import resnet18_round

from flower_dlion.clients import replica
from flower_dlion.strategies import downlink as server_downlink

SPENT: dict[str, list[tuple[int, float]]] = {"client": [], "server": []}  # (server round, seconds)
ROUND = [0]


def _timed(module: Any, name: str, side: str) -> None:
    """Replace ``module.name`` with a timed copy that adds its seconds to ``SPENT[side]``."""
    inner: Callable[..., Any] = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[side].append((ROUND[0], time.perf_counter() - t0))

    setattr(module, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    for name in ("check_part", "check_segment", "verified"):
        _timed(replica, name, "client")
    _timed(server_downlink, "payload_crc", "server")
    configure = server_downlink.Downlink.message_for

    def message_for(self: Any, node_id: int, server_round: int, *rest: Any, **kwargs: Any) -> Any:
        ROUND[0] = server_round
        return configure(self, node_id, server_round, *rest, **kwargs)

    server_downlink.Downlink.message_for = message_for  # type: ignore[method-assign]
    torch.manual_seed(0)
    rows, strategy = resnet18_round.dlion_rounds(args.rounds, args.nodes, args.batch_size)
    later = {r for r, *_ in rows}
    client = statistics.median(t for _, _, t, _ in rows)
    checks = sum(t for r, t in SPENT["client"] if r in later) / len(rows)  # per client round
    server = sum(t for r, t in SPENT["server"] if r in later) / len(later)  # per server round
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, d = {strategy.num_parameters:,}, "
          f"{args.nodes} nodes, rounds 2–{args.rounds}")  # fmt: skip
    print("| per round | seconds | ratio to the client round |")
    print("|---|---|---|")
    print(f"| client round (median, message in → reply out) | {client:.3f} | 1 |")
    print(f"| a node's checks (mean) | {checks:.4f} | {checks / client:.4f} |")
    print(f"| the server's payload CRC-32s (mean, all nodes) | {server:.4f} | {server / client:.4f} |")


if __name__ == "__main__":
    main()
