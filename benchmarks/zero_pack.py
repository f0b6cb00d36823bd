"""The CPU sign pack when values are exactly zero: coin flips (issue 4, item 1).

An exact zero has no 1-bit sign, so ``codec.pack_signs`` sends a fair coin flip there. How
many zeros a client sends depends on its settings: a single Lion step rarely gives one, but
with ``local-steps = K`` the client sends the sign of U = Σₖ δₖ, and for even K about
C(K, K/2)/2ᴷ of its values are 0 (K = 2: half). Rows: the same d values with no zero, with
one, and as a sum of K = 2 or K = 4 random ±1 directions. Columns: ``v.sum()``, the codec's
pack, and the pack with its coins drawn and set the earlier way (one ``torch.randint(0, 2)``
draw per zero and one ``np.bitwise_or.at`` per zero, as the codec did before 9aabce2),
measured in the same run. Usage::

    python benchmarks/zero_pack.py [--sizes 281034,1e6,1e7] [--kernels auto|on|off]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

MIN_SECONDS = 0.2  # each measurement: the median of as many calls as fill this (at least 5)


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call of ``fn()`` over calls that fill ``MIN_SECONDS`` (at least 5), after 2 warm-ups."""
    for _ in range(2):
        fn()
    times: list[float] = []
    while len(times) < 5 or sum(times) < MIN_SECONDS:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def per_coin_pack(v: torch.Tensor, generator: torch.Generator) -> np.ndarray:
    """The reference: the same signs, coins drawn one ``torch.randint(0, 2)`` each and set one ``or.at`` each."""
    host = v.numpy()
    packed = np.packbits(host > 0)
    where = np.flatnonzero(host == 0)
    coin = torch.randint(0, 2, (where.size,), generator=generator, dtype=torch.uint8).numpy()
    np.bitwise_or.at(packed, where >> 3, (coin << (7 - (where & 7))).astype(np.uint8))
    return packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="281034,1e6,1e7")
    parser.add_argument("--kernels", default="auto", choices=["auto", "on", "off"])
    args = parser.parse_args()
    os.environ["FLOWER_DLION_KERNELS"] = args.kernels
    from flower_dlion import codec  # after the kernel mode is set

    print(
        f"# zero-coin pack: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), FLOWER_DLION_KERNELS={args.kernels}\n"
    )
    print("| d | values | zeros | v.sum() | pack | pack / sum | per-coin draws | per-coin / pack |")
    print("|---|---|---|---|---|---|---|---|")
    for d in (int(float(s)) for s in args.sizes.split(",")):
        gen = torch.Generator().manual_seed(0)
        plain = torch.randn(d, generator=gen)
        plain[plain == 0] = 1.0
        one = plain.clone()
        one[d // 2] = 0.0
        rows = {"no zero": plain, "one zero": one}
        for k in (2, 4):
            signs = torch.randint(0, 2, (k, d), generator=gen, dtype=torch.int8).mul_(2).sub_(1)
            rows[f"sum of K = {k} signs"] = signs.sum(0, dtype=torch.int32).float()
        for name, v in rows.items():
            coins = torch.Generator().manual_seed(1)
            total = median_ms(lambda v=v: v.sum())
            pack = median_ms(lambda v=v, coins=coins: codec.pack_signs(v, coins))
            naive = median_ms(lambda v=v, coins=coins: per_coin_pack(v, coins))
            zeros = int((v == 0).sum())
            print(
                f"| {d:,} | {name} | {zeros / d:.1%} | {total:.3f} ms | {pack:.3f} ms | {pack / total:.2f}× "
                f"| {naive:.3f} ms | **{naive / pack:.1f}×** |"
            )


if __name__ == "__main__":
    main()
