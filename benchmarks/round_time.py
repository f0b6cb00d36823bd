"""End-to-end round wall time: D-Lion against Flower's FedAvg in the same simulation (issue 4, item 3).

Both run the real ServerApp logic and ClientApp on the in-process grid (``LocalGrid``: every
message and every node context through Flower's protobuf serialization), 10 clients, the
same model, one minibatch of ``--batch-size`` per client per round (FedAvg:
``local-epochs = 1``, ``local-batches = 1``), evaluation only before round 1 and after the
last round (not counted). The reference is FedAvg's round, measured in the same run; the
ratio D-Lion / FedAvg is printed for each D-Lion setting.

Usage::

    python benchmarks/round_time.py [--rounds 100] [--clients 10] [--batch-size 64] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.server_app import run_federation

SETTINGS = {
    "fedavg (1 minibatch)": {"strategy": "fedavg", "lr": 0.03, "local-batches": 1},
    "dlion-vote": {"strategy": "dlion-vote"},
    "dlion-vote, chain downlink": {"strategy": "dlion-vote", "downlink": "chain", "init": "full"},
    "dlion-vote, link 1 Mbit/s (context-coded Δs)": {"strategy": "dlion-vote", "link-mbps": 1.0},
    "dlion-vote, bf16 momentum": {"strategy": "dlion-vote", "momentum-dtype": "bfloat16"},
    "dlion-mean": {"strategy": "dlion-mean"},
}


def round_seconds(settings: dict, rounds: int, clients: int, batch_size: int, device: str) -> tuple[float, float]:
    """Seconds per round (wall minus evaluation) and MB per round, both ways."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {**settings, "num-server-rounds": rounds, "eval-every": rounds, "batch-size": batch_size}
        cfg |= {"results-dir": tmp, "device": device}
        run_federation(LocalGrid(client_app, clients, run_config=cfg), cfg, save_model=False)
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    train = summary["wall_time_s"] - summary["eval_time_s"]
    return train / rounds, (summary["total_mb_up"] + summary["total_mb_down"]) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="auto", help="the clients' device (auto: cuda if available)")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() else "none"
    logging.getLogger("flwr").setLevel(logging.WARNING)
    print(
        f"# round wall time, {args.clients} clients, {args.rounds} rounds, batch {args.batch_size}, in-process grid; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, {os.cpu_count()} CPUs; "
        f"clients on {args.device} (GPU: {gpu})\n"
    )
    print("| method | s per round | MB per round (all clients, up + down) | round time / FedAvg's |")
    print("|---|---|---|---|")
    reference = None
    for name, settings in SETTINGS.items():
        seconds, mb = round_seconds(settings, args.rounds, args.clients, args.batch_size, args.device)
        reference = reference or seconds
        print(f"| {name} | {seconds:.3f} | {mb:.2f} | **{seconds / reference:.2f}×** |")


if __name__ == "__main__":
    main()
