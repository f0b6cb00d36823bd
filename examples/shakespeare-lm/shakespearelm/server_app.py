"""shakespearelm: the ServerApp. Distributed Lion on the LoRA adapters; the server holds the base too."""

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from flower_dlion import DistributedLion
from shakespearelm import task

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Pre-train the base if it is missing, then fine-tune its adapters with Distributed Lion."""
    t0 = time.perf_counter()
    cfg = context.run_config
    task.RUN_CONFIG.update(cfg)
    num_rounds: int = cfg["num-server-rounds"]

    # The base: one file, built here if missing (in a simulation the nodes read the same file; on
    # real devices each node needs a copy, and a node whose copy differs is refused before round 1)
    task.ensure_base(cfg["base-steps"], cfg["seed"])
    pretrain_s = time.perf_counter() - t0
    model = task.lora_model()
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base_values = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    print(f"[shakespeare-lm] adapters d = {d:,} values, frozen base {base_values:,} ({base_values / d:.0f}×)")

    # Server-side evaluation on the test windows of the federation's roles (one per node)
    num_roles = federation_size(grid)
    test = task.test_windows(num_roles, cfg["eval-windows"], cfg["seed"])
    evaluations: dict[int, dict[str, float]] = {}

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Next-character accuracy and loss on the test windows (round 0: the base alone, as B = 0)."""
        if server_round % cfg["eval-every"] and server_round != num_rounds:
            return None
        model.load_state_dict(arrays.to_torch_state_dict())
        evaluations[server_round] = task.evaluate(model, test)
        return MetricRecord(evaluations[server_round])

    # The full state dict (base + adapters) as initial arrays: only the adapters are ever sent
    strategy = DistributedLion(
        lr=cfg["lr"], weight_decay=cfg["weight-decay"], fraction_train=cfg["fraction-train"], sample_seed=cfg["seed"]
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    # Results: accuracy before and after, bytes per node of round 1 and of the later rounds
    wall = time.perf_counter() - t0
    h = strategy.history
    later = h[1:] or h
    down_later = sum(r["bytes-down"] for r in later) / sum(r["num-sampled"] for r in later)
    up_later = sum(r["bytes-up"] for r in later) / max(1, sum(r["num-replies"] for r in later))
    results = {
        "roles": num_roles,
        "rounds": num_rounds,
        "run-config": dict(cfg),
        "adapters": d,
        "base-values": base_values,
        "evaluations": evaluations,
        "round-1-bytes-down-per-node": h[0]["bytes-down"] / h[0]["num-sampled"],
        "round-1-bytes-up-per-node": h[0]["bytes-up"] / max(1, h[0]["num-replies"]),
        "adapters-fp32-bytes": 4 * d,
        "later-bytes-down-per-node": down_later,
        "later-bytes-up-per-node": up_later,
        "later-bits-per-adapter-value": {"down": 8 * down_later / d, "up": 8 * up_later / d},
        "totals": {k: v for k, v in result.totals.items()},
        "pretrain-seconds": pretrain_s,
        "wall-seconds": wall,
    }
    path = Path(cfg["results-file"]).resolve()
    path.write_text(json.dumps(results, indent=2))
    first, last = evaluations[0], evaluations[max(evaluations)]
    print(
        f"[shakespeare-lm] {num_roles} roles, {num_rounds} rounds: accuracy {first['accuracy']:.4f} (base) -> "
        f"{last['accuracy']:.4f} (all positions {first['accuracy-all']:.4f} -> {last['accuracy-all']:.4f}), "
        f"loss/char {first['loss']:.4f} -> {last['loss']:.4f}; round 1: "
        f"{results['round-1-bytes-down-per-node']:,.0f} B down per node (adapters in fp32: {4 * d:,} B); "
        f"later rounds: {up_later:,.0f} B up, {down_later:,.0f} B down per node "
        f"({8 * up_later / d:.2f} / {8 * down_later / d:.2f} bits per adapter value); {wall:.0f} s; {path}"
    )


def federation_size(grid: Grid, timeout: float = 120.0) -> int:
    """How many nodes there are (one role each): Flower's simulation registers them as the ServerApp starts."""
    deadline, seen = time.monotonic() + timeout, -1
    while (n := len(list(grid.get_node_ids()))) < 2 or n != seen:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} node(s) connected after {timeout:.0f} s: the federation needs 2 or more")
        seen = n
        time.sleep(1.0)
    return n
