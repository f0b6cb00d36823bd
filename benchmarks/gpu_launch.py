"""Host-side cost of the codec's GPU calls at d = 10⁶, where they are launch-bound (issue 4, item 1 on CUDA).

Prints microseconds per call of 2,000 back-to-back calls (the host's launch rate where
the GPU keeps up) for torch's own one-launch operations, the Triton pack launched by its
JIT, taking a window of coin counters from a generator, reading a flag back (the apply
still does), and the codec's calls; then a cProfile of each codec call. Run on a CUDA device:

    python benchmarks/gpu_launch.py            (``cpu`` as an argument: a smoke run in Triton's interpreter)
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable

import torch
import triton

from flower_dlion import codec
from flower_dlion.accel import triton_kernels as gk

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
cuda = dev.type == "cuda"
N = 2000 if cuda else 3


def sync() -> None:
    """Wait for the device (nothing to wait for on the CPU)."""
    if cuda:
        torch.cuda.synchronize()


def per_call(fn: Callable[[], object], n: int = N) -> float:
    """Microseconds per call of ``n`` back-to-back calls after 20 warm-up calls."""
    for _ in range(20 if cuda else 1):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


d = 10**6 if cuda else 4000
v = torch.randn(d, device=dev).abs_().add_(0.1)  # no zeros: the pack's fast path
m, g = torch.randn(d, device=dev), torch.randn(d, device=dev)
x = torch.randn(d, device=dev)
levels = torch.randint(0, 3, (d,), device=dev, dtype=torch.uint8)
nbytes = (d + 7) // 8
out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
flag = torch.zeros(1, dtype=torch.int64, device=dev)
grid = (triton.cdiv(nbytes, 1024),)
gen = torch.Generator(device=dev)
seed, counter = gk.coin_stream(gen, dev, nbytes)
print("back-to-back, µs per call (CPU launch rate where the GPU keeps up)")
print("torch.sum", per_call(lambda: torch.sum(v)))
print("x.mul_", per_call(lambda: x.mul_(1.0)))
print("JIT _pack_positive", per_call(lambda: gk._pack_positive[grid](v, out, seed, counter, d, nbytes, BYTES=1024)))
print("coin_stream", per_call(lambda: gk.coin_stream(gen, dev, nbytes)))
print("int(flag)", per_call(lambda: int(flag)))
print("pack_signs", per_call(lambda: codec.pack_signs(v)))
print("pack_local_step_", per_call(lambda: codec.pack_local_step_(m, g, 0.9, 0.99)))
print("apply_levels_ L=3", per_call(lambda: codec.apply_levels_(x, levels, 3, 1e-4, 0.1)))
for name, fn in (
    ("pack_signs", lambda: codec.pack_signs(v)),
    ("pack_local_step_", lambda: codec.pack_local_step_(m, g, 0.9, 0.99)),
    ("apply_levels_", lambda: codec.apply_levels_(x, levels, 3, 1e-4, 0.1)),
):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(N // 4):
        fn()
    pr.disable()
    sync()
    print(f"\n### cProfile {name}, {N // 4} calls")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
