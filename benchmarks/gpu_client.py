"""GPU clients: what crosses between the GPU and the host, and what the δ path costs (issue 4, item 4).

1. A D-Lion federation on the in-process grid (``LocalGrid``, the real ServerApp logic and
   ClientApp) with the clients on a CUDA device (``device = "cuda"``; the strategy stays on
   the CPU, as in a ServerApp), profiled with ``torch.profiler``: every device → host and
   host → device copy the clients make, grouped by size, per client message. This is
   measured from the copies the GPU actually ran, not computed from formulas.
2. The client δ path alone for d float32 values: the Lion direction from m and g and its
   sign pack on the GPU, then the packed bytes to the host — against copying the float32
   direction to the host (what an fp32 method ships) and against ``v.sum()`` on the GPU.

Usage::

    python benchmarks/gpu_client.py [--clients 4] [--rounds 6] [--sizes 1e6,1e7,1e8]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flower_dlion import accel, codec, lion
from flower_dlion.clients.placement import Crossings
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.client_app import dlion
from flower_dlion_app.model import Net
from flower_dlion_app.server_app import run_federation


def copies(trace: Path) -> collections.Counter[tuple[str, int]]:
    """(kind, bytes) → number of memory copies in a ``torch.profiler`` Chrome trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    found: collections.Counter[tuple[str, int]] = collections.Counter()
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            kind = e["name"].removeprefix("Memcpy ").split(" ")[0]  # DtoH, HtoD, DtoD
            found[kind, int(e.get("args", {}).get("bytes", -1))] += 1
    if not found:
        print("no gpu_memcpy events in the trace; categories seen:", sorted({str(e.get("cat")) for e in events}))
    return found


def federation_copies(clients: int, rounds: int, settings: dict) -> None:
    d = sum(p.numel() for p in Net().parameters())
    print(f"\n## 1. Copies between GPU and host per client message ({settings}), model d = {d:,}\n")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"num-server-rounds": rounds, "eval-every": rounds, "results-dir": tmp, "device": "cuda"} | settings
        if not cfg.get("state-in-context", True):  # the state in files alone: a folder for them
            cfg["client-state-dir"] = f"{tmp}/state"
        grid = LocalGrid(client_app, clients, run_config=cfg)
        for here in dlion._devices.values():  # what earlier federations counted
            here.placement.crossings.take()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            run_federation(grid, cfg, save_model=False)
        prof.export_chrome_trace(f"{tmp}/trace.json")
        found = copies(Path(f"{tmp}/trace.json"))
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        counted = [here.placement.crossings.take() for here in dlion._devices.values()]
    messages = clients * rounds
    names = {codec.packed_size(d): "packed signs ⌈d/8⌉", 4 * d: "float32 d-vector (x or m)", 2 * d: "bf16 m"}
    print("| direction | bytes per copy | what (by size) | copies per message | bytes per message |")
    print("|---|---|---|---|---|")
    totals: collections.Counter[str] = collections.Counter()
    for (kind, nbytes), count in sorted(found.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        per = count / messages
        totals[kind] += nbytes * count
        print(f"| {kind} | {nbytes:,} | {names.get(nbytes, 'other')} | {per:.2f} | {nbytes * per:,.0f} |")
    for kind, total in sorted(totals.items()):
        print(f"| **{kind} total** | | | | **{total / messages:,.0f}** ({total / messages / (4 * d):.2f}× 4d) |")
    print(f"\n({messages} messages, {rounds} rounds; final accuracy {summary['final_accuracy']:.3f})")
    print_counted(counted, messages, d)


def print_counted(counted: list[Crossings], messages: int, d: int) -> None:
    """What ``Placement.crossings`` counted (the client's state and replicas; not the upload, batches, scalars)."""
    down: collections.Counter[str] = collections.Counter()
    up: collections.Counter[str] = collections.Counter()
    for c in counted:
        down.update(c.to_device)
        up.update(c.to_host)
    print("\nCounted by Placement.crossings (HtoD / DtoH above add the upload, batches, scalars):\n")
    print("| direction | purpose | bytes per message | × 4d |")
    print("|---|---|---|---|")
    for kind, found in (("HtoD", down), ("DtoH", up)):
        for label, nbytes in sorted(found.items()):
            print(f"| {kind} | {label} | {nbytes / messages:,.0f} | {nbytes / messages / (4 * d):.2f} |")


def timeit(fn: Callable[..., object], args: tuple, repeat: int) -> float:
    """Median seconds of ``repeat`` synchronized calls ``fn(*args)`` (after one warm-up)."""
    fn(*args)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def packed_to_host(m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The client's upload: the Lion direction's signs packed on the GPU, then the bytes to the host."""
    return codec.pack_signs(lion.direction(m, g, 0.9)).cpu()


def fp32_to_host(m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """What an fp32 method would ship: the float32 direction, copied to the host."""
    return lion.direction(m, g, 0.9).cpu()


def delta_path(sizes: list[int], repeat: int) -> None:
    print("\n## 2. Client δ path on the GPU: direction + pack + packed bytes to the host\n")
    print(
        "| d | v.sum() | direction(m, g) + pack → host | / sum | fp32 direction → host | fp32 / packed "
        "| bytes to host, packed / fp32 |"
    )
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in sizes:
        m = torch.randn(d, generator=gen, device="cuda")
        g = torch.randn(d, generator=gen, device="cuda")
        t_sum = timeit(torch.sum, (m,), repeat)
        t_packed = timeit(packed_to_host, (m, g), repeat)
        t_fp32 = timeit(fp32_to_host, (m, g), repeat)
        nbytes = packed_to_host(m, g).numel()
        print(
            f"| {d:.0e} | {t_sum * 1e3:.3f} ms | {t_packed * 1e3:.3f} ms | {t_packed / t_sum:.1f}× "
            f"| {t_fp32 * 1e3:.3f} ms | **{t_fp32 / t_packed:.1f}×** | {nbytes:,} / {4 * d:,} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_client.py needs a CUDA device")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    print(
        f"# GPU clients: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, kernels {os.environ.get(accel.KERNELS_ENV, 'auto')}"
    )
    for settings in (
        {"strategy": "dlion-vote"},
        {"strategy": "dlion-vote", "momentum-dtype": "bfloat16"},
        {"strategy": "dlion-vote", "state-in-context": False},
    ):
        federation_copies(args.clients, args.rounds, settings)
    delta_path([int(float(s)) for s in args.sizes.split(",")], args.repeat)


if __name__ == "__main__":
    main()
