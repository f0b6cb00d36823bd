"""The quickstart apps (examples/quickstart-pytorch and its FedAvg original) measured: accuracy, bytes, coin flips.

    .venv/bin/python benchmarks/quickstart.py --app quickstart-pytorch [--rounds 200] [--nodes 10]
    .venv/bin/python benchmarks/quickstart.py --app quickstart-pytorch-fedavg --rounds 30 --target 0.87
    .venv/bin/python benchmarks/quickstart.py --app quickstart-pytorch --activation silu

Runs the app's own ServerApp ``main`` and ClientApp with its own run config (``pyproject.toml``,
``--rounds`` overriding ``num-server-rounds``) on the in-process grid, every message and context
serialized as on the wire, and measures the bytes of every message (``metering.MeteredGrid``).

For D-Lion it also counts the coin flips: the values of the Lion mix β₁·m + (1−β₁)·g that are
exactly 0, which a 1-bit sign cannot carry (the client sends a seeded coin flip there). The
quickstart's model uses ReLU, which gives whole units an exactly-zero gradient when they are
inactive on a batch; ``--activation silu`` swaps ``torch.nn.functional.relu`` for SiLU in this
process to compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import Context

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    apps = ("quickstart-pytorch", "quickstart-pytorch-fedavg")
    parser.add_argument("--app", default=apps[0], choices=apps)
    parser.add_argument("--rounds", type=int, default=None, help="num-server-rounds (default: the app's)")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--activation", default="relu", choices=("relu", "silu"))
    parser.add_argument("--target", type=float, action="append", default=[], help="report the MB to reach it")
    args = parser.parse_args()
    app_dir = ROOT / "examples" / args.app
    sys.path.insert(0, str(app_dir))
    if args.activation == "silu":
        F.relu = F.silu  # the model's activations, in this process only

    from flwr.supercore.task_identity import TaskIdentity
    from pytorchexample import server_app
    from pytorchexample.client_app import app as client_app

    from flower_dlion.clients import dlion
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.metering import MeteredGrid

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    cfg = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    if args.rounds is not None:
        cfg["num-server-rounds"] = args.rounds
    flips = {"zeros": 0, "values": 0}
    pack = dlion.codec.pack_local_step_

    def counting_pack(m, g, beta1, beta2, generator=None, **kwargs):
        flips["zeros"] += int((m * beta1 + g * (1 - beta1) == 0).sum())
        flips["values"] += m.numel()
        return pack(m, g, beta1, beta2, generator, **kwargs)

    dlion.codec.pack_local_step_ = counting_pack
    accuracy: dict[int, float] = {}
    sent: dict[int, tuple[float, float]] = {}  # round → MB per client so far: all messages, train messages
    evaluate = server_app.global_evaluate

    def recording(server_round: int, arrays):
        result = evaluate(server_round, arrays)
        accuracy[server_round] = float(result["accuracy"])
        total = sum(e.bytes_up + e.bytes_down for e in grid.exchanges)
        train = sum(e.bytes_up + e.bytes_down for e in grid.exchanges if e.message_type == "train")
        sent[server_round] = (total / args.nodes / 1e6, train / args.nodes / 1e6)
        return result

    server_app.global_evaluate = recording
    grid = MeteredGrid(LocalGrid(client_app, args.nodes, run_config=cfg))
    os.chdir(tempfile.mkdtemp())  # the app saves final_model.pt into its working directory
    torch.manual_seed(0)
    t0 = time.perf_counter()
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=None, run_config=cfg))
    wall = time.perf_counter() - t0
    up = sum(e.bytes_up for e in grid.exchanges)
    down = sum(e.bytes_down for e in grid.exchanges)
    rounds = cfg["num-server-rounds"]
    best = max(accuracy, key=lambda r: accuracy[r])
    print(f"{args.app}, {args.nodes} nodes, {rounds} rounds, activation {args.activation}, {wall:.0f} s")
    print(f"final accuracy {accuracy[rounds]:.4f}, best {accuracy[best]:.4f} (round {best})")
    print(f"total up {up / 1e6:.2f} MB, down {down / 1e6:.2f} MB, per client {(up + down) / args.nodes / 1e6:.2f} MB")
    if flips["values"]:
        print(f"coin flips: {flips['zeros'] / flips['values']:.2%} of the uploaded signs")
    marks = sorted({r for r in accuracy if r % max(1, rounds // 8) == 0} | {rounds})
    print("round: " + ", ".join(f"{r}: {accuracy[r]:.4f}" for r in marks))
    for target in args.target:
        reached = [r for r in sorted(accuracy) if accuracy[r] >= target]
        if reached:
            total, train = sent[reached[0]]
            where = f"round {reached[0]}, {total:.2f} MB per client"
            print(f"accuracy >= {target}: {where} ({train:.2f} MB in train messages)")
        else:
            print(f"accuracy >= {target}: not reached")


if __name__ == "__main__":
    main()
