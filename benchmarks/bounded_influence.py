"""What the bounds of issue 34 change: the same attacks with the bounds on (today) and off (the rules before).

    .venv/bin/python benchmarks/bounded_influence.py [--seeds 0] [--rounds 10]

One attacker of 8 (Dirichlet 0.5, the ef-sign variant of examples/studies/beyond.toml: K = 20
local steps, scaled-sign upload with error feedback, 1-bit broadcast, mean; with momentum sync
every 2 rounds for the momentum attack), on the in-process grid. "off" swaps the server's rules
back to what they were before the bounds, in this process only: every client's own scales as
sent (``bounds.clip_scales`` → identity) and the plain mean of the momenta
(``bounds.median_momentum`` → mean). The final test accuracy of each run is printed as a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flower_dlion import uploads
from flower_dlion.strategies import uplink
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app
from flower_dlion_app.server_app import run_federation

EF_SIGN = {
    "strategy": "dlion-mean",
    "local-steps": 20,
    "upload": "ef-sign",
    "broadcast-bits": 1,
    "lr": 0.001,
    "init": "seed",
    "partitioner": "dirichlet",
    "alpha": 0.5,
}
ATTACKS = [
    ("honest", {}),
    ("−U, honest scales", {"byzantine-fraction": 0.125, "byzantine-mode": "flip"}),
    ("−U, scales × 10", {"byzantine-fraction": 0.125, "byzantine-mode": "scale", "byzantine-scale": 10.0}),
    ("−U, scales × 10³", {"byzantine-fraction": 0.125, "byzantine-mode": "scale", "byzantine-scale": 1e3}),
    ("−U, scales × 10³⁰", {"byzantine-fraction": 0.125, "byzantine-mode": "scale", "byzantine-scale": 1e30}),
    ("momentum sync, honest", {"momentum-sync-every": 2}),
    ("momentum sync, −U", {"momentum-sync-every": 2, "byzantine-fraction": 0.125, "byzantine-mode": "flip"}),
    (
        "momentum sync, −U, −10³·sign(m)",
        {"momentum-sync-every": 2, "byzantine-fraction": 0.125, "byzantine-mode": "momentum", "byzantine-scale": 1e3},
    ),
]


def final_accuracy(cfg: dict) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = {**cfg, "results-dir": out}
        run_federation(LocalGrid(app, 8, run_config=cfg), cfg, save_model=False)
        with open(os.path.join(out, "summary.json")) as f:
            return float(json.load(f)["final_accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    bounded = (uploads.clip_scales, uplink.median_momentum)  # where the server's code looks them up
    unbounded = (lambda s: (s, 0), lambda momenta: torch.stack(list(momenta)).mean(0))
    print(f"# 8 clients, Dirichlet 0.5, {args.rounds} rounds, seeds {args.seeds}; final test accuracy")
    print("| attacker (1 of 8) | bounds off (before) | bounds on |")
    print("|---|---|---|")
    for label, attack in ATTACKS:
        row = []
        for rules in (unbounded, bounded):
            uploads.clip_scales, uplink.median_momentum = rules
            accs = [
                final_accuracy({**EF_SIGN, **attack, "seed": s, "num-server-rounds": args.rounds, "eval-every": 10})
                for s in seeds
            ]
            row.append(f"{statistics.mean(accs):.4f}" + (f" ± {statistics.stdev(accs):.4f}" if len(accs) > 1 else ""))
        print(f"| {label} | {row[0]} | {row[1]} |", flush=True)


if __name__ == "__main__":
    main()
