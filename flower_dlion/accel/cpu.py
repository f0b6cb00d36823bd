"""The codec's functions (or steps of them) on the CPU, on the numba kernels: the same bytes and floats.

:func:`flower_dlion.accel.choose` hands these out (numba installed; from 2²⁰ values up under
``FLOWER_DLION_KERNELS=auto``, at every size under ``on``). Each one is the twin of the
:mod:`flower_dlion.codec` (or :mod:`flower_dlion.anchored_counts`) function or step its docstring
names, takes its arguments, for inputs the caller has checked it can take (float32,
contiguous, in host memory), runs the kernels of :mod:`.numba_pack`, :mod:`.numba_levels` and
:mod:`.numba_count` on torch's CPU threads (:mod:`.threads`) and returns its result; the caller
does what follows (the packs' coin flips). Where a kernel would round differently from torch on this machine
(checked once on a probe, against the reference the caller passes), the twin returns None and
the caller runs the reference.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..formats import POW3, as_uint8, encoded_size, packed_size, trit_table, zero_mask_words
from . import numba_count as count_kernels
from . import numba_levels as level_kernels
from . import numba_pack as kernels
from . import threads
from .probes import LocalStep, fused_step_matches_torch, lion_coefs, torch_steps

__all__ = [
    "apply_levels_",
    "count_ones",
    "count_planes",
    "decode_trits",
    "encode_trits",
    "levels_from_planes",
    "lion_pack",
    "pack_positive",
    "step_counts",
]

Payload = torch.Tensor | bytes | np.ndarray
Anchored = Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]  # lion.anchored: x from xₐ and C


# --------------------------------------------------------------------------- a vector
def pack_positive(v: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Bits of ``v > 0`` packed, and the masks of ``v``'s exact zeros by group of 64 (None: no zero).

    The step of :func:`flower_dlion.codec.pack_signs` before the coin flips, on a float32
    CPU vector: each value read once, packed in registers. The kernel only reports whether
    there is a zero; the masks take a second, compare-only pass when there is (writing them
    in the pack slowed the pack without zeros, docs/PERFORMANCE.md).
    """
    d = v.size
    out = np.empty(packed_size(d), dtype=np.uint8)
    groups, grain = -(-d // kernels.BLOCK), (1 << 20) // kernels.BLOCK  # waking a thread costs tens of µs
    if (team := threads.team("pack", d)) is not None:  # on torch's threads, awake after its operations
        found = team[0].pack_positive(v, out, team[1])
    else:
        found = any(threads.on_threads(lambda a, b: kernels.pack_positive(v, out, a, b), groups, grain))
    if not found:
        return out, None
    zeros = zero_mask_words(d)  # the second pass on the same threads (the team's spin a while after a run)
    if team is not None:
        team[0].zero_masks(v, zeros, team[1])
    else:
        threads.on_threads(lambda a, b: kernels.zero_masks(v, zeros, a, b), groups, grain)
    return out, zeros


def lion_pack(
    m: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float, *, local_step: LocalStep
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A Lion step of float32 CPU vectors (m contiguous) in one pass: δ > 0 packed, its zeros' masks, ``m`` updated.

    The step of :func:`flower_dlion.codec.pack_local_step_` before the coin flips, as
    :func:`pack_positive` of ``local_step(m, g, β₁, β₂)`` (the reference, ``lion.local_step_``)
    would give it: the masks mark the zero directions (None: none). None, with ``m`` untouched,
    where the kernel rounds otherwise than ``local_step`` on this machine (a probe, once).
    """
    coefs = lion_coefs(beta1, beta2)
    fused = functools.partial(_lion_pack_one_thread, coefs)
    if not fused_step_matches_torch(fused, local_step, beta1, beta2, m.device):
        return None
    d = m.numel()
    mh, gh = m.numpy().reshape(-1), g.contiguous().numpy().reshape(-1)  # views (torch's reshape costs µs)
    packed, zeros = np.empty(packed_size(d), dtype=np.uint8), zero_mask_words(d)
    if (team := threads.team("lion_pack", d)) is not None:
        found = [team[0].lion_pack(mh, gh, coefs, packed, zeros, team[1])]
    else:
        found = threads.on_threads(
            lambda a, b: kernels.lion_pack(mh, gh, coefs, packed, zeros, a, b), zeros.size, 1 << 13
        )
    return packed, (zeros if any(found) else None)  # zero directions: the caller flips their coins


def _lion_pack_one_thread(coefs: tuple[np.float32, ...], m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The kernel's fused step on one thread (for the probe): δ > 0 packed, ``m`` updated."""
    packed, zeros = np.empty(packed_size(m.numel()), np.uint8), zero_mask_words(m.numel())
    kernels.lion_pack(m.numpy(), g.numpy(), coefs, packed, zeros, 0, zeros.size)
    return torch.from_numpy(packed)


def apply_levels_(
    x: torch.Tensor, levels: torch.Tensor, num_levels: int, lr: float, weight_decay: float
) -> torch.Tensor | None:
    """:func:`flower_dlion.codec.apply_levels_` in one pass over a float32 CPU ``x`` and its levels.

    Each value goes through the same float32 operations as the composition; the L possible
    steps ``lr·Δ`` are compared with torch's own ones first (where torch would round one
    differently: None, ``x`` untouched, and the caller runs the composition).
    """
    d, top, lr32 = x.numel(), num_levels - 1, np.float32(lr)
    steps = (np.arange(-top, top + 1, 2, dtype=np.int64).astype(np.float32) / np.float32(top)) * lr32
    if not np.array_equal(steps.view(np.int32), torch_steps(x.device, num_levels, float(lr)).numpy().view(np.int32)):
        return None
    decay = np.float32(1.0 - lr * weight_decay)  # the factor x.mul_ rounds to float32
    xh, kh = x.reshape(-1).numpy(), levels.reshape(-1).contiguous().numpy()
    if kh.dtype in (np.uint8, np.int32) and (team := threads.team("apply", d)) is not None:
        worst = [team[0].apply_levels(xh, kh, top, lr32, decay, team[1])]
    else:
        worst = threads.on_threads(lambda a, b: kernels.apply_levels(xh, kh, top, lr32, decay, a, b), d, 1 << 19)
    if max(worst, default=0) > top:
        raise ValueError(f"level outside 0…{top}: corrupted update")
    return x


# ------------------------------------------------------------------------- one anchored Δ
_ANCHORED_EXACT: list[bool] = []  # whether the kernel rounds as lion.anchored's torch operations (probed once)


def step_counts(
    anchor: torch.Tensor,
    counts: torch.Tensor,
    packed: torch.Tensor,
    num_levels: int,
    decay: float,
    step: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch: torch.Tensor | None = None,
    anchored: Anchored,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`flower_dlion.anchored_counts.step_counts` in two passes: the Δ's levels as bytes, then C' and x' in one.

    The second pass reads 9 bytes a value and writes 8 (the composition: nine passes and
    four temporaries). ``scratch`` is not needed: the levels go to a buffer kept per thread.
    ``anchored``: the reference, ``lion.anchored``; where the kernel's x' is not its bits on
    this machine (a probe, once), None, nothing written, and the caller runs the composition.
    """
    d = counts.numel()
    if num_levels not in (2, 3):
        raise ValueError(f"the anchored downlink takes a vote (2 or 3 levels), got {num_levels} levels")
    if not _anchored_matches_torch(anchored):
        return None
    new_counts, x = out if out is not None else (torch.empty_like(counts), torch.empty_like(anchor))
    levels = _levels_into(packed, num_levels, d)  # ValueError for a corrupted payload, before anything is written
    work = functools.partial(
        kernels.step_counts, levels, 2 if num_levels == 2 else 1, counts.numpy(), anchor.numpy(),
        new_counts.numpy(), x.numpy(), np.float32(decay), np.float32(step),
    )  # fmt: skip
    threads.on_threads(work, d, 1 << 20)
    return new_counts, x


def _levels_into(packed: torch.Tensor, num_levels: int, d: int) -> np.ndarray:
    """A Δ's ``d`` levels (``sign1`` or ``trit5`` bytes) as uint8, in this thread's reused buffer."""
    p = as_uint8(packed).numpy()
    if p.size != encoded_size(d, num_levels):
        raise ValueError(
            f"expected {encoded_size(d, num_levels)} bytes for {d} values of {num_levels} levels, got {p.size}"
        )
    cache = _THREAD.__dict__.setdefault("levels", {})
    size = 8 * p.size if num_levels == 2 else 5 * p.size  # levels a byte holds
    if cache.get("size") != size:
        cache.update(size=size, buffer=np.empty(size + 8, dtype=np.uint8))
    buf: np.ndarray = cache["buffer"]
    if num_levels == 2:  # one bit plane: each byte's 8 bits spread to 8 bytes
        words = buf[:size].view(np.uint64)
        planes = p.reshape(1, -1)
        threads.on_threads(
            lambda first, last: level_kernels.planes_to_levels(planes, words, first, last), p.size, 1 << 17
        )
    else:
        lut = trit_table(packed.device).numpy()
        work = functools.partial(level_kernels.trits_to_levels, p, lut, buf)
        if max(threads.on_threads(work, p.size, 1 << 18), default=0) > 242:
            raise ValueError("trit5 byte above 242 (3^5 - 1): corrupted payload")
    return buf[:d]


def _anchored_matches_torch(anchored: Anchored) -> bool:
    """Whether the kernel's x' is ``anchored``'s (``lion.anchored``), bit for bit, on a probe (once per process)."""
    if not _ANCHORED_EXACT:
        gen = torch.Generator().manual_seed(0)
        d = 3 * 2**10 + 7
        anchor = torch.randn(d, generator=gen) * torch.rand(d, generator=gen).mul(30).sub(15).exp2()
        counts = torch.randint(-300, 300, (d,), generator=gen, dtype=torch.int32)
        levels = torch.randint(0, 3, (d,), generator=gen, dtype=torch.int32)
        decay, step = 0.9961743216, 3.0517e-4
        expected = anchored(anchor, counts + levels - 1, decay, step)
        got_c, got_x = torch.empty_like(counts), torch.empty_like(anchor)
        kernels.step_counts(
            levels.to(torch.uint8).numpy(), 1, counts.numpy(), anchor.numpy(), got_c.numpy(), got_x.numpy(),
            np.float32(decay), np.float32(step), 0, d,
        )  # fmt: skip
        exact = torch.equal(got_c, counts + levels - 1)
        _ANCHORED_EXACT.append(exact and torch.equal(got_x.view(torch.int32), expected.view(torch.int32)))
    return _ANCHORED_EXACT[0]


# ------------------------------------------------------------------------- level codes
def encode_trits(k: torch.Tensor) -> torch.Tensor:
    """The ``trit5`` bytes of 3-level CPU levels (five levels → a byte, in one pass)."""
    d = k.numel()
    k8, out, whole = k.to(torch.uint8).numpy(), np.empty((d + 4) // 5, dtype=np.uint8), d // 5
    threads.on_threads(lambda first, last: level_kernels.levels_to_trits(k8, out, first, last), whole, 1 << 18)
    if d % 5:  # the partial last group
        out[whole] = sum(int(v) * p for v, p in zip(k8[5 * whole :], POW3, strict=False))
    return torch.from_numpy(out)


def decode_trits(p: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``d`` levels from ``trit5`` bytes in host memory: each byte's digits from the table, the largest on the way."""
    t, lut, k8 = p.numpy(), trit_table(p.device).numpy(), np.empty(5 * p.numel(), dtype=np.uint8)
    work = functools.partial(level_kernels.trits_to_levels, t, lut, k8)
    largest = max(threads.on_threads(work, t.size, 1 << 18), default=0)
    if largest > 242:
        raise ValueError("trit5 byte above 242 (3^5 - 1): corrupted payload")
    return torch.from_numpy(k8[:d] if dtype == torch.uint8 else k8[:d].astype(np.int32))


def levels_from_planes(planes: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Levels from at most 8 packed bit planes in host memory: every plane byte spread to 8 levels in registers."""
    p, n8 = planes.contiguous().numpy(), planes.shape[1]
    words = np.empty(n8, dtype=np.uint64)
    threads.on_threads(lambda first, last: level_kernels.planes_to_levels(p, words, first, last), n8, 1 << 17)
    k8 = words.view(np.uint8)[:d]
    return torch.from_numpy(k8 if dtype == torch.uint8 else k8.astype(np.int32))


# ------------------------------------------------------------------------- vote counts
_COUNT_GRAIN = 1 << 23  # bytes (payload words read, results written) per thread at least
_THREAD = threading.local()  # per thread: the count kernels' scratch planes, by number of planes


def count_ones(payloads: Sequence[Payload], d: int) -> torch.Tensor:
    """:func:`flower_dlion.codec.count_ones` of payloads in host memory, from the planes in cache."""
    nbytes, num_planes = packed_size(d), len(payloads).bit_length()
    counts = np.empty(64 * ((nbytes + 7) // 8), dtype=np.int32)  # 64 per word; the spare ones are cut off
    words = Payloads(payloads, nbytes)
    words.run(
        lambda first, last: count_kernels.count_ones(words.addresses, first, last, counts, _scratch(num_planes)),
        out_bytes=4 * 64,
    )
    if words.tail is not None:
        count_kernels.count_ones(words.tail, 0, 1, counts[64 * words.whole :], _scratch(num_planes))
    return torch.from_numpy(counts[:d])


def count_planes(payloads: Sequence[Payload], d: int, *, chunk_words: int = 1 << 16) -> torch.Tensor:
    """:func:`flower_dlion.codec.count_planes` of payloads in host memory (8 kB chunks; ``chunk_words`` unused)."""
    nbytes, num_planes = packed_size(d), max(1, len(payloads).bit_length())
    planes = np.empty((num_planes, (nbytes + 7) // 8), dtype=np.uint64)
    words = Payloads(payloads, nbytes)
    words.count(planes)
    if words.tail is not None:
        last = np.empty((num_planes, 1), dtype=np.uint64)
        count_kernels.count_planes(words.tail, 0, 1, last, _scratch(num_planes))
        planes[:, words.whole] = last[:, 0]
    return torch.from_numpy(planes).view(torch.uint8)[:, :nbytes]


def _scratch(num_planes: int) -> np.ndarray:
    """The calling thread's ``numba_count.scratch(num_planes)``, allocated once and reused."""
    cache = _THREAD.__dict__.setdefault("scratch", {})
    if num_planes not in cache:
        cache[num_planes] = count_kernels.scratch(num_planes)
    return cache[num_planes]


def _host_bytes(p: Payload) -> np.ndarray:
    """A payload in host memory as a 1-D uint8 numpy array (a ``bytes`` payload read in place)."""
    if isinstance(p, bytes | bytearray):
        return np.frombuffer(p, dtype=np.uint8)
    return np.ascontiguousarray(as_uint8(p))


class Payloads:
    """The payloads as the count kernels read them: the address of each one's whole int64 words.

    No payload is copied (a ``bytes`` payload is read in place) unless it is not 8-byte
    aligned. The bytes after the last whole word, if any, are copied zero-padded into one
    word per payload, ``tail`` holding their addresses.
    """

    def __init__(self, payloads: Sequence[Payload], nbytes: int) -> None:
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

    def count(self, planes: np.ndarray) -> None:
        """The count planes (B, words) of the whole words, in place.

        On torch's OpenMP team (:func:`.threads.team`; at least 1 MB read and written per
        thread), else on the codec's own threads.
        """
        out_bytes = 8 * planes.shape[0]
        team = threads.team("count", self.whole * (8 * self.n + out_bytes), threads.TEAM_COUNT_GRAIN)
        if team is not None:
            team[0].count(self.addresses, self.whole, planes, team[1])
        else:
            num_planes = self.n.bit_length()
            self.run(
                lambda first, last: count_kernels.count_planes(
                    self.addresses, first, last, planes, _scratch(num_planes)
                ),
                out_bytes,
            )

    def run(self, work: Callable[[int, int], None], out_bytes: int) -> None:
        """``work(first, last)`` over the whole words, on as many threads as ``_COUNT_GRAIN`` bytes allow.

        A thread gets at least ``_COUNT_GRAIN`` bytes to read and write (n payload words and
        ``out_bytes`` of output per word): waking a pool thread costs about 0.1 ms on a
        virtual machine, about what 8 MB take to stream through one core.
        """
        threads.on_threads(work, self.whole, max(256, _COUNT_GRAIN // (8 * self.n + out_bytes)))
