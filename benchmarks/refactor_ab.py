"""Same numbers bit for bit? Five small in-process federations, hashed, for an A/B across a refactor.

Runs the real ``ClientApp`` on ``LocalGrid`` (every message and context serialized, node ids
fixed) through ``server_app.run_federation`` and prints, per configuration, a hash of the final
model and of every round's row of ``results.jsonl`` (timings left out), the last accuracy and the
byte totals. Run it on two trees and compare the lines::

    PYTHONPATH=/path/to/old .venv/bin/python benchmarks/refactor_ab.py /tmp/ab-old
    PYTHONPATH=.            .venv/bin/python benchmarks/refactor_ab.py /tmp/ab-new

(6 clients, 6–12 rounds each; a few minutes on 2 cores.)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

import flower_dlion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.server_app import run_federation

CONFIGS: dict[str, dict[str, object]] = {
    "vote-anchored-partial": {"num-server-rounds": 12, "eval-every": 4, "fraction-train": 0.5, "min-train-nodes": 1,
                              "anchor-every": 5},
    "mean-efsign-k3-cosine": {"num-server-rounds": 8, "eval-every": 4, "strategy": "dlion-mean", "local-steps": 3,
                              "upload": "ef-sign", "broadcast-bits": 1, "scale-block": 4096, "lr-schedule": "cosine",
                              "lr": 0.001},
    "vote-sum-k2-chain-momsync": {"num-server-rounds": 8, "eval-every": 4, "local-steps": 2, "upload": "sum",
                                  "downlink": "chain", "momentum-sync-every": 3, "init": "full"},
    "fedsmu": {"num-server-rounds": 6, "eval-every": 3, "strategy": "dlion-mean", "local-optimizer": "sgd",
               "local-steps": 4, "local-lr": 0.03, "lr": 0.003},
    "kernels-on-vote": {"num-server-rounds": 6, "eval-every": 3},  # under FLOWER_DLION_KERNELS=on
}  # fmt: skip


def main(out: Path) -> None:
    """Run every configuration into ``out`` and print its hashes."""
    torch.set_num_threads(1)
    print("flower_dlion from", Path(flower_dlion.__file__).parent)
    for name, settings in CONFIGS.items():
        os.environ["FLOWER_DLION_KERNELS"] = "on" if name.startswith("kernels-on") else "auto"
        cfg = {**settings, "results-dir": str(out / name), "batch-size": 32, "device": "cpu"}
        run_federation(LocalGrid(client_app, 6, run_config=cfg), cfg, save_model=True)
        rows = [json.loads(line) for line in (out / name / "results.jsonl").read_text().splitlines()]
        rows = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]
        state = torch.load(out / name / "final_model.pt")
        model = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()[:16]
        table = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
        up, down = sum(r.get("bytes_up", 0) for r in rows), sum(r.get("bytes_down", 0) for r in rows)
        print(f"{name}: model {model} rows {table} | accuracy {rows[-1].get('accuracy')} up {up} down {down}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/refactor-ab"))
