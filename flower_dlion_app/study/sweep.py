"""Run a grid of federations (strategy × clients × partition × seed × hyperparameters), resumably.

Usage::

    python -m flower_dlion_app.study.sweep examples/studies/study.toml [--workers 2] [--only PATTERN] [--dry-run]

The study file's format and its checks are in `flower_dlion_app.study.studyfile`; one cell's
run, and the check of its partitions, in `flower_dlion_app.study.runner`.

A finished cell is one JSON file ``<out>/cells/<name>.json`` (with its per-round CSV beside it);
a cell whose file exists with the same run config and thread count is skipped, and a cell
killed mid-run goes on from its last checkpoint (the study's ``checkpoint-every``,
`flower_dlion_app.study.runner.resume_keys`), so an interrupted sweep resumes where it stopped.

A cell's result does not depend on ``--workers``: every cell runs with ``threads`` torch CPU
threads (the study's ``threads``, default 1), whichever number of workers runs it, each worker
a fresh (spawned) process. A cell that ran with another thread count runs again; cells written
before the count was recorded are kept, and the sweep says how many there are.

Before anything runs (and with ``--dry-run``), the partitions of every cell to run are checked
(`flower_dlion_app.study.runner.check_partitions`): a cell whose partitioning leaves a class or
a client without data is refused unless the study sets ``allow-empty = true``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from flower_dlion_app.study.coverage import partition_key
from flower_dlion_app.study.runner import check_partitions, model_digest, run_cell
from flower_dlion_app.study.studyfile import (
    STUDY_KEYS,
    Cell,
    StudyError,
    cell_matches,
    load_study,
    parse_partition,
)

__all__ = [
    "STUDY_KEYS",
    "Cell",
    "StudyError",
    "build_parser",
    "cell_matches",
    "check_partitions",
    "load_study",
    "main",
    "model_digest",
    "parse_partition",
    "run_cell",
    "run_sweep",
]


def _state(out: Path, cell: Cell) -> str:
    """``todo``, ``done``, ``done-unrecorded`` (no thread count recorded) or ``other-threads``."""
    path = out / "cells" / f"{cell.name}.json"
    if not path.is_file():
        return "todo"
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return "todo"
    if not isinstance(record, dict) or record.get("key") != cell.key():
        return "todo"
    if "threads" not in record:
        return "done-unrecorded"
    return "done" if record["threads"] == cell.threads else "other-threads"


def run_sweep(
    study_file: Path, *, workers: int = 1, only: str | None = None, dry_run: bool = False
) -> list[dict[str, Any]]:
    """Run every unfinished cell of a study file; print progress; return the new records.

    Parameters
    ----------
    study_file : Path
        The study file (TOML).
    workers : int (default: 1)
        Cells run at once, each in its own process (1: one after the other, in this process). The
        results do not depend on it: every cell runs with the study's ``threads``.
    only : str | None (default: None)
        Run only the cells whose name contains this text.
    dry_run : bool (default: False)
        Check the cells to run (their partitions included) and list them; run nothing.

    Raises
    ------
    StudyError
        For a bad study file, ``workers`` < 1, or cells whose partitions leave data out (before any cell runs).

    """
    if workers < 1:
        raise StudyError(f"--workers {workers}: expected an integer >= 1 (cells run at once)")
    out, cells = load_study(study_file)
    if only:
        cells = [c for c in cells if only in c.name]
    states = {c.name: _state(out, c) for c in cells}
    todo = [c for c in cells if states[c.name] in ("todo", "other-threads")]
    threads = cells[0].threads if cells else 1
    print(
        f"[sweep] {study_file}: {len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run -> {out} "
        f"({threads} torch thread{'s' if threads > 1 else ''} per cell, {workers} worker{'s' if workers > 1 else ''})"
    )
    unrecorded = sum(state == "done-unrecorded" for state in states.values())
    if unrecorded:
        print(
            f"[sweep] {unrecorded} done cells were written before the thread count was recorded: kept as done "
            f"(delete their files in {out / 'cells'} to run them again with {threads} thread(s))"
        )
    other = [c.name for c in cells if states[c.name] == "other-threads"]
    if other:
        print(f"[sweep] {len(other)} cells ran with another thread count than {threads}: they run again")
    if workers * threads > (os.cpu_count() or 1):
        print(f"[sweep] note: {workers} workers × {threads} threads > {os.cpu_count()} CPUs: cells will share cores")
    distinct = len({partition_key(c.run_config, c.num_clients) for c in todo})
    if distinct:
        print(f"[sweep] checking the partitions of {len(todo)} cells ({distinct} distinct; computed once, cached)")
    check_partitions(todo, str(study_file))
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
            f"{s['total_mb_up']:.2f} MB up (all clients), {s['wall_time_s']:.0f} s | elapsed {elapsed / 60:.1f} min, "
            f"ETA {eta / 60:.1f} min",
            flush=True,
        )

    if workers <= 1:
        for i, cell in enumerate(todo, 1):
            done.append(run_cell(cell, out))
            report(i, done[-1])
        return done
    spawn = multiprocessing.get_context("spawn")  # fresh workers: nothing inherited that could change a result
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
        futures = {pool.submit(run_cell, cell, out): cell for cell in todo}
        for i, fut in enumerate(as_completed(futures), 1):
            done.append(fut.result())
            report(i, done[-1])
    return done


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every option with its help text)."""
    parser = argparse.ArgumentParser(
        prog="python -m flower_dlion_app.study.sweep",
        description=__doc__.splitlines()[0],
        epilog="Study-file keys of [study]: " + "; ".join(f"{k}: {v}" for k, v in STUDY_KEYS.items()) + ".",
    )
    parser.add_argument("study", type=Path, help="study file (TOML), e.g. examples/studies/study.toml")
    parser.add_argument(
        "--workers",
        type=_positive,
        default=1,
        help="cells run at once, each in its own process (default: 1); the results do not depend on it: every "
        "cell runs with the study's 'threads' torch threads (default 1)",
    )
    parser.add_argument("--only", help="run only the cells whose name contains this text (default: all)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the study and the partitions of the cells to run, list those cells, run nothing",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    try:
        run_sweep(args.study, workers=args.workers, only=args.only, dry_run=args.dry_run)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
