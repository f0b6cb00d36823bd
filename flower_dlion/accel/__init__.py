"""How fast: the one place that picks between the reference code and the fused kernels.

What Distributed Lion computes is written once, in torch and numpy: the Lion math in
:mod:`flower_dlion.lion`, the wire formats in :mod:`flower_dlion.codec`. This package holds
faster ways of computing exactly the same bytes and floats (the tests compare them bit for
bit), and nothing else. It is the lower layer: its modules import torch, numpy, numba or
Triton, each other and the formats' shared definitions (:mod:`flower_dlion.formats`), never
the codec, the downlink or the Lion math that call them (``tests/library/test_layers.py``):

============================  ===============================================================
module                        what
============================  ===============================================================
:mod:`.cpu`                   the codec's functions on the CPU, on the numba kernels
:mod:`.gpu`                   the codec's functions on a CUDA device, on the Triton kernels
:mod:`.numba_pack`            kernels: sign pack, Lion step + pack, apply Δ, level codes
:mod:`.numba_count`           kernels: bit-sliced vote counts of n packed payloads
:mod:`.numba_team`            running those kernels on torch's own OpenMP threads
:mod:`.triton_kernels`        kernels: the same on a CUDA device
:mod:`.threads`               splitting a pass over torch's CPU threads (used by both sides)
:mod:`.probes`                whether a fused kernel rounds as torch's composition, checked once
============================  ===============================================================

A codec function asks :func:`choose` for the accelerated twin of itself, or of one of its
steps, and calls it, or runs its reference code where there is none (as lion-pytorch picks
``update_fn`` once): callers of the codec never see which one ran. A twin returns its result
and leaves the rest to its caller (a CPU pack returns the bits and the zeros' masks, the codec
flips the coins). Where a kernel must round as a composition of torch operations does, the
caller passes that reference in (``lion.local_step_``, ``lion.anchored``), the twin compares
on a probe once (:mod:`.probes`) and returns None where it would differ: the caller then runs
the reference. The choice depends on the device type, the size and ``FLOWER_DLION_KERNELS``:

- ``auto`` (default): Triton on a CUDA device; numba on the CPU from 2²⁰ values up (below
  that, numpy is within a millisecond, and a Deployment Engine ClientApp, one process per
  message, would spend more importing numba than it saves).
- ``on``: the kernels at every size; an error where numba (or Triton, on a CUDA device) is missing.
- ``off``: the reference code only.

It is made once per (function, device type, size class, setting) and kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = ["KERNELS_ENV", "KERNELS_FROM", "choose", "mode"]

KERNELS_ENV = "FLOWER_DLION_KERNELS"
KERNELS_FROM = 1 << 20  # values: below, numpy is within a millisecond and numba's import is spared

_CHOSEN: dict[tuple[str, str, bool, str], Callable[..., Any] | None] = {}


def mode() -> str:
    """``FLOWER_DLION_KERNELS``: ``auto`` (default), ``on`` or ``off``."""
    setting = os.environ.get(KERNELS_ENV, "auto")
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"{KERNELS_ENV} must be 'auto', 'on' or 'off', got {setting!r}")
    return setting


def choose(name: str, device: torch.device, size: int) -> Callable[..., Any] | None:
    """The accelerated twin named ``name`` for ``size`` values on ``device``, or None.

    None means: run the reference code. The twin (of a codec or downlink function, or of a
    step of one: its docstring says which) takes that function's arguments and returns the
    same bytes and floats, or None where it cannot on this machine (run the reference then).
    """
    setting = mode()
    large = size >= KERNELS_FROM or setting == "on"
    key = (name, device.type, large, setting)
    if key not in _CHOSEN:
        module = None
        if setting != "off" and device.type == "cuda":
            module = _gpu()
        elif setting != "off" and device.type == "cpu" and large:
            module = _cpu()
        _CHOSEN[key] = getattr(module, name, None)
    return _CHOSEN[key]


def forget() -> None:
    """Choose afresh from now on (after a test has hidden numba or Triton)."""
    _CHOSEN.clear()


def _cpu() -> ModuleType | None:
    """:mod:`.cpu`, or None where numba is missing (an error under ``on``)."""
    try:
        from . import cpu
    except ImportError as err:
        if mode() == "on":
            raise ImportError(f"{KERNELS_ENV}=on needs numba: pip install 'flower-dlion[fast]'") from err
        return None
    return cpu


def _gpu() -> ModuleType | None:
    """:mod:`.gpu`, or None where Triton is missing (an error under ``on``)."""
    try:
        from . import gpu
    except ImportError as err:
        if mode() == "on":
            raise ImportError(f"{KERNELS_ENV}=on needs Triton on a CUDA device (torch's CUDA builds bring it)") from err
        return None
    return gpu
