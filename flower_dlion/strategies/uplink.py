"""The uplink of Distributed Lion: an object that aggregates the checked uploads into Δ, applies it and reports.

:class:`Uplink` is given the strategy's options, its :class:`~.server_state.ServerState` and its
:class:`~.global_model.GlobalModel` (``DistributedLion.up``). The replies reach it checked
(:class:`~.reply_check.CheckedRound`, :mod:`.reply_check`); ``DistributedLion.aggregate_train``
calls it in this order:

1. ``apply``: Δ of the valid uploads as levels with their broadcast bytes, by the one function
   ``aggregate_replies`` that :func:`flower_dlion.strategies.server_delta.choose_aggregator` picked
   for the options (the math: ``lion.aggregate``; for packed 1-bit signs its twin
   ``codec.aggregate_packed``; nothing here computes Δ); then x ← x − lr·(Δ + wd·x) (anchored:
   C ← C + Δ, x = γ·xₐ − η·C), and the round's momenta and buffers combined by medians. It returns
   the encoded Δ, which the strategy hands to its downlink to keep for clients that fall behind.
2. ``round_metrics``: the round's row of ``results.jsonl``, with the round's :class:`RoundCounts`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from logging import WARNING

import torch
from flwr.supercore import log

from .. import codec, quantizers
from ..bounds import mean_buffers, median_momentum, robust_buffers
from ..coin_flips import CAUSES, WARN_ABOVE
from ..uploads import Shape, upload_kind
from .global_model import GlobalModel
from .options import Options
from .reply_check import CheckedRound
from .server_delta import Aggregator, choose_aggregator, counts_delta
from .server_state import Broadcast, Round, RoundCounts, ServerState, Unmasked, ValidReply

__all__ = ["Applied", "RoundCounts", "Uplink"]


@dataclass(frozen=True)
class Applied:
    """What applying a round's Δ gave: its share of ties, its agreement, and the Δ for the chain downlink.

    Attributes
    ----------
    tie_fraction : float
        The share of coordinates whose S was 0.
    agreement : float
        Mean |S| / (n·scale); NaN for ef-sign (``Uplink.round_metrics`` then counts the signs).
    broadcast : Broadcast | None
        The encoded Δ for clients that fall behind on the chain downlink; None when anchored.

    """

    tie_fraction: float
    agreement: float
    broadcast: Broadcast | None


class Uplink:
    """The uplink of :class:`~flower_dlion.strategies.dlion.DistributedLion` (``strategy.up``).

    Turns the round's valid replies into Δ, applies Δ to x, and reports the round.

    Parameters
    ----------
    options : Options
        The strategy's options (read-only); ``uplink.aggregation`` is ``options.uplink.aggregation``.
    state : ServerState
        The server's state, shared with the downlink (x's version, the anchored history, the
        replicas' versions, the error feedback and momentum of the broadcast).
    model : GlobalModel
        The strategy's model: x and the buffers (updated in place), its layout and sizes.

    """

    def __init__(self, options: Options, state: ServerState, model: GlobalModel) -> None:
        self.options = options
        self.state = state
        self.model = model
        self.kind = upload_kind(options.uplink.upload)
        self.told_flips = False  # the coin-flip warning was logged

    @property
    def lion_steps(self) -> int:
        """K for local Lion steps, 1 for the sgd client: Δ's scale and decay."""
        return self.options.local.lion_steps

    @property
    def shape(self) -> Shape:
        """The model's size and K, as the upload kinds take them."""
        return self.model.shape(self.options.uplink.scale_block, self.lion_steps)

    # ------------------------------------------------------------------ 2. aggregate
    @cached_property
    def aggregate_replies(self) -> Aggregator:
        """The one function that turns a round's uploads into Δ, chosen once from the (read-only) options.

        :func:`flower_dlion.strategies.server_delta.choose_aggregator`: the packed twin of ``lion.aggregate``
        for the 1-bit sign upload with an exact broadcast (the default), the definition on
        ``Upload.total``'s S for the other exact ones, error-feedback quantization otherwise.
        """
        up = self.options.uplink
        return choose_aggregator(self.kind, up.aggregation, up.broadcast_bits, up.server_momentum)

    # ------------------------------------------------------------------ 1. apply
    def apply(
        self, valid: list[ValidReply], rnd: Round, counts: RoundCounts, unmasked: Unmasked | None = None
    ) -> Applied:
        """Aggregate the valid replies into Δ and apply it to x; count the clipped scales in ``counts``.

        ``unmasked``: secure aggregation's counts of the replies' signs (bit planes), which then
        give Δ (:func:`~flower_dlion.strategies.server_delta.counts_delta`) instead of the uploads, and in a
        buffer round the mean of their buffers' moments (:func:`~flower_dlion.bounds.mean_buffers`).

        Also combines the round's momenta and buffers. Returns the share of tied coordinates, the
        agreement (mean |S| / (n·scale); NaN for ef-sign) and, for the chain downlink, the encoded
        Δ that the strategy hands to the downlink to keep for lagging clients (None when anchored).
        """
        assert self.model.x is not None
        d, n = self.model.num_parameters, len(valid)
        if unmasked is not None:
            update = counts_delta(unmasked.planes, n, self.shape, how=self.options.uplink.aggregation)
        else:
            update = self.aggregate_replies([r.upload for r in valid], self.shape, self.state)
        counts.clipped, scales = update.clipped, update.scales
        self.state.drift_limits = update.limits  # sent in the next round's config (drift correction)
        broadcast = None
        history = self.state.anchored
        if history is not None:  # x = γ·xₐ − η·C (Δ = K·L, the K in η), written into x
            history.apply_levels(update.levels, update.num_levels, update.encoded, out=self.model.x)
            self.state.version += 1
        else:
            weight_decay = self.options.step.weight_decay * self.lion_steps  # K local Lion steps' worth of decay
            s = None if scales is None else torch.tensor(scales)
            sizes = self.model.scale_sizes(self.options.uplink.scale_block)
            quantizers.apply_delta_(self.model.x, update.levels, update.num_levels, s, sizes, rnd.lr, weight_decay)
            self.state.version += 1
            broadcast = Broadcast(self.state.version, update.num_levels, rnd.lr, weight_decay, update.encoded, scales)
        agreement = update.sum_abs / (d * n * self.kind.agreement_scale(self.lion_steps))
        if rnd.momentum_sync:
            self.state.synced_momentum = median_momentum([r.momentum for r in valid if r.momentum is not None])
        if rnd.buffer_sync and unmasked is not None and unmasked.buffers is not None:
            assert self.model.spec is not None
            self.model.rest.update(mean_buffers(self.model.spec, unmasked.buffers))
        elif rnd.buffer_sync:
            self._combine_buffers(valid)
        return Applied(update.ties / d, agreement, broadcast)

    def _combine_buffers(self, replies: list[ValidReply]) -> None:
        """The server's buffers ← the median of the replies' (``bounds.robust_buffers``)."""
        assert self.model.spec is not None
        buffers = [r.buffers.numpy() for r in replies if r.buffers is not None]
        self.model.rest.update(robust_buffers(self.model.spec, buffers))

    # ------------------------------------------------------------------ 2. report
    def round_metrics(
        self,
        rnd: Round,
        checked: CheckedRound,
        valid: list[ValidReply],
        outcome: Applied | None,
        counts: RoundCounts,
        queries: Mapping[str, int] | None = None,
    ) -> dict[str, int | float]:
        """The round's row: replies, faults, bytes as measured and as fp32 would have been, coin flips.

        ``valid``: the replies that made Δ (secure aggregation: none when the sum could not be
        unmasked); ``queries``: secure aggregation's own traffic (:meth:`.SecureRounds.round_bytes`),
        added to the bytes and kept under its keys. Each key, its range in an honest run and when it
        signals a problem: docs/USER_GUIDE.md, "The round's metrics". ``agreement`` is mean |S| / (n·K)
        for signs and sums; for ef-sign, whose S sums scaled signs (``apply`` gives NaN), the same of
        the uploaded signs, mean |Σᵢ ±1| / n.
        """
        d, n = self.model.num_parameters, len(valid)
        bytes_up = checked.bytes_up
        flip_fraction = self._coin_flip_fraction(valid, rnd.server_round)
        losses = [r.values["train-loss"] for r in valid]
        examples = [r.values["num-examples"] for r in valid]
        total = sum(examples)
        applied = outcome is not None
        tie_fraction, agreement = (outcome.tie_fraction, outcome.agreement) if outcome is not None else (0.0, 0.0)
        fp32_extra = sum(4 * d - len(r.upload.data) for r in valid)  # each valid reply's U as float32 instead
        if applied and math.isnan(agreement):  # ef-sign: S sums scaled signs; the agreement of the signs instead
            ones = codec.count_ones([r.upload.data for r in valid], d)  # votes for +1; Σ signs = 2·ones − n
            agreement = int(ones.mul_(2).sub_(n).abs_().sum(dtype=torch.int64)) / (d * n)
        metrics: dict[str, int | float] = {
            "num-replies": n,
            "num-rejected": checked.replies.rejected,
            "num-failed": len(set(rnd.sent) - checked.replies.answered),
            "num-sampled": len(rnd.sent),
            "full-syncs": sum(1 for kind in rnd.sent.values() if kind == "full"),
            "catch-ups": sum(1 for b in rnd.chain_lengths.values() if b > 1),
            "checksum-mismatches": counts.resyncs,
            "state-resets": counts.state_resets,
            "applied": int(applied),
            "version": self.state.version,
            "train-loss": sum(v * e for v, e in zip(losses, examples, strict=True)) / total if total else math.nan,
            "num-examples": int(total),
            "bytes-up": int(bytes_up),
            "bytes-down": int(rnd.bytes_down),
            "bytes-up-fp32": int(bytes_up + fp32_extra),
            "bytes-down-fp32": int(rnd.bytes_down_fp32),
            "tie-fraction": tie_fraction,
            "agreement": agreement,
            "coin-flip-fraction": flip_fraction,
            "clipped-scales": counts.clipped,
            "state-write-failures": len(counts.write_failures),
            "client-errors": len(checked.errors),
        }
        if queries is not None:  # secure aggregation's key and unmask queries are the round's traffic too
            metrics["bytes-up"] = int(metrics["bytes-up"]) + queries["secure-bytes-up"]
            metrics["bytes-down"] = int(metrics["bytes-down"]) + queries["secure-bytes-down"]
            metrics |= queries
        return metrics

    def _coin_flip_fraction(self, valid: list[ValidReply], server_round: int) -> float:
        """The share of the uploaded signs that were coin flips; warns once a run when it is large, naming the cause."""
        d, n = self.model.num_parameters, len(valid)
        flip_fraction = sum(r.values.get("coin-flips", 0) for r in valid) / (d * n) if n else 0.0
        if flip_fraction > WARN_ABOVE and not self.told_flips:
            self.told_flips = True
            explained = [r.values for r in valid if "coin-flips-cause" in r.values]
            where = ""
            if explained:  # the client with the most flips: its tensor and cause
                most = max(explained, key=lambda v: v.get("coin-flips", 0))
                name = self.model.layout[int(most["coin-flips-tensor"])][0]
                share, cause = most["coin-flips-share"], CAUSES[int(most["coin-flips-cause"])]
                where = f"; {100 * share:.0f} % of a client's are in '{name}': likely {cause}"
            log(
                WARNING,
                "round %d: %.1f %% of the uploaded signs were coin flips: exact zeros of β₁·m + (1−β₁)·g, which "
                "1 bit cannot carry; those coordinates move by ±lr at random (metric coin-flip-fraction; said "
                "once a run)%s",
                server_round,
                100 * flip_fraction,
                where,
            )
        return flip_fraction
