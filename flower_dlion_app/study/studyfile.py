"""A study file: its tables and keys, checked, and the cells of its grid.

The study file (TOML) names the grid, the run config shared by every cell and each
strategy's hyperparameters (a list value sweeps that key, e.g. for tuning)::

    [study]
    out = "study/fashion-mnist"          # relative to the study file
    strategies = ["dlion-vote", "fedavg"]
    num-clients = [4, 8]
    partitions = ["iid", "dirichlet-0.5", "pathological-2"]
    seeds = [0]
    seeds-by-clients = {"8" = [0, 1, 2]}   # optional: more seeds for some numbers of clients
    threads = 1                          # optional: torch's CPU threads in every cell (default 1)
    checkpoint-every = 10                # optional: a cell's checkpoint interval in rounds (0: none)
    allow-empty = false                  # optional: run partitions that leave a class or a client out

    [common]                             # run config of every cell
    num-server-rounds = 60

    [strategy.dlion-vote]                # run config of this strategy's cells
    lr = [0.001, 0.002]

    [variant.fedavg-slow]                # listed in strategies like a strategy: another
    strategy = "fedavg"                  # strategy's settings with these keys on top
    lr = 0.03
    partitions = ["iid"]                 # optional: fewer partitions (or seeds-by-clients:
                                         # fewer seeds) for this variant

`load_study` checks every table, key and value before anything runs: a bad one is a `StudyError`
that names the file, the key, its value and what is allowed (``STUDY_KEYS``). A cell is one
federation of the grid (`Cell`); its name carries its method, partition, number of clients, seed
and swept values, and its run config's hash (`Cell.key`) tells whether a cell file is its result
(`cell_matches`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flower_dlion_app.config import DLION_STRATEGIES, FEDAVG_FAMILY, STRATEGIES, read_config

__all__ = ["STUDY_KEYS", "Cell", "StudyError", "cell_matches", "load_study", "parse_partition"]

TABLES = ("study", "common", "strategy", "variant")
STUDY_KEYS = {
    "out": 'the output folder, relative to the study file: a string (default "study")',
    "strategies": "the methods: a non-empty list of strategy or variant names",
    "num-clients": "a non-empty list of numbers of clients, integers >= 1",
    "partitions": "a non-empty list of iid, dirichlet-<alpha>, pathological-<k> or shard-<k>",
    "seeds": "a non-empty list of integer seeds",
    "seeds-by-clients": 'a table from a number of clients to a list of integer seeds, e.g. {"8" = [0, 1, 2]}',
    "threads": "torch's CPU threads in every cell: an integer >= 1 (default 1)",
    "allow-empty": "whether to run cells whose partitions leave a class or a client without data: "
    "true or false (default false)",
    "checkpoint-every": "rounds between a cell's checkpoints, from which an interrupted cell goes on (our "
    "strategies; Flower's FedAvg family has none): an integer >= 0, 0 for none (default 10)",
}
REQUIRED = ("strategies", "num-clients", "partitions", "seeds")


class StudyError(ValueError):
    """A study file, or a cell of it, that cannot run as written; the message says where and what is allowed."""


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
    threads: int = 1  # torch's CPU threads while the cell runs
    allow_empty: bool = False  # run even if the partitions leave a class or a client without data
    checkpoint_every: int = 0  # rounds between the cell's checkpoints (0: none); not part of its result

    def key(self) -> str:
        """Hash of the run config: a cell file with another key is stale."""
        return hashlib.sha256(json.dumps(self.run_config, sort_keys=True).encode()).hexdigest()[:16]

    def checkpoint_config(self, work: Path) -> dict[str, Any]:
        """The run-config keys of the cell's checkpoints in folder ``work`` (none with ``checkpoint_every`` 0).

        ``checkpoint-every``, and for D-Lion, whose clients keep state, ``client-state-dir``
        (``<work>/client-state`` unless the cell names one), so that a resumed cell finds it.
        """
        if not self.checkpoint_every:
            return {}
        keys: dict[str, Any] = {"checkpoint-every": self.checkpoint_every}
        if self.strategy in DLION_STRATEGIES:
            keys["client-state-dir"] = self.run_config.get("client-state-dir") or str(work / "client-state")
        return keys


def parse_partition(spec: str) -> dict[str, Any]:
    """``iid``, ``natural``, ``dirichlet-<alpha>``, ``pathological-<k>`` or ``shard-<k>`` → run config keys."""
    kind, _, arg = spec.partition("-")
    try:
        if kind in ("iid", "natural") and not arg:
            return {"partitioner": kind}
        if kind == "dirichlet":
            return {"partitioner": "dirichlet", "alpha": float(arg)}
        if kind in ("pathological", "shard"):
            return {"partitioner": kind, "classes-per-partition": int(arg)}
    except ValueError:
        pass
    raise ValueError(f"partition {spec!r}: expected iid, natural, dirichlet-<alpha>, pathological-<k> or shard-<k>")


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _toml(value: Any) -> str:
    """A value as the study file spells it (``true``, ``"x"``, ``[1, 2]``)."""
    return json.dumps(value, default=str)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_study_table(path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The ``[study]`` table with its defaults, after checking every table and key of the study file.

    Raises
    ------
    StudyError
        Naming the file, the table or key, its value and what is allowed.

    """
    unknown = sorted(set(spec) - set(TABLES))
    if unknown:
        allowed = "[study], [common], [strategy.<name>] and [variant.<name>]"
        raise StudyError(f"{path}: unknown tables {unknown}; a study file has {allowed}")
    study = spec.get("study")
    if not isinstance(study, dict):
        raise StudyError(f"{path}: no [study] table; it needs {', '.join(REQUIRED)}")
    for key, value in study.items():
        if key not in STUDY_KEYS:
            raise StudyError(f"{path}: [study] {key} = {_toml(value)}: unknown key; allowed: {', '.join(STUDY_KEYS)}")
    missing = [k for k in REQUIRED if k not in study]
    if missing:
        raise StudyError(f"{path}: [study] misses {', '.join(missing)} ({'; '.join(STUDY_KEYS[k] for k in missing)})")
    defaults = {"out": "study", "seeds-by-clients": {}, "threads": 1, "allow-empty": False, "checkpoint-every": 10}
    study = {**defaults, **study}

    def bad(key: str) -> StudyError:
        return StudyError(f"{path}: [study] {key} = {_toml(study[key])}: expected {STUDY_KEYS[key]}")

    def int_list(value: Any, least: int | None = None) -> bool:
        return (
            isinstance(value, list) and bool(value) and all(_is_int(v) and (least is None or v >= least) for v in value)
        )

    if not isinstance(study["out"], str) or not study["out"]:
        raise bad("out")
    if not isinstance(study["strategies"], list) or not study["strategies"]:
        raise bad("strategies")
    if not all(isinstance(s, str) for s in study["strategies"]):
        raise bad("strategies")
    if not int_list(study["num-clients"], least=1):
        raise bad("num-clients")
    if not int_list(study["seeds"]):
        raise bad("seeds")
    parts = study["partitions"]
    if not isinstance(parts, list) or not parts or not all(isinstance(p, str) for p in parts):
        raise bad("partitions")
    for part in parts:
        try:
            parse_partition(part)
        except ValueError as err:
            raise StudyError(f"{path}: [study] partitions = {_toml(parts)}: {err}") from err
    by_clients = study["seeds-by-clients"]
    if not isinstance(by_clients, dict) or not all(str(k).isdigit() and int_list(v) for k, v in by_clients.items()):
        raise bad("seeds-by-clients")
    if not _is_int(study["threads"]) or study["threads"] < 1:
        raise bad("threads")
    if not isinstance(study["allow-empty"], bool):
        raise bad("allow-empty")
    if not _is_int(study["checkpoint-every"]) or study["checkpoint-every"] < 0:
        raise bad("checkpoint-every")
    return study


def load_study(path: Path) -> tuple[Path, list[Cell]]:
    """The output folder and the cells of a study file, in a fixed order.

    Raises
    ------
    StudyError
        When a table, key or value of the study file is not allowed (the message says which and why).

    """
    try:
        spec = tomllib.loads(path.read_text())
    except OSError as err:
        raise StudyError(f"{path}: cannot read the study file: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise StudyError(f"{path}: not valid TOML: {err}") from err
    study = _check_study_table(path, spec)
    out = (path.parent / study["out"]).resolve()
    common = spec.get("common", {})
    per_strategy = spec.get("strategy", {})
    variants = spec.get("variant", {})
    unknown = sorted(set(study["strategies"]) - set(STRATEGIES) - set(variants))
    if unknown:
        known = list(STRATEGIES) + list(variants)
        raise StudyError(f"{path}: unknown strategies {unknown}; known: {known}")
    seeds_for = study["seeds-by-clients"]  # e.g. {"8": [0, 1, 2]}: more seeds for some n
    cells = []
    for label in study["strategies"]:
        if label in variants and variants[label].get("strategy") not in STRATEGIES:
            raise StudyError(
                f"{path}: [variant.{label}] strategy = {_toml(variants[label].get('strategy'))}: expected one of "
                f"{list(STRATEGIES)}"
            )
        strategy = variants[label]["strategy"] if label in variants else label
        params = {**per_strategy.get(strategy, {}), **variants.get(label, {})}
        params.pop("strategy", None)
        label_seeds = params.pop("seeds-by-clients", seeds_for)  # a variant may run fewer seeds
        label_parts = params.pop("partitions", study["partitions"])  # … or on fewer partitions
        if not set(label_parts) <= set(study["partitions"]):
            raise StudyError(
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
                    extra = "".join(f"_{k}{_short(v)}" for k, v in zip(swept, values, strict=True))
                    name = f"{label}_{part}_n{n}_s{seed}{extra}"
                    every = 0 if strategy in FEDAVG_FAMILY else study["checkpoint-every"]  # Flower's: no checkpoints
                    cell = Cell(
                        name, strategy, label, n, part, seed, cfg, study["threads"], study["allow-empty"], every
                    )
                    try:  # fail early on a bad key or value
                        read_config({**cfg, **cell.checkpoint_config(out / "work" / name)})
                    except ValueError as err:
                        raise StudyError(f"{path}: cell {name}: {err}") from err
                    cells.append(cell)
    cells.sort(key=lambda c: c.seed)  # every setting's first seed before any extra seed
    return out, cells


def cell_matches(record: dict[str, Any], cell: Cell) -> bool:
    """Whether a cell file is this cell's result: the same run config and the same thread count.

    A file written before the thread count was recorded (no ``threads``) matches on its run config alone.
    """
    return record.get("key") == cell.key() and record.get("threads", cell.threads) == cell.threads
