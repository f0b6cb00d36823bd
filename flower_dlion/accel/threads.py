"""Splitting a pass over torch's CPU threads: the codec's thread pool, or torch's own OpenMP team.

:func:`on_threads` runs ``work(first, last)`` on contiguous parts of a range, one per torch CPU
thread, on a pool of the codec's own (the numpy reference's loops and the numba kernels release
the GIL). :func:`team` hands out the OpenMP team torch itself runs on
(:class:`flower_dlion.accel.numba_team.Team`) once a process calls a kernel repeatedly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

import torch

__all__ = ["on_threads", "team"]

_T = TypeVar("_T")
_POOLS: dict[int, ThreadPoolExecutor] = {}  # worker count → pool

TEAM_AFTER = 3  # calls of a kernel in this process before it moves onto torch's OpenMP team
TEAM_GRAIN = 1 << 18  # values per thread at least on the team (its threads are awake after torch's operations)
TEAM_COUNT_GRAIN = 1 << 20  # bytes read and written per thread at least on the team (vote counts)
_TEAM_CALLS: dict[str, int] = {}  # kernel → calls so far
_TEAM: list[object] = []  # [numba_team.Team or None], made once


def on_threads(work: Callable[[int, int], _T], total: int, grain: int) -> list[_T]:
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


def team(name: str, values: int, grain: int | None = None) -> tuple[Any, int] | None:
    """The OpenMP team torch runs on (:class:`~.numba_team.Team`) and a thread count for ``values``, or None.

    None (use :func:`on_threads`) until the kernel ``name`` has been called ``TEAM_AFTER``
    times in this process — the team's tasks take 0.2 s to load once, more than a
    Deployment Engine ClientApp, one process per message, would ever save — where torch's
    parallel backend is not OpenMP, and where one thread does it (less than ``grain`` of
    ``values`` per thread; default ``TEAM_GRAIN``).
    """
    calls = _TEAM_CALLS[name] = _TEAM_CALLS.get(name, 0) + 1
    threads = min(torch.get_num_threads(), values // (grain or TEAM_GRAIN))
    if calls <= TEAM_AFTER or threads < 2:
        return None
    if not _TEAM:
        openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
        try:
            from .numba_team import Team

            _TEAM.append(Team() if openmp else None)
        except (AttributeError, OSError, TypeError):  # no GOMP_parallel loaded (or no dlopen(NULL): Windows)
            _TEAM.append(None)
    return None if _TEAM[0] is None else (_TEAM[0], threads)
