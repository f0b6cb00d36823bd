"""Helpers of ``benchmarks/ray_round.py`` that both app layouts import by reference (one copy per process).

The models, the synthetic batches (cached per process, so that data is not what the layouts
compare) and the probe that logs each client handler call to ``$RAY_ROUND_LOG_DIR/<pid>.jsonl``.
The model is chosen by ``$RAY_ROUND_MODEL`` ("resnet18" or "cnn"), which Ray's workers inherit
from the process that starts Ray.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

import flower_dlion
from flower_dlion_app.model import Net as CNN

MODEL_ENV, LOG_ENV = "RAY_ROUND_MODEL", "RAY_ROUND_LOG_DIR"
BATCH_SIZE = {"resnet18": 32, "cnn": 64}
SHAPE = {"resnet18": (3, 32, 32), "cnn": (1, 28, 28)}  # CIFAR-10's, Fashion-MNIST's
_batches: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_MARK = "_ray_round_seen"


def model_name() -> str:
    name = os.environ.get(MODEL_ENV, "cnn")
    if name not in BATCH_SIZE:
        raise ValueError(f"${MODEL_ENV} must be one of {sorted(BATCH_SIZE)}, got {name!r}")
    return name


def build_model() -> nn.Module:
    """ResNet-18 (torchvision's, 10 classes: 11,181,642 parameters) or the default app's CNN (281,034)."""
    if model_name() == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    return CNN()


def batch_for(partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This partition's one synthetic batch (CIFAR-sized × 32 or Fashion-MNIST-sized × 64), made once per process."""
    name = model_name()
    if (name, partition_id) not in _batches:
        gen = torch.Generator().manual_seed(1000 + partition_id)
        n = BATCH_SIZE[name]
        _batches[name, partition_id] = (
            torch.randn(n, *SHAPE[name], generator=gen),
            torch.randint(0, 10, (n,), generator=gen),
        )
    return _batches[name, partition_id]


def note_call(strategy: str, msg: Any, context: Any, seconds: float, client: Any = None, empty: bool = False) -> None:
    """Log one train handler call: its process, round, node, seconds, and for D-Lion what the client held.

    ``empty``: the DLionClient had no device state when the call started (``len(client._devices) == 0``).
    ``fresh``: the device state it holds after the call was made during this call (not seen by an
    earlier call in this process), which also catches a client that is rebuilt lazily.
    """
    row: dict[str, Any] = {
        "strategy": strategy,
        "pid": os.getpid(),
        "run": int(msg.metadata.run_id),
        "round": _round_of(msg),
        "partition": int(context.node_config.get("partition-id", -1)),
        "seconds": seconds,
        "t": time.time(),
        "library": str(Path(flower_dlion.__file__).resolve().parent.parent),  # where this worker imported it from
    }
    if client is not None:
        devices = list(client._devices.values())
        fresh = any(not getattr(dev, _MARK, False) for dev in devices)
        for dev in devices:
            setattr(dev, _MARK, True)
        row.update(empty=empty, fresh=fresh, client=id(client))
    folder = os.environ.get(LOG_ENV)
    if folder:
        with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def _round_of(msg: Any) -> int:
    """The server round of a train message: D-Lion's group id, FedAvg's config "server-round"."""
    if str(msg.metadata.group_id).isdigit():
        return int(msg.metadata.group_id)
    return int(msg.content["config"]["server-round"])
