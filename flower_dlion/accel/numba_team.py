"""Running the numba kernels on torch's own OpenMP team (``GOMP_parallel``), for the client's hot path.

torch runs its CPU operations on an OpenMP team whose threads spin for a while after each
operation; a kernel that follows one (the pack after backward) finds them awake, where the
codec's own thread pool (:mod:`flower_dlion.accel.threads`) would have to wake its threads.
:func:`flower_dlion.accel.threads.team` hands out a :class:`Team` once a process has called a
kernel a few times (the tasks take 0.2 s to load once).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .numba_count import CHUNK_WORDS, count_planes, pointer_to, scratch
from .numba_pack import BLOCK, apply_levels, lion_pack, pack_positive, zero_masks

__all__ = ["Team"]

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)
_R = TypeVar("_R")
_f32_at, _u8_at, _i32_at, _i64_at, _u64_at = (
    pointer_to(t) for t in (types.float32, types.uint8, types.int32, types.int64, types.uint64)
)

# torch runs its CPU operations on an OpenMP team whose threads spin for a while after each
# operation; a kernel that follows one (the pack after backward) finds them awake. A task
# below is a C callback that GOMP_parallel runs once on each thread of that team: each
# thread takes parts of the work (an atomic counter in the task's int64 arguments) until
# none is left, so a thread that wakes late takes fewer parts and none is waited for twice.
_TASK = types.void(types.voidptr)


@intrinsic
def _take(typingctx: object, args: types.Type, index: types.Integer) -> tuple:
    """Atomically add 1 to the int64 ``args[index]`` (a task's counter); returns the old value."""
    sig = types.int64(types.voidptr, types.int64)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, a: tuple) -> object:
        counter = builder.gep(builder.bitcast(a[0], ir.IntType(64).as_pointer()), [a[1]])
        return builder.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@functools.cache
def _pack_task(pack: object = None) -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task).

    ``pack``: another compiled :func:`pack_positive` to run instead (``benchmarks/pack_variants.py``
    times the formulations on the team); that task is compiled afresh, not cached.
    """
    cache, pack = pack is None, pack_positive if pack is None else pack

    @numba.cfunc(_TASK, cache=cache)
    def task(args: object) -> None:  # int64 [next, parts, groups, v, d, out, masks, found]
        a = numba.carray(args, 8, np.int64)
        parts, groups, d = a[1], a[2], a[4]
        v, found = numba.carray(_f32_at(a[3]), d), numba.carray(_u8_at(a[7]), parts)
        p = _take(args, 0)
        while p < parts:
            first, last = groups * p // parts, groups * (p + 1) // parts
            if a[6]:  # the second pass: the zeros' masks into out (uint64, one per group)
                zero_masks(v, numba.carray(_u64_at(a[5]), groups), first, last)
            else:
                found[p] = pack(v, numba.carray(_u8_at(a[5]), (d + 7) // 8), first, last)
            p = _take(args, 0)

    return task


@functools.cache
def _lion_pack_task() -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task)."""

    @numba.cfunc(_TASK, cache=True)
    def task(args: object) -> None:  # int64 [next, parts, groups, m, g, d, coefs, out, zeros, found]
        a = numba.carray(args, 10, np.int64)
        parts, groups, d = a[1], a[2], a[5]
        m, g = numba.carray(_f32_at(a[3]), d), numba.carray(_f32_at(a[4]), d)
        c = numba.carray(_f32_at(a[6]), 4)
        coefs = (c[0], c[1], c[2], c[3])
        out, zeros = numba.carray(_u8_at(a[7]), (d + 7) // 8), numba.carray(_u64_at(a[8]), groups)
        found = numba.carray(_u8_at(a[9]), parts)
        p = _take(args, 0)
        while p < parts:
            found[p] = lion_pack(m, g, coefs, out, zeros, groups * p // parts, groups * (p + 1) // parts)
            p = _take(args, 0)

    return task


@functools.cache
def _apply_task() -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task)."""

    @numba.cfunc(_TASK, cache=True)
    def task(args: object) -> None:  # int64 [next, parts, d, x, levels, wide, top, scalars, worst]
        a = numba.carray(args, 9, np.int64)
        parts, d, top = a[1], a[2], a[6]
        x, s = numba.carray(_f32_at(a[3]), d), numba.carray(_f32_at(a[7]), 2)  # s: lr, decay
        worst = numba.carray(_u64_at(a[8]), parts)
        p = _take(args, 0)
        while p < parts:
            first, last = d * p // parts, d * (p + 1) // parts
            if a[5]:  # int32 levels
                worst[p] = apply_levels(x, numba.carray(_i32_at(a[4]), d), top, s[0], s[1], first, last)
            else:  # uint8 levels
                worst[p] = apply_levels(x, numba.carray(_u8_at(a[4]), d), top, s[0], s[1], first, last)
            p = _take(args, 0)

    return task


@functools.cache
def _count_task() -> object:
    """The task, compiled on first use (loaded from numba's cache: 0.2 s for a process's first task)."""

    @numba.cfunc(_TASK, cache=True)
    def task(args: object) -> None:  # int64 [next, parts, whole, addresses, n, out, rows, cols,
        a = numba.carray(args, 11, np.int64)  # scratch, scratch rows, next scratch slot]
        parts, whole, n = a[1], a[2], a[4]
        addresses = numba.carray(_i64_at(a[3]), n)
        out = numba.carray(_u64_at(a[5]), (a[6], a[7]))
        slot = _take(args, 10)  # this thread's counters: one of the caller's scratch arrays (see scratch)
        work = numba.carray(_u64_at(a[8] + slot * a[9] * CHUNK_WORDS * 8), (a[9], CHUNK_WORDS))
        p = _take(args, 0)
        while p < parts:
            count_planes(addresses, whole * p // parts, whole * (p + 1) // parts, out, work)
            p = _take(args, 0)

    return task


@intrinsic
def _gomp_parallel(typingctx: object, parallel: types.Integer, task: types.Integer, data: types.Integer,
                   threads: types.Integer) -> tuple:  # fmt: skip
    """``GOMP_parallel(task, data, threads, 0)`` through its address ``parallel`` (all int64)."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, a: tuple) -> object:
        void_p, uint = ir.IntType(8).as_pointer(), ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [void_p, void_p, uint, uint])  # (fn, data, num_threads, flags)
        run = builder.inttoptr(a[0], kind.as_pointer())
        builder.call(run, [builder.inttoptr(a[1], void_p), builder.inttoptr(a[2], void_p), builder.trunc(a[3], uint),
                           ir.Constant(uint, 0)])  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


# The launches: each fills its task's int64 arguments and runs it on the team, compiled and
# with the GIL released: from Python, one call with a few array arguments (Python's own
# per-call work, ctypes and array addresses, cost 15–20 µs against a 57 µs pack of 10⁶
# values). The task's arguments, its float scalars and its per-part results share one
# buffer that is read after the run: numba frees an array after its last use, so none may
# be used only through an address.
_PARTS_PER_THREAD = 4  # a thread that wakes late leaves its parts to the others


@_jit
def _launch_pack(
    parallel: int, task: int, threads: int, v: np.ndarray, out: np.ndarray, masks: bool = False
) -> bool:  # fmt: skip
    """:func:`pack_positive` of every group of ``v`` into ``out`` on the team; whether there is an exact zero.

    With ``masks``, :func:`zero_masks` into ``out`` (uint64, one per group) instead; returns False.
    """
    parts = threads * _PARTS_PER_THREAD
    a = np.zeros(8 + (parts + 7) // 8, dtype=np.int64)  # the arguments, then a byte per part: found
    a[1], a[2], a[3], a[4] = parts, (v.size + BLOCK - 1) // BLOCK, v.ctypes.data, v.size
    a[5], a[6], a[7] = out.ctypes.data, masks, a.ctypes.data + 8 * 8
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[8:].view(np.uint8)[:parts].any()


@_jit
def _launch_lion_pack(
    parallel: int, task: int, threads: int, m: np.ndarray, g: np.ndarray, coefs: tuple, out: np.ndarray,
    zeros: np.ndarray,
) -> bool:  # fmt: skip
    """:func:`lion_pack` of every group on the team; whether there is a zero direction."""
    parts = threads * _PARTS_PER_THREAD
    a = np.zeros(12 + (parts + 7) // 8, dtype=np.int64)  # the arguments, 4 float32 coefs, a byte per part
    c = a[10:12].view(np.float32)
    c[0], c[1], c[2], c[3] = coefs
    a[1], a[2], a[3], a[4], a[5] = parts, zeros.size, m.ctypes.data, g.ctypes.data, m.size
    a[6], a[7], a[8], a[9] = a.ctypes.data + 10 * 8, out.ctypes.data, zeros.ctypes.data, a.ctypes.data + 12 * 8
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[12:].view(np.uint8)[:parts].any()


@_jit
def _launch_apply(
    parallel: int, task: int, threads: int, x: np.ndarray, levels: np.ndarray, top: int, lr: np.float32,
    decay: np.float32,
) -> int:  # fmt: skip
    """:func:`apply_levels` of every value on the team (uint8 or int32 levels); the largest level."""
    parts = threads * _PARTS_PER_THREAD
    a = np.zeros(10 + parts, dtype=np.int64)  # the arguments, float32 lr and decay, a word per part: worst
    s = a[9:10].view(np.float32)
    s[0], s[1] = lr, decay
    a[1], a[2], a[3], a[4] = parts, x.size, x.ctypes.data, levels.ctypes.data
    a[5], a[6], a[7], a[8] = levels.itemsize == 4, top, a.ctypes.data + 9 * 8, a.ctypes.data + 10 * 8
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[10:].view(np.uint64).max()


@_jit
def _launch_count(
    parallel: int, task: int, threads: int, addresses: np.ndarray, whole: int, out: np.ndarray, work: np.ndarray
) -> int:  # fmt: skip
    """:func:`count_planes` into ``out`` (the (B, words) planes) on the team; how many threads took part."""
    a = np.zeros(11, dtype=np.int64)
    a[1], a[2], a[3], a[4] = threads * _PARTS_PER_THREAD, whole, addresses.ctypes.data, addresses.size
    a[5], a[6], a[7] = out.ctypes.data, out.shape[0], out.shape[1]  # the planes: rows and words
    a[8], a[9] = work.ctypes.data, work.shape[1]
    _gomp_parallel(parallel, task, a.ctypes.data, threads)
    return a[10]


class Team:
    """Runs a task on torch's OpenMP team: ``GOMP_parallel`` of the runtime already loaded.

    Works with GNU libgomp and LLVM's libomp (which provides the same entry point); the
    codec makes one only when torch's parallel backend is OpenMP. The call releases the
    GIL; calls from several threads get a team each (OpenMP's rules), and a call from
    inside a parallel region runs on the calling thread alone. Every part is done before
    :meth:`run` returns.
    """

    def __init__(self) -> None:
        parallel = ctypes.CDLL(None).GOMP_parallel  # AttributeError where no OpenMP is loaded
        self._parallel = ctypes.cast(parallel, ctypes.c_void_p).value
        self._local = threading.local()  # per calling thread: the count's scratch arrays

    def run(self, launch: Callable[..., _R], task: object, threads: int, *operands: object) -> _R:
        """``launch``'s task on ``threads`` threads of the team with ``operands``; what ``launch`` returns."""
        return launch(self._parallel, task.address, threads, *operands)

    def pack_positive(self, v: np.ndarray, out: np.ndarray, threads: int) -> bool:
        """:func:`pack_positive` of every group on ``threads`` threads; whether ``v`` has an exact zero."""
        return self.run(_launch_pack, _pack_task(), threads, v, out)

    def zero_masks(self, v: np.ndarray, zeros: np.ndarray, threads: int) -> None:
        """:func:`zero_masks` of every group on ``threads`` threads (after :meth:`pack_positive` found a zero)."""
        self.run(_launch_pack, _pack_task(), threads, v, zeros, True)

    def lion_pack(
        self, m: np.ndarray, g: np.ndarray, coefs: tuple, out: np.ndarray, zeros: np.ndarray, threads: int
    ) -> bool:
        """:func:`lion_pack` of every group on ``threads`` threads; whether there is a zero direction."""
        return self.run(_launch_lion_pack, _lion_pack_task(), threads, m, g, coefs, out, zeros)

    def apply_levels(
        self, x: np.ndarray, levels: np.ndarray, top: int, lr: np.float32, decay: np.float32, threads: int
    ) -> int:
        """:func:`apply_levels` of every value on ``threads`` threads (uint8 or int32 levels); the largest level."""
        if levels.dtype not in (np.uint8, np.int32):
            raise TypeError(f"levels must be uint8 or int32, got {levels.dtype}")
        return int(self.run(_launch_apply, _apply_task(), threads, x, levels, top, lr, decay))

    def count(self, addresses: np.ndarray, whole: int, planes: np.ndarray, threads: int) -> None:
        """:func:`count_planes` of the words ``0 … whole−1`` into ``planes`` (B, words) on ``threads`` threads."""
        work = self._scratch(threads, addresses.size.bit_length())
        self.run(_launch_count, _count_task(), threads, addresses, whole, planes, work)

    def _scratch(self, threads: int, num_planes: int) -> np.ndarray:
        """``threads`` stacked :func:`scratch` arrays, allocated once per calling thread and reused."""
        cache = self._local.__dict__.setdefault("scratch", {})
        key = (threads, max(num_planes, 3))
        if key not in cache:
            cache[key] = np.stack([scratch(num_planes) for _ in range(threads)])
        return cache[key]
