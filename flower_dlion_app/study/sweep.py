"""Run a grid of federations (strategy × clients × partition × seed × hyperparameters), resumably.

Usage::

    python -m flower_dlion_app.study.sweep examples/studies/study.toml [--workers 2] [--only PATTERN] [--dry-run]

The study file (TOML) names the grid, the run config shared by every cell and each
strategy's hyperparameters (a list value sweeps that key, e.g. for tuning)::

    [study]
    out = "study/fashion-mnist"          # relative to the study file
    strategies = ["dlion-vote", "fedavg"]
    num-clients = [4, 8]
    partitions = ["iid", "dirichlet-0.5", "pathological-2"]
    seeds = [0]
    seeds-by-clients = {"8" = [0, 1, 2]}   # optional: more seeds for some numbers of clients

    [common]                             # run config of every cell
    num-server-rounds = 60

    [strategy.dlion-vote]                # run config of this strategy's cells
    lr = [0.001, 0.002]

    [variant.fedavg-slow]                # listed in strategies like a strategy: another
    strategy = "fedavg"                  # strategy's settings with these keys on top
    lr = 0.03
    partitions = ["iid"]                 # optional: fewer partitions (or seeds-by-clients:
                                         # fewer seeds) for this variant

Every cell runs the real ServerApp logic (``run_federation``) and ClientApp on an
in-process Flower grid (``LocalGrid``: every message and context serialized, no Ray),
which gives the same results as ``flwr run`` (``tests/test_simulation.py``). A finished
cell is one JSON file ``<out>/cells/<name>.json`` written atomically; a cell whose file
exists with the same run config is skipped, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import os
import sys
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flower_dlion_app.config import STRATEGIES, read_config

__all__ = ["Cell", "load_study", "main", "parse_partition", "run_cell", "run_sweep"]


@dataclass(frozen=True)
class Cell:
    """One federation of the grid."""

    name: str
    strategy: str  # the run-config strategy
    label: str  # the strategy or the variant name, as the report shows it
    num_clients: int
    partition: str
    seed: int
    run_config: dict[str, Any]

    def key(self) -> str:
        """Hash of the run config: a cell file with another key is stale."""
        return hashlib.sha256(json.dumps(self.run_config, sort_keys=True).encode()).hexdigest()[:16]


def parse_partition(spec: str) -> dict[str, Any]:
    """``iid``, ``dirichlet-<alpha>``, ``pathological-<k>`` or ``shard-<k>`` → run config keys."""
    kind, _, arg = spec.partition("-")
    try:
        if kind == "iid" and not arg:
            return {"partitioner": "iid"}
        if kind == "dirichlet":
            return {"partitioner": "dirichlet", "alpha": float(arg)}
        if kind in ("pathological", "shard"):
            return {"partitioner": kind, "classes-per-partition": int(arg)}
    except ValueError:
        pass
    raise ValueError(f"partition {spec!r}: expected iid, dirichlet-<alpha>, pathological-<k> or shard-<k>")


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def load_study(path: Path) -> tuple[Path, list[Cell]]:
    """The output folder and the cells of a study file, in a fixed order."""
    spec = tomllib.loads(path.read_text())
    study = spec["study"]
    out = (path.parent / study.get("out", "study")).resolve()
    common = spec.get("common", {})
    per_strategy = spec.get("strategy", {})
    variants = spec.get("variant", {})
    unknown = sorted(set(study["strategies"]) - set(STRATEGIES) - set(variants))
    if unknown:
        known = list(STRATEGIES) + list(variants)
        raise ValueError(f"{path}: unknown strategies {unknown}; known: {known}")
    seeds_for = study.get("seeds-by-clients", {})  # e.g. {"8": [0, 1, 2]}: more seeds for some n
    cells = []
    for label in study["strategies"]:
        strategy = variants[label]["strategy"] if label in variants else label
        params = {**per_strategy.get(strategy, {}), **variants.get(label, {})}
        params.pop("strategy", None)
        label_seeds = params.pop("seeds-by-clients", seeds_for)  # a variant may run fewer seeds
        label_parts = params.pop("partitions", study["partitions"])  # … or on fewer partitions
        if not set(label_parts) <= set(study["partitions"]):
            raise ValueError(
                f"{path}: {label}'s partitions {label_parts} must be among the study's {study['partitions']}"
            )
        swept = sorted(k for k, v in params.items() if isinstance(v, list))
        fixed = {k: v for k, v in params.items() if not isinstance(v, list)}
        for values in itertools.product(*(params[k] for k in swept)):
            for n, part in itertools.product(study["num-clients"], label_parts):
                for seed in label_seeds.get(str(n), study["seeds"]):
                    cfg = {**common, **fixed, **dict(zip(swept, values, strict=True))}
                    cfg.update(parse_partition(part))
                    cfg.update({"strategy": strategy, "seed": seed})
                    read_config(cfg)  # fail early on a bad key or value
                    extra = "".join(f"_{k}{_short(v)}" for k, v in zip(swept, values, strict=True))
                    name = f"{label}_{part}_n{n}_s{seed}{extra}"
                    cells.append(Cell(name, strategy, label, n, part, seed, cfg))
    cells.sort(key=lambda c: c.seed)  # every setting's first seed before any extra seed
    return out, cells


def _is_done(out: Path, cell: Cell) -> bool:
    path = out / "cells" / f"{cell.name}.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text())["key"] == cell.key()
    except (ValueError, KeyError):
        return False


def _ran_on(device: str) -> str:
    """Where a cell's clients trained: ``cpu`` or the CUDA device's name, with torch's version."""
    import torch

    on_gpu = device != "cpu" and torch.cuda.is_available()
    where = f"cuda ({torch.cuda.get_device_name(0)})" if on_gpu else "cpu"
    return f"{where}, torch {torch.__version__}"


def run_cell(cell: Cell, out: Path, threads: int | None = None) -> dict[str, Any]:
    """Run one cell and write ``<out>/cells/<name>.json`` atomically; return its summary."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from flower_dlion.strategies.run_stops import RunStopped
    from flower_dlion_app.client_app import app as client_app
    from flower_dlion_app.local_grid import LocalGrid
    from flower_dlion_app.server_app import run_federation

    work = out / "work" / cell.name
    cfg = {**cell.run_config, "results-dir": str(work)}
    try:
        run_federation(LocalGrid(client_app, cell.num_clients, run_config=cfg), cfg, save_model=False)
    except RunStopped as err:  # a cell that cannot learn (diverged): kept, its summary says so, with the rounds it ran
        print(f"[sweep] {cell.name}: {err}", flush=True)
    summary = json.loads((work / "summary.json").read_text())
    rows, cum_up, cum_down = [], 0, 0
    for line in (work / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        cum_up += row["bytes_up"]
        cum_down += row["bytes_down"]
        if row["accuracy"] is not None:
            rows.append(
                {
                    "round": row["round"],
                    "accuracy": row["accuracy"],
                    "loss": row["loss"],
                    "train_loss": row["train_loss"],
                    "cum_bytes_up": cum_up,
                    "cum_bytes_down": cum_down,
                    "wall_time_s": row["wall_time_s"],
                }
            )
    record = {
        "name": cell.name,
        "key": cell.key(),
        "strategy": cell.strategy,
        "label": cell.label,
        "num_clients": cell.num_clients,
        "partition": cell.partition,
        "seed": cell.seed,
        "run_config": cell.run_config,
        "summary": {k: v for k, v in summary.items() if k != "config"},
        "evals": rows,
        "ran_on": _ran_on(cfg.get("device", "auto")),
    }
    path = out / "cells" / f"{cell.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a cell file is either complete or absent
    return record


def run_sweep(
    study_file: Path, *, workers: int = 1, only: str | None = None, dry_run: bool = False
) -> list[dict[str, Any]]:
    """Run every unfinished cell of a study file; print progress; return the new records."""
    out, cells = load_study(study_file)
    if only:
        cells = [c for c in cells if only in c.name]
    todo = [c for c in cells if not _is_done(out, c)]
    print(f"[sweep] {study_file}: {len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run -> {out}")
    if dry_run:
        for c in todo:
            print(f"[sweep] would run {c.name}")
        return []
    done: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def report(i: int, record: dict[str, Any]) -> None:
        s = record["summary"]
        elapsed = time.perf_counter() - t0
        eta = elapsed / i * (len(todo) - i)
        accuracy = s.get("final_accuracy")  # None: a cell that stopped (kept with its reason)
        outcome = f"{accuracy:.4f}" if accuracy is not None else f"none ({s.get('status', 'stopped')})"
        print(
            f"[sweep] {i}/{len(todo)} {record['name']}: final {s['eval_set']} accuracy {outcome}, "
            f"{s['total_mb_up']:.2f} MB up, {s['wall_time_s']:.0f} s | elapsed {elapsed / 60:.1f} min, "
            f"ETA {eta / 60:.1f} min",
            flush=True,
        )

    if workers <= 1:
        for i, cell in enumerate(todo, 1):
            done.append(run_cell(cell, out))
            report(i, done[-1])
        return done
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_cell, cell, out, max(1, (os.cpu_count() or 1) // workers)): cell for cell in todo}
        for i, fut in enumerate(as_completed(futures), 1):
            done.append(fut.result())
            report(i, done[-1])
    return done


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path, help="study file (TOML), e.g. examples/studies/study.toml")
    parser.add_argument("--workers", type=int, default=1, help="cells run in parallel (default: 1)")
    parser.add_argument("--only", help="run only cells whose name contains this text")
    parser.add_argument("--dry-run", action="store_true", help="list the cells that would run")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    run_sweep(args.study, workers=args.workers, only=args.only, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
