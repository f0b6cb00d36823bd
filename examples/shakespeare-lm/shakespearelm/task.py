"""shakespearelm: the model, the text and the evaluation.

The model: a GPT-2-shaped character LM (``transformers.GPT2LMHeadModel`` built from a config, offline),
pre-trained once, centrally; the federation trains only LoRA adapters on it (``peft``), with
Distributed Lion. The text: LEAF's Shakespeare (``flower_dlion_app.shakespeare``: one client per
speaking role, 80 characters in, the 81st out), read offline.

- Pre-training: the train text of the held-out plays, every 4th play by name (10 of 37), which the
  federation never sees: ``base-steps`` AdamW steps of 32 random 81-character windows, seeded, on the
  CPU. The base is saved with the vocabulary it was trained on, in
  ``<cache>/shakespeare-lm/base-<key>.pt`` (``<cache>``: ``$FLOWER_DLION_CACHE`` or
  ``~/.cache/flower-dlion``; the key hashes the model config, the steps, the seed, the vocabulary and
  the recipe). ``python -m shakespearelm.task --pretrain`` builds it; so does the ServerApp when it is
  missing.
- The federation: node ``partition-id`` i of N trains on the i-th largest role (most train windows,
  then by name) of the other 27 plays: random 81-character windows of its train split.
- Evaluation (on the server): ``eval-windows`` test windows of the federation's N roles, drawn with
  ``seed``: next-character accuracy at the last position (LEAF's metric), and the accuracy and the
  loss per character over all 80 predicted positions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import tempfile
import time
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from flower_dlion_app.shakespeare import SEQ_LEN, VOCAB, VOCAB_SIZE, Shakespeare, batch, load_shakespeare

WINDOW = SEQ_LEN + 1  # 81 characters: the model reads 80 and predicts each next one
HELD_OUT_EVERY = 4  # plays[::4] of the sorted play names: pre-training text only
LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]  # every linear layer of each block: attention and MLP
PRETRAIN = {"batch": 32, "lr": 3e-3, "warmup": 0.1, "weight-decay": 0.01, "recipe": 1}  # bump recipe on change

# The run config this process serves: the apps set it from their Context before the model is built
# (client_app.py: a mod, before the strategy's hello); the pyproject's values until then.
RUN_CONFIG: dict[str, Any] = {}


def app_config() -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` of this app's pyproject.toml (the defaults)."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]


def run_config() -> dict[str, Any]:
    """This process's run config: the pyproject's defaults, updated by the apps."""
    if not RUN_CONFIG:
        RUN_CONFIG.update(app_config())
    return RUN_CONFIG


# ---------------------------------------------------------------- the model
def model_config() -> GPT2Config:
    """The base's architecture: 2 blocks of 128, 4 heads, 128 positions, LEAF's 80 characters + OOV."""
    return GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=128, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def base_model(config: GPT2Config) -> GPT2LMHeadModel:
    """A new (untrained) base of ``config``; ValueError unless its vocabulary is the data's."""
    if config.vocab_size != VOCAB_SIZE:
        raise ValueError(
            f"the model config's vocab_size is {config.vocab_size}, the data's VOCAB_SIZE is {VOCAB_SIZE} "
            f"({len(VOCAB)} characters + OOV): they must be equal"
        )
    return GPT2LMHeadModel(config)


def cache_dir() -> Path:
    """``$FLOWER_DLION_CACHE/shakespeare-lm``, else ``~/.cache/flower-dlion/shakespeare-lm``."""
    return Path(os.environ.get("FLOWER_DLION_CACHE") or Path.home() / ".cache" / "flower-dlion") / "shakespeare-lm"


def base_path(steps: int, seed: int) -> Path:
    """Where the base pre-trained for ``steps`` steps from ``seed`` lives (whether or not it is there yet)."""
    c = model_config()
    arch = {k: getattr(c, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    what = {"arch": arch, "steps": steps, "seed": seed, "vocab": VOCAB, "held-out": HELD_OUT_EVERY, **PRETRAIN}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"base-{key}.pt"


def load_base(path: Path) -> GPT2LMHeadModel:
    """The pre-trained base in ``path``; ValueError if it was trained on another vocabulary."""
    if not path.is_file():
        raise FileNotFoundError(
            f"no pre-trained base model at {path}: build it with `python -m shakespearelm.task --pretrain "
            "--steps <base-steps> --seed <seed>` (from examples/shakespeare-lm, the run config's values), or start "
            "the ServerApp, which builds it; on other machines, copy the file there"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved["vocab"] != VOCAB:
        theirs = saved["vocab"]
        at = next((i for i, (a, b) in enumerate(zip(theirs, VOCAB, strict=False)) if a != b), min(len(theirs), 80))
        raise ValueError(
            f"tokenizer mismatch: the base model {path} was pre-trained on the vocabulary {theirs!r} "
            f"({len(theirs)} characters), the data is coded over VOCAB {VOCAB!r} ({len(VOCAB)} characters); "
            f"they first differ at position {at}: rebuild the base (`python -m shakespearelm.task --pretrain`)"
        )
    model = base_model(GPT2Config.from_dict(json.loads(saved["config"])))
    model.load_state_dict(saved["state_dict"])
    return model


def lora_model() -> nn.Module:
    """The base from its file, frozen, with rank ``lora-rank`` LoRA adapters on ``LORA_TARGETS`` (B = 0)."""
    cfg = run_config()
    base = load_base(base_path(cfg["base-steps"], cfg["seed"]))
    rank = cfg["lora-rank"]
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0, fan_in_fan_out=True)
    with torch.random.fork_rng(devices=[]):  # the adapters' A from the seed: the same on every node
        torch.manual_seed(cfg["seed"])
        return get_peft_model(base, lora)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal LM's own loss per character (labels are the inputs, shifted inside the model)."""
    return model(**batch).loss


# ---------------------------------------------------------------- the text
@cache
def shakespeare() -> Shakespeare:
    """LEAF's Shakespeare (built once into the cache, then loaded from it)."""
    return load_shakespeare()


def held_out_plays(data: Shakespeare) -> list[str]:
    """The plays of the pre-training text: every ``HELD_OUT_EVERY``-th by name, from the first."""
    return sorted(set(data.plays))[::HELD_OUT_EVERY]


@cache
def federated_roles() -> list[int]:
    """The federation's roles, by index into ``data.roles``: those of the other plays, largest first."""
    data = shakespeare()
    held = set(held_out_plays(data))
    roles = [i for i, play in enumerate(data.plays) if play not in held]
    return sorted(roles, key=lambda i: (-int(data.train.windows[i]), data.roles[i]))


def role_of(partition_id: int, num_partitions: int) -> int:
    """The role (index into ``data.roles``) of node ``partition_id`` of ``num_partitions``."""
    roles = federated_roles()
    if not 0 <= partition_id < num_partitions <= len(roles):
        raise ValueError(
            f"partition-id {partition_id} of num-partitions {num_partitions}: there are {len(roles)} federated roles"
        )
    return roles[partition_id]


def rows_of(data: Shakespeare, roles: list[int], split: str) -> np.ndarray:
    """All windows (rows) of ``roles`` in ``split``."""
    s = data.split(split)
    return np.concatenate([np.arange(s.first[r], s.first[r + 1]) for r in roles])


def windows(data: Shakespeare, rows: np.ndarray, split: str = "train") -> torch.Tensor:
    """Rows of a split → int64 windows ``[B, 81]``."""
    x, y = batch(data, rows, split=split)
    return torch.cat([x, y[:, None]], dim=1)


class RoleBatches:
    """A role's train windows as random batches ``{input_ids, labels}``: re-iterable, endless.

    Drawn with torch's RNG, which ``DLionClient`` seeds by (run seed, node, round).
    """

    def __init__(self, role: int, batch_size: int) -> None:
        self.data, self.batch_size = shakespeare(), batch_size
        self.rows = rows_of(self.data, [role], "train")

    def __iter__(self):
        while True:
            pick = self.rows[torch.randint(len(self.rows), (self.batch_size,)).numpy()]
            ids = windows(self.data, pick)
            yield {"input_ids": ids, "labels": ids}


def test_windows(num_roles: int, n: int, seed: int) -> torch.Tensor:
    """``n`` test windows of the federation's first ``num_roles`` roles, drawn with ``seed`` (sorted)."""
    data = shakespeare()
    rows = rows_of(data, federated_roles()[:num_roles], "test")
    pick = np.sort(np.random.default_rng(seed).choice(len(rows), size=min(n, len(rows)), replace=False))
    return windows(data, rows[pick], "test")


@torch.no_grad()
def evaluate(model: nn.Module, ids: torch.Tensor, batch_size: int = 250) -> dict[str, float]:
    """The model on windows ``ids`` ``[n, 81]``, each reading 80 characters and predicting the next.

    ``accuracy``: of the 81st character (LEAF's metric, one prediction a window); ``accuracy-all``
    and ``loss``: next-character accuracy and cross-entropy (nats) over all 80 positions.
    """
    model.eval()
    last, every, loss = 0, 0, 0.0
    for chunk in ids.split(batch_size):
        logits = model(input_ids=chunk).logits[:, :-1]  # position t predicts character t + 1
        hits = logits.argmax(-1) == chunk[:, 1:]
        last, every = last + int(hits[:, -1].sum()), every + int(hits.sum())
        loss += float(nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
    n = len(ids)
    return {"accuracy": last / n, "accuracy-all": every / (n * SEQ_LEN), "loss": loss / (n * SEQ_LEN)}


# ---------------------------------------------------------------- pre-training
def pretrain(steps: int, seed: int, log_every: int = 100) -> Path:
    """Pre-train the base on the held-out plays and save it (atomically) to :func:`base_path`; return the path."""
    path = base_path(steps, seed)
    data = shakespeare()
    held = set(held_out_plays(data))
    rows = rows_of(data, [i for i, play in enumerate(data.plays) if play in held], "train")
    torch.manual_seed(seed)
    model = base_model(model_config())
    opt = torch.optim.AdamW(model.parameters(), PRETRAIN["lr"], (0.9, 0.95), weight_decay=PRETRAIN["weight-decay"])
    warmup = max(1, int(PRETRAIN["warmup"] * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine to 10 %
        opt, lambda t: min(1.0, (t + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(t, steps) / steps))
    )
    picks = np.random.default_rng(seed).integers(len(rows), size=(steps, PRETRAIN["batch"]))
    model.train()
    t0 = time.perf_counter()
    for step, pick in enumerate(picks, 1):
        ids = windows(data, rows[pick])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            took = time.perf_counter() - t0
            print(f"[shakespeare-lm] pre-training step {step}/{steps}: loss {loss.item():.3f} ({took:.0f} s)")
    seconds = time.perf_counter() - t0
    saved = {
        "vocab": VOCAB,
        "config": json.dumps(model.config.to_dict()),
        "state_dict": model.state_dict(),
        "meta": {"steps": steps, "seed": seed, "held-out plays": sorted(held), "seconds": seconds},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:  # atomic: nodes may read it
        torch.save(saved, f)
    os.replace(f.name, path)
    print(f"[shakespeare-lm] base pre-trained in {seconds:.0f} s ({steps} steps): {path}")
    return path


def ensure_base(steps: int, seed: int) -> Path:
    """The base's path, pre-training it first if it is not there."""
    path = base_path(steps, seed)
    return path if path.is_file() else pretrain(steps, seed)


def main() -> None:
    defaults = app_config()
    parser = argparse.ArgumentParser(description="Pre-train the base model of examples/shakespeare-lm.")
    parser.add_argument("--pretrain", action="store_true", help="build the base (again, if it is there)")
    parser.add_argument("--steps", type=int, default=defaults["base-steps"])
    parser.add_argument("--seed", type=int, default=defaults["seed"])
    args = parser.parse_args()
    if args.pretrain:
        pretrain(args.steps, args.seed)
    print(base_path(args.steps, args.seed))


if __name__ == "__main__":
    main()
