"""Run one cell of a study, after checking the partitions it will train on.

`run_cell` runs the real ServerApp logic (``run_federation``) and ClientApp on an in-process
Flower grid (``LocalGrid``: every message and context serialized, no Ray), which gives the same
results as ``flwr run`` (``tests/app/test_simulation.py``). It writes ``<out>/cells/<name>.json``
atomically, with the cell's metrics at every round in ``<out>/cells/<name>.csv`` beside it
(`flower_dlion_app.study.outputs`). torch runs with the cell's ``threads`` CPU threads meanwhile,
so a cell's result does not depend on how many cells run at once; the thread count and the final
model's SHA-256 (``final_model_sha256``, `model_digest`) are recorded, so two runs of a cell can
be compared bit for bit. While a cell runs, its log lines start with ``[<cell name>]``.

A cell with ``checkpoint_every`` K (the study's ``checkpoint-every``) runs with the app's own
checkpoints (``checkpoint-every`` K, its clients' state in files under ``<out>/work/<name>/``), so
a cell killed mid-run goes on from its last checkpoint when the sweep runs again (`resume_keys`),
to the same final model, bit for bit, as a run never stopped. Only a checkpoint of the same run
config and thread count is resumed; another is said and the cell starts over. The checkpoint and
the state files are removed once the cell's JSON is written.

`check_partitions` computes each cell's partitions as its clients will
(`flower_dlion_app.study.coverage`): a cell whose partitioning gives some class to no client, or
some client no data, is refused with the cell, its partition and what is missing, unless the
study sets ``allow-empty = true``. Each cell records the check (``partition_check``) and the
report shows it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from flower_dlion_app.study.coverage import cell_coverage, describe
from flower_dlion_app.study.studyfile import Cell, StudyError

__all__ = ["check_partitions", "model_digest", "resume_keys", "run_cell"]


def _ran_on(device: str) -> str:
    """Where a cell's clients trained: ``cpu`` or the CUDA device's name, with torch's version."""
    import torch

    on_gpu = device != "cpu" and torch.cuda.is_available()
    where = f"cuda ({torch.cuda.get_device_name(0)})" if on_gpu else "cpu"
    return f"{where}, torch {torch.__version__}"


def model_digest(arrays: Any) -> str:
    """SHA-256 of a model's arrays (an ``ArrayRecord``): names, dtypes, shapes and every bit of the values."""
    import numpy as np

    digest = hashlib.sha256()
    for name in sorted(arrays.keys()):
        values = np.ascontiguousarray(arrays[name].numpy())
        digest.update(f"{name}|{values.dtype.str}|{values.shape}|".encode())
        digest.update(values.tobytes())
    return digest.hexdigest()


def _left_out(problems: list[tuple[Cell, dict[str, Any]]]) -> list[str]:
    """One line per partitioning that leaves data out: what is missing, and every cell that trains on it."""
    groups: dict[tuple[str, int, int, str], list[str]] = defaultdict(list)
    for cell, check in problems:
        groups[(cell.partition, cell.num_clients, cell.seed, describe(check))].append(cell.name)
    return [
        f"  - partition {part} on {n} clients, seed {seed}: {what}; cells: {', '.join(names)}"
        for (part, n, seed, what), names in groups.items()
    ]


def _refusal(study: str, problems: list[tuple[Cell, dict[str, Any]]]) -> str:
    """The error for cells whose partitions leave data out, grouped by partitioning, each cell named."""
    head = (
        f"{study}: {len(problems)} cell(s) would train on partitions that leave data out (set "
        "allow-empty = true in [study] to run them anyway, or change the partition or the number of clients):"
    )
    return "\n".join([head, *_left_out(problems)])


def check_partitions(cells: list[Cell], study: str = "the study") -> dict[str, dict[str, Any]]:
    """Compute every cell's partitions as its clients will and check them (`flower_dlion_app.study.coverage`).

    Parameters
    ----------
    cells : list of Cell
        The cells to check.
    study : str (default: "the study")
        The study file, for the error message.

    Returns
    -------
    dict
        Each cell's ``partition_check`` by cell name.

    Raises
    ------
    StudyError
        When some cell that does not allow it (``allow-empty``) leaves a class or a client without
        data: naming each such cell, its partition, number of clients and seed, and what is missing.

    """
    checks, problems = {}, []
    for cell in cells:
        try:
            with warnings.catch_warnings():  # flwr-datasets' warning of unused classes: said below, with the cell
                warnings.filterwarnings("ignore", message="Classes: .* will NOT be used", category=UserWarning)
                checks[cell.name] = cell_coverage(cell.run_config, cell.num_clients)
        except Exception as err:  # flwr-datasets' own refusals: e.g. more clients than images, or than a class has
            raise StudyError(
                f"{study}: cell {cell.name}: partition {cell.partition} on {cell.num_clients} clients "
                f"cannot be made: {err}"
            ) from err
        if describe(checks[cell.name]) and not cell.allow_empty:
            problems.append((cell, checks[cell.name]))
    if problems:
        raise StudyError(_refusal(study, problems))
    allowed = [(cell, checks[cell.name]) for cell in cells if describe(checks[cell.name])]
    if allowed:
        lines = _left_out(allowed)
        print(f"[sweep] allow-empty = true: {len(allowed)} cell(s) run on partitions that leave data out:", flush=True)
        print("\n".join(lines), flush=True)
    return checks


def run_cell(cell: Cell, out: Path) -> dict[str, Any]:
    """Run one cell and write ``<out>/cells/<name>.json`` (and its ``.csv``) atomically; return its record.

    torch runs with ``cell.threads`` CPU threads meanwhile (the caller's count is restored after), and every
    log line starts with ``[<cell name>]``.

    Raises
    ------
    StudyError
        When the cell's partitions leave a class or a client without data and ``cell.allow_empty`` is false.

    """
    import torch

    from flower_dlion_app.study.outputs import cell_logging

    for module in ("flower_dlion_app.client_app", "flower_dlion_app.server_app"):
        importlib.import_module(module)  # before cell_logging: Flower's log handler exists, so it gets the prefix

    logging.getLogger("flwr").setLevel(logging.WARNING)  # after Flower's import, which sets its own level
    before = torch.get_num_threads()
    torch.set_num_threads(cell.threads)
    try:
        with cell_logging(cell.name):
            return _run_cell(cell, out)
    finally:
        torch.set_num_threads(before)


def _run_cell(cell: Cell, out: Path) -> dict[str, Any]:
    from flower_dlion.strategies.run_stops import RunStopped
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app as client_app
    from flower_dlion_app.server_app import run_federation
    from flower_dlion_app.study.outputs import round_rows, write_rounds_csv

    check = cell_coverage(cell.run_config, cell.num_clients)  # computed by the sweep already: cached
    if describe(check) and not cell.allow_empty:
        raise StudyError(_refusal(f"cell {cell.name}", [(cell, check)]))
    work = out / "work" / cell.name
    cfg = {**cell.run_config, "results-dir": str(work), **resume_keys(cell, work)}
    digest = None
    try:
        result = run_federation(LocalGrid(client_app, cell.num_clients, run_config=cfg), cfg, save_model=False)
        digest = model_digest(result.arrays)
    except RunStopped as err:  # a cell that cannot learn (diverged): kept, its summary says so, with the rounds it ran
        print(f"[sweep] {cell.name}: {err}", flush=True)
    summary = json.loads((work / "summary.json").read_text())
    rounds = round_rows([json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()])
    keep = ("round", "accuracy", "loss", "train_loss", "cum_bytes_up", "cum_bytes_down", "wall_time_s")
    rows = [{k: row[k] for k in keep} for row in rounds if row["accuracy"] is not None]
    identity = {
        "cell": cell.name,
        "label": cell.label,
        "strategy": cell.strategy,
        "partition": cell.partition,
        "num_clients": cell.num_clients,
        "seed": cell.seed,
    }
    write_rounds_csv(out / "cells" / f"{cell.name}.csv", identity, rounds)  # before the JSON: the JSON means done
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
        "threads": cell.threads,
        "partition_check": check,
        "final_model_sha256": digest,
    }
    path = out / "cells" / f"{cell.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a cell file is either complete or absent
    for done in (work / "checkpoint.pt", work / _STAMP):  # the cell is done: nothing to resume
        done.unlink(missing_ok=True)
    shutil.rmtree(work / "client-state", ignore_errors=True)
    return record


_STAMP = "cell.json"  # beside a cell's checkpoint: the run config's key and the thread count it was written with


def resume_keys(cell: Cell, work: Path) -> dict[str, Any]:
    """The run-config keys that make a cell resumable, with ``resume`` when an interrupted run of it left a checkpoint.

    With ``cell.checkpoint_every`` 0: none. Otherwise `Cell.checkpoint_config`, and ``resume`` =
    ``<work>/checkpoint.pt`` if that file is readable and was written by this cell's run config and
    thread count (``<work>/cell.json``). Any other checkpoint is said and the cell starts over in an
    emptied ``work`` folder.
    """
    keys = cell.checkpoint_config(work)
    if not keys:
        return {}
    ckpt, stamp = work / "checkpoint.pt", {"key": cell.key(), "threads": cell.threads}
    if ckpt.is_file():
        from flower_dlion_app.checkpoint import load_checkpoint

        try:
            if json.loads((work / _STAMP).read_text()) != stamp:
                raise ValueError("it was written with another run config or thread count")
            after = load_checkpoint(ckpt)["round"]
        except (OSError, ValueError) as err:
            print(f"[sweep] {cell.name}: not resuming from {ckpt} ({err}): starting over", flush=True)
        else:
            print(f"[sweep] {cell.name}: resuming from {ckpt} after round {after}", flush=True)
            return {**keys, "resume": str(ckpt)}
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / _STAMP).write_text(json.dumps(stamp) + "\n")
    return keys
