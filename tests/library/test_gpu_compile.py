"""The Triton kernels go through Triton's real compiler and ``ptxas`` for NVIDIA targets, with no GPU.

Without a GPU the kernels' arithmetic is tested in Triton's interpreter (``tests/library/test_codec.py``),
which runs them as Python and so accepts kernels the compiler rejects. Here
``scripts/compile_kernels.py`` compiles every variant the codec launches down to a cubin for
sm_80 (A100) and sm_90 (H100, H200), in a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_kernels.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

VARIANTS = [  # every kernel variant the codec launches, in the order scripts/compile_kernels.py compiles them
    ("_pack_positive", "BYTES=1024"),
    ("_lion_pack", "BYTES=512"),
    ("_apply_levels", "BLOCK=4096, uint8 levels"),
    ("_apply_levels", "BLOCK=4096, int32 levels"),
    *[("_count_sliced", f"PLANES={planes}") for planes in (1, 2, 6, 12)],
    ("_count_votes", "counts PLANES=2"),
    ("_count_votes", "planes PLANES=13"),
]


def _compile(tmp_path: Path, *archs: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it for this process
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # nothing cached: every variant really compiles
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", *archs], env=env, capture_output=True, text=True, timeout=600
    )


def _rows(stdout: str) -> list[list[str]]:
    return [line.strip("| ").split(" | ") for line in stdout.splitlines() if line.startswith("| sm_")]


def test_every_kernel_variant_compiles_to_a_cubin_for_ampere_and_hopper(tmp_path: Path) -> None:
    # Prepare: a fresh Triton cache (above), no GPU, no interpreter

    # Execute
    proc = _compile(tmp_path, "80", "90")

    # Assert: every variant for both targets, in order, each with a cubin and a ptxas report, and
    # compiled with fp fusion off (Triton's default is on up to 3.9: a launch without the option shows "on")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert [(r[0], r[1], r[2]) for r in rows] == [(f"sm_{a}", k, v) for a in (80, 90) for k, v in VARIANTS]
    for r in rows:
        registers, cubin = int(r[3]), int(r[6].removesuffix(" B").replace(",", ""))
        assert 0 < registers <= 255 and cubin > 1000, r
        assert r[7] == "off", r


def test_a_kernel_that_only_the_interpreter_accepts_fails_the_compile(tmp_path: Path) -> None:
    # Prepare: triton_kernels with one cast dropped. Then the coin flips are uint32 and ``packed`` changes
    # type inside an ``if``: the interpreter runs it (and gives the same bytes), the compiler refuses.
    package = tmp_path / "flower_dlion"
    (package / "accel").mkdir(parents=True)
    shutil.copy(ROOT / "flower_dlion" / "__init__.py", package)
    shutil.copy(ROOT / "flower_dlion" / "accel" / "__init__.py", package / "accel")
    source = (ROOT / "flower_dlion" / "accel" / "triton_kernels.py").read_text()
    right = "coins = (tl.randint(seed, counter + byte) & 255).to(tl.int32)"
    assert source.count(right) == 1  # in _store_signs, the pack's and the fused step's epilogue
    bad = source.replace(right, "coins = tl.randint(seed, counter + byte) & 255")
    (package / "accel" / "triton_kernels.py").write_text(bad)

    # Execute
    proc = _compile(tmp_path, "90", pythonpath=tmp_path)

    # Assert: exit 1, both kernels that use the epilogue named as failed with the compiler's reason,
    # every other variant compiled
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert [r[1] for r in rows if r[3] == "**failed** (below)"] == ["_pack_positive", "_lion_pack"]
    assert [(r[1], r[2]) for r in rows] == VARIANTS
    assert "## sm_90 _pack_positive (BYTES=1024) did not compile" in proc.stdout
    assert "## sm_90 _lion_pack (BYTES=512) did not compile" in proc.stdout
    assert proc.stdout.count("redefines it as uint32") == 2
