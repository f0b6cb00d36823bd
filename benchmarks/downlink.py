"""Issue 38's table: up and down bits per parameter per reply under partial participation, before and after.

    .venv/bin/python benchmarks/downlink.py run [--clients 10 50 100 1000] [--rounds 200] [--seeds 0] [--modes ...]
    .venv/bin/python benchmarks/downlink.py report          # the table from the saved runs, into docs/RESULTS.md
    .venv/bin/python benchmarks/downlink.py speed [--d 11000000]   # coding an 11M-value catch-up

``run``: for each federation (N nodes, 10 sampled per round: ``fraction-train = 10/N``; the
default federation otherwise: Fashion-MNIST, Dirichlet 0.5, vote, 200 rounds) two in-process
runs from the same seed:

* **before**: ``downlink = "chain"`` (a client that missed k rounds gets the k packed Δs, or
  the float32 model when that is smaller; the decay applied every round), ``init = "full"`` for
  10 of 10 (the default before issue 38) and ``"seed"`` otherwise, as the issue measured;
* **after**: the anchored downlink (``downlink = "auto"``, ``init = "seed"``) with every in-sync
  client's Δ coded with the two before it as context, as issue 38 measured it (since issue 48
  that is what a client on a slow link asks for: ``link-mbps = 0.001`` here);
* **packed** (``--modes packed``): issue 48's defaults, the in-sync Δ as its packed levels (the
  clients' link unknown: they never ask for the context coding).

Bytes come from ``results.jsonl`` (measured on the messages by the metering grid). Bits per
parameter per reply = 8 · bytes / (d · messages), over rounds 50–200 and over the whole run;
"vs FedAvg" = 64 / (up + down) (FedAvg sends the float32 model both ways). Each run's summary is
saved under ``study/downlink/``; ``report`` rewrites the block between the ``downlink`` markers in
docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "study" / "downlink"
D = 281_034  # trainable parameters of the repository's CNN (flower_dlion_app.model.Net); checked in run()
BEGIN, END = "<!-- downlink:begin -->", "<!-- downlink:end -->"


MODES = ("before", "after", "packed")


def _config(clients: int, mode: str, rounds: int, seed: int) -> dict:
    cfg = {"num-server-rounds": rounds, "fraction-train": min(1.0, 10 / clients), "seed": seed, "eval-every": rounds}
    if mode == "before":
        cfg |= {"downlink": "chain", "init": "full" if clients == 10 else "seed"}
    elif mode == "after":
        cfg |= {"link-mbps": 0.001}  # a slow link: the clients ask for every Δ coded with context
    return cfg


def run(clients: list[int], rounds: int, seeds: list[int], modes: list[str]) -> None:
    """Run every (clients, mode, seed) federation not yet saved."""
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app
    from flower_dlion_app.model import Net
    from flower_dlion_app.server_app import run_federation

    assert sum(p.numel() for p in Net().parameters()) == D
    OUT.mkdir(parents=True, exist_ok=True)
    for n in clients:
        for seed in seeds:
            for mode in modes:
                path = OUT / f"n{n}-{mode}-s{seed}-r{rounds}.json"
                if path.exists():
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    cfg = _config(n, mode, rounds, seed) | {"results-dir": tmp}
                    run_federation(LocalGrid(app, n), cfg, save_model=False)
                    rows = [json.loads(line) for line in Path(tmp, "results.jsonl").read_text().splitlines()]
                summary = _summarize(rows) | {"clients": n, "mode": mode, "seed": seed, "rounds": rounds}
                path.write_text(json.dumps(summary, indent=1))
                print(json.dumps(summary))


def _summarize(rows: list[dict]) -> dict:
    train = [r for r in rows if r["round"] >= 1]
    late = [r for r in train if r["round"] >= 50]

    def bits(rs: list[dict], key: str) -> float:
        return 8 * sum(r[key] for r in rs) / (D * max(1, sum(r["num_sent"] for r in rs)))

    return {
        "accuracy": [r["accuracy"] for r in rows if r["accuracy"] is not None][-1],
        "up_bits_late": bits(late, "bytes_up"),
        "down_bits_late": bits(late, "bytes_down"),
        "up_bits": bits(train, "bytes_up"),
        "down_bits": bits(train, "bytes_down"),
        "up_mb": sum(r["bytes_up"] for r in rows) / 1e6,
        "down_mb": sum(r["bytes_down"] for r in rows) / 1e6,
        "full_syncs": sum(r["full_syncs"] for r in train),
        "checksum_mismatches": sum(r["checksum_mismatches"] for r in train),
    }


def report() -> str:
    """The markdown table of the saved runs (mean over seeds), written into docs/RESULTS.md."""
    runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    keys = sorted({(r["clients"], r["rounds"]) for r in runs})
    lines = [
        "| federation | | up, bits/param per reply (rounds 50–200) | down (rounds 50–200) | down (whole run) "
        "| up + down vs FedAvg's 64 | MB up / down (whole run) | final accuracy (seeds) | full models sent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, rounds in keys:
        for mode in MODES:
            rs = [r for r in runs if (r["clients"], r["rounds"], r["mode"]) == (n, rounds, mode)]
            if not rs:
                continue

            def mean(key: str, rs: list[dict] = rs) -> float:
                return statistics.fmean(r[key] for r in rs)

            acc = ", ".join(f"{r['accuracy']:.4f}" for r in sorted(rs, key=lambda r: r["seed"]))
            total = mean("up_bits_late") + mean("down_bits_late")
            lines.append(
                f"| 10 of {n}, {rounds} rounds | {mode} | {mean('up_bits_late'):.2f} "
                f"| **{mean('down_bits_late'):.2f}** "
                f"| {mean('down_bits'):.2f} | {64 / total:.1f}× fewer | {mean('up_mb'):.1f} / {mean('down_mb'):.1f} "
                f"| {acc} | {mean('full_syncs'):.0f} |"
            )
    table = "\n".join(lines)
    results = ROOT / "docs" / "RESULTS.md"
    text = results.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]
        results.write_text(text)
    return table


def speed(d: int) -> None:
    """Time and size of coding a catch-up of d values: counts of k rounds of random votes, k = 1, 10, 100.

    Each coordinate's Δ is −1, 0, +1 with probabilities 1/3 (the default run has ~1/3 ties), so the
    counts are a worst case for the coder (real Δs are correlated over rounds: their counts spread less).
    Against lzma (preset 6) on the same values as int8/int16 bytes.
    """
    import lzma
    import time

    import numpy as np

    from flower_dlion import entropy

    rng = np.random.default_rng(0)
    ends = entropy.blocks_of([d // 20] * 19 + [d - 19 * (d // 20)])
    print("| k | ANS bits/value | encode s | decode s | lzma bits/value | packed trits (k = 1) or k·1.6 |")
    print("|---|---|---|---|---|---|")
    counts = np.zeros(d, np.int32)
    done = 0
    for k in (1, 10, 100):
        for _ in range(k - done):
            counts += rng.integers(-1, 2, d, dtype=np.int32)
        done = k
        t0 = time.perf_counter()
        coded = entropy.encode(counts, ends)
        t1 = time.perf_counter()
        assert np.array_equal(entropy.decode(coded, d, ends), counts)
        t2 = time.perf_counter()
        raw = counts.astype(np.int8 if k < 100 else np.int16).tobytes()
        lz = len(lzma.compress(raw))
        print(f"| {k} | {8 * len(coded) / d:.2f} | {t1 - t0:.3f} | {t2 - t1:.3f} | {8 * lz / d:.2f} | {1.6 * k:.1f} |")
        if k == 1:  # an in-sync client's Δ, coded with 9 contexts (the two Δs before it)
            context = rng.integers(0, 9, d, dtype=np.uint8)
            t0 = time.perf_counter()
            coded = entropy.encode(counts, ends, context, 9)
            t1 = time.perf_counter()
            assert np.array_equal(entropy.decode(coded, d, ends, context, 9), counts)
            t2 = time.perf_counter()
            print(f"| 1, 9 contexts | {8 * len(coded) / d:.2f} | {t1 - t0:.3f} | {t2 - t1:.3f} | | |")
            packed = packed_step(counts, d)
    print()
    print(
        "A Δ as its packed levels (issue 48): C' = C + L and x' = γ·xₐ − η·C' in one step on the CPU "
        f"(`anchored_counts.step_counts`), median of 5: {packed * 1e3:.1f} ms, against the context decode above "
        "(its decode alone; the counts and x come on top)."
    )


def packed_step(signs: np.ndarray, d: int) -> float:
    """Seconds (median of 5) of applying one Δ given as packed trits to an anchor and counts of d values."""
    import time

    import torch

    from flower_dlion import anchored_counts, codec

    packed = codec.encode_levels(torch.from_numpy(signs + 1), 3)
    anchor, counts = torch.randn(d), torch.zeros(d, dtype=torch.int32)
    out = (torch.empty_like(counts), torch.empty_like(anchor))
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        anchored_counts.step_counts(anchor, counts, packed, 3, 0.999, 1e-3, out=out, scratch=torch.empty_like(anchor))
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100, 1000])
    r.add_argument("--rounds", type=int, default=200)
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--modes", nargs="+", choices=MODES, default=["before", "after"])
    sub.add_parser("report")
    sp = sub.add_parser("speed")
    sp.add_argument("--d", type=int, default=11_000_000)
    args = parser.parse_args()
    if args.command == "speed":
        speed(args.d)
        return
    if args.command == "run":
        run(args.clients, args.rounds, args.seeds, args.modes)
    print(report())


if __name__ == "__main__":
    main()
