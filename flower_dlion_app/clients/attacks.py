"""The Byzantine clients of the fault studies (run config ``byzantine-mode``), as :class:`UploadHook` objects.

Each attacks through the public client API's ``tamper`` hook (the library's extension point
:class:`~flower_dlion.clients.hooks.UploadHook`), as any node running the library could. With
U = Σₖ δₖ the node's honest upload (δ with one local step) and S = ``byzantine-scale``:

=========== ===========================================================================
mode        what the node sends
=========== ===========================================================================
``flip``     −U
``random``   K·(random signs)
``scale``    −U, with its ef-sign scales × S (a magnitude lie; ``upload = "ef-sign"``)
``momentum`` −U, and −S·sign(m) as its momentum in sync rounds (``momentum-sync-every``)
``little``   U with the signs flipped on the half of the coordinates where |U| is smallest
             (ties broken at random): honest magnitudes, inside every bound, aimed at the
             coordinates where honest clients are most split ("a little is enough")
=========== ===========================================================================
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array

from flower_dlion.clients.dlion import UploadHook
from flower_dlion.protocol import to_array
from flower_dlion_app.config import BYZANTINE_MODES

__all__ = ["Flip", "LittleIsEnough", "MomentumPoison", "RandomSigns", "ScaleLie", "attacker"]


class Flip(UploadHook):
    """Upload −U."""

    def upload(self, u: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """−U."""
        return -u


class RandomSigns(UploadHook):
    """Upload K·(random signs)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def upload(self, u: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """K·(±1 at random)."""
        return self.steps * (2.0 * torch.randint(0, 2, u.shape, generator=generator, device=u.device) - 1.0)


class ScaleLie(Flip):
    """Upload −U and claim scales S times the true ones."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def arrays(self, arrays: dict[str, Array]) -> dict[str, Array]:
        """Scales × S (float32: 10³⁰ fits, 10⁴⁰ would be inf and refused as malformed)."""
        if "scales" in arrays:
            arrays["scales"] = to_array((arrays["scales"].numpy() * np.float32(self.factor)).astype(np.float32))
        return arrays


class MomentumPoison(Flip):
    """Upload −U and, in a momentum-sync round, −S·sign(m) as the momentum."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def arrays(self, arrays: dict[str, Array]) -> dict[str, Array]:
        """Momentum ← −S·sign(m)."""
        if "momentum" in arrays:
            m = arrays["momentum"].numpy()
            arrays["momentum"] = to_array((-np.float32(self.factor) * np.sign(m)).astype(np.float32))
        return arrays


class LittleIsEnough(UploadHook):
    """Flip U's signs where |U| is smallest (half of the coordinates), keep the rest honest."""

    def upload(self, u: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """U with the signs of its least certain half flipped."""
        noise = torch.rand(u.shape, generator=generator, device=u.device)  # breaks the ties of |U|
        order = torch.argsort(u.abs() + 1e-3 * noise)
        out = u.clone()
        out[order[: u.numel() // 2]] *= -1
        return out


def attacker(mode: str, *, steps: int, factor: float) -> UploadHook:
    """The upload hook of a ``byzantine-mode``."""
    if mode == "flip":
        return Flip()
    if mode == "random":
        return RandomSigns(steps)
    if mode == "scale":
        return ScaleLie(factor)
    if mode == "momentum":
        return MomentumPoison(factor)
    if mode == "little":
        return LittleIsEnough()
    raise ValueError(f"byzantine-mode must be one of {BYZANTINE_MODES}, got {mode!r}")
