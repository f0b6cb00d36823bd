"""ResNet-18 (examples/resnet18-cifar10) on this machine: a D-Lion client round against a FedAvg local step.

    .venv/bin/python benchmarks/resnet18_round.py [--rounds 4] [--batch-size 32] [--nodes 2]

Runs the example's own model and client code (DLionClient on 11,173,962 parameters, state in
files as the library chooses for that size) on the in-process grid, every message serialized,
and times each client's ``train`` handler from the message in to the reply out (state file
read and written, Δ applied, one Lion step, the pack). Against it, on the same batches:

* a FedAvg local step: ``zero_grad``, forward, backward, ``SGD.step`` on one batch (what one of
  FedAvg's local steps costs; a FedAvg round is ``len(loader) × epochs`` of them);
* the forward and backward alone (what any client must spend on one batch).

Bytes per client per round are the measured message sizes (``protocol.message_bytes``): D-Lion's
reply and its Δ message in rounds after the first, FedAvg's model down and model up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "resnet18-cifar10"))

from resnetexample.task import Net, load_data

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.local_grid import LocalGrid
from flower_dlion.protocol import message_bytes


def dlion_rounds(rounds: int, nodes: int, batch_size: int) -> tuple[list[float], DistributedLion]:
    """Seconds of each client's train handler after round 1, and the strategy (its byte metrics)."""
    app = ClientApp()
    client = DLionClient(app, Net)
    times: list[tuple[int, float]] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        loader = load_data(context.node_config["partition-id"], nodes, batch_size, "")
        t0 = time.perf_counter()
        reply = client.train(msg, context, loader)
        times.append((int(msg.metadata.group_id), time.perf_counter() - t0))
        return reply

    torch.manual_seed(0)
    strategy = DistributedLion(lr=3e-4, weight_decay=0.5)
    strategy.start(LocalGrid(app, nodes), ArrayRecord(Net().state_dict()), num_rounds=rounds)
    return [t for r, t in times if r > 1], strategy


def fedavg_step(batch_size: int, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds of one SGD step and of the forward and backward alone, on the example's batches."""
    model = Net()
    images, labels = next(iter(load_data(0, 2, batch_size, "")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps, grads = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.autograd.grad(F.cross_entropy(model(images), labels), list(model.parameters()))
        grads.append(time.perf_counter() - t0)
    return steps, grads


def fedavg_bytes() -> tuple[int, int]:
    """Bytes of FedAvg's train message (the model and its config) and of a reply (the model and metrics)."""
    arrays = ArrayRecord(Net().state_dict())
    down = Message(
        RecordDict({"arrays": arrays, "config": ConfigRecord({"lr": 0.05, "server-round": 2})}),
        dst_node_id=1,
        message_type="train",
        group_id="2",
    )
    down.metadata.__dict__["_message_id"] = "0" * 64
    up = Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1000})}), reply_to=down)
    return message_bytes(down), message_bytes(up)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    torch.manual_seed(0)
    client, strategy = dlion_rounds(args.rounds, args.nodes, args.batch_size)
    step, grad = fedavg_step(args.batch_size, args.repeat)
    down, up = fedavg_bytes()
    later = strategy.history[1:]
    d_up = statistics.median(h["bytes-up"] for h in later) / args.nodes
    d_down = statistics.median(h["bytes-down"] for h in later) / args.nodes
    med = statistics.median
    setup = f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size}"
    print(f"{setup}, d = {strategy.num_parameters:,}")
    print("| per client | D-Lion round (message in → reply out) | FedAvg local step | forward + backward |")
    print("|---|---|---|---|")
    print(f"| seconds (median) | {med(client):.3f} | {med(step):.3f} | {med(grad):.3f} |")
    print(f"| ratio to the FedAvg local step | {med(client) / med(step):.2f} | 1 | {med(grad) / med(step):.2f} |")
    print()
    print("| bytes per client per round | up | down | total | ratio to FedAvg |")
    print("|---|---|---|---|---|")
    ratio = (up + down) / (d_up + d_down)
    print(f"| D-Lion (rounds 2–{args.rounds}) | {d_up:,.0f} | {d_down:,.0f} | {d_up + d_down:,.0f} | 1/{ratio:.1f} |")
    print(f"| FedAvg | {up:,} | {down:,} | {up + down:,} | 1 |")


if __name__ == "__main__":
    main()
