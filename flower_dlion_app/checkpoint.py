"""Atomic checkpoints of a federation: write, read, and check that a resume continues the same run.

A checkpoint is one file written with ``torch.save`` to a temporary name, flushed to disk
and renamed over the previous one (``os.replace``), so the file is always a complete
checkpoint, old or new, whenever the process is killed. Imports only torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "RESUMABLE_KEYS", "check_resumable", "load_checkpoint", "save_checkpoint"]

FORMAT = 4  # 2: model description and rest of the model; 3: ServerState; 4: the anchored downlink
# Run-config keys that may differ between the run that wrote a checkpoint and the one resuming it.
RESUMABLE_KEYS = (
    "num-server-rounds",
    "resume",
    "results-dir",
    "checkpoint-every",
    "eval-every",
    "round-timeout",
    "poll-interval",
    "max-failed-rounds",  # when to give up, not what is trained
    "wait-for-nodes",
    "divergence-factor",  # what is watched, not what is trained
    "divergence-rounds",
    "stop-on-divergence",
    "state-in-context",  # where the clients keep their state, not what it is: a resumed run reads the files anyway
)


def save_checkpoint(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (temporary file, fsync, rename, fsync of the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failed write; the previous checkpoint is untouched
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises
    ------
    ValueError
        When the file is not a checkpoint of this format.

    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise ValueError(f"{path} is not a readable flower-dlion checkpoint: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a flower-dlion checkpoint of format {FORMAT}")
    return payload


def check_resumable(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if two run configs differ in a key other than :data:`RESUMABLE_KEYS`."""
    differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_KEYS and saved.get(k) != now.get(k))
    if differ:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} → {now.get(k)!r}" for k in differ)
        raise ValueError(f"cannot resume: the run config differs from the checkpoint's in {pairs}")
