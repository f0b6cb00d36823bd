"""Round wall time on Flower's Deployment Engine, by isolation mode (issue 6, item 4).

Each row is a real deployment (``flower_dlion_app.deploy``: SuperLink + ``--nodes`` SuperNodes on
127.0.0.1, TLS, SuperNode auth) running the default D-Lion app for ``--rounds`` rounds with
evaluation only at the end. A round's time is read from the run's ``results.jsonl``
(``wall_time_s`` of consecutive rows, evaluation excluded); round 1 (hellos, first full
model) is left out. The reference, measured in the same run, is the same federation on the
in-process grid (``LocalGrid``: no processes, messages and contexts still serialized): the
ratio is what the Deployment Engine's processes add.

Rows (Flower's default ``--isolation subprocess`` unless named: the SuperNode's
``flower-superexec`` starts one ClientApp process per message):

* ``partitions not cached`` — how the app ran before the partition cache
  (``FLOWER_DLION_CACHE`` points where nothing can be written);
* ``defaults`` — the partition cache; the ServerApp pulls for replies every 3 s (run config
  ``poll-interval = 3``: our loop at the interval of Flower's Grid, which the default 0 uses),
  the SuperExec looks for work every 1 s (Flower's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``);
* ``0.1 s polls`` — both polls every 0.1 s;
* ``--isolation process`` — the launcher starts each node's ``flower-superexec`` itself;
* ``local-steps = 4`` — four Lion steps per message (a different algorithm: see README,
  "Beyond the paper"); its row is seconds per round, i.e. per 4 steps.

Usage::

    python benchmarks/deploy_rounds.py [--rounds 8] [--nodes 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.deploy import Deployment
from flower_dlion_app.server_app import run_federation

MODES = {  # isolation, partition cache, reply poll (s), SuperExec poll (s), extra run config
    "partitions not cached": ("subprocess", False, 3.0, 1.0, ""),
    "defaults (partition cache)": ("subprocess", True, 3.0, 1.0, ""),
    "0.1 s polls": ("subprocess", True, 0.1, 0.1, ""),
    "--isolation process": ("process", True, 3.0, 1.0, ""),
    "local-steps = 4 (a round = 4 steps)": ("subprocess", True, 3.0, 1.0, " local-steps=4"),
}


def per_round(results: Path) -> list[float]:
    """Seconds of each round after the first (wall time minus evaluation)."""
    rows = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()]
    walls = [r["wall_time_s"] for r in rows if r["round"] >= 1]
    return [b - a for a, b in itertools.pairwise(walls)][:-1]  # the last row includes its evaluation


def deployed(mode: tuple, rounds: int, nodes: int, tmp: Path) -> list[float]:
    """Per-round seconds of one deployment."""
    isolation, cache, poll, superexec_poll, extra = mode
    results = tmp / "results"
    dep = Deployment(tmp / "work", nodes, isolation)
    dep.env["FLOWER_DLION_CACHE"] = str(tmp / "cache") if cache else "/dev/null/no-cache"
    dep.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(superexec_poll)
    config = f"num-server-rounds={rounds} eval-every={rounds} poll-interval={poll} results-dir='{results}'{extra}"
    try:
        dep.start_superlink()
        for i in range(nodes):
            dep.register(i)
            dep.start_supernode(i)
        record = dep.run(config, timeout=1800)
    finally:
        dep.stop()
    if record["status"] != "finished:completed":
        raise RuntimeError(f"run ended {record['status']}")
    return per_round(results)


def in_process(rounds: int, nodes: int, tmp: Path) -> list[float]:
    """Per-round seconds of the same federation on the in-process grid."""
    cfg = {"num-server-rounds": rounds, "eval-every": rounds, "results-dir": str(tmp / "local")}
    run_federation(LocalGrid(client_app, nodes, run_config=cfg), cfg, save_model=False)
    return per_round(tmp / "local")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    print(
        f"# round wall time on the Deployment Engine, {args.nodes} SuperNodes, rounds 2–{args.rounds - 1} "
        f"of {args.rounds}; {platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| how | s per round (median) | min – max | round time / in-process |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        ref = statistics.median(in_process(args.rounds, args.nodes, Path(tmp)))
    print(f"| in-process grid (reference) | {ref:.2f} | | 1.00× |")
    for name, mode in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            times = deployed(mode, args.rounds, args.nodes, Path(tmp))
        med = statistics.median(times)
        print(f"| {name} | {med:.2f} | {min(times):.2f} – {max(times):.2f} | **{med / ref:.1f}×** |", flush=True)


if __name__ == "__main__":
    main()
