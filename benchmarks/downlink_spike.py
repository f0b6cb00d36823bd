"""Groundwork for issue 38 (downlink under partial participation): two measurements, no library change.

    .venv/bin/python benchmarks/downlink_spike.py entropy [--rounds 100]
    .venv/bin/python benchmarks/downlink_spike.py anchor [--clients 100 --sampled 10 --rounds 200 --every 50 --seed 0]

``entropy``: runs the default federation in process (10 clients, vote, ``init = "seed"``),
keeps every broadcast Δ, and prints per round (every 10th) the bits per parameter of the packed
payload (trit5, 1.6), its order-0 entropy, its entropy given the previous one and the previous
two Δs at the same coordinate (what a client that kept them could decode with), and the size
under the stdlib coders (zlib, lzma) and, when installed, zstandard and constriction's ANS coder.

``anchor``: a plain-torch D-Lion federation (the repository's CNN, Fashion-MNIST, Dirichlet 0.5,
``clients`` partitions, ``sampled`` per round, vote, lr 0.002, wd 0.1) run twice from the same
seed: with today's per-round decay ``x ← x − lr·(Δ + wd·x)``, and with the anchor rule of issue
38, ``x = γᵗ⁻ᵃ·xₐ − lr·C`` (C = Σ Δ since the anchor, refreshed every ``every`` rounds). Prints
both final test accuracies and the order-0 entropy of the count differences C_t − C_{t−k} that a
client k rounds behind would need (k = 1, 10).
"""

from __future__ import annotations

import argparse
import bz2
import importlib.util
import lzma
import os
import tempfile
import time
import zlib

import numpy as np
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


def _entropy(values: np.ndarray) -> float:
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _conditional(context: np.ndarray, k: np.ndarray, num_contexts: int) -> float:
    joint = np.bincount(context * 3 + k, minlength=num_contexts * 3).reshape(num_contexts, 3)
    total = joint.sum()
    return sum(row.sum() / total * _entropy(np.repeat(np.arange(3), row)) for row in joint if row.sum())


def entropy(rounds: int) -> None:
    """Per-round Δ entropies and coder sizes of the default federation."""
    from flower_dlion import codec
    from flower_dlion.strategies import downlink as server_downlink
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app
    from flower_dlion_app.server_app import run_federation

    kept: list[tuple[int, bytes, int]] = []
    remember = server_downlink.Downlink.remember

    def spy(self: server_downlink.Downlink, broadcast: server_downlink.Broadcast) -> None:
        kept.append((broadcast.num_levels, broadcast.payload, self.model.num_parameters))
        remember(self, broadcast)

    server_downlink.Downlink.remember = spy  # type: ignore[method-assign]
    cfg = {"num-server-rounds": rounds, "init": "seed", "eval-every": rounds}
    with tempfile.TemporaryDirectory() as out:
        cfg["results-dir"] = out
        run_federation(LocalGrid(app, 10, run_config=cfg), cfg, save_model=False)
    server_downlink.Downlink.remember = remember  # type: ignore[method-assign]

    coders = {"zlib-9": lambda b: zlib.compress(b, 9), "lzma": lzma.compress, "bz2": bz2.compress}
    if importlib.util.find_spec("zstandard"):
        import zstandard

        coders["zstd-19"] = zstandard.ZstdCompressor(level=19).compress
    levels = [codec.decode_levels(p, n, d).numpy().astype(np.int64) for n, p, d in kept]
    print(
        "| round | packed | H0 | H given Δ(t−1) | H given Δ(t−1), Δ(t−2) | "
        + " | ".join(coders)
        + " (of the packed bytes) |"
    )
    print("|---" * (5 + len(coders)) + "|")
    for t in range(2, len(kept), 10):
        _, payload, d = kept[t]
        k, k1, k2 = levels[t], levels[t - 1], levels[t - 2]
        sizes = [8 * len(f(payload)) / d for f in coders.values()]
        row = [8 * len(payload) / d, _entropy(k), _conditional(k1, k, 3), _conditional(3 * k1 + k2, k, 9), *sizes]
        print(f"| {t + 1} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    if importlib.util.find_spec("constriction"):
        import constriction

        d = 11_000_000  # a ResNet-18's worth of trits at the last round's frequencies
        p = np.bincount(levels[-1], minlength=3) / levels[-1].size
        symbols = np.random.default_rng(0).choice(3, size=d, p=p).astype(np.int32)
        model = constriction.stream.model.Categorical(p, perfect=False)
        t0 = time.perf_counter()
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(symbols, model)
        compressed = coder.get_compressed()
        t1 = time.perf_counter()
        decoded = constriction.stream.stack.AnsCoder(compressed).decode(model, d)
        t2 = time.perf_counter()
        assert (decoded == symbols).all()
        bits, took = 8 * compressed.nbytes / d, f"encode {t1 - t0:.3f} s, decode {t2 - t1:.3f} s"
        print(f"constriction ANS, {d} trits: {bits:.3f} bits, {took}")


def anchor(clients: int, sampled: int, rounds: int, every: int, seed: int) -> None:
    """Per-round decay against the anchor rule, from the same seed; count-difference entropies."""
    from flower_dlion import lion
    from flower_dlion_app.data import load_fashion_mnist, partition_indices, sample_batch, to_tensor
    from flower_dlion_app.model import Net, evaluate, flat_gradient, flat_parameters

    lr, wd, beta1, beta2 = 0.002, 0.1, 0.9, 0.99
    torch.manual_seed(seed)
    data = load_fashion_mnist()
    x_train, y_train = to_tensor(data.x_train), torch.as_tensor(data.y_train, dtype=torch.long)
    x_test, y_test = to_tensor(data.x_test), torch.as_tensor(data.y_test, dtype=torch.long)
    parts = partition_indices(data.y_train, partitioner="dirichlet", num_partitions=clients, alpha=0.5, seed=seed)
    model = Net()
    x0 = flat_parameters(model)
    d = x0.numel()
    for rule in ("per-round decay", "anchor"):
        x, m = x0.clone(), [torch.zeros(d) for _ in range(clients)]
        x_a, a, counts, counts_at = x0.clone(), 0, torch.zeros(d), {0: torch.zeros(d)}
        gaps: dict[int, list[float]] = {1: [], 10: []}
        for t in range(1, rounds + 1):
            chosen = np.random.default_rng([seed, t]).choice(clients, size=sampled, replace=False)
            votes = torch.zeros(d)
            for i in chosen:
                rows = sample_batch(parts[i], 64, seed=seed, partition_id=int(i), server_round=t)
                _, g = flat_gradient(model, x, x_train[rows], y_train[rows])
                votes += lion.local_step_(m[i], g, beta1, beta2)
            delta = votes.sign()
            if rule == "per-round decay":
                lion.apply_update_(x, delta, lr, wd)
                continue
            counts += delta
            x = x_a * np.float32((1 - lr * wd) ** (t - a)) - counts * np.float32(lr)
            if t - a >= every:  # a new anchor: x as it is, counts from zero
                x_a, a, counts, counts_at = x.clone(), t, torch.zeros(d), {}
            counts_at[t] = counts.clone()
            for k, found in gaps.items():
                if t % 5 == 0 and t - k in counts_at:
                    found.append(_entropy((counts - counts_at[t - k]).numpy().astype(np.int64)))
        torch.nn.utils.vector_to_parameters(x, model.parameters())
        _, accuracy = evaluate(model, x_test, y_test)
        bits = {k: round(float(np.mean(v)), 3) for k, v in gaps.items() if v}
        print(f"{rule}: final accuracy {accuracy:.4f}" + (f", count-difference entropy by gap {bits}" if bits else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    e = sub.add_parser("entropy")
    e.add_argument("--rounds", type=int, default=100)
    a = sub.add_parser("anchor")
    a.add_argument("--clients", type=int, default=100)
    a.add_argument("--sampled", type=int, default=10)
    a.add_argument("--rounds", type=int, default=200)
    a.add_argument("--every", type=int, default=50)
    a.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.what == "entropy":
        entropy(args.rounds)
    else:
        anchor(args.clients, args.sampled, args.rounds, args.every, args.seed)


if __name__ == "__main__":
    main()
