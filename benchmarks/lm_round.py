"""Language models (flower_dlion_app/text_models.py): a D-Lion client round against an AdamW step and a FedAvg round.

    .venv/bin/python benchmarks/lm_round.py --model char-lstm [--batch 32] [--context 80] [--repeat 5]
    .venv/bin/python benchmarks/lm_round.py --model gpt2-small --batch 1 --context 128 --repeat 3 [--device cuda]

One node of a real federation: ``DistributedLion`` and a ``DLionClient`` on the in-process grid
(``LocalGrid``: every message and context serialized as on the wire), one train message per
round, state files as the library chooses (in a temporary folder). The timed D-Lion client is
its ``train`` handler from the message in to the reply out: the server's Δ applied to the
replica, forward and backward of one batch (``Binding.gradient``), the Lion step of the flat
vector with its signs packed (``codec.pack_local_step_``), the reply. Its state file is written
after the reply, on a background thread; the benchmark waits for it (``DLionClient.wait``)
before it times anything else, and reports that wait apart.

In the same handler, on the same batch, in an order rotated round by round (paired,
interleaved samples; round 1, which carries the full model, is a warm-up and not counted):

* AdamW: ``zero_grad``, forward, backward, ``torch.optim.AdamW.step`` (one optimizer step);
* a FedAvg client's one-step round, as Flower's quickstart client does it: the received model
  loaded (``ArrayRecord.to_torch_state_dict`` + ``load_state_dict``), one SGD step, the model
  returned as numpy arrays (``ArrayRecord(model.state_dict())``); its model object is kept
  between rounds (not rebuilt);
* the D-Lion step from the library's pieces, without Flower: ``Binding.gradient``, then
  ``codec.pack_local_step_`` (Lion's direction and momentum update, the signs packed), then
  ``codec.decode_levels`` + ``codec.apply_levels_`` (x ← x − lr·(Δ + wd·x) with the packed signs
  as a one-voter Δ of 2 levels: what the next message applies).

Targets: ``last`` (LEAF's next character after each window: y of shape (B,), the default
loss) for the character models, ``all`` (every position: ``sequence_loss``) for GPT-2 small.
Medians of ``--repeat`` rounds; each ratio is the median of the rounds' own ratios (paired samples).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from flower_dlion import DistributedLion, DLionClient, codec
from flower_dlion.params import Binding, cross_entropy_loss
from flower_dlion.testing import LocalGrid
from flower_dlion_app.text_models import CharLSTM, CharTransformer, gpt2_small, sequence_loss

VOCAB = {"char-lstm": 81, "char-transformer": 81, "gpt2-small": 50257}
LR, WD, BETA1, BETA2 = 3e-4, 0.1, 0.9, 0.99


def model_fn(name: str, context: int) -> Callable[[], nn.Module]:
    """The model's builder (the transformer's positions: ``context``; GPT-2 small keeps its 1024)."""
    if name == "char-lstm":
        return CharLSTM
    if name == "char-transformer":
        return lambda: CharTransformer(context=context)
    return lambda: gpt2_small(context=max(1024, context))


def make_batch(name: str, batch: int, context: int, targets: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token windows (B, T) and their targets: (B,) for ``last``, (B, T) for ``all``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB[name], (batch, context), generator=gen)
    y = torch.randint(0, VOCAB[name], (batch,), generator=gen) if targets == "last" else torch.roll(x, -1, 1)
    return x, y


class Baselines:
    """AdamW, FedAvg and the D-Lion pieces on one second copy of the model (each sets the values it needs)."""

    def __init__(self, build: Callable[[], nn.Module], loss_fn: Callable, batch: Any, device: torch.device) -> None:
        torch.manual_seed(1)
        self.model, self.loss_fn, self.device = build().to(device), loss_fn, device
        self.batch = tuple(t.to(device) for t in batch)
        self.received = ArrayRecord(self.model.state_dict())  # what a FedAvg client is sent
        self.adamw = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WD)
        self.sgd = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.bound = Binding(self.model)
        self.x = self.bound.flat_parameters()
        self.m = torch.zeros_like(self.x)
        self.g = torch.empty_like(self.x)
        self.gen = torch.Generator(device=device).manual_seed(0)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def adamw_step(self) -> dict[str, float]:
        self.sync()
        t0 = time.perf_counter()
        self.adamw.zero_grad(set_to_none=True)
        self.loss_fn(self.model, self.batch).backward()
        self.adamw.step()
        self.sync()
        return {"adamw": time.perf_counter() - t0}

    def fedavg_round(self) -> dict[str, float]:
        self.sync()
        t0 = time.perf_counter()
        self.model.load_state_dict(self.received.to_torch_state_dict())
        self.sgd.zero_grad(set_to_none=True)
        self.loss_fn(self.model, self.batch).backward()
        self.sgd.step()
        reply = ArrayRecord(self.model.state_dict())  # numpy arrays (on the host), as Flower's clients send
        self.sync()
        assert len(reply) == len(self.received)
        return {"fedavg": time.perf_counter() - t0}

    def dlion_pieces(self) -> dict[str, float]:
        self.sync()
        t0 = time.perf_counter()
        self.bound.gradient(self.x, self.loss_fn, self.batch, out=self.g)
        self.sync()
        t1 = time.perf_counter()
        packed = codec.pack_local_step_(self.m, self.g, BETA1, BETA2, self.gen)
        self.sync()
        t2 = time.perf_counter()
        levels = codec.decode_levels(packed, 2, self.x.numel(), torch.uint8)  # one voter's Δ = its δ: 2 levels
        codec.apply_levels_(self.x, levels.to(self.device), 2, LR, WD)
        self.sync()
        t3 = time.perf_counter()
        return {"pieces": t3 - t0, "forward-backward": t1 - t0, "lion-pack": t2 - t1, "apply": t3 - t2}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round's samples (seconds) and the setup."""
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    build = model_fn(args.model, args.context)
    loss_fn = cross_entropy_loss if args.targets == "last" else sequence_loss
    batch = make_batch(args.model, args.batch, args.context, args.targets)
    samples: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="lm-round-") as tmp:
        app = ClientApp()
        client = DLionClient(app, build, loss_fn, device=device.type, state_dir=tmp)
        base = Baselines(build, loss_fn, batch, device)

        def dlion(msg: Message, context: Context, out: list[Message]) -> dict[str, float]:
            base.sync()
            t0 = time.perf_counter()
            out.append(client.train(msg, context, [batch]))
            base.sync()
            t1 = time.perf_counter()
            client.wait()  # the state file written after the reply: not in the next timing
            return {"dlion": t1 - t0, "state-write-wait": time.perf_counter() - t1}

        @app.train()
        def train(msg: Message, context: Context) -> Message:
            rnd, out, row = int(msg.metadata.group_id), [], {}
            tasks = [lambda: dlion(msg, context, out), base.adamw_step, base.fedavg_round, base.dlion_pieces]
            for i in range(len(tasks)):  # rotated by the round: each goes first, second, … in turn
                row |= tasks[(i + rnd) % len(tasks)]()
            if rnd > 1:
                samples.append(row)
            print(f"  round {rnd}: " + ", ".join(f"{k} {v:.3f}s" for k, v in row.items()), file=sys.stderr)
            return out[0]

        torch.manual_seed(0)
        strategy = DistributedLion(lr=LR, weight_decay=WD, min_train_nodes=1, min_available_nodes=1)
        strategy.start(LocalGrid(app, 1), ArrayRecord(build().state_dict()), num_rounds=args.repeat + 1)
        client.wait()
    return {
        "model": args.model,
        "d": strategy.num_parameters,
        "batch": args.batch,
        "context": args.context,
        "targets": args.targets,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "samples": samples,
        "median": {k: statistics.median(s[k] for s in samples) for k in samples[0]},
        "paired_ratio": {  # the median of each round's ratio (the samples of one round are paired)
            k: statistics.median(s["dlion"] / s[k] for s in samples) for k in ("adamw", "fedavg")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(VOCAB), default="char-lstm")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=80, help="tokens per window")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--targets", choices=["last", "all"], help="default: last (char models), all (gpt2-small)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, help="write the samples and medians as JSON here")
    args = parser.parse_args()
    args.targets = args.targets or ("all" if args.model == "gpt2-small" else "last")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    logging.getLogger("flwr").setLevel(logging.WARNING)
    result = run(args)
    med = result["median"]
    print(
        f"# {result['device']}, torch {result['torch']}, {result['threads']} threads, {result['cpus']} CPUs "
        f"({result['machine']}); targets: {args.targets}; medians of {args.repeat} paired rounds\n"
    )
    print("| model | d | batch | context | D-Lion client s | AdamW step s | ratio | FedAvg s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratio = result["paired_ratio"]
    print(
        f"| {args.model} | {result['d']:,} | {args.batch} | {args.context} | {med['dlion']:.4f} | "
        f"{med['adamw']:.4f} | {ratio['adamw']:.2f} | {med['fedavg']:.4f} | {ratio['fedavg']:.2f} |"
    )
    print("\nratio: D-Lion client / the other, the median of the rounds' paired ratios")
    print("\nD-Lion from the library's pieces (no Flower), and the state write after the reply:\n")
    print("| forward + backward s | Lion step + pack s | apply Δ s | pieces total s | state write wait s |")
    print("|---|---|---|---|---|")
    print(
        f"| {med['forward-backward']:.4f} | {med['lion-pack']:.4f} | {med['apply']:.4f} | {med['pieces']:.4f} | "
        f"{med['state-write-wait']:.4f} |"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
