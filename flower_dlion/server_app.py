"""ServerApp: Distributed Lion on Fashion-MNIST, evaluated on the server, logged to JSONL."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .config import read_config
from .data import load_fashion_mnist, to_tensor
from .model import Net, evaluate
from .strategies.dlion import DistributedLion

__all__ = ["app", "default_results_dir", "run_federation"]


def default_results_dir(run_id: int) -> Path:
    """``~/flower-dlion/runs/<UTC time>-run<run id>``."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path.home() / "flower-dlion" / "runs" / f"{stamp}-run{run_id}"


def _json_number(value: float | int | None) -> float | int | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value


def run_federation(grid: Grid, run_config: dict[str, Any], run_id: int = 0) -> Result:
    """Run the whole federation described by ``run_config`` (defaults: ``config.DEFAULTS``).

    Writes ``results.jsonl`` (one object per round, round 0 = the initial model),
    ``summary.json`` and ``final_model.pt`` into the results directory.
    """
    cfg = read_config(run_config)
    out_dir = Path(cfg["results-dir"]).expanduser() if cfg["results-dir"] else default_results_dir(run_id)
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log(INFO, "[flower-dlion] results directory: %s", out_dir)

    torch.manual_seed(cfg["seed"])
    model = Net()
    initial = ArrayRecord({name: Array(p.detach().numpy().copy()) for name, p in model.named_parameters()})
    data = load_fashion_mnist(cfg["data-dir"])
    test_x, test_y = to_tensor(data.x_test), torch.from_numpy(data.y_test)

    strategy = DistributedLion(
        aggregation=cfg["aggregation"],
        lr=cfg["lr"],
        weight_decay=cfg["weight-decay"],
        beta1=cfg["beta1"],
        beta2=cfg["beta2"],
        fraction_train=cfg["fraction-train"],
        min_replies=cfg["min-replies"],
    )
    num_rounds = cfg["num-server-rounds"]
    results_path = out_dir / "results.jsonl"
    results_path.write_text("")
    t_start = time.perf_counter()
    last_acc: list[float | None] = [None]

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Evaluate x every ``eval-every`` rounds (and first and last); log the round."""
        acc = loss = None
        if server_round % cfg["eval-every"] == 0 or server_round == num_rounds:
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = evaluate(model, test_x, test_y)
            last_acc[0] = acc
        row: dict[str, Any] = {
            "round": server_round,
            "test_accuracy": acc,
            "test_loss": loss,
            "train_loss": None,
            "bytes_up": 0,
            "bytes_down": 0,
            "bytes_up_fp32": 0,
            "bytes_down_fp32": 0,
            "num_replies": 0,
        }
        if server_round > 0:
            m = strategy.history[-1]
            row.update(
                {
                    "train_loss": m["train-loss"],
                    "bytes_up": m["bytes-up"],
                    "bytes_down": m["bytes-down"],
                    "bytes_up_fp32": m["bytes-up-fp32"],
                    "bytes_down_fp32": m["bytes-down-fp32"],
                    "num_replies": m["num-replies"],
                    "num_rejected": m["num-rejected"],
                    "full_syncs": m["full-syncs"],
                    "tie_fraction": m["tie-fraction"],
                    "agreement": m["agreement"],
                }
            )
            log(
                INFO,
                "[flower-dlion] round %d/%d: train loss %.4f | up %.1f KB | down %.1f KB | %s",
                server_round,
                num_rounds,
                m["train-loss"],
                m["bytes-up"] / 1e3,
                m["bytes-down"] / 1e3,
                f"test accuracy {acc:.4f}" if acc is not None else "not evaluated",
            )
        row["wall_time_s"] = round(time.perf_counter() - t_start, 3)
        with results_path.open("a") as f:
            f.write(json.dumps({k: _json_number(v) for k, v in row.items()}) + "\n")
        return None if acc is None else MetricRecord({"test-accuracy": acc, "test-loss": loss})

    train_config = ConfigRecord({"batch-size": cfg["batch-size"], "seed": cfg["seed"]})
    result = strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=num_rounds, train_config=train_config, evaluate_fn=evaluate_fn
    )
    wall = time.perf_counter() - t_start

    totals = {
        k: sum(m[k] for m in strategy.history) for k in ("bytes-up", "bytes-down", "bytes-up-fp32", "bytes-down-fp32")
    }
    replies = sum(m["num-replies"] for m in strategy.history)
    d = strategy.num_parameters
    summary = {
        "final_test_accuracy": last_acc[0],
        "rounds": num_rounds,
        "wall_time_s": round(wall, 2),
        "num_parameters": d,
        "total_mb_up": totals["bytes-up"] / 1e6,
        "total_mb_down": totals["bytes-down"] / 1e6,
        "fp32_over_sent_up": totals["bytes-up-fp32"] / max(totals["bytes-up"], 1),
        "fp32_over_sent_down": totals["bytes-down-fp32"] / max(totals["bytes-down"], 1),
        "bytes_up_per_reply": totals["bytes-up"] / max(replies, 1),
        "fp32_model_bytes": 4 * d,
        "config": cfg,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save(
        model.state_dict() if result.arrays is None else result.arrays.to_torch_state_dict(), out_dir / "final_model.pt"
    )
    log(
        INFO,
        "[flower-dlion] done in %.1f s: final test accuracy %s | total up %.2f MB, down %.2f MB | "
        "fp32 would send %.1fx more up, %.1fx more down | %.0f B up per reply = 1/%.1f of the fp32 model (%d B)",
        wall,
        "n/a" if last_acc[0] is None else f"{last_acc[0]:.4f}",
        summary["total_mb_up"],
        summary["total_mb_down"],
        summary["fp32_over_sent_up"],
        summary["fp32_over_sent_down"],
        summary["bytes_up_per_reply"],
        4 * d / max(summary["bytes_up_per_reply"], 1),
        4 * d,
    )
    log(INFO, "[flower-dlion] wrote %s", results_path)
    return result


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``."""
    run_federation(grid, dict(context.run_config), run_id=context.run_id)
