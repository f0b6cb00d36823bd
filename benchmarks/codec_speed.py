"""Codec speed against memory-speed references measured in the same run (issue 4, items 1–2).

1. Client pack: ``codec.pack_signs(v)`` (sign of the Lion mix v, bit-packed) against a
   float32 reduction ``v.sum()`` over the same tensor, with the fused kernel and with numpy;
   also the client's whole step from m and g (δ and the momentum update): composed
   (``lion.local_step_``, then the pack) and fused into one pass (``codec.pack_local_step_``),
   which reads two tensors and writes one. In a process that calls them repeatedly (as here)
   the CPU kernels run on torch's own OpenMP team; the last column is the pack on the
   codec's own threads instead.
2. Server aggregation of n packed payloads: the vote (``codec.count_planes`` then
   ``codec.majority_masks``: bit-sliced, never unpacked) and the mean (``codec.count_planes``:
   its planes are the mean's encoded levels) against an XOR-reduce over the same packed bytes
   (``acc ^= payload`` on int64 words) and against the naive form: unpack each payload to bytes and add it to an int16
   counter, then sign / encode; the vote also with numpy instead of the kernels.
3. The int32 vote counts (``codec.count_ones``: the sum S = 2·count − n comes from it; the
   strategy's count when it quantizes Δ) with the kernels and with numpy, against writing d
   int32 zeros.
4. Applying Δ from its levels (``codec.apply_levels_``, on the server and on every client)
   against the composition it replaces and against ``x.mul_(c)`` alone (``--apply``); and a
   client's whole receive path, decoding the broadcast bytes and applying Δ, with the levels
   decoded as int32 and as uint8 (what the client does).
5. CUDA only: the GPU's own time per call of the pack, the fused step and the sum, with the
   launches queued behind a sleep kernel (``gpu_time``). Sections 1–4 time one call from the
   host (synchronize, call, synchronize): at 10⁶–10⁷ values that is the launch and its Python,
   not the kernel; this section times the kernels back to back, as the memory sees them.

On the CPU "kernel" means ``FLOWER_DLION_KERNELS=on`` (numba's fused kernels at every size;
the codec's default ``auto`` uses them from 2²⁰ values up) and "numpy" means ``off``. On a
CUDA device the vote, the mean, the fused step, the apply and "kernel" are the Triton kernels
(``on``, as under ``auto``) and "numpy" stands for the tensor-operation path (``off``); section 3
is CPU only.
Each figure is the median of ``--repeat`` runs or more (as many as fill 0.2 s, up to 2000: fast
calls are noisy); ratios are printed against the references
of the same run. Usage::

    python benchmarks/codec_speed.py [--device cpu|cuda] [--sizes 1e6,1e7,1e8] [--clients 4,16,64,256]
        [--counts] [--apply] [--count-sizes 281031,1e7]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from flower_dlion import accel, codec, lion
from flower_dlion.accel import threads

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
MIN_SECONDS = 0.2  # timeit's calls add up to at least this


@contextmanager
def kernels(mode: str) -> Iterator[None]:
    """Run the codec with ``FLOWER_DLION_KERNELS=mode``."""
    old = os.environ.get(accel.KERNELS_ENV, "auto")
    os.environ[accel.KERNELS_ENV] = mode
    try:
        yield
    finally:
        os.environ[accel.KERNELS_ENV] = old


@contextmanager
def own_threads() -> Iterator[None]:
    """Run the CPU kernels on the codec's own threads, never on torch's OpenMP team."""
    old = threads.TEAM_AFTER
    threads.TEAM_AFTER = 1 << 30
    try:
        yield
    finally:
        threads.TEAM_AFTER = old


def timeit(fn: Callable[..., object], args: tuple, repeat: int, device: torch.device) -> float:
    """Median seconds of at least ``repeat`` calls ``fn(*args)`` (after warm-up calls).

    Calls go on until they add up to ``MIN_SECONDS`` too (at most 2000 calls): the median
    of a few calls of 0.05 ms moves by 2× between runs on a virtual machine. The warm-up
    takes the codec's CPU kernels past the calls they make on the codec's own threads
    (``accel.threads.TEAM_AFTER``) onto torch's team, where a process that calls them repeatedly runs them.
    """
    for _ in range(min(threads.TEAM_AFTER, 8) + 1):  # own_threads() sets it out of reach
        fn(*args)
    times: list[float] = []
    while len(times) < repeat or (sum(times) < MIN_SECONDS and len(times) < 2000):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pack_inputs(d: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Momentum m, gradient g and a Lion mix v of d values (v scaled by a random factor in [0.5, 1.5): no zeros)."""
    m = torch.randn(d, generator=gen, device=device)
    g = torch.randn(d, generator=gen, device=device)
    return m, g, lion.direction(m, g, 0.9).mul_(torch.rand(d, generator=gen, device=device).add_(0.5))


@functools.cache
def sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on the current device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 10**7 / start.elapsed_time(end)


def gpu_time(fn: Callable[..., object], args: tuple, calls: int, repeat: int) -> float | None:
    """Median GPU seconds per call of ``fn(*args)``, over ``repeat`` batches of ``calls`` calls.

    The GPU first runs a sleep kernel that outlasts twice the host's time for a batch (its
    launches and its kernels, timed just before), so the host queues the whole batch before
    the GPU starts it, and CUDA events around the batch time its kernels back to back, without
    the host's cost per launch. Returns None if the sleep ended before the batch was queued
    (the start event had already run: a call that synchronizes, or a host slower than it was).
    """
    fn(*args)
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2 * host_ms * sleep_cycles_per_ms()) + 1)
        start.record()
        for _ in range(calls):
            fn(*args)
        end.record()
        queued = not start.query()  # the GPU is still asleep: every launch of the batch is in the queue
        end.synchronize()
        if not queued:
            return None
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def _ms(t: float | None) -> str:
    """A time in ms for a table cell (a dash where there is none)."""
    return "–" if t is None else f"{t * 1e3:.4f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    """``a / b`` for a table cell (a dash where either is missing)."""
    return "–" if a is None or b is None else f"**{a / b:.2f}×**"


def bench_gpu_time(sizes: list[int], device: torch.device, repeat: int, calls: int = 200) -> None:
    print("\n## 5. On the GPU itself: kernel time per call, launches queued behind a sleep kernel (CUDA only)\n")
    print(
        "| d | v.sum() | pack, kernel | ratio | Lion step + pack, fused | ratio | momentum update alone | fused / it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=device).manual_seed(0)
    for d in sizes:
        m, g, v = pack_inputs(d, gen, device)  # as in section 1
        with kernels("on"):
            t_sum = gpu_time(torch.sum, (v,), calls, repeat)
            t_pack = gpu_time(codec.pack_signs, (v,), calls, repeat)
            t_fused = gpu_time(fused_step, (m, g), calls, repeat)
            t_momentum = gpu_time(lion.update_momentum_, (m, g, 0.99), calls, repeat)
        print(
            f"| {d:.0e} | {_ms(t_sum)} | {_ms(t_pack)} | {_ratio(t_pack, t_sum)} | {_ms(t_fused)} "
            f"| {_ratio(t_fused, t_sum)} | {_ms(t_momentum)} | {_ratio(t_fused, t_momentum)} |",
            flush=True,
        )
        del m, g, v


def naive_counts(payloads: list[torch.Tensor], d: int) -> torch.Tensor:
    """The naive form: unpack every payload to one byte per value and add it to a counter."""
    counts = torch.zeros(d, dtype=torch.int16, device=payloads[0].device)
    for p in payloads:
        counts += codec.unpack_bits(p, d)
    return counts


def vote(payloads: list[torch.Tensor], d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vote's packed masks (S > 0, S = 0) as the server forms them: the count planes, compared bit-sliced."""
    return codec.majority_masks(codec.count_planes(payloads, d), len(payloads), d)


def xor_reduce(words: list[torch.Tensor]) -> torch.Tensor:
    """The reference: XOR of the payloads, 64 bits at a time."""
    acc = words[0].clone()
    for w in words[1:]:
        acc.bitwise_xor_(w)
    return acc


def step_then_pack(m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The client's whole step, composed: δ and m ← β₂·m + (1−β₂)·g (``lion.local_step_``), then the pack."""
    return codec.pack_signs(lion.local_step_(m, g, 0.9, 0.99))


def fused_step(m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The same in one pass over m and g (``codec.pack_local_step_``; the fused kernel on the CPU)."""
    return codec.pack_local_step_(m, g, 0.9, 0.99)


def bench_pack(sizes: list[int], device: torch.device, repeat: int) -> None:
    print("\n## 1. Client pack: sign + bit-pack of d float32 values, against v.sum() over the same tensor\n")
    unfused = "numpy" if device.type == "cpu" else "tensor ops"
    print(
        f"| d | v.sum() | pack, kernel | ratio | v.sum(), 1 thread | pack / it | pack, {unfused} | ratio "
        "| Lion step, then pack | ratio | Lion step + pack, fused | ratio | composed / fused "
        "| momentum update alone | fused / it | pack, own threads | own / pack |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=device).manual_seed(0)
    for d in sizes:
        m, g, v = pack_inputs(d, gen, device)
        t_sum = timeit(torch.sum, (v,), repeat, device)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        t_sum1 = timeit(torch.sum, (v,), repeat, device)  # one core: what the pack gets below 2²⁰ values
        torch.set_num_threads(threads)
        with kernels("on" if HAVE_NUMBA or device.type == "cuda" else "off"):
            t_pack = timeit(codec.pack_signs, (v,), repeat, device)
            t_step = timeit(step_then_pack, (m, g), repeat, device)
            t_momentum = timeit(lion.update_momentum_, (m, g, 0.99), repeat, device)  # torch: m.mul_(β₂).add_(g, …)
            fused = "– | – | – | –"  # no fused step without numba on the CPU (there the composition runs)
            if device.type == "cuda" or HAVE_NUMBA:
                t_fused = timeit(fused_step, (m, g), repeat, device)
                fused = (
                    f"{t_fused * 1e3:.3f} ms | **{t_fused / t_sum:.2f}×** | **{t_step / t_fused:.1f}×** "
                    f"| {t_momentum * 1e3:.3f} ms | {t_fused / t_momentum:.2f}×"
                )
        with kernels("off"):
            t_numpy = timeit(codec.pack_signs, (v,), repeat, device)
        own = "– | –"  # the codec's own threads instead of torch's OpenMP team (CPU kernels only)
        if device.type == "cpu" and HAVE_NUMBA:
            with kernels("on"), own_threads():
                t_own = timeit(codec.pack_signs, (v,), repeat, device)
            own = f"{t_own * 1e3:.3f} ms | {t_own / t_pack:.2f}×"
        print(
            f"| {d:.0e} | {t_sum * 1e3:.3f} ms | {t_pack * 1e3:.3f} ms | **{t_pack / t_sum:.2f}×** "
            f"| {t_sum1 * 1e3:.3f} ms | {t_pack / t_sum1:.2f}× "
            f"| {t_numpy * 1e3:.3f} ms | {t_numpy / t_sum:.2f}× | {t_step * 1e3:.3f} ms | {t_step / t_sum:.2f}× "
            f"| {fused} | {own} |"
        )
        del m, g, v


def naive_vote(payloads: list[torch.Tensor], n: int, d: int) -> torch.Tensor:
    """Naive vote: sign of 2·counts − n."""
    return torch.sign(2 * naive_counts(payloads, d).int() - n)


def naive_mean(payloads: list[torch.Tensor], n: int, d: int) -> torch.Tensor:
    """Naive mean: the counts encoded as the mean's n + 1 levels."""
    return codec.encode_levels(naive_counts(payloads, d), n + 1)


def bench_aggregate(
    sizes: list[int], clients: list[int], device: torch.device, repeat: int, naive_limit: float
) -> None:
    print("\n## 2. Server aggregation of n packed payloads, against XOR-reduce and the naive unpack-then-sum\n")
    unfused = "numpy" if device.type == "cpu" else "tensor ops"
    print(
        f"| d | n | XOR-reduce | vote (bit-sliced) | vote / XOR | mean (bit-sliced) | mean / XOR "
        f"| vote, {unfused} / XOR | naive vote | naive / vote | naive mean | naive / mean | extra memory (vote) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for d in sizes:
        nbytes = codec.packed_size(d)
        pool: list[torch.Tensor] = []
        for n in clients:
            while len(pool) < n:  # payloads are reused across n (random bits: the vote's worst case)
                pool.append(torch.from_numpy(np.frombuffer(rng.bytes(nbytes), dtype=np.uint8).copy()).to(device))
            p = pool[:n]
            words = [x.view(torch.int64) for x in p]
            t_xor = timeit(xor_reduce, (words,), repeat, device)
            with kernels("on" if HAVE_NUMBA or device.type == "cuda" else "off"):
                t_vote = timeit(vote, (p, d), repeat, device)
                t_mean = timeit(codec.count_planes, (p, d), repeat, device)
            with kernels("off"):
                t_numpy = timeit(vote, (p, d), repeat, device)
            row = f"| {d:.0e} | {n} | {t_xor * 1e3:.3f} ms | {t_vote * 1e3:.3f} ms | **{t_vote / t_xor:.2f}×** "
            row += f"| {t_mean * 1e3:.3f} ms | **{t_mean / t_xor:.2f}×** | {t_numpy / t_xor:.2f}× "
            if n * d <= naive_limit:
                t_nv = timeit(naive_vote, (p, n, d), repeat, device)
                t_nm = timeit(naive_mean, (p, n, d), repeat, device)
                row += f"| {t_nv * 1e3:.0f} ms | **{t_nv / t_vote:.1f}×** "
                row += f"| {t_nm * 1e3:.0f} ms | **{t_nm / t_mean:.1f}×** "
            else:
                row += "| – | – | – | – "
            planes, nwords = n.bit_length(), (nbytes + 7) // 8
            if device.type == "cuda":  # two masks and the table of payload addresses
                extra = 2 * nbytes + 8 * n
            elif HAVE_NUMBA:  # two masks + per thread the counters: 2·max(B, 3) + 2 chunk planes of 8 kB
                extra = 2 * 8 * nwords + torch.get_num_threads() * (2 * max(planes, 3) + 2) * 8 * 1024
            else:  # B + 1 planes + 2B + 8 chunk buffers, then the two masks
                extra = (planes + 3) * 8 * nwords + (2 * planes + 8) * 8 * min(1 << 16, nwords)
            print(row + f"| {extra / 1e6:.1f} MB ({extra / d:.2f} B/value) |")
        del pool


def bench_counts(sizes: list[int], clients: list[int], repeat: int) -> None:
    print("\n## 3. count_ones (int32 counts) of n payloads, kernel against numpy\n")
    print("| d | n | zeros(d, int32) | count_ones, kernel | / zeros | count_ones, numpy | numpy / kernel |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for d in sizes:
        d += 3  # a partial last word, as in a real model
        payloads: list[bytes] = []
        for n in clients:
            payloads += [rng.bytes(codec.packed_size(d)) for _ in range(n - len(payloads))]  # as Flower delivers them
            t_zeros = timeit(functools.partial(torch.zeros, dtype=torch.int32), (d,), repeat, torch.device("cpu"))
            with kernels("on" if HAVE_NUMBA else "off"):
                t_kernel = timeit(codec.count_ones, (payloads[:n], d), repeat, torch.device("cpu"))
            with kernels("off"):
                t_numpy = timeit(codec.count_ones, (payloads[:n], d), repeat, torch.device("cpu"))
            print(
                f"| {d:,} | {n} | {t_zeros * 1e3:.1f} ms | {t_kernel * 1e3:.1f} ms | {t_kernel / t_zeros:.2f}× "
                f"| {t_numpy * 1e3:.1f} ms | **{t_numpy / t_kernel:.1f}×** |"
            )


def compose_apply(x: torch.Tensor, levels: torch.Tensor, num_levels: int) -> torch.Tensor:
    """Δ from its levels, then x ← x − lr·(Δ + wd·x): the composition ``codec.apply_levels_`` replaces."""
    return lion.apply_update_(x, codec.levels_to_values(levels, num_levels), 0.01, 0.1)


def receive(x: torch.Tensor, encoded: torch.Tensor, num_levels: int, dtype: torch.dtype) -> torch.Tensor:
    """A client's receive path: decode the broadcast levels (as ``dtype``), apply Δ."""
    levels = codec.decode_levels(encoded, num_levels, x.numel(), dtype)
    return codec.apply_levels_(x, levels, num_levels, 0.01, 0.1)


def bench_apply(sizes: list[int], device: torch.device, repeat: int) -> None:
    print("\n## 4. Applying Δ from its levels (the server and every client, every round), against x.mul_(c)\n")
    print(
        "| d | L | x.mul_(c) | apply_levels_, kernel | / mul_ | levels_to_values + apply_update_ "
        "| / mul_ | composed / kernel | received: decode (int32) + apply | decode (uint8) + apply | int32 / uint8 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for d in sizes:
        d += 3
        x = torch.randn(d, generator=torch.Generator().manual_seed(d)).to(device)
        for num_levels in (2, 3, 11):  # the vote of an odd n, with ties (even n); the mean of 10 signs
            levels = torch.randint(0, num_levels, (d,), dtype=torch.int32).to(device)
            t_mul = timeit(x.mul_, (0.999,), repeat, device)
            with kernels("on" if HAVE_NUMBA or device.type == "cuda" else "off"):
                t_kernel = timeit(codec.apply_levels_, (x, levels, num_levels, 0.01, 0.1), repeat, device)
                encoded = codec.encode_levels(levels, num_levels)
                t_wide = timeit(receive, (x, encoded, num_levels, torch.int32), repeat, device)
                t_narrow = timeit(receive, (x, encoded, num_levels, torch.uint8), repeat, device)
            with kernels("off"):
                t_comp = timeit(compose_apply, (x, levels, num_levels), repeat, device)
            print(
                f"| {d:,} | {num_levels} | {t_mul * 1e3:.2f} ms | {t_kernel * 1e3:.2f} ms "
                f"| **{t_kernel / t_mul:.2f}×** | {t_comp * 1e3:.2f} ms | {t_comp / t_mul:.2f}× "
                f"| **{t_comp / t_kernel:.1f}×** | {t_wide * 1e3:.2f} ms | {t_narrow * 1e3:.2f} ms "
                f"| **{t_wide / t_narrow:.1f}×** |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="d values (multiples of 64)")
    parser.add_argument("--clients", default="4,16,64,256")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--naive-limit", type=float, default=2e9, help="skip the naive form when n·d exceeds this")
    parser.add_argument("--skip-pack", action="store_true")
    parser.add_argument("--skip-aggregate", action="store_true")
    parser.add_argument("--counts", action="store_true", help="also section 3 (CPU only), for --count-sizes")
    parser.add_argument("--count-sizes", default="281031,1e7")
    parser.add_argument("--apply", action="store_true", help="also section 4, for --count-sizes")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = [int(float(s)) // 64 * 64 for s in args.sizes.split(",")]
    clients = [int(n) for n in args.clients.split(",")]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    numba = importlib.import_module("numba").__version__ if HAVE_NUMBA else "not installed"
    print(
        f"# codec speed: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numba {numba}, device {device} (GPU: {gpu})"
    )
    if not args.skip_pack:
        bench_pack(sizes, device, args.repeat)
    if not args.skip_aggregate:
        bench_aggregate(sizes, clients, device, args.repeat, args.naive_limit)
    if args.counts:
        bench_counts([int(float(s)) for s in args.count_sizes.split(",")], [10, 64], args.repeat)
    if args.apply:
        bench_apply([int(float(s)) for s in args.count_sizes.split(",")], device, args.repeat)
    if device.type == "cuda" and not args.skip_pack:  # last: nothing above is lost if the GPU's sleep misbehaves
        bench_gpu_time(sizes, device, args.repeat)


if __name__ == "__main__":
    main()
