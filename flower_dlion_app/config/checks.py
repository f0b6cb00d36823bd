"""Checking a run config: known keys, the defaults' types, ranges, and the keys that must go together."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flower_dlion_app.config.keys import _CHOICES, DEFAULTS, DLION_ONLY, DLION_STRATEGIES, FEDAVG_FAMILY, FEDOPT

__all__ = ["read_config"]


def read_config(run_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge ``run_config`` over :data:`DEFAULTS` and check every value.

    Raises
    ------
    ValueError
        For an unknown key, a value of the wrong type, a value out of range, or keys that
        do not go together; the message names the key, the value and what is allowed.

    """
    cfg = _merged(run_config)
    for check in (_check_ranges, _check_algorithm, _check_lr_schedule, _check_local_optimizer, _check_baselines):
        check(cfg)
    _check_data(cfg)
    _check_faults(cfg)
    _check_persistence(cfg)
    return cfg


def _merged(run_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """:data:`DEFAULTS` with ``run_config`` over them: known keys, the defaults' types, allowed choices."""
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
    return cfg


NUM_CLASSES = 10  # Fashion-MNIST's classes
TRAIN_IMAGES = 60_000  # Fashion-MNIST's training images (the clients' data and the holdout)

_POSITIVE = (
    "num-server-rounds",
    "batch-size",
    "eval-every",
    "min-replies",
    "min-train-nodes",
    "min-available-nodes",
    "classes-per-partition",
    "local-epochs",
    "local-steps",
    "accumulate",
    "anchor-every",
    "max-local-batches",
    "divergence-rounds",
)


def _check_ranges(cfg: dict[str, Any]) -> None:
    """Each number on its own: within its range.

    ``lr`` and ``weight-decay`` for every strategy (the D-Lion family's constructors check them too,
    the FedAvg family's clients would take them as they are), ``seed`` as numpy seeds with it.
    """
    for key in _POSITIVE:
        if cfg[key] < 1:
            raise ValueError(f"run-config '{key}' must be >= 1, got {cfg[key]}")
    if not (math.isfinite(cfg["lr"]) and cfg["lr"] > 0):
        raise ValueError(f"run-config 'lr' must be finite and > 0, got {cfg['lr']}")
    if not (math.isfinite(cfg["weight-decay"]) and cfg["weight-decay"] >= 0):
        raise ValueError(f"run-config 'weight-decay' must be finite and >= 0, got {cfg['weight-decay']}")
    if not 0 <= cfg["seed"] < 2**32:
        raise ValueError(f"run-config 'seed' must be in [0, 2**32) (numpy's seeds), got {cfg['seed']}")
    if cfg["max-failed-rounds"] < 0:
        raise ValueError(f"run-config 'max-failed-rounds' must be >= 0 (0: never stop), got {cfg['max-failed-rounds']}")
    if not cfg["divergence-factor"] > 1.0:
        raise ValueError(
            f"run-config 'divergence-factor' must be > 1 (inf: non-finite losses only), got {cfg['divergence-factor']}"
        )
    for key in ("beta1", "beta2", "momentum"):
        if not 0.0 <= cfg[key] < 1.0:
            raise ValueError(f"run-config '{key}' must be in [0, 1), got {cfg[key]}")
    if not 0 <= cfg["holdout"] < 50_000:
        raise ValueError(f"run-config 'holdout' must be in [0, 50000), got {cfg['holdout']}")
    if not 0.0 < cfg["fraction-train"] <= 1.0:
        raise ValueError(f"run-config 'fraction-train' must be in (0, 1], got {cfg['fraction-train']}")
    if cfg["alpha"] <= 0:
        raise ValueError(f"run-config 'alpha' must be > 0, got {cfg['alpha']}")
    if cfg["max-resident"] < -1:
        raise ValueError(f"run-config 'max-resident' must be >= -1 (-1: automatic, 0: none), got {cfg['max-resident']}")
    if not (math.isfinite(cfg["link-mbps"]) and cfg["link-mbps"] >= 0):
        raise ValueError(f"run-config 'link-mbps' must be a finite number >= 0 (0: unknown), got {cfg['link-mbps']}")
    if not 0 <= cfg["broadcast-bits"] <= 8:
        raise ValueError(
            f"run-config 'broadcast-bits' must be in [0, 8] (0: exact levels), got {cfg['broadcast-bits']}"
        )
    if cfg["scale-block"] < 0:
        raise ValueError(f"run-config 'scale-block' must be >= 0 (0: one scale per tensor), got {cfg['scale-block']}")
    if cfg["momentum-sync-every"] < 0:
        raise ValueError(f"run-config 'momentum-sync-every' must be >= 0 (0: never), got {cfg['momentum-sync-every']}")
    for key in ("fail-fraction", "byzantine-fraction"):
        if not 0.0 <= cfg[key] < 1.0:
            raise ValueError(f"run-config '{key}' must be in [0, 1), got {cfg[key]}")
    if not (math.isfinite(cfg["poll-interval"]) and cfg["poll-interval"] >= 0):
        raise ValueError(
            f"run-config 'poll-interval' must be finite and >= 0 (0: the Grid's own), got {cfg['poll-interval']}"
        )
    if not (math.isfinite(cfg["wait-for-nodes"]) and cfg["wait-for-nodes"] >= 0):
        wait = cfg["wait-for-nodes"]
        raise ValueError(f"run-config 'wait-for-nodes' must be finite and >= 0 (0: stop at once), got {wait}")
    for key in ("round-timeout", "byzantine-scale"):
        if not (math.isfinite(cfg[key]) and cfg[key] > 0):
            raise ValueError(f"run-config '{key}' must be finite and > 0, got {cfg[key]}")
    if cfg["local-batches"] < 0:
        raise ValueError(f"run-config 'local-batches' must be >= 0 (0: whole epochs), got {cfg['local-batches']}")
    if cfg["checkpoint-every"] < 0:
        raise ValueError(f"run-config 'checkpoint-every' must be >= 0 (0: never), got {cfg['checkpoint-every']}")
    if not 0.0 <= cfg["server-momentum"] < 1.0:
        raise ValueError(f"run-config 'server-momentum' must be in [0, 1), got {cfg['server-momentum']}")
    if not (math.isfinite(cfg["sign-noise"]) and 0.0 <= cfg["sign-noise"] <= 100.0):
        raise ValueError(
            f"run-config 'sign-noise' must be in [0, 100] (0: deterministic signs), got {cfg['sign-noise']}"
        )
    if cfg["secure-degree"] < 0:
        raise ValueError(
            f"run-config 'secure-degree' must be >= 0 (0: every other participant), got {cfg['secure-degree']}"
        )


def _check_data(cfg: dict[str, Any]) -> None:
    """``classes-per-partition`` within what the partitioner can make of Fashion-MNIST.

    ``pathological`` gives each partition that many distinct classes: at most :data:`NUM_CLASSES`.
    ``shard`` cuts the clients' ``TRAIN_IMAGES − holdout`` images into num-partitions × that many
    shards of equal size, which must hold one image at least (else flwr-datasets divides by 0 on
    every client): num-partitions comes from the nodes' node config, which the run config does not
    know, so only the bound for one partition is checked here.
    """
    from flower_dlion_app.tasks import MODELS_OF, PARTITIONERS_OF

    cpp, partitioner, dataset = cfg["classes-per-partition"], cfg["partitioner"], cfg["dataset"]
    for key, allowed in (("model", MODELS_OF[dataset]), ("partitioner", PARTITIONERS_OF[dataset])):
        if cfg[key] not in allowed:
            raise ValueError(f"run-config '{key}' = {cfg[key]!r} does not go with dataset {dataset!r}: {allowed}")
    if dataset == "shakespeare" and cfg["data-dir"]:
        raise ValueError(f"run-config 'data-dir' is Fashion-MNIST's folder, not Shakespeare's: got {cfg['data-dir']!r}")
    if partitioner == "pathological" and cpp > NUM_CLASSES:
        raise ValueError(
            f"run-config 'classes-per-partition' must be <= {NUM_CLASSES} (Fashion-MNIST's classes) for "
            f"partitioner 'pathological', got {cpp}"
        )
    images = TRAIN_IMAGES - cfg["holdout"]
    if partitioner == "shard" and cpp > images:
        raise ValueError(
            f"run-config 'classes-per-partition' (shards per partition) must be <= {images} (the clients' "
            f"images: {TRAIN_IMAGES} - holdout {cfg['holdout']}; times num-partitions, at most that) for "
            f"partitioner 'shard', got {cpp}"
        )


def _check_algorithm(cfg: dict[str, Any]) -> None:
    """The algorithm's keys together: D-Lion's options only on D-Lion, and the combinations that work."""
    if cfg["strategy"] not in DLION_STRATEGIES:
        changed = sorted(k for k in DLION_ONLY if cfg[k] != DEFAULTS[k])
        if changed:
            raise ValueError(f"run-config {changed} apply to {DLION_STRATEGIES} only, not to {cfg['strategy']!r}")
    if cfg["scale-block"] and cfg["upload"] != "ef-sign" and not cfg["broadcast-bits"]:
        raise ValueError(
            f"run-config 'scale-block' = {cfg['scale-block']} needs scales: upload = 'ef-sign' or 'broadcast-bits' >= 1"
        )
    if cfg["downlink"] == "anchored" and (cfg["strategy"] == "dlion-mean" or cfg["broadcast-bits"]):
        raise ValueError(
            "run-config downlink='anchored' needs integer Δs: a vote ('dlion-vote', 'signsgd-vote') with "
            f"'broadcast-bits' = 0, got strategy={cfg['strategy']!r}, broadcast-bits={cfg['broadcast-bits']}; "
            "use 'auto' or 'chain'"
        )
    if cfg["local-steps"] * cfg["accumulate"] > cfg["max-local-batches"]:
        raise ValueError(
            f"run-config 'local-steps' × 'accumulate' = {cfg['local-steps']} × {cfg['accumulate']} batches a round is "
            f"more than the clients' 'max-local-batches' = {cfg['max-local-batches']}: raise it, or take fewer steps"
        )
    if cfg["anchor-every"] * cfg["local-steps"] > 1 << 20:
        raise ValueError(
            f"run-config 'anchor-every' × 'local-steps' must be <= 2**20 (the counts' range), got "
            f"{cfg['anchor-every']} × {cfg['local-steps']}"
        )
    if cfg["sign-noise"] and cfg["upload"] == "sum":
        raise ValueError("run-config 'sign-noise' perturbs signs: 'upload' must be 'sign' or 'ef-sign', got 'sum'")
    if cfg["secure"] and cfg["min-train-nodes"] < 3:
        raise ValueError(f"run-config 'secure' needs 'min-train-nodes' >= 3, got {cfg['min-train-nodes']}")
    if cfg["server-momentum"] and not cfg["broadcast-bits"]:
        raise ValueError(
            "run-config 'server-momentum' needs 'broadcast-bits' >= 1: the momentum step is quantized for the "
            f"broadcast, got server-momentum={cfg['server-momentum']}, broadcast-bits=0"
        )
    if cfg["upload"] == "ef-sign" and cfg["strategy"] == "dlion-mean" and cfg["broadcast-bits"] == 0:
        raise ValueError(
            "run-config upload='ef-sign' with the mean needs 'broadcast-bits' >= 1: "
            "a mean of scaled signs has no exact low-bit form"
        )


def _check_faults(cfg: dict[str, Any]) -> None:
    """The fault study: which strategies each attack applies to, and what it needs."""
    if cfg["byzantine-fraction"] and cfg["strategy"] not in (*DLION_STRATEGIES, *FEDAVG_FAMILY):
        raise ValueError(
            f"run-config 'byzantine-fraction' applies to {(*DLION_STRATEGIES, *FEDAVG_FAMILY)}, "
            f"not to {cfg['strategy']!r}"
        )
    if cfg["byzantine-mode"] in ("scale", "momentum", "little") and cfg["strategy"] not in DLION_STRATEGIES:
        raise ValueError(
            f"run-config byzantine-mode {cfg['byzantine-mode']!r} applies to {DLION_STRATEGIES}, "
            f"not to {cfg['strategy']!r} (its attackers flip or randomize their update: 'flip', 'random')"
        )
    if cfg["byzantine-mode"] == "scale" and cfg["upload"] != "ef-sign":
        raise ValueError("run-config byzantine-mode 'scale' lies about ef-sign scales: it needs upload = 'ef-sign'")
    if cfg["byzantine-mode"] == "momentum" and not cfg["momentum-sync-every"]:
        raise ValueError("run-config byzantine-mode 'momentum' poisons the synced momentum: set momentum-sync-every")


def _check_persistence(cfg: dict[str, Any]) -> None:
    """Checkpoints need one of our strategies."""
    if cfg["strategy"] in FEDAVG_FAMILY and (cfg["checkpoint-every"] or cfg["resume"]):
        raise ValueError(
            f"run-config 'checkpoint-every' / 'resume' need one of our strategies, not Flower's {cfg['strategy']!r}"
        )


def _check_lr_schedule(cfg: dict[str, Any]) -> None:
    """``lr-schedule`` = "cosine" decays ``lr`` to ``lr-final`` × ``lr`` over the run (D-Lion and FedAvg family)."""
    final = cfg["lr-final"]
    if not 0.0 <= final <= 1.0:
        raise ValueError(f"run-config 'lr-final' must be in [0, 1] (a factor of 'lr'), got {final}")
    if cfg["lr-schedule"] == "constant":
        if final:
            raise ValueError(f"run-config 'lr-final' = {final} applies to lr-schedule 'cosine' only")
        return
    if cfg["strategy"] not in (*DLION_STRATEGIES, *FEDAVG_FAMILY):
        raise ValueError(
            f"run-config lr-schedule 'cosine' applies to {(*DLION_STRATEGIES, *FEDAVG_FAMILY)}, "
            f"not to {cfg['strategy']!r}"
        )
    if cfg["downlink"] == "anchored":
        raise ValueError(
            "run-config downlink='anchored' needs a constant learning rate (x = γ·xₐ − η·C), got lr-schedule "
            "'cosine'; use 'auto' or 'chain'"
        )


def _check_local_optimizer(cfg: dict[str, Any]) -> None:
    """The local work's keys: ``local-proximal-mu`` needs local steps; ``local-optimizer`` = "sgd".

    The local SGD client (``local-optimizer`` = "sgd") needs a ``local-lr`` > 0 and the sign upload
    (FedSMU's: one Lion step on the SGD delta) or ef-sign (the delta itself, compressed with error feedback).
    """
    if cfg["drift-correction"] != "off":  # the full check (which mode, no server momentum): DistributedLion's
        mode = (cfg["local-optimizer"], cfg["upload"], cfg["strategy"])
        if mode != ("sgd", "ef-sign", "dlion-mean") or not cfg["broadcast-bits"] or cfg["server-momentum"]:
            raise ValueError(
                f"run-config 'drift-correction' = {cfg['drift-correction']!r} needs local-optimizer 'sgd', upload "
                "'ef-sign', strategy 'dlion-mean', 'broadcast-bits' >= 1 and 'server-momentum' = 0, got "
                f"{mode}, broadcast-bits={cfg['broadcast-bits']}, server-momentum={cfg['server-momentum']}"
            )
    mu = cfg["local-proximal-mu"]
    if not (math.isfinite(mu) and 0 <= mu <= 1e6):
        raise ValueError(f"run-config 'local-proximal-mu' must be in [0, 1e6] (0: off), got {mu}")
    if mu and cfg["local-steps"] == 1:
        raise ValueError(f"run-config 'local-proximal-mu' = {mu} needs 'local-steps' > 1 (one step starts at x)")
    lr = cfg["local-lr"]
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"run-config 'local-lr' must be finite and >= 0, got {lr}")
    if cfg["local-optimizer"] == "lion":
        if lr:
            raise ValueError(
                f"run-config 'local-lr' = {lr} applies to local-optimizer 'sgd' only "
                "(local Lion steps move the copy by 'lr', the server's rate)"
            )
        return
    if lr <= 0:
        raise ValueError("run-config local-optimizer 'sgd' needs 'local-lr' > 0 (the local SGD learning rate), got 0.0")
    if cfg["upload"] not in ("sign", "ef-sign") or cfg["accumulate"] != 1:
        raise ValueError(
            "run-config local-optimizer 'sgd' uploads the 1-bit sign of one Lion step on the local SGD delta "
            "(upload = 'sign') or the delta itself as a scaled sign with error feedback (upload = 'ef-sign'): "
            f"it needs one of them and accumulate = 1, got upload={cfg['upload']!r}, accumulate={cfg['accumulate']}"
        )


def _check_baselines(cfg: dict[str, Any]) -> None:
    """The FedAvg family's keys: ``local-batches``, ``proximal-mu``, ``server-lr`` and ``server-tau``."""
    if cfg["local-batches"] and cfg["strategy"] not in FEDAVG_FAMILY:
        raise ValueError(f"run-config 'local-batches' applies to {FEDAVG_FAMILY} only, not to {cfg['strategy']!r}")
    mu = cfg["proximal-mu"]
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"run-config 'proximal-mu' must be finite and > 0 (0 is FedAvg), got {mu}")
    if cfg["strategy"] != "fedprox" and mu != DEFAULTS["proximal-mu"]:
        raise ValueError(f"run-config 'proximal-mu' applies to 'fedprox' only, not to {cfg['strategy']!r}")
    for key in ("server-lr", "server-tau"):
        if not (math.isfinite(cfg[key]) and cfg[key] > 0):
            raise ValueError(f"run-config '{key}' must be finite and > 0, got {cfg[key]}")
        if cfg["strategy"] not in FEDOPT and cfg[key] != DEFAULTS[key]:
            raise ValueError(f"run-config '{key}' applies to {FEDOPT} only, not to {cfg['strategy']!r}")
