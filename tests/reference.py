"""Reference formulas the tests compare the library against: test helpers, not the library's API."""

from __future__ import annotations

import numpy as np
import torch

from flower_dlion.secure.masking import add_planes_
from flower_dlion.stochastic import NOISE_KINDS

__all__ = ["expected_sign", "subtract_planes_"]


def expected_sign(v: torch.Tensor, sigma: float, kind: str) -> torch.Tensor:
    """``E[sign(v + σξ)]`` for the noise ``kind`` (the formulas of :mod:`flower_dlion.stochastic`).

    Parameters
    ----------
    v : torch.Tensor
        The values before the noise.
    sigma : float
        The noise's scale σ.
    kind : str
        ``"uniform"`` (ξ ~ U[−1, 1]) or ``"gaussian"`` (ξ ~ N(0, 1)).

    Returns
    -------
    torch.Tensor
        ``clamp(v/σ, −1, 1)`` (uniform) or ``erf(v / (σ√2))`` (gaussian).

    Raises
    ------
    ValueError
        ``kind`` is none of :data:`flower_dlion.stochastic.NOISE_KINDS`.

    """
    if kind == "uniform":
        return (v / sigma).clamp(-1.0, 1.0)
    if kind == "gaussian":
        return torch.erf(v / (sigma * 2.0**0.5))
    raise ValueError(f"noise kind must be one of {NOISE_KINDS}, got {kind!r}")


def subtract_planes_(acc: np.ndarray, planes: np.ndarray) -> None:
    """``acc ← acc − planes`` mod 2ᵇ on bit planes (:func:`flower_dlion.secure.masking.add_planes_`, ``subtract=True``).

    Parameters
    ----------
    acc : numpy.ndarray
        (b, words) uint64 planes, changed in place.
    planes : numpy.ndarray
        (b, ⌈d/8⌉) uint8 or (b, words) uint64 planes.

    """
    add_planes_(acc, planes, subtract=True)
