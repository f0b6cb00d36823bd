"""Run configuration: every key of ``[tool.flwr.app.config]``, its default and its check.

``DEFAULTS`` mirrors the table in ``pyproject.toml`` (a test keeps them equal), so code
that gets an empty run config (``run_simulation``, unit tests) behaves like ``flwr run``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULTS", "STRATEGIES", "read_config"]

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 200,
    "strategy": "dlion-vote",
    "lr": 0.002,
    "weight-decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.99,
    "momentum": 0.9,
    "local-epochs": 1,
    "batch-size": 64,
    "fraction-train": 1.0,
    "min-replies": 1,
    "partitioner": "dirichlet",
    "alpha": 0.5,
    "classes-per-partition": 2,
    "seed": 0,
    "eval-every": 20,
    "holdout": 0,
    "results-dir": "",
    "data-dir": "",
    "device": "auto",
}

STRATEGIES = ("dlion-vote", "dlion-mean", "signsgd-vote", "global-lion", "global-adamw", "terngrad", "fedavg")

_CHOICES = {
    "strategy": STRATEGIES,
    "partitioner": ("iid", "dirichlet", "pathological", "shard"),
    "device": ("auto", "cpu", "cuda"),
}


def read_config(run_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge ``run_config`` over :data:`DEFAULTS` and check every value.

    Raises
    ------
    ValueError
        For an unknown key, a value of the wrong type, or a value out of range.

    """
    run_config = dict(run_config or {})
    unknown = sorted(set(run_config) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown run-config keys {unknown}; known keys: {sorted(DEFAULTS)}")
    cfg = dict(DEFAULTS)
    for key, value in run_config.items():
        default = DEFAULTS[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ValueError(f"run-config '{key}' must be {type(default).__name__}, got {value!r}")
        cfg[key] = value
    for key, choices in _CHOICES.items():
        if cfg[key] not in choices:
            raise ValueError(f"run-config '{key}' must be one of {choices}, got {cfg[key]!r}")
    positive = ("num-server-rounds", "batch-size", "eval-every", "min-replies", "classes-per-partition", "local-epochs")
    for key in positive:
        if cfg[key] < 1:
            raise ValueError(f"run-config '{key}' must be >= 1, got {cfg[key]}")
    for key in ("beta1", "beta2", "momentum"):
        if not 0.0 <= cfg[key] < 1.0:
            raise ValueError(f"run-config '{key}' must be in [0, 1), got {cfg[key]}")
    if not 0 <= cfg["holdout"] < 50_000:
        raise ValueError(f"run-config 'holdout' must be in [0, 50000), got {cfg['holdout']}")
    if not 0.0 < cfg["fraction-train"] <= 1.0:
        raise ValueError(f"run-config 'fraction-train' must be in (0, 1], got {cfg['fraction-train']}")
    if cfg["alpha"] <= 0:
        raise ValueError(f"run-config 'alpha' must be > 0, got {cfg['alpha']}")
    return cfg
