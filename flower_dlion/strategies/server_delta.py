"""The server's Δ of one round from its valid replies' uploads: the one home of the aggregation.

The math is :func:`flower_dlion.lion.aggregate` (and :func:`~flower_dlion.lion.weighted_vote` for
scaled signs); this module only decides, once per strategy, how a round's uploads U₁ … Uₙ
(:mod:`flower_dlion.uploads`) reach it, as :func:`flower_dlion.accel.choose` picks a kernel:
:func:`choose_aggregator` returns the function the strategy then calls every round.

=============================  ==========================================  =======================================
upload, broadcast              Δ's levels (S = Σᵢ Uᵢ)                      computed by
=============================  ==========================================  =======================================
sign, exact (the default)      ``lion.aggregate(S, n, how, k=1)``          :func:`packed_delta`: the accelerated twin
                                                                           :func:`flower_dlion.codec.aggregate_packed`
                                                                           from the packed bits (S never formed)
sign, exact, secure            ``lion.aggregate(S, n, how, k=1)``          :func:`counts_delta`: the same twin from the
                                                                           unmasked count planes (no upload seen)
sum, exact                     ``lion.aggregate(S, n, how, k=K)``          :func:`reference_delta`: S from
                                                                           ``Upload.total``, then the definition
ef-sign, exact (vote only)     ``lion.weighted_vote(S)``, S = Σᵢ ±sᵢ        :func:`reference_delta`
any, ``broadcast_bits`` b ≥ 1  ``ef_quantize_(target)`` into 2 (b = 1) or  :func:`quantized_delta`
                               2ᵇ − 1 levels, per-tensor scales
=============================  ==========================================  =======================================

An exact Δ is in units of K local steps: its per-tensor scales are K (``None`` for K = 1). The
quantized target, in local steps, is ``K·sign(S)`` (vote), ``K·S/n`` (mean of signs, each standing
for K steps) or ``S/n`` (mean of sums or scaled signs), plus the server's Nesterov step
``M ← μ·M + target``, ``target + μ·M`` when ``server_momentum`` μ > 0; what the quantization loses
is carried to the next round in the server's error feedback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple, Protocol

import numpy as np
import torch

from .. import codec, lion, quantizers
from ..bounds import lower_median
from ..lion import Aggregation
from ..uploads import Parsed, Shape, SignUpload, Upload

__all__ = [
    "Aggregator",
    "FeedbackState",
    "RoundDelta",
    "aggregate_replies",
    "choose_aggregator",
    "counts_delta",
    "packed_delta",
    "quantized_delta",
    "reference_delta",
]


class RoundDelta(NamedTuple):
    """Δ of one round, as the strategy applies and broadcasts it, with what the round's metrics need."""

    levels: torch.Tensor  # Δ's levels: Δ = scale·(2·levels − (L−1)) / (L−1) per tensor
    num_levels: int  # L
    encoded: bytes  # the broadcast: codec.encode_levels(levels, num_levels)
    ties: int  # coordinates where S = 0
    sum_abs: int  # Σ|S| for an integer S; 0 for the float S of scaled signs
    scales: tuple[float, ...] | None  # one per scale block (``Shape.sizes``); None: 1
    clipped: int  # ef-sign scales cut to the round's median (``Upload.total``)
    limits: tuple[float, ...] | None = None  # quantized ef-sign means: the cut per block (drift correction's)


class FeedbackState(Protocol):
    """The server's state a quantized broadcast keeps between rounds (``ServerState`` has it)."""

    server_error: torch.Tensor | None  # error feedback of the quantized broadcast
    outer_momentum: torch.Tensor | None  # M of the server's Nesterov momentum on Δ


Aggregator = Callable[[Sequence[Parsed], Shape, FeedbackState], RoundDelta]


def choose_aggregator(
    kind: Upload, how: Aggregation, broadcast_bits: int = 0, server_momentum: float = 0.0
) -> Aggregator:
    """The function that turns a round's uploads into Δ, chosen once for a strategy's options.

    Parameters
    ----------
    kind
        The upload kind (:func:`flower_dlion.uploads.upload_kind`).
    how
        ``"vote"`` (Δ = sign(S)) or ``"mean"`` (Δ = S/(n·k)).
    broadcast_bits
        0: Δ exact (:func:`flower_dlion.lion.aggregate`); b ≥ 1: quantized with error feedback.
    server_momentum
        μ of the server's Nesterov momentum on Δ (quantized broadcasts only).

    Returns
    -------
    Aggregator
        ``f(uploads, shape, state) -> RoundDelta``; ``state`` is used (and updated) by a
        quantized broadcast only.

    """
    if broadcast_bits:
        return partial(quantized_delta, kind=kind, how=how, broadcast_bits=broadcast_bits, momentum=server_momentum)
    if isinstance(kind, SignUpload):  # the 1-bit upload: count the packed bits, never unpack
        return partial(packed_delta, how=how)  # the same Δ as reference_delta (tests/library/test_aggregation_home.py)
    return partial(reference_delta, kind=kind, how=how)


def aggregate_replies(
    uploads: Sequence[Parsed],
    shape: Shape,
    kind: Upload,
    how: Aggregation,
    broadcast_bits: int = 0,
    server_momentum: float = 0.0,
    state: FeedbackState | None = None,
) -> RoundDelta:
    """Δ of one round's uploads: :func:`choose_aggregator`, then the function it chose (a one-off call).

    ``state`` is needed for ``broadcast_bits`` ≥ 1 only (its error feedback is updated in place).
    """
    aggregator = choose_aggregator(kind, how, broadcast_bits, server_momentum)
    if state is None:
        if broadcast_bits:
            raise ValueError("a quantized broadcast (broadcast_bits >= 1) needs the server's state")
        state = _NoFeedback()
    return aggregator(uploads, shape, state)


class _NoFeedback:
    """An empty :class:`FeedbackState` for exact broadcasts, which keep none."""

    server_error: torch.Tensor | None = None
    outer_momentum: torch.Tensor | None = None


def _step_scales(shape: Shape) -> tuple[float, ...] | None:
    """Per-block scales of an exact Δ in local steps: K each (``None`` for K = 1)."""
    return (float(shape.steps),) * len(shape.sizes) if shape.steps > 1 else None


def packed_delta(uploads: Sequence[Parsed], shape: Shape, state: FeedbackState, *, how: Aggregation) -> RoundDelta:
    """Exact Δ of n packed sign uploads by the twin :func:`flower_dlion.codec.aggregate_packed`.

    The levels are ``lion.aggregate(S, n, how, k=1)`` of S = Σᵢ sign(Uᵢ) = 2·c − n (c: votes for +1),
    counted bit-sliced from the payloads; Δ = K·levels' values (scales K). ``state`` is not used.
    """
    agg = codec.aggregate_packed([u.data for u in uploads], shape.d, how)
    return RoundDelta(agg.levels, agg.num_levels, agg.encoded, agg.ties, agg.sum_abs, _step_scales(shape), 0)


def counts_delta(planes: np.ndarray, n: int, shape: Shape, *, how: Aggregation) -> RoundDelta:
    """Exact Δ of n sign uploads from their per-coordinate counts c of +1 (secure aggregation's sum).

    ``planes`` (b, ⌈d/8⌉) uint8: bit planes of c (:mod:`flower_dlion.secure.masking`); the planes
    above ⌈log₂(n+1)⌉ are zero and dropped. Then :func:`flower_dlion.codec.aggregate_counts`, which
    :func:`packed_delta` runs on the counts of the payloads: the same Δ, bit for bit.
    """
    counts = torch.from_numpy(np.ascontiguousarray(planes[: max(1, n.bit_length())]))
    agg = codec.aggregate_counts(counts, n, shape.d, how)
    return RoundDelta(agg.levels, agg.num_levels, agg.encoded, agg.ties, agg.sum_abs, _step_scales(shape), 0)


def reference_delta(
    uploads: Sequence[Parsed], shape: Shape, state: FeedbackState, *, kind: Upload, how: Aggregation
) -> RoundDelta:
    """Exact Δ from S = Σᵢ Uᵢ (``kind.total``) by the definition :func:`flower_dlion.lion.aggregate`.

    Integer S (sign, sum): ``lion.aggregate(S, n, how, k=kind.max_abs(K))``; the float S of scaled
    signs (ef-sign, vote only): ``lion.weighted_vote(S)``. Δ = K·levels' values (scales K).
    ``state`` is not used.
    """
    total, clipped = kind.total(list(uploads), shape)
    bound = kind.max_abs(shape.steps)
    if bound is None:
        if how != "vote":
            raise ValueError(f"a sum of scaled signs ({kind.name!r}) has exact levels for the vote only, got {how!r}")
        levels = lion.weighted_vote(total)
    else:
        levels = lion.aggregate(total, len(uploads), how, k=bound)
    return _finish(total, levels, _step_scales(shape), clipped)


def quantized_delta(
    uploads: Sequence[Parsed],
    shape: Shape,
    state: FeedbackState,
    *,
    kind: Upload,
    how: Aggregation,
    broadcast_bits: int,
    momentum: float,
) -> RoundDelta:
    """Δ quantized to ``broadcast_bits`` with error feedback (and the server's Nesterov momentum μ).

    From S = Σᵢ Uᵢ of n uploads, in local steps: target = ``K·sign(S)`` (vote), ``S·(K/n)`` (mean
    of signs) or ``S/n`` (mean of sums or scaled signs); with μ > 0, ``M ← μ·M + target`` and
    target ← ``target + μ·M``. Then ``levels, scales = ef_quantize_(target, e)`` into 2
    (``broadcast_bits`` = 1) or 2ᵇ − 1 levels with one scale per block, e ← target + e − sent.
    ``state.outer_momentum`` (M) and ``state.server_error`` (e) start at 0 and are updated in place.

    In the 1-bit SGD mode (``local_optimizer="sgd"``, ef-sign uploads averaged) the target is
    Δ̄ₜ, the decoded mean of the clients' model changes, and μ is FedAvgM's server momentum (Hsu et
    al., 2019) in Nesterov's form: M is heavy ball's v (v ← μ·v + Δ̄ₜ), and the steps sent satisfy
    Σₜ Δ̂ₜ + eₜ = Σₜ vₜ + μ·vₜ, i.e. x is heavy ball's x minus the look-ahead lr·μ·v
    (tests/library/test_drift.py). No byte is added: M stays on the server; μ = 0 is bit for bit
    the run without it.
    """
    total, clipped = kind.total(list(uploads), shape)
    n, k = len(uploads), shape.steps
    if how == "vote":
        target = torch.sign(total).float() * k
    elif isinstance(kind, SignUpload):
        target = total.float() * (k / n)
    else:
        target = total.float() / n
    if momentum:  # Nesterov: M ← μ·M + Δ, step Δ + μ·M
        if state.outer_momentum is None:
            state.outer_momentum = torch.zeros_like(target)
        outer = state.outer_momentum.mul_(momentum).add_(target)
        target = target.add_(outer, alpha=momentum)
    if state.server_error is None:
        state.server_error = torch.zeros_like(target)
    num_levels = 2 if broadcast_bits == 1 else 2**broadcast_bits - 1
    levels, scales = quantizers.ef_quantize_(target, state.server_error, shape.sizes, num_levels)
    delta = _finish(total, lion.Levels(levels, num_levels), tuple(float(v) for v in scales), clipped)
    sent = [u.scales for u in uploads if u.scales is not None]  # ef-sign: where Upload.total cut them
    return delta._replace(limits=tuple(float(v) for v in lower_median(torch.stack(sent)))) if sent else delta


def _finish(total: torch.Tensor, levels: lion.Levels, scales: tuple[float, ...] | None, clipped: int) -> RoundDelta:
    """The RoundDelta of levels made from S: its broadcast bytes, ties #{S = 0} and Σ|S| (S is spent)."""
    ties = int(torch.count_nonzero(total == 0))
    sum_abs = 0  # S is not needed after this: |S| in place, summed by numpy (4× torch's int sum)
    if not total.dtype.is_floating_point:
        sum_abs = int(total.abs_().numpy().sum(dtype=np.int64))
    encoded = codec.encode_levels(levels.levels, levels.num_levels).numpy().tobytes()
    return RoundDelta(levels.levels, levels.num_levels, encoded, ties, sum_abs, scales, clipped)
