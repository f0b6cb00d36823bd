"""The CPU pack's two formulations side by side, in one process, on the same data (issue 4, item 1).

``kernels.pack_positive`` packs the signs of 64 floats at a time in one of two ways, chosen
when it is compiled (``kernels._AVX2_PACKS``, from the CPU numba compiles for):

- **compare**: LLVM's own lowering of a 64-lane ``x > 0`` and an unsigned-minimum zero
  test (AVX-512 mask registers; on AVX2 alone a chain of packs, permutes and a scalar bit
  reversal);
- **AVX2 packs**: the sign bits through ``packssdw``/``packsswb``, one ``pshufb`` and one
  ``permd`` per 32 values and ``pmovmskb``, with the exact compare only in groups holding
  ±0 or NaN (x86-64 with AVX2 only).

Each is compiled here afresh (not from numba's cache) and timed, alternating, on one
thread and on torch's OpenMP team (where the codec runs it: ``numba_team.Team``, without the
codec's Python around it), against ``v.sum()`` on torch's threads and on one thread,
measured in the same rounds. The codec's whole call is ``benchmarks/codec_speed.py``'s
section 1. Usage::

    python benchmarks/pack_variants.py [--sizes 1e6,1e7] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable

import llvmlite.binding
import numba
import numpy as np
import torch

from flower_dlion import codec
from flower_dlion.accel import numba_pack as kernels
from flower_dlion.accel import numba_team

MIN_SECONDS = 0.2  # each measurement: the median of as many calls as fill this (at least 20)
BLOCK = kernels.BLOCK


def median_seconds(fn: Callable[[], object]) -> float:
    """Median seconds per call of ``fn()`` over calls that fill ``MIN_SECONDS`` (at least 20), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times: list[float] = []
    while len(times) < 20 or sum(times) < MIN_SECONDS:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiled(avx2: bool) -> Callable[..., bool]:
    """``kernels.pack_positive`` compiled afresh with the AVX2 packs on or off."""
    old = kernels._AVX2_PACKS
    kernels._AVX2_PACKS = avx2  # read by the intrinsic's code generator, at compile time
    try:
        pack = numba.njit(nogil=True, boundscheck=False)(kernels.pack_positive.py_func)
        pack(np.ones(BLOCK, np.float32), np.zeros(BLOCK // 8, np.uint8), 0, 1)  # compile now
    finally:
        kernels._AVX2_PACKS = old
    return pack


def measure(d: int, variants: dict[str, Callable[..., bool]], team: numba_team.Team, rounds: int) -> dict[str, float]:
    """Median seconds over ``rounds`` alternating rounds: the sums, each formulation on one thread and on the team.

    The team has all of torch's threads, as the codec's pack at this size would.
    """
    v = torch.randn(d, generator=torch.Generator().manual_seed(d))
    v[v == 0] = 1.0  # no exact zeros: every group on the plain path
    host, out, groups = v.numpy(), np.empty(codec.packed_size(d), np.uint8), -(-d // BLOCK)
    threads = torch.get_num_threads()
    times: dict[str, list[float]] = {}
    for _ in range(rounds):  # each round measures everything once
        times.setdefault("sum", []).append(median_seconds(v.sum))
        torch.set_num_threads(1)
        times.setdefault("sum, 1 thread", []).append(median_seconds(v.sum))
        torch.set_num_threads(threads)
        for name, pack in variants.items():
            out[:] = 0
            if pack(host, out, 0, groups) or not np.array_equal(out, np.packbits(host > 0)):
                raise AssertionError(f"{name}: wrong bits")
            times.setdefault(name, []).append(median_seconds(lambda p=pack: p(host, out, 0, groups)))
            task = numba_team._pack_task(pack)  # the codec's task with this formulation
            on_team = functools.partial(team.run, numba_team._launch_pack, task, threads, host, out)
            times.setdefault(f"{name}, team", []).append(median_seconds(on_team))
    return {k: statistics.median(x) for k, x in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e6,1e7", help="comma-separated d")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians over them are printed")
    args = parser.parse_args()
    features = llvmlite.binding.get_host_cpu_features()
    has = ", ".join(f for f in ("avx2", "avx512f", "avx512bw", "gfni") if features.get(f)) or "none"
    threads = torch.get_num_threads()
    print(
        f"# pack formulations: {platform.machine()}, {llvmlite.binding.get_host_cpu_name()} ({has}), "
        f"torch {torch.__version__} ({threads} threads), numba {numba.__version__}; "
        f"this CPU uses: {'AVX2 packs' if kernels._AVX2_PACKS else 'compare'}\n"
    )
    team = numba_team.Team()  # torch's OpenMP team (AttributeError where torch does not run on OpenMP)
    variants = {"compare": compiled(False)}
    if platform.machine().lower() in ("x86_64", "amd64") and features.get("avx2"):
        variants["AVX2 packs"] = compiled(True)
    head = "| d | v.sum() | v.sum(), 1 thread |"
    for name in variants:
        head += f" {name}, 1 thread | / sum 1 thread | {name}, team of {threads} | / sum |"
    head += " compare / AVX2 packs (team) |" if len(variants) == 2 else ""
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for d in (int(float(s)) for s in args.sizes.split(",")):
        med = measure(d, variants, team, args.rounds)
        row = f"| {d:.0e} | {med['sum'] * 1e3:.3f} ms | {med['sum, 1 thread'] * 1e3:.3f} ms |"
        for name in variants:
            one, teamed = med[name], med[f"{name}, team"]
            row += f" {one * 1e3:.3f} ms | {one / med['sum, 1 thread']:.2f}× "
            row += f"| {teamed * 1e3:.3f} ms | **{teamed / med['sum']:.2f}×** |"
        row += f" **{med['compare, team'] / med['AVX2 packs, team']:.2f}×** |" if len(variants) == 2 else ""
        print(row)


if __name__ == "__main__":
    main()
