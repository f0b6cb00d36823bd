"""Bit codec for Distributed Lion: what a sign vector and a broadcast Δ look like on the wire.

Imports torch and numpy only (never flwr), so it runs on a GPU box, in a benchmark, or
on the server alike. Every function is device-agnostic: it runs where its input tensor
lives, so a CUDA client packs on the GPU and ships only the packed bytes to the host.

Formats (``d`` values, bytes in big-endian bit order, the same layout as
``numpy.packbits(..., bitorder="big")``):

============  ==========================  ==========================================
stype         values                      size in bytes
============  ==========================  ==========================================
``sign1``     {-1, +1}: bit 1 means +1    ⌈d/8⌉
``trit5``     3 levels, 5 per byte (3⁵≤256)  ⌈d/5⌉            (1.6 bits/value)
``planesB``   2ᴮ levels, B bit planes     B·⌈d/8⌉          (B bits/value)
============  ==========================  ==========================================

A broadcast Δ is sent as integer *levels* ``k ∈ {0, …, L-1}`` with
``Δ = (2k − (L−1)) / (L−1)``: the vote uses L = 3 ({-1, 0, +1}) or L = 2 when no tie is
possible (odd number of voters), the mean over n votes uses L = n + 1. The smallest of
the formats above that fits L is used (:func:`level_format`).

On the CPU, packing signs, a client's whole Lion step with its pack (:func:`pack_local_step_`),
decoding a broadcast Δ (:func:`decode_levels`), applying Δ from its levels
(:func:`apply_levels_`) and counting votes run in fused kernels
(:mod:`flower_dlion.kernels`, numba, the ``fast`` extra) when numba is installed, else in
numpy or torch; both give the same bytes and floats.
``FLOWER_DLION_KERNELS`` picks: ``auto`` (default: the kernels from 2²⁰ values up, where they
save more than a fresh process spends importing them), ``on`` (always; an error without
numba) or ``off`` (numpy only). On a CUDA device the sign pack is one fused Triton kernel
(:mod:`flower_dlion.gpu_kernels`; Triton comes with torch's CUDA builds on Linux) under
``auto`` and ``on`` (an error without Triton), tensor operations under ``off`` (the same
bytes but for the coin flips at exact zeros, which the kernel draws itself); so are the
vote counts of payloads in GPU memory (:func:`count_ones`, :func:`vote_masks`, :func:`count_planes`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

__all__ = [
    "SIGN1",
    "TRIT5",
    "PackedAggregate",
    "aggregate_packed",
    "apply_levels_",
    "as_uint8",
    "count_ones",
    "count_planes",
    "decode_levels",
    "encode_levels",
    "encoded_size",
    "level_format",
    "levels_to_values",
    "majority_masks",
    "pack_bits",
    "pack_local_step_",
    "pack_signs",
    "packed_size",
    "planes_to_counts",
    "unpack_bits",
    "unpack_signs",
    "vote_masks",
]

SIGN1 = "sign1"
TRIT5 = "trit5"

_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)  # bit j of a byte holds element j (MSB first)
_POW3 = (1, 3, 9, 27, 81)


def packed_size(d: int) -> int:
    """Bytes needed for ``d`` bits: ⌈d/8⌉."""
    return (d + 7) // 8


def as_uint8(buf: torch.Tensor | bytes | np.ndarray) -> torch.Tensor:
    """View received bytes as a 1-D uint8 tensor without copying where possible."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"packed data must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        return buf
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1))
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D boolean tensor into ⌈d/8⌉ bytes (MSB first), on the tensor's device."""
    if bits.device.type == "cpu":  # numpy's C loop: one pass, no temporaries
        return torch.from_numpy(np.packbits(bits.reshape(-1).numpy().view(np.uint8), bitorder="big"))
    d = bits.numel()
    b = bits.reshape(-1).to(torch.uint8)
    if d % 8:
        b = torch.cat([b, b.new_zeros(8 - d % 8)])
    b = b.view(-1, 8)
    out = b[:, 0] << 7
    for j in range(1, 8):
        out |= b[:, j] << _SHIFTS[j]
    return out


def unpack_bits(packed: torch.Tensor | bytes | np.ndarray, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``d`` bits as a boolean tensor."""
    p = as_uint8(packed)
    if p.numel() != packed_size(d):
        raise ValueError(f"expected {packed_size(d)} packed bytes for {d} bits, got {p.numel()}")
    if p.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(p.numpy(), count=d, bitorder="big").view(np.bool_))
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=p.device)
    return ((p.unsqueeze(1) >> shifts) & 1).view(-1)[:d].bool()


def pack_signs(
    v: torch.Tensor, generator: torch.Generator | None = None, *, flips: list[int] | None = None
) -> torch.Tensor:
    """Pack the signs of ``v`` into ⌈d/8⌉ bytes: bit 1 for v > 0, bit 0 for v < 0.

    Exact zeros have no 1-bit code. Sending them all as one fixed side would push every
    such parameter the same way each round, so each zero is sent as a fair coin flip
    drawn from ``generator`` (unbiased; seed it for reproducible runs). On the CPU the
    signs are compared and packed on torch's threads in one read of ``v``: 64 at a time by
    the fused kernel where available, else 256 k values at a time by numpy; each group of
    64 values that holds a zero takes one random 64-bit word for its coins
    (:func:`_set_coin_flips`). On a CUDA device one Triton
    kernel reads ``v`` once and draws the coins itself, from Philox at a counter the
    generator hands out without device work (:func:`flower_dlion.gpu_kernels.coin_stream`):
    nothing is synchronized. Elsewhere it is tensor operations on ``v``'s device
    (``torch.randint`` coins for all d values, used at the zeros).

    ``flips``: a list to append the number of coin flips (exact zeros) to; on a CUDA device
    that count is one more reduction over ``v``.
    """
    v = v if v.dim() == 1 else v.reshape(-1)
    if v.is_cuda and v.dtype == torch.float32 and (gpu := _gpu_kernels()) is not None:
        if flips is not None:
            flips.append(int(torch.count_nonzero(v == 0)))
        return gpu.pack_positive(v.contiguous(), generator)
    if v.is_cpu and v.dtype == torch.float32:
        host = v.contiguous().numpy()
        packed, zeros = _pack_positive_cpu(host)  # one pass on torch's threads (a second for the zeros, if any)
        if zeros is not None:  # set a coin flip's bit at each exact zero
            _set_coin_flips(packed, zeros, generator)
        if flips is not None:
            flips.append(_count_masks(zeros))
        return torch.from_numpy(packed)
    bits = v > 0
    zeros = v == 0
    if flips is not None:
        flips.append(int(torch.count_nonzero(zeros)))
    if bool(zeros.any()):
        coin = torch.randint(0, 2, (v.numel(),), generator=generator, device=v.device, dtype=torch.uint8)
        bits = torch.where(zeros, coin.bool(), bits)
    return pack_bits(bits)


_MASKS = np.dtype("<u8")  # zero masks, a word per 64 values: viewed as bytes, laid out as the packed bits


def _count_masks(zeros: np.ndarray | None) -> int:
    """Number of set bits in the zero masks (0 for none)."""
    if zeros is None:
        return 0
    if hasattr(np, "bitwise_count"):  # numpy ≥ 2.0
        return int(np.bitwise_count(zeros).sum())
    return int(np.unpackbits(zeros.view(np.uint8)).sum())


def _zero_masks(d: int) -> np.ndarray:
    """⌈d/64⌉ mask words for a kernel to write whole (not zeroed: a memset would be one more pass)."""
    return np.empty(-(-d // 64), dtype=_MASKS)


def _set_coin_flips(packed: np.ndarray, zeros: np.ndarray, generator: torch.Generator | None) -> None:
    """Set a fair coin flip's bit in ``packed`` wherever ``zeros`` has one (``packed`` has a 0 bit there).

    ``zeros`` holds the masks of the exact zeros in the packed layout, a word per 64 values
    (:data:`_MASKS`: its bytes are ``np.packbits(v == 0)``). The j-th group of 64 values with
    a zero takes the j-th uniform 64-bit word that ``generator`` draws (``random_(-2**63)``,
    every bit pattern equally likely), and its zeros take that word's bits at their own
    positions: the word's little-endian bytes are the group's 8 bytes of coins. So a lone zero
    costs one draw, and a vector that is half zeros (a sum of two local directions) d/64 draws
    and a few passes over d/8 bytes (``benchmarks/zero_pack.py``).
    """
    k = np.flatnonzero(zeros)
    words = torch.empty(k.size, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    coins = zeros[k] & words.numpy().view(np.uint64)
    whole = packed.size // 8
    full = k < whole  # all but a partial last group
    packed[: 8 * whole].view(_MASKS)[k[full]] |= coins[full]
    if k.size and not full[-1]:  # the partial last group's bytes
        packed[8 * whole :] |= coins[-1:].astype(_MASKS).view(np.uint8)[: packed.size - 8 * whole]


def pack_local_step_(
    m: torch.Tensor,
    g: torch.Tensor,
    beta1: float,
    beta2: float,
    generator: torch.Generator | None = None,
    *,
    flips: list[int] | None = None,
) -> torch.Tensor:
    """A worker's Lion step with its direction packed: ``pack_signs(lion.local_step_(m, g, β₁, β₂), generator)``.

    Returns the ⌈d/8⌉ bytes of ``δ = sign(β₁·m + (1−β₁)·g)`` (zeros as coin flips, see
    :func:`pack_signs`) and updates ``m ← β₂·m + (1−β₂)·g`` in place, exactly as the
    composition does: the same bytes, the same coins from ``generator``, the same ``m`` bit
    for bit. With float32 ``m`` and ``g`` it is one fused pass that reads ``m`` and ``g``
    once and writes ``m`` and the bits, instead of five passes and a d-float temporary: on
    the CPU with the kernels (contiguous ``m``; :func:`flower_dlion.kernels.lion_pack`), on
    a CUDA device with Triton (:func:`flower_dlion.gpu_kernels.lion_pack`). The fused step
    rounds like torch's ``add(alpha=)`` where that is one FMA (x86-64 with AVX2 or AVX-512,
    Arm64, CUDA); this is checked once per device type and (β₁, β₂) on a probe against torch
    itself, and where the two would differ the composition runs instead. Elsewhere (other
    devices, other dtypes) it is the composition. ``flips``: as :func:`pack_signs`'s.
    """
    from .lion import local_step_  # the reference: lion.py imports torch only

    d = m.numel()
    fusable = m.dtype == g.dtype == torch.float32 and m.is_contiguous() and g.numel() == d
    coefs = _lion_coefs(beta1, beta2)
    if fusable and m.is_cuda and m.device == g.device and (gpu := _gpu_kernels()) is not None:
        cuda_coefs = tuple(map(float, coefs))
        if _fused_step_matches_torch(functools.partial(_lion_pack_cuda, gpu, cuda_coefs), beta1, beta2, m.device):
            if flips is not None:  # the mix's exact zeros, as lion.direction computes the mix
                flips.append(int(torch.count_nonzero(m.mul(beta1).add_(g, alpha=1.0 - beta1) == 0)))
            return gpu.lion_pack(m.view(-1), g.reshape(-1).contiguous(), cuda_coefs, generator)  # pack_signs's coins
    kernels = _kernels(d) if fusable and m.is_cpu and g.is_cpu else None
    if kernels is None or not _fused_step_matches_torch(
        functools.partial(_lion_pack_cpu, kernels, coefs), beta1, beta2, m.device
    ):
        return pack_signs(local_step_(m, g, beta1, beta2), generator, flips=flips)
    mh, gh = m.numpy().reshape(-1), g.contiguous().numpy().reshape(-1)  # views (torch's reshape costs µs)
    packed, zeros = np.empty(packed_size(d), dtype=np.uint8), _zero_masks(d)
    if (team := _team(kernels, "lion_pack", d)) is not None:
        found = [team[0].lion_pack(mh, gh, coefs, packed, zeros, team[1])]
    else:
        found = _on_threads(lambda a, b: kernels.lion_pack(mh, gh, coefs, packed, zeros, a, b), zeros.size, 1 << 13)
    if any(found):  # zero directions: coin flips, drawn as pack_signs draws them
        _set_coin_flips(packed, zeros, generator)
    if flips is not None:
        flips.append(_count_masks(zeros) if any(found) else 0)
    return torch.from_numpy(packed)


@functools.lru_cache(maxsize=64)
def _lion_coefs(beta1: float, beta2: float) -> tuple[np.float32, ...]:
    """``(β₁, 1−β₁, β₂, 1−β₂)`` as float32, as torch rounds a Python scalar for a float32 tensor."""
    return tuple(np.float32(c) for c in (beta1, 1.0 - beta1, beta2, 1.0 - beta2))


def _lion_pack_cpu(
    kernels: ModuleType, coefs: tuple[np.float32, ...], m: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """The CPU kernel's fused step on one thread (for the probe): δ > 0 packed, ``m`` updated."""
    packed, zeros = np.empty(packed_size(m.numel()), np.uint8), _zero_masks(m.numel())
    kernels.lion_pack(m.numpy(), g.numpy(), coefs, packed, zeros, 0, zeros.size)
    return torch.from_numpy(packed)


def _lion_pack_cuda(gpu: ModuleType, coefs: tuple[float, ...], m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The Triton kernel's fused step (for the probe, which has no zero direction): δ packed, ``m`` updated."""
    return gpu.lion_pack(m, g, coefs, torch.Generator(device=m.device))  # not the device's default generator


_FUSED_EXACT: dict[tuple[str, float, float], bool] = {}  # (device type, β₁, β₂) → the fused step equals torch's


def _fused_step_matches_torch(
    fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], beta1: float, beta2: float, device: torch.device
) -> bool:
    """Whether ``fused(m, g)`` gives torch's δ > 0 bits and m bit for bit (checked once per device type, β₁, β₂).

    The probe: 3·2¹⁵ + 45 values spanning many magnitudes (past one torch thread's range,
    with a partial last group), run through both on ``device``.
    """
    key = (device.type, float(beta1), float(beta2))
    if key not in _FUSED_EXACT:
        from .lion import local_step_

        gen = torch.Generator().manual_seed(0)
        d = 3 * 2**15 + 45
        m = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(40).sub(20).exp2()
        g = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(40).sub(20).exp2()
        m, g = m.to(device), g.to(device)
        m_ref = m.clone()
        expected = pack_bits(local_step_(m_ref, g, beta1, beta2) > 0)
        packed = fused(m, g)
        same_m = torch.equal(m.view(torch.int32), m_ref.view(torch.int32))
        _FUSED_EXACT[key] = same_m and torch.equal(packed, expected)
    return _FUSED_EXACT[key]


def apply_levels_(
    x: torch.Tensor, levels: torch.Tensor, num_levels: int, lr: float, weight_decay: float
) -> torch.Tensor:
    """In place: ``x ← x − lr·(Δ + wd·x)`` with Δ given as levels. Returns ``x``.

    Exactly ``lion.apply_update_(x, levels_to_values(levels, L), lr, wd)``, bit for bit. On
    the CPU with the kernels (float32, contiguous ``x``) it is one pass over ``x`` and the
    levels (:func:`flower_dlion.kernels.apply_levels`) instead of seven passes and five
    d-sized temporaries; each value goes through the same float32 operations, and the
    L possible steps ``lr·Δ`` are compared with torch's own ones first (where torch would
    round one differently, the composition runs). On a CUDA device (float32, contiguous
    ``x``, uint8 or int32 levels) one Triton pass does the same with torch's own L steps
    (:func:`flower_dlion.gpu_kernels.apply_levels`, no FMA contraction). Elsewhere it is
    the composition.
    A level outside ``0 … L−1`` is a ``ValueError``; the kernel finds it as it goes and
    leaves ``x`` partly updated, so check untrusted levels first (:func:`decode_levels` does).
    """
    from .lion import apply_update_  # the reference: lion.py imports torch only

    d, top = x.numel(), num_levels - 1
    if x.is_cuda and _apply_on_gpu(x, levels, top) and (gpu := _gpu_kernels()) is not None:
        steps = _steps_on(x.device, num_levels, float(lr))  # torch's own lr·Δ of every level
        bad = gpu.apply_levels(x.view(-1), levels.view(-1), steps, float(np.float32(1.0 - lr * weight_decay)))
        if bad.read() and not 0 <= int((bounds := torch.aminmax(levels)).min) <= int(bounds.max) <= top:
            raise ValueError(f"level outside 0…{top}: corrupted update")
        return x
    on_cpu = x.is_cpu and levels.is_cpu and x.dtype == torch.float32
    kernels = _kernels(d) if on_cpu and x.is_contiguous() and levels.numel() == d and top >= 1 else None
    lr32 = np.float32(lr)
    if kernels is not None:  # torch's steps lr·Δ for every level against the kernel's float32 arithmetic
        torch_steps = _steps_on(x.device, num_levels, float(lr)).numpy()
        steps = (np.arange(-top, top + 1, 2, dtype=np.int64).astype(np.float32) / np.float32(top)) * lr32
        kernels = kernels if np.array_equal(steps.view(np.int32), torch_steps.view(np.int32)) else None
    if kernels is None:
        if levels.numel() and not 0 <= int((bounds := torch.aminmax(levels)).min) <= int(bounds.max) <= top:
            raise ValueError(f"level outside 0…{top}: corrupted update")
        return apply_update_(x, levels_to_values(levels, num_levels), lr, weight_decay)
    decay = np.float32(1.0 - lr * weight_decay)  # the factor x.mul_ rounds to float32
    xh, kh = x.reshape(-1).numpy(), levels.reshape(-1).contiguous().numpy()
    if kh.dtype in (np.uint8, np.int32) and (team := _team(kernels, "apply", d)) is not None:
        worst = [team[0].apply_levels(xh, kh, top, lr32, decay, team[1])]
    else:
        worst = _on_threads(lambda a, b: kernels.apply_levels(xh, kh, top, lr32, decay, a, b), d, 1 << 19)
    if max(worst, default=0) > top:
        raise ValueError(f"level outside 0…{top}: corrupted update")
    return x


_STEPS: dict[tuple[torch.device, int, float], torch.Tensor] = {}  # (device, L, lr) → lr·Δ of the L levels


def _steps_on(device: torch.device, num_levels: int, lr: float) -> torch.Tensor:
    """``levels_to_values(arange(L), L) * lr`` on ``device``, as torch computes it there (kept: a round reuses it)."""
    key = (device, num_levels, lr)
    steps = _STEPS.get(key)
    if steps is None:
        if len(_STEPS) >= 64:  # a learning-rate schedule: keep only the latest
            _STEPS.clear()
        steps = _STEPS[key] = levels_to_values(torch.arange(num_levels, device=device), num_levels) * lr
    return steps


def _apply_on_gpu(x: torch.Tensor, levels: torch.Tensor, top: int) -> bool:
    """Whether the Triton apply takes ``x`` and ``levels`` as they are (else the composition runs)."""
    return (
        top >= 1
        and x.dtype == torch.float32
        and x.is_contiguous()
        and levels.device == x.device
        and levels.dtype in (torch.uint8, torch.int32)
        and levels.is_contiguous()
        and levels.numel() == x.numel()
    )


# ------------------------------------------------------------------ CPU: kernels and threads
KERNELS_ENV = "FLOWER_DLION_KERNELS"
_KERNELS_FROM = 1 << 20  # values: below, numpy is within a millisecond and numba's import is spared
_T = TypeVar("_T")
_POOLS: dict[int, ThreadPoolExecutor] = {}  # worker count → pool


def _kernel_mode() -> str:
    """``FLOWER_DLION_KERNELS``: ``auto`` (default), ``on`` or ``off``."""
    mode = os.environ.get(KERNELS_ENV, "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{KERNELS_ENV} must be 'auto', 'on' or 'off', got {mode!r}")
    return mode


def _optional_kernels(module: str, needs: str) -> ModuleType | None:
    """``flower_dlion.<module>``, or None where it cannot be imported (an error under ``on``)."""
    name = f"{__package__}.{module}"
    try:
        return sys.modules.get(name) or importlib.import_module(name)  # imported once: a lookup (per GPU call)
    except ImportError as err:
        if _kernel_mode() == "on":
            raise ImportError(f"{KERNELS_ENV}=on needs {needs}") from err
        return None


def _kernels(size: int) -> ModuleType | None:
    """The fused kernels (:mod:`flower_dlion.kernels`) if they should handle ``size`` values, else None."""
    mode = _kernel_mode()
    if mode == "off" or (mode == "auto" and size < _KERNELS_FROM):
        return None
    return _optional_kernels("kernels", "numba: pip install 'flower-dlion[fast]'")


def _gpu_kernels() -> ModuleType | None:
    """The Triton kernels (:mod:`flower_dlion.gpu_kernels`) unless ``FLOWER_DLION_KERNELS=off`` or Triton is missing."""
    if _kernel_mode() == "off":
        return None
    return _optional_kernels("gpu_kernels", "Triton on a CUDA device (torch's CUDA builds bring it)")


_TEAM_AFTER = 3  # calls of a kernel in this process before it moves onto torch's OpenMP team
_TEAM_GRAIN = 1 << 18  # values per thread at least on the team (its threads are awake after torch's operations)
_TEAM_COUNT_GRAIN = 1 << 20  # bytes read and written per thread at least on the team (vote counts)
_TEAM_CALLS: dict[str, int] = {}  # kernel → calls so far
_TEAM: list[object] = []  # [kernels.Team or None], made once


def _team(kernels: ModuleType, name: str, values: int, grain: int | None = None) -> tuple[Any, int] | None:
    """The OpenMP team torch runs on (:class:`flower_dlion.kernels.Team`) and a thread count for ``values``, or None.

    None (use :func:`_on_threads`) until the kernel ``name`` has been called ``_TEAM_AFTER``
    times in this process — the team's tasks take 0.2 s to load once, more than a
    Deployment Engine ClientApp, one process per message, would ever save — where torch's
    parallel backend is not OpenMP, and where one thread does it (less than ``grain`` of
    ``values`` per thread; default ``_TEAM_GRAIN``).
    """
    calls = _TEAM_CALLS[name] = _TEAM_CALLS.get(name, 0) + 1
    threads = min(torch.get_num_threads(), values // (grain or _TEAM_GRAIN))
    if calls <= _TEAM_AFTER or threads < 2:
        return None
    if not _TEAM:
        openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
        try:
            _TEAM.append(importlib.import_module(f"{__package__}.kernels").Team() if openmp else None)
        except (AttributeError, OSError, TypeError):  # no GOMP_parallel loaded (or no dlopen(NULL): Windows)
            _TEAM.append(None)
    return None if _TEAM[0] is None else (_TEAM[0], threads)


def _on_threads(work: Callable[[int, int], _T], total: int, grain: int) -> list[_T]:
    """``work(first, last)`` over ``[0, total)`` in contiguous parts, one per torch CPU thread.

    Each part has at least ``grain`` items (one part when ``total`` is small). The work
    must release the GIL (numpy loops and the kernels do). The calling thread does the
    first part itself (one thread fewer to wake). Returns every part's result; all parts
    are finished when it returns or raises.
    """
    workers = max(1, min(torch.get_num_threads(), total // max(grain, 1)))
    if workers == 1:
        return [work(0, total)]
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="codec")
    bounds = [total * i // workers for i in range(workers + 1)]
    others = [_POOLS[workers].submit(work, a, b) for a, b in itertools.pairwise(bounds[1:])]
    try:
        first = work(bounds[0], bounds[1])
    finally:
        wait(others)
    return [first, *(f.result() for f in others)]


_CHUNK = 1 << 18  # values per numpy chunk (a multiple of 8: chunks start on byte boundaries)
_CHUNKS_PER_THREAD = 4  # below 2·4 chunks (2²¹ values) one thread: waking another costs more than it saves


def _pack_positive_cpu(v: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Bits of ``v > 0`` packed, and the masks of ``v``'s exact zeros by group of 64 (None: no zero).

    With the kernels each value is read once and packed in registers on torch's CPU
    threads; the kernel only reports whether there is a zero, and the masks take a second,
    compare-only pass when there is (writing them in the pack slowed the pack without
    zeros, docs/PERFORMANCE.md). Without, numpy compares and packs a 1 MB chunk at a time
    (its loops release the GIL) and packs the chunk's zeros, if any, while it is in cache;
    the masks are only made when there are some. The chunks are large because each numpy
    call costs microseconds and, on several threads, a turn of the GIL: 64 k-value chunks
    made the pack 2–3× slower than these.
    """
    d = v.size
    out = np.empty(packed_size(d), dtype=np.uint8)
    kernels = _kernels(d)
    if kernels is not None:
        groups, grain = -(-d // kernels.BLOCK), (1 << 20) // kernels.BLOCK  # waking a thread costs tens of µs
        if (team := _team(kernels, "pack", d)) is not None:  # on torch's threads, awake after its operations
            found = team[0].pack_positive(v, out, team[1])
        else:
            found = any(_on_threads(lambda a, b: kernels.pack_positive(v, out, a, b), groups, grain))
        if not found:
            return out, None
        zeros = _zero_masks(d)  # the second pass on the same threads (the team's spin a while after a run)
        if team is not None:
            team[0].zero_masks(v, zeros, team[1])
        else:
            _on_threads(lambda a, b: kernels.zero_masks(v, zeros, a, b), groups, grain)
        return out, zeros
    found: list[tuple[int, np.ndarray]] = []  # (first byte, the chunk's zeros packed)

    def pack(first: int, last: int) -> None:  # chunks first … last−1
        for s in range(first * _CHUNK, min(last * _CHUNK, d), _CHUNK):
            c = v[s : s + _CHUNK]
            out[s // 8 : s // 8 + (c.size + 7) // 8] = np.packbits(c > 0, bitorder="big")  # the sign bit: 1 for v > 0
            zero = c == 0  # exact zeros (+0 and −0) get coin flips: packed while the chunk is in cache
            if zero.any():
                found.append((s // 8, np.packbits(zero, bitorder="big")))  # list.append is atomic

    _on_threads(pack, -(-d // _CHUNK), _CHUNKS_PER_THREAD)
    if not found:
        return out, None
    zeros = np.zeros(-(-d // 64), dtype=_MASKS)
    zero_bytes = zeros.view(np.uint8)
    for start, b in found:
        zero_bytes[start : start + b.size] = b
    return out, zeros


def unpack_signs(packed: torch.Tensor | bytes | np.ndarray, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a tensor of ±1 of length ``d``."""
    return unpack_bits(packed, d).to(dtype) * 2 - 1


def count_ones(payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int) -> torch.Tensor:
    """Per-coordinate number of 1 bits (votes for +1) over packed sign payloads (int32).

    Counted bit-sliced (:func:`count_planes`), never unpacked to an n × d array: memory is
    O(d) besides the payloads. The kernels write the counts straight from the cached
    planes; without them the B = ⌊log₂ n⌋ + 1 count planes are unpacked once each. The
    vote sum is ``S = 2·count_ones(...) − n``.
    """
    if not payloads:
        return torch.zeros(d, dtype=torch.int32)
    on_cpu = _on_cpu(payloads)
    if not on_cpu and (gpu := _gpu_kernels()) is not None:
        return gpu.count_ones([as_uint8(p) for p in payloads], d)
    kernels = _kernels(d) if on_cpu else None
    if kernels is None:
        return planes_to_counts(count_planes(payloads, d), d)
    nbytes, num_planes = packed_size(d), len(payloads).bit_length()
    counts = np.empty(64 * ((nbytes + 7) // 8), dtype=np.int32)  # 64 per word; the spare ones are cut off
    words = _KernelWords(payloads, nbytes)
    words.run(
        lambda first, last: kernels.count_ones(words.addresses, first, last, counts, _scratch(kernels, num_planes)),
        out_bytes=4 * 64,
    )
    if words.tail is not None:
        kernels.count_ones(words.tail, 0, 1, counts[64 * words.whole :], _scratch(kernels, num_planes))
    return torch.from_numpy(counts[:d])


def vote_masks(payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed masks (gt, tie) of count > n/2 and count = n/2 over n packed sign payloads.

    The vote Δ = sign(S) is +1 where ``gt``, 0 where ``tie``, −1 elsewhere; the same as
    :func:`majority_masks` of :func:`count_planes`, but the kernels keep the planes in
    cache and write only the two masks.
    """
    n = len(payloads)
    on_cpu = _on_cpu(payloads)
    if n and not on_cpu and (gpu := _gpu_kernels()) is not None:
        return gpu.vote_masks([as_uint8(p) for p in payloads], d)
    kernels = _kernels(d) if n and on_cpu else None
    if kernels is None:
        return majority_masks(count_planes(payloads, d), n, d)
    nbytes = packed_size(d)
    gt, tie = np.empty((2, (nbytes + 7) // 8), dtype=np.uint64)  # one allocation for both masks
    words = _KernelWords(payloads, nbytes)
    planes = n.bit_length()
    words.count(kernels, gt, tie)
    if words.tail is not None:
        kernels.vote_masks(words.tail, 0, 1, gt[words.whole :], tie[words.whole :], _scratch(kernels, planes))
    return torch.from_numpy(gt.view(np.uint8)[:nbytes]), torch.from_numpy(tie.view(np.uint8)[:nbytes])


# ---------------------------------------------------------------- bit-sliced vote counting
_THREAD = threading.local()  # per thread: the count kernels' scratch planes, by number of planes


def _scratch(kernels: ModuleType, num_planes: int) -> np.ndarray:
    """The calling thread's ``kernels.scratch(num_planes)``, allocated once and reused."""
    cache = _THREAD.__dict__.setdefault("scratch", {})
    if num_planes not in cache:
        cache[num_planes] = kernels.scratch(num_planes)
    return cache[num_planes]


def _on_cpu(payloads: Sequence[torch.Tensor | bytes | np.ndarray]) -> bool:
    """Whether the payloads are in host memory (bytes, numpy arrays or CPU tensors)."""
    return not any(isinstance(p, torch.Tensor) and p.device.type != "cpu" for p in payloads)


def _host_bytes(p: torch.Tensor | bytes | np.ndarray) -> np.ndarray:
    """A payload in host memory as a 1-D uint8 numpy array (a ``bytes`` payload read in place)."""
    return np.frombuffer(p, dtype=np.uint8) if isinstance(p, bytes | bytearray) else np.ascontiguousarray(as_uint8(p))


_COUNT_GRAIN = 1 << 23  # bytes (payload words read, results written) per thread at least


class _KernelWords:
    """The payloads as the kernels read them: the address of each one's whole int64 words.

    No payload is copied (a ``bytes`` payload is read in place) unless it is not 8-byte
    aligned. The bytes after the last whole word, if any, are copied zero-padded into one
    word per payload, ``tail`` holding their addresses. ``run`` counts the whole words on
    torch's threads.
    """

    def __init__(self, payloads: Sequence[torch.Tensor | bytes | np.ndarray], nbytes: int) -> None:
        self.whole = nbytes // 8
        self.n = len(payloads)
        self._keep: list[object] = list(payloads)  # the memory the addresses point into stays alive
        addresses = []
        for p in payloads:
            if isinstance(p, torch.Tensor) and p.dtype == torch.uint8 and p.dim() == 1 and p.is_contiguous():
                size, address = p.numel(), p.data_ptr()  # cheaper than via numpy: the loop pays per payload
            elif isinstance(p, bytes):  # ctypes passes bytes as a pointer to their data
                size, address = len(p), ctypes.cast(p, ctypes.c_void_p).value or 0
            else:
                a = _host_bytes(p)
                size, address = a.size, a.ctypes.data
                self._keep.append(a)
            if size != nbytes:
                raise ValueError(f"expected {nbytes} packed bytes, got {size}")
            if address % 8:
                a = _host_bytes(p).copy()  # numpy's own allocations are aligned
                address = a.ctypes.data
                self._keep.append(a)
            addresses.append(address)
        self.addresses = np.array(addresses, dtype=np.int64)
        self.tail: np.ndarray | None = None
        if nbytes % 8:  # the bytes after the last whole word, zero-padded: one word per payload
            tails = np.zeros((self.n, 8), dtype=np.uint8)
            for i, p in enumerate(payloads):
                tails[i, : nbytes % 8] = _host_bytes(p)[8 * self.whole :]
            self._keep.append(tails)
            self.tail = tails.ctypes.data + 8 * np.arange(self.n, dtype=np.int64)

    def count(self, kernels: ModuleType, out: np.ndarray, tie: np.ndarray | None) -> None:
        """The count planes (``tie`` None) or the vote's masks ``out``, ``tie`` of the whole words, in place.

        On torch's OpenMP team (:func:`_team`; at least 1 MB read and written per thread),
        else on the codec's own threads.
        """
        out_bytes = 8 * out.shape[0] if tie is None else 16
        planes = self.n.bit_length()
        team = _team(kernels, "count", self.whole * (8 * self.n + out_bytes), _TEAM_COUNT_GRAIN)
        if team is not None:
            team[0].count(self.addresses, self.whole, out, tie, team[1])
        elif tie is None:
            self.run(
                lambda first, last: kernels.count_planes(self.addresses, first, last, out, _scratch(kernels, planes)),
                out_bytes,
            )
        else:
            self.run(
                lambda first, last: kernels.vote_masks(
                    self.addresses, first, last, out, tie, _scratch(kernels, planes)
                ),
                out_bytes,
            )

    def run(self, work: Callable[[int, int], None], out_bytes: int) -> None:
        """``work(first, last)`` over the whole words, on as many threads as ``_COUNT_GRAIN`` bytes allow.

        A thread gets at least ``_COUNT_GRAIN`` bytes to read and write (n payload words and
        ``out_bytes`` of output per word): waking a pool thread costs about 0.1 ms on a
        virtual machine, about what 8 MB take to stream through one core.
        """
        _on_threads(work, self.whole, max(256, _COUNT_GRAIN // (8 * self.n + out_bytes)))


def _words(packed: torch.Tensor | bytes | np.ndarray, nbytes: int, nwords: int) -> torch.Tensor:
    """Packed bytes as ``nwords`` int64 words (zero-padded to a whole word: a copy only then)."""
    p = as_uint8(packed)
    if p.numel() != nbytes:
        raise ValueError(f"expected {nbytes} packed bytes, got {p.numel()}")
    if nbytes % 8 or p.data_ptr() % 8:
        q = p.new_zeros(8 * nwords)
        q[:nbytes] = p
        p = q
    return p.view(torch.int64)


def count_planes(
    payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int, *, chunk_words: int = 1 << 16
) -> torch.Tensor:
    """Per-coordinate count of 1 bits over packed payloads, bit-sliced: ``(B, ⌈d/8⌉)`` uint8.

    Plane j holds bit j of each coordinate's count, packed like the payloads, so the
    planes *are* the ``planesB`` encoding of the counts (B = ⌊log₂ n⌋ + 1 bit planes).
    The payloads are never unpacked: 64 coordinates are counted at once with carry-save
    adders over int64 words (the counter plane of weight 2ᵏ and two new planes of that
    weight → the new counter plane and one carry plane of weight 2ᵏ⁺¹; five bitwise
    operations), a chunk of words at a time so that the counters stay in cache: on the CPU
    in the fused kernel (8 kB chunks, every payload word read once) where available, else
    with torch operations (``chunk_words`` words per chunk). Extra memory is O(B·d/8) for
    the planes plus O(B·chunk) — never n × d. Payloads in GPU memory are counted by a
    Triton kernel instead (:mod:`flower_dlion.gpu_kernels`: per-value counters in registers,
    each payload byte read once) unless ``FLOWER_DLION_KERNELS=off``.
    """
    n = len(payloads)
    nbytes = packed_size(d)
    nwords = (nbytes + 7) // 8
    num_planes = max(1, n.bit_length())
    on_cpu = _on_cpu(payloads)
    if n and not on_cpu and (gpu := _gpu_kernels()) is not None:
        return gpu.count_planes([as_uint8(p) for p in payloads], d)
    kernels = _kernels(d) if n and on_cpu else None
    if kernels is not None:
        planes_np = np.empty((num_planes, nwords), dtype=np.uint64)
        words = _KernelWords(payloads, nbytes)
        words.count(kernels, planes_np, None)
        if words.tail is not None:
            last = np.empty((num_planes, 1), dtype=np.uint64)
            kernels.count_planes(words.tail, 0, 1, last, _scratch(kernels, num_planes))
            planes_np[:, words.whole] = last[:, 0]
        return torch.from_numpy(planes_np).view(torch.uint8)[:, :nbytes]
    device = as_uint8(payloads[0]).device if n else torch.device("cpu")
    planes = torch.zeros(num_planes + 1, nwords, dtype=torch.int64, device=device)  # +1: an always-zero spill
    words = [_words(p, nbytes, nwords) for p in payloads]
    if device.type != "cpu":
        chunk_words = max(nwords, 1)  # a GPU gains nothing from cache-sized chunks, only launches
    size = min(chunk_words, max(nwords, 1))
    spare = [torch.empty(size, dtype=torch.int64, device=device) for _ in range(2 * num_planes + 8)]
    for start in range(0, nwords, chunk_words):
        stop = min(start + chunk_words, nwords)
        counter = _CarrySaveCounter(planes[:, start:stop], [t[: stop - start] for t in spare])
        for w in words:
            counter.add(0, w[start:stop])
        counter.flush()
    return planes[:num_planes].view(torch.uint8)[:, :nbytes]


class _CarrySaveCounter:
    """Bit-sliced counters over one chunk of words: ``acc[k]`` is the plane of weight 2ᵏ."""

    def __init__(self, acc: torch.Tensor, spare: list[torch.Tensor]) -> None:
        self.acc = acc  # (B + 1, chunk) int64 view into the result
        self.free = spare  # scratch planes
        self.owned = {t.data_ptr() for t in spare}
        self.pending: list[torch.Tensor | None] = [None] * (acc.shape[0] + 1)

    def _release(self, *planes: torch.Tensor) -> None:
        self.free.extend(t for t in planes if t.data_ptr() in self.owned)  # never a payload's memory

    def add(self, k: int, x: torch.Tensor) -> None:
        """Add plane ``x`` of weight 2ᵏ; two pending planes go through a carry-save adder."""
        y = self.pending[k]
        if y is None:
            self.pending[k] = x
            return
        self.pending[k] = None
        acc = self.acc[k]
        u, t, carry = self.free.pop(), self.free.pop(), self.free.pop()
        torch.bitwise_xor(x, y, out=u)  # u = x ⊕ y
        torch.bitwise_and(x, y, out=carry)
        torch.bitwise_and(acc, u, out=t)
        carry.bitwise_or_(t)  # carry = majority(acc, x, y), weight 2ᵏ⁺¹
        acc.bitwise_xor_(u)  # acc ← acc ⊕ x ⊕ y
        self._release(u, t, x, y)
        self.add(k + 1, carry)

    def flush(self) -> None:
        """Half-add the plane left pending at each weight (its carry moves up)."""
        for k in range(self.acc.shape[0]):
            y = self.pending[k]
            if y is not None:
                self.pending[k] = None
                carry = self.free.pop()
                torch.bitwise_and(self.acc[k], y, out=carry)
                self.acc[k].bitwise_xor_(y)
                self._release(y)
                self.add(k + 1, carry)


def planes_to_counts(planes: torch.Tensor, d: int) -> torch.Tensor:
    """The per-coordinate counts (int32) from :func:`count_planes`."""
    counts = torch.zeros(d, dtype=torch.int32, device=planes.device)
    for j in range(planes.shape[0]):
        counts |= unpack_bits(planes[j].contiguous(), d).to(torch.int32) << j
    return counts


def majority_masks(planes: torch.Tensor, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed masks (gt, tie) of count > n/2 and count = n/2, compared bit-sliced from the top plane down."""
    threshold = n // 2  # count > n/2 ⇔ count > ⌊n/2⌋ ; a tie needs n even and count = n/2
    nbytes = packed_size(d)
    gt = torch.zeros(nbytes, dtype=torch.uint8, device=planes.device)
    eq = torch.full((nbytes,), 255, dtype=torch.uint8, device=planes.device)
    for j in reversed(range(planes.shape[0])):
        bit = planes[j]
        if (threshold >> j) & 1:
            eq &= bit  # equal so far only if this bit is 1 too
        else:
            gt |= eq & bit  # first bit where count has 1 and the threshold 0
            eq &= ~bit
    if n % 2:
        eq.zero_()  # no ties with an odd number of voters
    return gt, eq


class PackedAggregate(NamedTuple):
    """Δ aggregated from n packed sign payloads (:func:`aggregate_packed`)."""

    levels: torch.Tensor  # Δ's levels k, uint8 (int32 above 256 levels): Δ = (2k − (L−1)) / (L−1)
    num_levels: int  # L
    encoded: bytes  # the broadcast: encode_levels(levels, num_levels)
    ties: int  # coordinates where S = Σᵢ δᵢ is 0
    sum_abs: int  # Σ |S| over the d coordinates, exact


def aggregate_packed(payloads: Sequence[torch.Tensor | bytes | np.ndarray], d: int, how: str) -> PackedAggregate:
    """Vote or mean of n packed sign payloads, straight from their bit-sliced counts.

    With c the per-coordinate count of +1 votes (S = 2c − n), the levels are those of
    ``lion.aggregate(S, n, how)`` and ``encoded`` is :func:`encode_levels` of them, but no
    d-sized integer array is formed on the way: the count planes (:func:`count_planes`)
    and the masks of :func:`majority_masks` are packed, the levels are bytes.

    - vote, n odd: Δ = sign(S), 2 levels; the mask "S > 0" *is* their ``sign1`` encoding.
    - vote, n even: 3 levels; the masks "S = 0" and "S > 0" are the levels' bit planes 0 and 1.
    - mean: Δ = S/n, n + 1 levels k = c; the count planes *are* their ``planesB`` encoding
      (``trit5`` for n = 2 is encoded from the levels).

    The levels come out of these planes as a client decodes a broadcast (the kernel of
    :func:`decode_levels`); the ties and Σ|S| from popcounts of the count planes under the
    masks: with Cₘ = Σⱼ 2ʲ·popcount(planeⱼ ∧ m) and #m the number of coordinates in a mask m,
    Σ|S| = (2·C_gt − n·#gt) + (n·#lt − 2·C_lt), where #lt = d − #gt − #tie and
    C_lt = C_all − C_gt − (n/2)·#tie.

    Example::

        >>> a = pack_signs(torch.tensor([1.0, -1.0, 1.0]))
        >>> b = pack_signs(torch.tensor([1.0, 1.0, -1.0]))
        >>> agg = aggregate_packed([a, b], 3, "vote")
        >>> agg.levels.tolist(), agg.num_levels, agg.ties, agg.sum_abs
        ([2, 1, 1], 3, 2, 2)
    """
    n = len(payloads)
    if n < 1:
        raise ValueError("aggregate_packed needs at least one payload")
    if how not in ("vote", "mean"):
        raise ValueError(f"how must be 'vote' or 'mean', got {how!r}")
    planes = count_planes(payloads, d).cpu()
    if d % 8:  # bits past d (a payload's spare bits) count for nothing
        planes[:, -1] &= (0xFF00 >> (d % 8)) & 0xFF
    gt, tie = majority_masks(planes, n, d)
    if how == "vote":
        level_planes, num_levels = (gt[None], 2) if n % 2 else (torch.stack([tie, gt]), 3)
    else:
        level_planes, num_levels = planes.contiguous(), n + 1
    levels = _levels_from_planes(level_planes, d, torch.uint8 if num_levels <= 256 else torch.int32)
    if level_format(num_levels)[0] == TRIT5:
        encoded = encode_levels(levels, num_levels).numpy().tobytes()
    else:
        encoded = level_planes.numpy().tobytes()
    num_gt, num_tie = _popcount(gt), _popcount(tie)
    c_all = sum(_popcount(plane) << j for j, plane in enumerate(planes))
    c_gt = sum(_popcount(plane & gt) << j for j, plane in enumerate(planes))
    c_lt = c_all - c_gt - (n // 2) * num_tie  # a tie has c = n/2
    num_lt = d - num_gt - num_tie
    sum_abs = (2 * c_gt - n * num_gt) + (n * num_lt - 2 * c_lt)
    return PackedAggregate(levels, num_levels, encoded, num_tie, sum_abs)


_POPCOUNT8 = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.uint8)


def _popcount(mask: torch.Tensor) -> int:
    """The number of 1 bits in a uint8 tensor on the CPU."""
    a = mask.numpy()
    if not hasattr(np, "bitwise_count"):  # numpy < 2: a table
        return int(np.take(_POPCOUNT8, a).sum(dtype=np.int64))
    whole = a.size - a.size % 8
    return int(np.bitwise_count(a[:whole].view(np.uint64)).sum(dtype=np.int64)) + int(np.bitwise_count(a[whole:]).sum())


def level_format(num_levels: int) -> tuple[str, int]:
    """The format used for ``num_levels`` levels and its bits per value (or 0 for trit5)."""
    if num_levels < 2:
        raise ValueError(f"num_levels must be >= 2, got {num_levels}")
    if num_levels == 2:
        return SIGN1, 1
    if num_levels == 3:
        return TRIT5, 0
    b = math.ceil(math.log2(num_levels))
    return f"planes{b}", b


def encoded_size(d: int, num_levels: int) -> int:
    """Bytes used by :func:`encode_levels` for ``d`` values of ``num_levels`` levels."""
    fmt, b = level_format(num_levels)
    if fmt == TRIT5:
        return (d + 4) // 5
    return b * packed_size(d)


def encode_levels(k: torch.Tensor, num_levels: int) -> torch.Tensor:
    """Encode integer levels ``k ∈ {0, …, num_levels−1}`` into bytes (see module doc)."""
    k = k.reshape(-1)
    d = k.numel()
    fmt, b = level_format(num_levels)
    if fmt == SIGN1:
        return pack_bits(k > 0)
    if fmt == TRIT5:
        if k.device.type == "cpu" and (kernels := _kernels(d)) is not None:  # five levels → a byte, in one pass
            k8, out, whole = k.to(torch.uint8).numpy(), np.empty((d + 4) // 5, dtype=np.uint8), d // 5
            _on_threads(lambda first, last: kernels.levels_to_trits(k8, out, first, last), whole, 1 << 18)
            if d % 5:  # the partial last group
                out[whole] = sum(int(v) * p for v, p in zip(k8[5 * whole :], _POW3, strict=False))
            return torch.from_numpy(out)
        t = k.to(torch.uint8)
        if d % 5:
            t = torch.cat([t, t.new_zeros(5 - d % 5)])
        t = t.view(-1, 5)
        out = t[:, 0].clone()
        for j in range(1, 5):
            out += t[:, j] * _POW3[j]
        return out
    if k.device.type == "cpu" and num_levels <= 256:  # bytes: a quarter of the int32 passes' memory traffic
        k8 = k.to(torch.uint8).numpy()
        bit = np.empty_like(k8)
        return torch.from_numpy(
            np.concatenate([np.packbits(np.bitwise_and(k8, 1 << j, out=bit), bitorder="big") for j in range(b)])
        )  # packbits packs every nonzero byte as a 1 bit
    k = k.to(torch.int32)
    return torch.cat([pack_bits(((k >> j) & 1).bool()) for j in range(b)])


_TRIT_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def _trit_lut(device: torch.device) -> torch.Tensor:
    """256 × 5 table: the five base-3 digits of every byte value."""
    if device not in _TRIT_LUT_CACHE:
        byte = torch.arange(256, dtype=torch.int32)
        digits = torch.stack([(byte // p) % 3 for p in _POW3], dim=1).to(torch.uint8)
        _TRIT_LUT_CACHE[device] = digits.to(device)
    return _TRIT_LUT_CACHE[device]


def decode_levels(
    buf: torch.Tensor | bytes | np.ndarray, num_levels: int, d: int, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Inverse of :func:`encode_levels`: ``d`` integer levels, int32 or (up to 256 levels) uint8.

    uint8 levels are a quarter of the memory, and :func:`apply_levels_` reads them as they
    are. A level that cannot occur (a trit5 byte above 242, a bit-plane level ≥ L) is a
    ``ValueError``: nothing is returned for a corrupted payload.
    """
    if dtype not in (torch.int32, torch.uint8) or (dtype == torch.uint8 and num_levels > 256):
        raise ValueError(f"levels are int32, or uint8 for at most 256 levels; got {dtype} for {num_levels} levels")
    p = as_uint8(buf)
    if p.numel() != encoded_size(d, num_levels):
        raise ValueError(
            f"expected {encoded_size(d, num_levels)} bytes for {d} values of {num_levels} levels, got {p.numel()}"
        )
    fmt, b = level_format(num_levels)
    if fmt == SIGN1:
        bits = unpack_bits(p, d)
        return bits.view(torch.uint8) if dtype == torch.uint8 else bits.to(dtype)
    if fmt == TRIT5:
        kernels = _kernels(d) if p.device.type == "cpu" else None
        if kernels is not None:  # each byte's digits from the table; the largest byte on the way
            t, lut, k8 = p.numpy(), _trit_lut(p.device).numpy(), np.empty(5 * p.numel(), dtype=np.uint8)
            work = functools.partial(kernels.trits_to_levels, t, lut, k8)
            largest = max(_on_threads(work, t.size, 1 << 18), default=0)
        else:
            largest = int(p.max()) if p.numel() else 0
        if largest > 242:
            raise ValueError("trit5 byte above 242 (3^5 - 1): corrupted payload")
        if p.device.type == "cpu":
            if kernels is None:  # numpy's take: no int64 index copy, 3× its fancy indexing
                k8 = np.take(_trit_lut(p.device).numpy(), p.numpy(), axis=0).reshape(-1)
            return torch.from_numpy(k8[:d] if dtype == torch.uint8 else k8[:d].astype(np.int32))
        return _trit_lut(p.device)[p.long()].view(-1)[:d].to(dtype)
    k = _levels_from_planes(p.view(b, -1), d, dtype)
    if d and num_levels < 1 << b and int(k.numpy().max() if k.device.type == "cpu" else k.max()) >= num_levels:
        raise ValueError(f"level above {num_levels - 1}: corrupted payload")
    return k


def _levels_from_planes(planes: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Levels ``k = Σⱼ 2ʲ·(bit j)`` of ``d`` values from B packed bit planes ``(B, ⌈d/8⌉)`` uint8, as ``dtype``."""
    b, n8 = planes.shape
    if planes.device.type != "cpu" or b > 8:
        return planes_to_counts(planes, d).to(dtype)
    p = planes.contiguous().numpy()
    if (kernels := _kernels(d)) is not None:  # every plane byte spread to 8 levels in registers
        words = np.empty(n8, dtype=np.uint64)
        _on_threads(lambda first, last: kernels.planes_to_levels(p, words, first, last), n8, 1 << 17)
        k8 = words.view(np.uint8)[:d]
    else:  # bytes: a quarter of the int32 passes' memory traffic
        k8, bit = np.zeros(d, dtype=np.uint8), np.empty(d, dtype=np.uint8)
        for j in range(b):  # k |= bit j of every level
            np.bitwise_or(k8, np.left_shift(np.unpackbits(p[j], count=d), j, out=bit), out=k8)
    return torch.from_numpy(k8 if dtype == torch.uint8 else k8.astype(np.int32))


def levels_to_values(k: torch.Tensor, num_levels: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map levels to update values: ``Δ = (2k − (L−1)) / (L−1)``.

    The numerator is an exact integer and the one division is correctly rounded, so the
    server and every client (CPU or GPU) get bit-identical Δ from the same levels. The
    divisor is a tensor on ``k``'s device: divided by a Python number, torch's CUDA kernel
    multiplies by the number's rounded reciprocal instead, 1 ulp off for some levels of
    L − 1 = 7, 11, 12, … (the mean of that many votes), and GPU replicas would drift from
    the server's x.
    """
    top = num_levels - 1
    return (2 * k.to(torch.int32) - top).to(dtype) / torch.full((), top, dtype=dtype, device=k.device)
