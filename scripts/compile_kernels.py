"""Compile every Triton kernel of ``flower_dlion.accel.triton_kernels`` for NVIDIA GPUs, on a machine without one.

The tests run the kernels in Triton's interpreter when there is no GPU, which checks their
arithmetic but not that Triton and ``ptxas`` accept them: the interpreter runs Python, the
compiler types every value and lowers every operation. This script goes through the real
compiler. It calls each launcher of :mod:`flower_dlion.accel.triton_kernels` with CPU tensors, as the
codec calls it on a GPU, and where the launcher would launch a kernel it only compiles it,
with Triton's own argument binding and specialization (``JITFunction.warmup``), for a target
GPU named here instead of the one a driver would report: Triton IR → LLVM → PTX → cubin
with the ``ptxas`` that ships with Triton. Nothing runs on a GPU and no CUDA driver is needed.

For each kernel and architecture it prints the registers per thread, the spilled bytes and
the shared memory that ``ptxas`` reports and whether floating-point fusion was on (the
launchers turn it off, so a kernel's bits do not change with Triton's default), and exits
with status 1 if any compile fails.
With ``--sass DIR`` it also writes each variant's machine code (SASS, addresses and
encodings left out), so that ``diff -r`` of two such folders shows whether a change to a
kernel's source changed the code a GPU would run.

Usage::

    python scripts/compile_kernels.py [--arch 80 90 100] [--sass DIR]

Run it with ``TRITON_INTERPRET`` unset (the interpreter never compiles).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Compiled:
    """One kernel variant compiled for one architecture (``error`` set and nothing else if it did not compile)."""

    arch: int
    kernel: str
    variant: str
    seconds: float
    error: str | None = None  # what Triton or ptxas said, for a kernel that did not compile
    registers: int | None = None  # per thread, from ptxas -v
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared_bytes: int = 0
    fp_fusion: bool | None = None  # whether the compiler was let fuse a multiply and an add into an FMA
    cubin: bytes = field(default=b"", repr=False)


class _Target:
    """A stand-in for Triton's active driver that names the GPU to compile for; it launches nothing."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class _CompileOnly:
    """Replaces a ``@triton.jit`` kernel in the module: ``kernel[grid](*args)`` compiles it and records how."""

    def __init__(self, jit: Any, arch: int, out: list[Compiled], variant: Callable[..., str]) -> None:
        self.jit, self.arch, self.out, self.variant = jit, arch, out, variant

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def compile_(*args: Any, **kwargs: Any) -> None:
            name, variant = self.jit.fn.__name__, self.variant(*args, **kwargs)
            log = io.StringIO()
            start = time.perf_counter()
            try:
                with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v's report
                    kernel = self.jit.warmup(*args, grid=grid, **kwargs)
            except Exception as exc:  # recorded; the launcher goes on to its next kernel
                self.out.append(Compiled(self.arch, name, variant, time.perf_counter() - start, error=_reasons(exc)))
                return
            seconds = time.perf_counter() - start
            regs, spill = _PTXAS.search(log.getvalue()), _SPILL.search(log.getvalue())
            self.out.append(
                Compiled(
                    self.arch,
                    name,
                    variant,
                    seconds,
                    registers=int(regs.group(1)) if regs else None,
                    spill_stores=int(spill.group(1)) if spill else None,
                    spill_loads=int(spill.group(2)) if spill else None,
                    shared_bytes=int(kernel.metadata.shared),
                    fp_fusion=bool(kernel.metadata.enable_fp_fusion),
                    cubin=kernel.asm["cubin"],
                )
            )

        return compile_


def _reasons(exc: BaseException | None) -> str:
    """The error and its causes: for a helper function Triton names the call first, then what failed inside."""
    parts = []
    while exc is not None:
        parts.append(f"{exc}")
        exc = exc.__cause__
    return "\n\n".join(parts)


@contextlib.contextmanager
def _compiling_for(arch: int, out: list[Compiled]) -> Iterator[Any]:
    """Point Triton at ``arch`` and make every kernel launch of ``triton_kernels`` a compile only."""
    from triton.runtime import driver

    from flower_dlion.accel import triton_kernels as gk

    names = ("_pack_positive", "_lion_pack", "_apply_levels", "_count_votes", "_count_sliced")
    variants: dict[str, Callable[..., str]] = {  # how each compiled variant is named in the table
        "_pack_positive": lambda *a, BYTES, **kw: f"BYTES={BYTES}",
        "_lion_pack": lambda *a, BYTES, **kw: f"BYTES={BYTES}",
        "_apply_levels": lambda x, k, *a, BLOCK, **kw: f"BLOCK={BLOCK}, {str(k.dtype).removeprefix('torch.')} levels",
        "_count_votes": lambda *a, COUNTS, PLANES, **kw: f"{'counts' if COUNTS else 'planes'} PLANES={PLANES}",
        "_count_sliced": lambda *a, PLANES, **kw: f"PLANES={PLANES}",
    }
    saved = {name: getattr(gk, name) for name in names}
    previous = driver._active  # None until a real driver was asked for (and none exists without a GPU)
    driver.set_active(_Target(arch))
    try:
        for name in names:
            saved[name].device_caches.clear()  # Triton keeps its target and kernels per device number: forget them
            setattr(gk, name, _CompileOnly(saved[name], arch, out, variants[name]))
        yield gk
    finally:
        for name, jit in saved.items():
            jit.device_caches.clear()
            setattr(gk, name, jit)
        driver.set_active(previous)


def compile_all(arch: int) -> list[Compiled]:
    """Compile, for ``sm_<arch>``, every kernel variant the codec launches.

    The variants: the pack and the fused Lion step; the apply with uint8 and with int32
    levels; the bit-sliced count planes (the vote's and the mean's) with 1, 2, 6 and 12 bit
    planes (n = 1, 2, 63 and 4,095 payloads); the per-value count for the int32 counts and
    for the planes of more than 4,095 payloads.

    Parameters
    ----------
    arch : int
        The compute capability as an integer: 80 (A100), 90 (H100, H200), 100 (B200), ...

    Returns
    -------
    list of Compiled
        One entry per variant, in the order compiled; ``error`` holds what Triton or
        ``ptxas`` said about a variant that did not compile.

    """
    out: list[Compiled] = []
    d = 10_000  # small CPU tensors: the arguments' types and alignment are what matter
    nbytes = (d + 7) // 8
    with _compiling_for(arch, out) as gk:
        v = torch.randn(d)
        gk.pack_positive(v)
        gk.lion_pack(torch.randn(d), v, (0.9, 0.1, 0.99, 0.01))
        for dtype in (torch.uint8, torch.int32):
            gk.apply_levels(torch.randn(d), torch.ones(d, dtype=dtype), torch.zeros(3), 0.999)
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        for n in (1, 2, 63, 4095):
            payloads = [payload] * n
            gk.count_planes(payloads, d)
        gk.count_ones([payload] * 3, d)
        gk.count_planes([payload] * 4096, d)
    return out


def main(argv: list[str] | None = None) -> int:
    """Compile for each ``--arch`` and print one table row per kernel variant; 1 if any compile failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    parser.add_argument("--sass", type=Path, help="write each variant's SASS under this folder, one file each")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    import triton

    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="flower-dlion-triton-"))  # a real compile
    print(f"# Triton kernels compiled without a GPU: triton {triton.__version__}, torch {torch.__version__}, "
          f"{platform.machine()}")  # fmt: skip
    print()
    print("| arch | kernel | variant | registers | spill stores / loads | shared | cubin | fp fusion | compile |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [r for arch in args.arch for r in _print_rows(compile_all(arch))]
    if args.sass is not None:
        _write_sass(rows, args.sass)
    failed = [r for r in rows if r.error is not None]
    for r in failed:
        print(f"\n## sm_{r.arch} {r.kernel} ({r.variant}) did not compile\n\n{r.error}")
    return 1 if failed else 0


def _write_sass(rows: list[Compiled], folder: Path) -> None:
    """``folder/sm_<arch>/<kernel> <variant>.sass``: the instructions alone, comparable across builds."""
    from triton import knobs

    instruction = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;")  # "/*0040*/  IMAD.MOV.U32 R1, ... ;"
    for r in rows:
        if r.error is not None:
            continue
        (folder / f"sm_{r.arch}").mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(r.cubin)
            f.flush()
            sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
        lines = [" ".join(m.group(1).split()) for m in map(instruction.match, sass.splitlines()) if m]
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{r.kernel} {r.variant}")
        (folder / f"sm_{r.arch}" / f"{name}.sass").write_text("\n".join(lines) + "\n")


def _print_rows(rows: list[Compiled]) -> list[Compiled]:
    for r in rows:
        if r.error is not None:
            print(f"| sm_{r.arch} | {r.kernel} | {r.variant} | **failed** (below) | | | | | |")
            continue
        print(
            f"| sm_{r.arch} | {r.kernel} | {r.variant} | {r.registers} | {r.spill_stores} B / {r.spill_loads} B "
            f"| {r.shared_bytes:,} B | {len(r.cubin):,} B | {'on' if r.fp_fusion else 'off'} | {r.seconds:.1f} s |"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
