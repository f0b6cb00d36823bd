"""ServerApp: Distributed Lion (or a baseline) on Fashion-MNIST, evaluated on the server, logged to JSONL."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    Bulyan,
    FedAdam,
    FedAvg,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
    Result,
    Strategy,
)
from flwr.supercore import log

from flower_dlion.lion import cosine_decay
from flower_dlion.protocol import sync_prefixes
from flower_dlion.strategies.dlion import DistributedLion
from flower_dlion.strategies.run_stops import FailedRounds, RunStopped, reply_error
from flower_dlion_app.checkpoint import check_resumable, load_checkpoint, save_checkpoint
from flower_dlion_app.config import DLION_STRATEGIES, FEDAVG_FAMILY, FEDOPT, read_config
from flower_dlion_app.metering import Exchange, MeteredGrid
from flower_dlion_app.model import MODELS, evaluate
from flower_dlion_app.results import Recorder
from flower_dlion_app.strategies.global_opt import GlobalOptimizer
from flower_dlion_app.strategies.scaffold import Scaffold
from flower_dlion_app.tasks import evaluation_set

__all__ = ["app", "build_strategy", "default_results_dir", "evaluation_set", "run_federation", "train_config"]


def default_results_dir(run_id: int) -> Path:
    """``~/flower-dlion/runs/<UTC time>-run<run id>``."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path.home() / "flower-dlion" / "runs" / f"{stamp}-run{run_id}"


def build_strategy(cfg: dict[str, Any], state_key: str = "") -> Strategy:
    """The strategy named by run config ``strategy``, with its hyperparameters from ``cfg``.

    ``signsgd-vote`` is Signum with majority vote (Bernstein et al., 2019): each worker
    keeps m ← β·m + (1−β)·g and sends sign(m). That is Distributed Lion with β₁ = β₂ = β
    (``momentum``): sign(β·m + (1−β)·g) is the sign of the new m. So it runs on the same
    client and strategy, with the same 1-bit messages.
    """
    common = {
        "fraction_train": cfg["fraction-train"],
        "min_train_nodes": cfg["min-train-nodes"],
        "min_available_nodes": cfg["min-available-nodes"],
        "min_replies": cfg["min-replies"],
        "sample_seed": cfg["seed"],
        "wait_for_nodes": cfg["wait-for-nodes"],
    }
    name = cfg["strategy"]
    if name in ("dlion-vote", "dlion-mean", "signsgd-vote"):
        beta1, beta2 = (cfg["momentum"], cfg["momentum"]) if name == "signsgd-vote" else (cfg["beta1"], cfg["beta2"])
        return DistributedLion(
            aggregation="mean" if name == "dlion-mean" else "vote",
            lr=cfg["lr"],
            lr_schedule=lr_schedule(cfg),
            weight_decay=cfg["weight-decay"],
            beta1=beta1,
            beta2=beta2,
            local_steps=cfg["local-steps"],
            local_optimizer=cfg["local-optimizer"],
            local_lr=cfg["local-lr"] or None,
            local_proximal_mu=cfg["local-proximal-mu"],
            stale_momentum=cfg["stale-momentum"],
            drift_correction=cfg["drift-correction"],
            accumulate=cfg["accumulate"],
            upload=cfg["upload"],
            broadcast_bits=cfg["broadcast-bits"],
            scale_block=cfg["scale-block"],
            sign_noise=cfg["sign-noise"],
            sign_noise_kind=cfg["sign-noise-kind"],
            server_momentum=cfg["server-momentum"],
            momentum_sync_every=cfg["momentum-sync-every"],
            momentum_sync_layers=sync_prefixes(cfg["momentum-sync-layers"]),
            init_seed=cfg["seed"] if cfg["init"] == "seed" else None,  # x₀ = Net() after torch.manual_seed(seed)
            state_key=state_key,
            downlink=cfg["downlink"],
            anchor_every=cfg["anchor-every"],
            secure=cfg["secure"],
            secure_degree=cfg["secure-degree"],
            max_failed_rounds=cfg["max-failed-rounds"],
            divergence_factor=cfg["divergence-factor"],
            divergence_rounds=cfg["divergence-rounds"],
            stop_on_divergence=cfg["stop-on-divergence"],
            **common,
        )
    if name in ("global-lion", "global-adamw", "terngrad"):
        return GlobalOptimizer(
            optimizer={"global-lion": "lion", "global-adamw": "adamw", "terngrad": "sgd"}[name],
            encoding="terngrad" if name == "terngrad" else "fp32",
            lr=cfg["lr"],
            weight_decay=cfg["weight-decay"],
            beta1=cfg["beta1"],
            beta2=cfg["beta2"],
            momentum=cfg["momentum"],
            max_failed_rounds=cfg["max-failed-rounds"],
            **common,
        )
    if name in FEDAVG_FAMILY:
        return fedavg_family(name, cfg)
    raise ValueError(f"unknown strategy {name!r}")


def lr_schedule(cfg: dict[str, Any]) -> Callable[[int], float] | None:
    """The factor of ``lr`` per server round that run config ``lr-schedule`` names (None: constant)."""
    if cfg["lr-schedule"] == "cosine":
        return cosine_decay(cfg["num-server-rounds"], cfg["lr-final"])
    return None


def fedavg_family(name: str, cfg: dict[str, Any]) -> Strategy:
    """Flower's FedAvg, FedProx, FedAdam, FedYogi, or a robust aggregator told what it needs to know of attackers.

    With ``lr-schedule`` the clients' SGD rate in round t is ``lr`` × the schedule's factor.
    SCAFFOLD (:mod:`flower_dlion_app.strategies.scaffold`) sends its control variate c beside the model.
    FedProx sends ``proximal-mu`` to the clients (their loss gains μ/2·‖w − x‖²). FedAdam and
    FedYogi (Reddi et al., 2021) treat the mean client model change as a pseudo-gradient for a
    server Adam / Yogi step with ``server-lr`` (η), ``beta1``, ``beta2`` and ``server-tau`` (τ);
    their new model is cast back to the dtype the clients sent (Flower's step returns float64,
    which would double every download).

    Krum, MultiKrum and Bulyan are given the number of Byzantine clients f = ⌊``byzantine-fraction``
    · N + ½⌋ of the N connected nodes (the attackers of the fault study: the standard assumption
    that the defender knows f); MultiKrum averages the N − f best; FedTrimmedAvg trims a fraction
    ``max(0.1, byzantine-fraction)`` from each end. FedMedian needs nothing.

    Every one of them drops replies with non-finite arrays and stops the run after
    ``max-failed-rounds`` rounds in a row without a valid reply (:func:`_stops_when_failing`).
    """
    common = {
        "fraction_train": cfg["fraction-train"],
        "fraction_evaluate": 0.0,
        "min_train_nodes": cfg["min-train-nodes"],
        "min_available_nodes": cfg["min-available-nodes"],
    }
    fraction = cfg["byzantine-fraction"]
    kwargs: dict[str, Any] = {}
    if name in ("fedavg", "fedprox", "scaffold", "fedmedian", "fedtrimmedavg"):
        named = {"fedavg": FedAvg, "fedprox": FedProx, "scaffold": Scaffold, "fedmedian": FedMedian}
        base: type[FedAvg] = named.get(name, FedTrimmedAvg)
        if name == "fedprox":
            kwargs["proximal_mu"] = cfg["proximal-mu"]
        if name == "fedtrimmedavg":
            kwargs["beta"] = max(0.1, fraction)
    elif name in FEDOPT:
        base = _same_dtype(FedAdam if name == "fedadam" else FedYogi)
        kwargs.update(eta=cfg["server-lr"], beta_1=cfg["beta1"], beta_2=cfg["beta2"], tau=cfg["server-tau"])
    else:
        base = _knowing_the_attackers({"krum": Krum, "multikrum": MultiKrum, "bulyan": Bulyan}[name], fraction)
    schedule = lr_schedule(cfg)
    if schedule is not None:
        base = _scheduled(base, schedule)
    base = _stops_when_failing(base, cfg["max-failed-rounds"])
    return base(**kwargs, **common)


def _non_finite_array(msg: Message) -> str | None:
    """The first array of a reply that holds a value that is not finite (``record/array``), or None."""
    for record_name, record in msg.content.array_records.items():
        for array_name, array in record.items():
            try:
                values = array.numpy()
            except (TypeError, ValueError):  # not a numpy array (another library's stype): the base's to judge
                continue
            if values.dtype.kind in "fc" and not np.isfinite(values).all():
                return f"{record_name}/{array_name}"
    return None


def _stops_when_failing(base: type[FedAvg], max_failed_rounds: int) -> type[FedAvg]:
    """``base`` that drops replies with non-finite arrays and stops after ``max_failed_rounds`` failed rounds.

    A round fails when no valid reply is left (error replies and dropped ones do not count) or
    ``base`` aggregates none (its arrays are None); at ``max_failed_rounds`` failed rounds in a row
    (0: never) ``aggregate_train`` raises :class:`~flower_dlion.strategies.run_stops.RunStopped` naming
    the rounds and why the replies were rejected. A round with a valid reply resets the count.
    """

    class StopsWhenFailing(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.failed_rounds = FailedRounds(max_failed_rounds)

        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            kept: list[Message] = []
            valid = dropped = 0
            for msg in replies:
                node_id = msg.metadata.src_node_id
                if msg.has_error():
                    self.failed_rounds.reject(node_id, reply_error(msg))
                    kept.append(msg)  # the base logs it
                    continue
                bad = _non_finite_array(msg)
                if bad is not None:
                    why = "round %d: dropped reply from node %d: array %r has non-finite values"
                    log(WARNING, why, server_round, node_id, bad)
                    self.failed_rounds.reject(node_id, f"array {bad!r} has non-finite values")
                    dropped += 1
                    continue
                kept.append(msg)
                valid += 1
            arrays, metrics = super().aggregate_train(server_round, kept)
            account = f"{valid} valid replies ({len(kept) - valid} errors, {dropped} with non-finite arrays)"
            if arrays is None and valid:
                account += f", {base.__name__} aggregated none of them"
            self.failed_rounds.outcome(server_round, valid if arrays is not None else 0, account)
            return arrays, metrics

    StopsWhenFailing.__name__ = base.__name__
    return StopsWhenFailing


def _knowing_the_attackers(base: type[FedAvg], fraction: float) -> type[FedAvg]:
    """Krum / MultiKrum / Bulyan told f = ⌊fraction · N + ½⌋ of the N connected nodes each round."""

    class KnowingTheAttackers(base):  # type: ignore[misc, valid-type]
        def configure_train(
            self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
        ) -> Iterable[Message]:
            n = len(list(grid.get_node_ids()))
            self.num_malicious_nodes = int(fraction * n + 0.5)
            if base is MultiKrum:
                self.num_nodes_to_select = n - self.num_malicious_nodes
            return super().configure_train(server_round, arrays, config, grid)

    KnowingTheAttackers.__name__ = base.__name__
    return KnowingTheAttackers


def _scheduled(base: type[FedAvg], schedule: Callable[[int], float]) -> type[FedAvg]:
    """``base`` whose clients' SGD rate in round t is the train config's ``lr`` × ``schedule(t)``."""

    class Scheduled(base):  # type: ignore[misc, valid-type]
        def configure_train(
            self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
        ) -> Iterable[Message]:
            config = ConfigRecord({**config, "lr": float(config["lr"]) * schedule(server_round)})
            return super().configure_train(server_round, arrays, config, grid)

    Scheduled.__name__ = base.__name__
    return Scheduled


def _same_dtype(base: type[FedAvg]) -> type[FedAvg]:
    """``base`` whose aggregated model keeps the dtype of the arrays it was sent."""

    class SameDtype(base):  # type: ignore[misc, valid-type]
        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            dtypes = {k: a.dtype for k, a in (self.current_arrays or {}).items()}
            arrays, metrics = super().aggregate_train(server_round, replies)
            if arrays is not None:
                arrays = ArrayRecord(
                    {k: Array(np.asarray(a.numpy(), dtype=dtypes.get(k, a.numpy().dtype))) for k, a in arrays.items()}
                )
            return arrays, metrics

    SameDtype.__name__ = base.__name__
    return SameDtype


def train_config(cfg: dict[str, Any]) -> ConfigRecord:
    """What the server sends the baselines' clients in every train message besides the strategy's keys.

    The D-Lion clients read their batch size and seed from the run config (as any app's
    clients read their own); Flower's FedAvg forwards this record as is.
    """
    if cfg["strategy"] in DLION_STRATEGIES:
        return ConfigRecord()
    values: dict[str, Any] = {"batch-size": cfg["batch-size"], "seed": cfg["seed"]}
    if cfg["strategy"] in FEDAVG_FAMILY:
        values.update(
            {
                "lr": cfg["lr"],
                "momentum": cfg["momentum"],
                "weight-decay": cfg["weight-decay"],
                "local-epochs": cfg["local-epochs"],
                "local-batches": cfg["local-batches"],
            }
        )
    return ConfigRecord(values)


def run_federation(grid: Grid, run_config: dict[str, Any], run_id: int = 0, *, save_model: bool = True) -> Result:
    """Run the whole federation described by ``run_config`` (defaults: ``config.DEFAULTS``).

    Writes ``results.jsonl`` (one object per round, round 0 = the initial model),
    ``summary.json`` and (with ``save_model``) ``final_model.pt`` into the results directory.
    Bytes are measured on the messages by :class:`~flower_dlion_app.metering.MeteredGrid`, the
    same way for every strategy (train messages and the one hello per new node).

    With ``checkpoint-every`` K, ``checkpoint.pt`` is written atomically after every K-th
    and the last round: the strategy's state (x, version, kept Δs, each partition's
    version, error and momentum buffers, metrics), the rows so far, the byte tallies and
    the run config. ``resume = "<path>"`` goes on from such a file (by default into its
    folder); only ``checkpoint.RESUMABLE_KEYS`` may differ. Sampling and client batches
    are functions of (seed, round, partition), so no generator state needs saving.

    A run that cannot learn stops: when the strategy raises
    :class:`~flower_dlion.strategies.run_stops.RunStopped` (no node answered the hello usefully, or
    ``max-failed-rounds`` rounds in a row without enough valid replies), ``summary.json`` is written
    with ``"status": "stopped"`` and the ``"reason"``, the reason is logged at ERROR, and the
    exception goes on (the ServerApp fails; no ``final_model.pt``). Any other error during the rounds
    does the same with ``"status": "failed"`` (its type and message as the reason). A finished run's
    summary has ``"status": "completed"``.
    """
    run = Federation(grid, read_config(run_config), run_id)
    try:
        result = run.strategy.start(
            grid=run.metered,
            initial_arrays=run.initial,
            num_rounds=run.num_rounds,
            timeout=run.cfg["round-timeout"],
            train_config=train_config(run.cfg),
            evaluate_fn=run.evaluate,
            **({"start_round": run.start_round, "on_round_end": run.on_round_end} if run.resumable else {}),
        )
    except RunStopped as err:
        run.write_summary(status="stopped", reason=str(err), stopped_in_round=err.server_round)
        log(ERROR, "[flower-dlion] %s: stopped in round %d: %s", run.cfg["strategy"], err.server_round, err)
        log(ERROR, "[flower-dlion] wrote %s (status 'stopped') and %s", run.out_dir / "summary.json", run.recorder.path)
        raise
    except Exception as err:  # any other end: the summary says so too, and the error goes on
        rnd = run.round_in_progress()
        run.write_summary(status="failed", reason=f"{type(err).__name__}: {err}", stopped_in_round=rnd)
        log(ERROR, "[flower-dlion] %s: failed in round %d: %s: %s", run.cfg["strategy"], rnd, type(err).__name__, err)
        log(ERROR, "[flower-dlion] wrote %s (status 'failed') and %s", run.out_dir / "summary.json", run.recorder.path)
        raise
    run.finish(result, save_model=save_model)
    return result


class Federation:
    """One run of the app: prepared (or resumed), evaluated and checkpointed round by round, summarized.

    Parameters
    ----------
    grid : Grid
        The grid the run's messages go through (measured by a :class:`MeteredGrid` around it).
    cfg : dict
        The checked run config (:func:`read_config`).
    run_id : int
        Flower's run id (names the default results directory).

    """

    def __init__(self, grid: Grid, cfg: dict[str, Any], run_id: int) -> None:
        self.cfg = cfg
        self.ckpt = load_checkpoint(Path(cfg["resume"]).expanduser()) if cfg["resume"] else None
        if self.ckpt is not None:
            check_resumable(self.ckpt["run-config"], cfg)
        self.out_dir = self._results_dir(run_id)
        log(INFO, "[flower-dlion] %s, results directory: %s", cfg["strategy"], self.out_dir)
        torch.manual_seed(cfg["seed"])
        self.model = MODELS[cfg["model"]]()  # the same x₀ as model.seeded_net(seed), which init = "seed" clients build
        self.initial = ArrayRecord(self.model.state_dict())
        self.eval_name, self.eval_x, self.eval_y = evaluation_set(cfg)
        # kept across resumes (in the strategy); as long as the strategy's own random key, so that the key
        # costs the messages the same bytes with or without the state files
        state_key = secrets.token_hex(8) if cfg["client-state-dir"] else ""
        self.strategy = build_strategy(cfg, state_key)
        self.metered = MeteredGrid(grid, poll_interval=cfg["poll-interval"] or None)
        self.num_rounds = cfg["num-server-rounds"]
        self.resumable = isinstance(self.strategy, (DistributedLion, GlobalOptimizer))  # start_round, on_round_end
        self.start_round = 1
        if self.ckpt is not None:
            self._resume(self.ckpt)
        self.recorder = self._recorder()

    def _results_dir(self, run_id: int) -> Path:
        """``results-dir``, else the resumed checkpoint's folder, else :func:`default_results_dir`; made."""
        cfg = self.cfg
        if cfg["results-dir"]:
            out_dir = Path(cfg["results-dir"]).expanduser()
        elif cfg["resume"]:
            out_dir = Path(cfg["resume"]).expanduser().parent
        else:
            out_dir = default_results_dir(run_id)
        out_dir = out_dir.resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        return out_dir

    def _resume(self, ckpt: dict[str, Any]) -> None:
        """Go on from a checkpoint: the strategy's state, the byte tallies, the rows, the RNG."""
        assert self.resumable
        self.strategy.load_state_dict(ckpt["strategy"])
        self.initial = self.strategy.arrays()
        self.start_round = int(ckpt["round"]) + 1
        if isinstance(self.strategy, DistributedLion):
            self.strategy.checkpoint_round = int(ckpt["round"])  # clients need no state file older than it
        self.metered.exchanges = [Exchange(**e) for e in ckpt["exchanges"]]
        torch.set_rng_state(ckpt["torch-rng"])
        log(INFO, "[flower-dlion] resuming from %s after round %d", self.cfg["resume"], self.start_round - 1)

    def _recorder(self) -> Recorder:
        """The per-round log (``results.jsonl``), with a resumed run's rows so far."""
        ckpt = self.ckpt
        if ckpt is None:
            return Recorder(self.out_dir, self.metered)
        evals = {int(k): float(v) for k, v in ckpt["evals"].items()}
        return Recorder(self.out_dir, self.metered, list(ckpt["rows"]), evals, dict(ckpt["elapsed"]))

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Evaluate x every ``eval-every`` rounds (and first and last); log and record the round."""
        acc = loss = None
        if server_round % self.cfg["eval-every"] == 0 or server_round == self.num_rounds:
            t0 = time.perf_counter()
            self.model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = evaluate(self.model, self.eval_x, self.eval_y)
            self.recorder.elapsed["eval"] += time.perf_counter() - t0
        row = self.recorder.record(server_round, acc, loss, self.strategy)
        if server_round > 0:
            log(
                INFO,
                "[flower-dlion] round %d/%d: %d replies | up %.1f KB | down %.1f KB | %s",
                server_round,
                self.num_rounds,
                row["num_replies"],
                row["bytes_up"] / 1e3,
                row["bytes_down"] / 1e3,
                f"{self.eval_name} accuracy {acc:.4f}" if acc is not None else "not evaluated",
            )
        return None if acc is None else MetricRecord({"accuracy": acc, "loss": loss})

    def on_round_end(self, server_round: int) -> None:
        """Write the checkpoint every ``checkpoint-every`` rounds and after the last one."""
        every = self.cfg["checkpoint-every"]
        if not every or (server_round % every and server_round != self.num_rounds):
            return
        assert self.resumable
        recorder, path = self.recorder, self.out_dir / "checkpoint.pt"
        payload = {
            "round": server_round,
            "run-config": self.cfg,
            "strategy": self.strategy.state_dict(),
            "rows": recorder.rows,
            "evals": recorder.evals,
            "exchanges": [dataclasses.asdict(e) for e in self.metered.exchanges],
            "elapsed": {"before": recorder.wall(), "eval": recorder.elapsed["eval"]},
            "torch-rng": torch.get_rng_state(),
        }
        save_checkpoint(path, payload)
        if isinstance(self.strategy, DistributedLion):
            self.strategy.checkpoint_round = server_round  # clients may now drop older state files
        log(INFO, "[flower-dlion] round %d: checkpoint written to %s", server_round, path)

    def round_in_progress(self) -> int:
        """The round after the last one recorded (``results.jsonl``), or the first to run."""
        return int(self.recorder.rows[-1]["round"]) + 1 if self.recorder.rows else self.start_round

    @property
    def num_parameters(self) -> int:
        """d, the model's parameters."""
        return sum(p.numel() for p in self.model.parameters())

    def write_summary(self, **status: Any) -> dict[str, Any]:
        """Write ``summary.json`` (``status``: how the run ended, see ``Recorder.summary``) and return it."""
        summary = self.recorder.summary(
            self.strategy,
            name=self.cfg["strategy"],
            eval_set=self.eval_name,
            num_rounds=self.num_rounds,
            num_parameters=self.num_parameters,
            resumed_from_round=self.start_round - 1 if self.ckpt is not None else None,
            config=self.cfg,
            **status,
        )
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def finish(self, result: Result, *, save_model: bool) -> None:
        """The summary, the final model (``save_model``) and the closing log line."""
        summary = self.write_summary()
        if save_model:
            state = self.model.state_dict() if result.arrays is None else result.arrays.to_torch_state_dict()
            torch.save(state, self.out_dir / "final_model.pt")
        final, d = summary["final_accuracy"], self.num_parameters
        log(
            INFO,
            "[flower-dlion] done in %.1f s: %s, final %s accuracy %s | total up %.2f MB, down %.2f MB | "
            "%.0f B up per reply = 1/%.1f of the fp32 model (%d B)",
            summary["wall_time_s"],
            self.cfg["strategy"],
            self.eval_name,
            "n/a" if final is None else f"{final:.4f}",
            summary["total_mb_up"],
            summary["total_mb_down"],
            summary["bytes_up_per_reply"],
            4 * d / max(summary["bytes_up_per_reply"], 1),
            4 * d,
        )
        log(INFO, "[flower-dlion] wrote %s", self.recorder.path)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``."""
    run_federation(grid, dict(context.run_config), run_id=context.run_id)
