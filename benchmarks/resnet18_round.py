"""ResNet-18 (examples/resnet18-cifar10) on this machine: a D-Lion client round against a FedAvg local step.

    .venv/bin/python benchmarks/resnet18_round.py [--rounds 4] [--batch-size 32] [--nodes 2] [--secure]

Runs the example's own model and client code (DLionClient on 11,173,962 parameters, state in
files as the library chooses for that size) on the in-process grid, every message serialized,
and times each client's ``train`` handler from the message in to the reply out (its state
checked against its file, Δ applied, one Lion step, the pack; the file is written after the
reply). The first node of a round applies the Δ; the others find the replica it made (one
process, one replica per version). "Bookkeeping" is a round minus its own forward and backward
pass. Against it, on the same batches:

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
from flower_dlion.params import Binding
from flower_dlion.protocol import message_bytes
from flower_dlion.testing import LocalGrid

Row = tuple[int, int, float, float]  # round, node's place in it (0: first), seconds, seconds of forward + backward


def dlion_rounds(rounds: int, nodes: int, batch_size: int, secure: bool = False) -> tuple[list[Row], DistributedLion]:
    """Each client's train handler after round 1 (its seconds, its forward and backward's), and the strategy."""
    app = ClientApp()
    client = DLionClient(app, Net)
    rows: list[Row] = []
    passes: list[float] = []
    gradient = Binding.gradient

    def timed(self: Binding, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return gradient(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            passes.append(time.perf_counter() - t0)

    Binding.gradient = timed  # type: ignore[method-assign]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        loader = load_data(context.node_config["partition-id"], nodes, batch_size, "")
        passes.clear()
        t0 = time.perf_counter()
        reply = client.train(msg, context, loader)
        rnd = int(msg.metadata.group_id)
        rows.append((rnd, sum(r == rnd for r, *_ in rows), time.perf_counter() - t0, sum(passes)))
        return reply

    torch.manual_seed(0)
    strategy = DistributedLion(lr=3e-4, weight_decay=0.5, secure=secure)
    try:
        strategy.start(LocalGrid(app, nodes), ArrayRecord(Net().state_dict()), num_rounds=rounds)
    finally:
        Binding.gradient = gradient  # type: ignore[method-assign]
    client.wait()
    return [row for row in rows if row[0] > 1], strategy


def fedavg_step(batch_size: int, repeat: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Seconds of one SGD step and of the forward and backward alone, on the example's batches, on ``device``."""
    model = Net().to(device)
    images, labels = (t.to(device) for t in next(iter(load_data(0, 2, batch_size, ""))))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps, grads = [], []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        opt.step()
        sync()
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.autograd.grad(F.cross_entropy(model(images), labels), list(model.parameters()))
        sync()
        grads.append(time.perf_counter() - t0)
    return steps[1:], grads[1:]  # the first of each warms the kernels up


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
    parser.add_argument("--secure", action="store_true", help="secure aggregation (3 nodes at least)")
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    torch.manual_seed(0)
    rows, strategy = dlion_rounds(args.rounds, args.nodes, args.batch_size, args.secure)
    client = [t for _, _, t, _ in rows]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where DLionClient's "auto" computes
    step, grad = fedavg_step(args.batch_size, args.repeat + 1, device)
    down, up = fedavg_bytes()
    later = strategy.history[1:]
    d_up = statistics.median(h["bytes-up"] for h in later) / args.nodes
    d_down = statistics.median(h["bytes-down"] for h in later) / args.nodes
    med = statistics.median
    gpu = f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""
    setup = f"torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}, batch {args.batch_size}"
    setup += ", secure aggregation" if args.secure else ""
    print(f"{setup}, d = {strategy.num_parameters:,}")
    print("| per client | D-Lion round (message in → reply out) | FedAvg local step | forward + backward |")
    print("|---|---|---|---|")
    print(f"| seconds (median) | {med(client):.3f} | {med(step):.3f} | {med(grad):.3f} |")
    print(f"| ratio to the FedAvg local step | {med(client) / med(step):.2f} | 1 | {med(grad) / med(step):.2f} |")
    print()
    print("| per client round | D-Lion round (s, median) | its forward + backward | bookkeeping (ms, median) |")
    print("|---|---|---|---|")
    for name, place in (("first node of the round (applies the Δ)", True), ("the others (find it applied)", False)):
        mine = [(t, g) for _, p, t, g in rows if (p == 0) == place]
        if mine:
            book = med(1e3 * (t - g) for t, g in mine)
            print(f"| {name} | {med(t for t, _ in mine):.3f} | {med(g for _, g in mine):.3f} | {book:.1f} |")
    print()
    print("| bytes per client per round | up | down | total | ratio to FedAvg |")
    print("|---|---|---|---|---|")
    ratio = (up + down) / (d_up + d_down)
    print(f"| D-Lion (rounds 2–{args.rounds}) | {d_up:,.0f} | {d_down:,.0f} | {d_up + d_down:,.0f} | 1/{ratio:.1f} |")
    print(f"| FedAvg | {up:,} | {down:,} | {up + down:,} | 1 |")


if __name__ == "__main__":
    main()
