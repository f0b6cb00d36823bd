"""Bounded influence: how the server combines the floats clients choose, so none outweighs an honest client.

Imports torch and numpy only. A 1-bit vote bounds each client by construction (one ±1 per
coordinate). Three channels carry floats a client picks itself, and each is combined with a
rule whose breakdown point is one half: fewer than half of the clients, however large the
numbers they send, cannot move the result outside the range of the honest clients' values.
The **median** of n values is the middle one, or the mean of the two middle ones for even n;
the **lower median** is the ⌈n/2⌉-th smallest (torch's ``median``; of two values, the smaller).

* **Scales of the ef-sign upload** (:func:`clip_scales`): client i's scale for tensor j is cut
  to the lower median of the round's scales of that tensor,
  ``s'ᵢⱼ = min(sᵢⱼ, medianᵢ sᵢⱼ)``. A scaled sign then weighs at most what the median client's
  does, whatever scale it claims; honest scales of one tensor are close to each other, so honest
  rounds barely change (docs/RESULTS.md, *Bounded influence*).
* **Synchronized momentum** (:func:`median_momentum`): the coordinate-wise median of the
  uploaded momenta, instead of their mean (the median, not the lower one: it has no bias
  toward smaller values when n is even).
* **Buffers** (:func:`robust_buffers`): the coordinate-wise median of the clients' values,
  and for BatchNorm's running variance the median of each client's variance plus its mean's
  squared distance to the median mean (the law of total variance, with medians):
  ``μ = medianᵢ μᵢ``, ``σ² = medianᵢ (σᵢ² + (μᵢ − μ)²)``.

The server's error feedback (``broadcast_bits``) only ever sees the clipped aggregate, and the
integer uploads (signs, sums of K signs) are bounded by their levels.

Under secure aggregation the server sees only sums, so the buffers are combined by their
**mean** (:func:`buffer_moments`, :func:`mean_buffers`; a bound on each value, not a median:
see docs/USER_GUIDE.md, "Secure aggregation"), BatchNorm's variance pooled the same way with means:
``μ = meanᵢ μᵢ``, ``σ² = meanᵢ σᵢ² + meanᵢ μᵢ² − μ²``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .params import Entry, ModelSpec

__all__ = [
    "buffer_moments",
    "clip_scales",
    "lower_median",
    "mean_buffers",
    "median",
    "median_momentum",
    "moment_count",
    "robust_buffers",
]


def lower_median(values: torch.Tensor) -> torch.Tensor:
    """The ⌈n/2⌉-th smallest of n rows, per column (``torch.median`` along dim 0)."""
    return values.median(dim=0).values


def median(values: torch.Tensor) -> torch.Tensor:
    """The median of n rows, per column: the middle row, or the mean of the two middle rows for even n."""
    return (lower_median(values) - lower_median(-values)) / 2  # −lower_median(−v): the upper median


def clip_scales(scales: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each client's per-tensor scales cut to the round's lower median of that tensor.

    Parameters
    ----------
    scales : torch.Tensor
        (n, J) float32: client i's scale of tensor j.

    Returns
    -------
    clipped : torch.Tensor
        (n, J): ``min(sᵢⱼ, medianᵢ sᵢⱼ)``.
    count : int
        How many scales were cut.

    """
    cap = lower_median(scales)
    clipped = torch.minimum(scales, cap)
    return clipped, int(torch.count_nonzero(clipped != scales))


def median_momentum(momenta: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of the clients' momenta (float32)."""
    return median(torch.stack(list(momenta)))


def robust_buffers(spec: ModelSpec, uploads: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The server's buffers from n clients' flat uploads (spec order), median by median.

    See the module docstring for the rule; integers are rounded to the nearest, booleans are
    the median of 0/1 (a majority).
    """
    stacked = torch.from_numpy(np.stack([np.asarray(u, dtype=np.float64) for u in uploads]))  # (n, values)
    per_client, offset = {}, 0
    for e in spec.buffers:
        per_client[e.name] = stacked[:, offset : offset + e.size]
        offset += e.size
    out: dict[str, np.ndarray] = {}
    for e in spec.buffers:
        values = per_client[e.name]
        means = per_client.get(e.name.removesuffix("running_var") + "running_mean")
        if e.name.endswith("running_var") and means is not None:
            values = values + (means - median(means)) ** 2  # within-client + between-client
        out[e.name] = _cast(median(values).numpy(), e).reshape(e.shape)
    return out


def _pairs(spec: ModelSpec) -> list[tuple[int, int, int]]:
    """(offset of running_var, offset of its running_mean, size) in the flat buffers, for each BatchNorm pair."""
    offsets, offset = {}, 0
    for e in spec.buffers:
        offsets[e.name] = (offset, e.size)
        offset += e.size
    return [
        (offsets[name][0], offsets[mean][0], offsets[name][1])
        for name in offsets
        if name.endswith("running_var") and (mean := name.removesuffix("running_var") + "running_mean") in offsets
    ]


def buffer_moments(spec: ModelSpec, flat: np.ndarray) -> np.ndarray:
    """A client's flat buffers followed by the squares of each BatchNorm running mean (float64).

    What a client sums under secure aggregation, so that the mean of these gives the pooled
    variance (:func:`mean_buffers`).
    """
    flat = np.asarray(flat, dtype=np.float64)
    return np.concatenate([flat, *(flat[mean : mean + size] ** 2 for _, mean, size in _pairs(spec))])


def moment_count(spec: ModelSpec) -> int:
    """The length of :func:`buffer_moments`: the buffers, and once more each BatchNorm running mean."""
    return spec.num_buffer_values + sum(size for _, _, size in _pairs(spec))


def mean_buffers(spec: ModelSpec, moments: np.ndarray) -> dict[str, np.ndarray]:
    """The server's buffers from the mean of the clients' :func:`buffer_moments`.

    ``σ² = mean σᵢ² + mean μᵢ² − μ²`` for BatchNorm's running variance (the law of total variance,
    at least 0), the mean for every other buffer; each cast to its dtype as :func:`robust_buffers` does.
    """
    flat = np.array(moments[: spec.num_buffer_values], dtype=np.float64)
    extra = spec.num_buffer_values
    for var, mean, size in _pairs(spec):
        squares = moments[extra : extra + size]
        flat[var : var + size] = np.maximum(flat[var : var + size] + squares - flat[mean : mean + size] ** 2, 0.0)
        extra += size
    out, offset = {}, 0
    for e in spec.buffers:
        out[e.name] = _cast(flat[offset : offset + e.size], e).reshape(e.shape)
        offset += e.size
    return out


def _cast(values: np.ndarray, e: Entry) -> np.ndarray:
    """float64 values in the buffer's own dtype (numpy has no bfloat16: float32 there)."""
    if e.dtype == "bool":
        return values >= 0.5
    if e.dtype.startswith(("int", "uint")):
        return np.rint(values).astype(e.dtype)
    return values.astype(np.float32 if e.dtype == "bfloat16" else e.dtype)
