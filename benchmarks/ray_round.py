"""The round under Ray (issue 60): D-Lion's per-round wall time against FedAvg's in Flower's Simulation Engine.

    .venv/bin/python benchmarks/ray_round.py [--models resnet18 cnn] [--nodes 2 4] [--layouts module script]
        [--rounds 10] [--repeat 2] [--out ray_round.md]

Each run is ``flwr.simulation.run_simulation(server_app, client_app, num_supernodes=N,
backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})`` in a fresh Python
process (a fresh Ray), with one of two app layouts:

* ``module``: the ClientApps live in ``benchmarks/ray_round_app.py``, imported by the script, as
  ``flwr run`` loads an app: Ray pickles their handlers by reference, each worker imports the
  module once and its ``DLionClient`` lives as long as the worker;
* ``script``: the same source is executed at the top level of this ``__main__`` script, as
  Flower's notebooks and tutorials define their apps: Ray pickles the handlers, and the
  ``DLionClient`` they use, by value with every actor task.

Both sides do the same work per round and node: D-Lion is the README's public API
(``DLionClient(app, model_fn)``, ``dlion.train(msg, context, batches)``, ``DistributedLion()``
with its defaults: one local Lion step on one batch); FedAvg (Flower's
``flwr.serverapp.strategy.FedAvg``) is a ClientApp that loads the arrays, takes one SGD step on
one batch and returns the arrays. All nodes train every round (fraction-train 1.0), no
evaluation. Models: torchvision's ``resnet18(num_classes=10)`` on synthetic CIFAR-sized batches
of 32, and the default app's CNN (``flower_dlion_app.model.Net``) on Fashion-MNIST-shaped
batches of 64 (one batch per partition, made once per process).

A round's wall time is taken on the server: from the strategy's ``configure_train`` of round r
to that of round r+1 (the last round: to ``strategy.start`` returning); rounds 2… are timed
(round 1 holds D-Lion's hello and both sides' first model download and warm-up). Repeats are
interleaved (repeat 1: every cell's D-Lion then FedAvg; then repeat 2 …) and the medians are
over the timed rounds of all repeats. Each client handler call is logged by its process
(``ray_round_support.note_call``): the last column counts the D-Lion calls that found their
``DLionClient`` holding nothing (``len(dlion._devices) == 0``): one per worker process is
expected, every call means each message got a fresh client.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYOUT_ENV = "RAY_ROUND_LAYOUT"
APP_SOURCE = HERE / "ray_round_app.py"

if __name__ == "__main__" and os.environ.get(LAYOUT_ENV) == "script":
    # Layout "script": the apps defined at the top level of the __main__ script (ray_round_app.py's
    # source, so that both layouts run the same code), as a notebook or tutorial defines them.
    sys.path.insert(0, str(HERE))
    exec(compile(APP_SOURCE.read_text(), str(APP_SOURCE), "exec"))


# ---------------------------------------------------------------- one run (a child process)
def child(spec: dict[str, Any]) -> None:
    """One simulation run; its server-side round stamps and its handler log summarized into spec["result"]."""
    import ray.cloudpickle as cloudpickle
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from ray_round_support import build_model

    import flower_dlion
    from flower_dlion import DistributedLion

    if spec["layout"] == "script":
        apps = globals()
        assert apps["dlion_train"].__module__ == "__main__"
    else:
        import ray_round_app

        apps = vars(ray_round_app)
    dlion = spec["strategy"] == "dlion"
    client_app = apps["dlion_app" if dlion else "fedavg_app"]
    nodes, rounds = spec["nodes"], spec["rounds"]
    stamps: dict[str, Any] = {"rounds": {}}

    class TimedDLion(DistributedLion):
        def configure_train(self, server_round: int, *args: Any, **kwargs: Any) -> Any:
            stamps["rounds"][server_round] = time.monotonic()
            return super().configure_train(server_round, *args, **kwargs)

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round: int, *args: Any, **kwargs: Any) -> Any:
            stamps["rounds"][server_round] = time.monotonic()
            return super().configure_train(server_round, *args, **kwargs)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        stamps["run"] = int(context.run_id)
        torch.manual_seed(0)
        arrays = ArrayRecord(build_model().state_dict())
        if dlion:
            strategy = TimedDLion(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=nodes)
            result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=rounds)
            stamps["replies"] = [int(h["num-replies"]) for h in strategy.history]
            stamps["state-key"] = strategy.run_key  # the clients' state files are filed under it
        else:
            strategy = TimedFedAvg(
                fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes
            )
            result = strategy.start(
                grid=grid, initial_arrays=arrays, num_rounds=rounds, train_config=ConfigRecord({"lr": 0.01})
            )
        stamps["end"] = time.monotonic()
        stamps["trained-rounds"] = len(result.train_metrics_clientapp)

    t0 = time.monotonic()
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    wall = time.monotonic() - t0
    if key := stamps.get("state-key"):  # this run's state files (the default folder, where the library ignores ours)
        from flower_dlion.clients.state import default_state_dir

        shutil.rmtree(default_state_dir() / key, ignore_errors=True)
    t = stamps["rounds"]
    if sorted(t) != list(range(1, rounds + 1)) or "end" not in stamps:
        raise RuntimeError(f"the run did not complete its {rounds} rounds: {stamps}")
    t[rounds + 1] = stamps["end"]
    calls = [
        json.loads(line)
        for f in sorted(Path(spec["log_dir"]).glob("*.jsonl"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    calls = [c for c in calls if c["run"] == stamps["run"]]
    library = str(Path(flower_dlion.__file__).resolve().parent.parent)
    if (found := {c["library"] for c in calls}) != {library}:
        raise RuntimeError(f"the workers imported flower_dlion from {sorted(found)}, not {library}")
    served = {(c["pid"], c["partition"], c["round"]) for c in calls}
    later = [c for c in calls if c["round"] >= 2]
    spec["result"] = {
        "round_s": [t[r + 1] - t[r] for r in range(2, rounds + 1)],
        "round1_s": t[2] - t[1],
        "wall_s": wall,
        "run": stamps["run"],
        "trained_rounds": stamps["trained-rounds"],
        "replies": stamps.get("replies"),
        "calls": len(calls),
        "pids": len({c["pid"] for c in calls}),
        "empty": sum(bool(c.get("empty")) for c in calls),
        "fresh": sum(bool(c.get("fresh")) for c in calls),
        "clients": len({(c["pid"], c["client"]) for c in calls if "client" in c}),
        "handler_s": statistics.median(c["seconds"] for c in later),
        "later_calls": len(later),  # rounds 2…: whether the node's state could be resident where it runs
        "moved": sum((c["pid"], c["partition"], c["round"] - 1) not in served for c in later),
        "pickled_app_bytes": len(cloudpickle.dumps(client_app)),
        "library": library,
    }
    Path(spec["out"]).write_text(json.dumps(spec))


# ---------------------------------------------------------------- the grid (the parent process)
def run_one(
    work: Path, model: str, nodes: int, layout: str, strategy: str, rounds: int, tag: str, library: Path
) -> dict[str, Any]:
    """Run one cell's strategy in a fresh process (flower_dlion imported from ``library``); its result."""
    log_dir, state_dir = work / f"{tag}-calls", work / f"{tag}-state"
    log_dir.mkdir()
    spec = {
        "model": model,
        "nodes": nodes,
        "layout": layout,
        "strategy": strategy,
        "rounds": rounds,
        "log_dir": str(log_dir),
        "out": str(work / f"{tag}.json"),
    }
    env = {
        **os.environ,
        LAYOUT_ENV: layout,
        "RAY_ROUND_MODEL": model,
        "RAY_ROUND_LOG_DIR": str(log_dir),
        "FLOWER_DLION_STATE_DIR": str(state_dir),  # the clients' state files: removed after the run
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(library), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    log = work / f"{tag}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
            env=env,
            cwd=work,  # Ray puts the driver's working folder first on its workers' path: not this checkout
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=3600,
        )
    shutil.rmtree(state_dir, ignore_errors=True)
    if proc.returncode != 0 or not Path(spec["out"]).exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{tag} failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    result = json.loads(Path(spec["out"]).read_text())["result"]
    r = result
    print(
        f"  {tag}: median {statistics.median(r['round_s']):.3f} s/round (round 1 {r['round1_s']:.2f} s), "
        f"handler {r['handler_s']:.3f} s, {r['calls']} calls in {r['pids']} processes, {r['empty']} found empty "
        f"({r['fresh']} made fresh state), app pickled {r['pickled_app_bytes']:,} B; {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return result


def fmt_empty(runs: list[dict[str, Any]]) -> str:
    empty, fresh, calls = (sum(r[k] for r in runs) for k in ("empty", "fresh", "calls"))
    pids = sum(r["pids"] for r in runs)
    text = f"{empty}/{calls} ({pids} worker processes)"
    return text if fresh == empty else f"{text}; {fresh} made fresh state"


def table(cells: list[tuple[str, int, str]], results: dict[tuple[str, int, str, str], list[dict[str, Any]]]) -> str:
    lines = [
        "| model | nodes | layout | D-Lion s/round | FedAvg s/round | ratio "
        "| handler calls that found the client empty |",
        "|---|---|---|---|---|---|---|",
    ]
    detail = [
        "",
        "| model | nodes | layout | D-Lion handler s/call | FedAvg handler s/call "
        "| D-Lion calls whose node moved process | D-Lion round 1 s | FedAvg round 1 s "
        "| pickled ClientApp B (D-Lion / FedAvg) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, nodes, layout in cells:
        d, f = results[model, nodes, layout, "dlion"], results[model, nodes, layout, "fedavg"]
        ds = statistics.median(s for r in d for s in r["round_s"])
        fs = statistics.median(s for r in f for s in r["round_s"])
        lines.append(f"| {model} | {nodes} | {layout} | {ds:.3f} | {fs:.3f} | {ds / fs:.2f} | {fmt_empty(d)} |")
        detail.append(
            f"| {model} | {nodes} | {layout} | {statistics.median(r['handler_s'] for r in d):.3f} "
            f"| {statistics.median(r['handler_s'] for r in f):.3f} "
            f"| {sum(r['moved'] for r in d)}/{sum(r['later_calls'] for r in d)} "
            f"| {statistics.median(r['round1_s'] for r in d):.2f} | {statistics.median(r['round1_s'] for r in f):.2f} "
            f"| {d[0]['pickled_app_bytes']:,} / {f[0]['pickled_app_bytes']:,} |"
        )
    return "\n".join(lines + detail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "cnn"], choices=["resnet18", "cnn"])
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["module", "script"], choices=["module", "script"])
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run; rounds 2… are timed")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repeats of every cell")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here, and the raw results next to it")
    parser.add_argument(
        "--library",
        type=Path,
        default=ROOT,
        help="import flower_dlion from this folder (e.g. `git archive HEAD | tar -x -C DIR`; default: this checkout)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs of every run)")
    parser.add_argument(
        "--tables", nargs="+", type=Path, help="print the tables of earlier runs (their --out .json files), merged"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.tables:
        merged: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
        for path in args.tables:
            for key, runs in json.loads(path.read_text()).items():
                model, nodes, layout, strategy = key.split("|")
                merged.setdefault((model, int(nodes), layout, strategy), []).extend(runs)
        print(table(list(dict.fromkeys(k[:3] for k in merged)), merged))
        return
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (rounds 2… are timed)")

    cells = [(m, n, layout) for m in args.models for n in args.nodes for layout in args.layouts]
    work = Path(tempfile.mkdtemp(prefix="ray_round-"))
    print(f"{len(cells)} cells × {args.repeat} repeats × 2 strategies, {args.rounds} rounds each; logs in {work}")
    print(f"flower_dlion from {args.library.resolve()}")
    results: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    for rep in range(args.repeat):
        for model, nodes, layout in cells:
            for strategy in ("dlion", "fedavg"):
                tag = f"{model}-{nodes}-{layout}-{strategy}-{rep}"
                res = run_one(work, model, nodes, layout, strategy, args.rounds, tag, args.library)  # failed: logs kept
                results.setdefault((model, nodes, layout, strategy), []).append(res)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    text = table(cells, results)
    cpu = os.cpu_count()
    note = (
        f"\n\n{args.rounds} rounds a run, rounds 2–{args.rounds} timed, medians over {args.repeat} interleaved "
        f"repeats; {cpu} CPUs, one per client (Ray runs {cpu} actors); torch {_torch_version()}; "
        f"flower_dlion from {args.library.resolve()}. "
        "Timings are rough where other work shares the machine."
    )
    print("\n" + text + note)
    if args.out:
        args.out.write_text(text + note + "\n")
        raw = {"|".join(map(str, k)): v for k, v in results.items()}
        args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
