"""What the server does with what it receives: check each reply, aggregate the uploads into Δ, apply it.

A round's second half, in the order ``DistributedLion.aggregate_train`` runs it:

1. ``_check_reply``: one reply's envelope, arrays (kinds, sizes, finite floats), metrics, and
   the replica's version and checksum; a bad reply raises ``RejectedReply`` (``_on_rejected``
   then decides whether its node needs the full model next time).
2. ``_aggregate_replies``: Δ of the valid uploads as levels with their broadcast bytes, by the one
   function :func:`flower_dlion.server_delta.choose_aggregator` picked for the options (the math:
   ``lion.aggregate``; for packed 1-bit signs its twin ``codec.aggregate_packed``). Nothing here
   computes Δ.
3. ``_apply``: x ← x − lr·(Δ + wd·x) (anchored: C ← C + Δ, x = γ·xₐ − η·C), keep Δ for clients
   that fall behind, combine the round's momenta and buffers by medians.
4. ``_round_metrics``: the round's row of ``results.jsonl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property
from logging import WARNING

import torch
from flwr.app import Array, ArrayRecord, Message
from flwr.supercore import log

from .. import codec, quantizers
from ..bounds import median_momentum, robust_buffers
from ..downlink import levels_to_signs
from ..protocol import (
    CLIENT_STATE_ERROR,
    METRICS,
    OPTIONAL_REPLY_METRICS,
    REPLY_METRICS,
    SEED_MISMATCH,
    UPLOAD,
    RejectedReply,
    check_envelope,
    float_array,
    message_bytes,
    read_metrics,
)
from ..server_delta import Aggregator, choose_aggregator
from ..uploads import Shape, Upload
from .common import CheckedReplies, ServerModelStrategy
from .server_state import Broadcast, Round, ServerState, ValidReply

__all__ = ["COIN_FLIP_WARNING", "ReplyAggregation"]

COIN_FLIP_WARNING = 0.05  # warn once when more than this share of the uploaded signs are coin flips


class ReplyAggregation(ServerModelStrategy):
    """The uplink half of :class:`~flower_dlion.strategies.dlion.DistributedLion` (a mixin).

    Checks the round's replies, turns the valid ones into Δ, applies Δ to x, and reports the round.
    """

    # Set by DistributedLion: its options (read-only, from ``options``: its docstring says what each is), its state.
    state: ServerState
    aggregation: str
    upload: str
    broadcast_bits: int
    server_momentum: float
    weight_decay: float
    _round: Round | None
    _kind: Upload
    _lion_steps: int
    _mask: torch.Tensor | None
    _resyncs: int
    _clipped: int
    _told_flips: bool
    _told_seed: bool
    history: list[dict[str, int | float]]
    _state_resets: int
    _shape: Shape  # a property of DistributedLion
    _scale_sizes: list[int]  # a property of DistributedLion
    _remember: Callable[[Broadcast], None]  # DownlinkMessages keeps the Δs for the chain downlink

    # ------------------------------------------------------------------ 1. check
    def _expected_arrays(self, rnd: Round) -> dict[str, tuple[str, str, int]]:
        """Array name → (stype or "", dtype, bytes) that a valid reply holds this round."""
        out = self._kind.expected(self._shape)
        if rnd.momentum_sync:
            assert self._mask is not None
            out["momentum"] = ("numpy.ndarray", "float32", 4 * int(self._mask.sum()))
        if rnd.buffer_sync:
            assert self.spec is not None
            out["buffers"] = ("numpy.ndarray", "float32", 4 * self.spec.num_buffer_values)
        return out

    def _check_reply(self, msg: Message, rnd: Round) -> ValidReply:
        """Validate one reply; return it parsed, or raise RejectedReply."""
        node_id = msg.metadata.src_node_id
        check_envelope(msg, rnd.sent.keys(), rnd.server_round, (UPLOAD, METRICS))
        content = msg.content
        record = content[UPLOAD]
        expected = self._expected_arrays(rnd)
        if not isinstance(record, ArrayRecord) or set(record.keys()) != set(expected):
            got = sorted(record.keys()) if isinstance(record, ArrayRecord) else type(record).__name__
            raise RejectedReply(f"'{UPLOAD}' must be an ArrayRecord holding {sorted(expected)}, got {got}")
        floats = self._check_arrays(record, expected)
        d = self.num_parameters
        upload = self._kind.parse(record[self._kind.main].data, floats, self._shape)
        values = read_metrics(content, METRICS, REPLY_METRICS, optional=OPTIONAL_REPLY_METRICS)
        flips = values.get("coin-flips", 0)
        if not (isinstance(flips, int) and 0 <= flips <= d):
            raise RejectedReply(f"metric 'coin-flips' is {flips!r}, expected an integer in [0, {d}]")
        if values["version"] != rnd.base_version:
            raise RejectedReply(
                f"replica at version {values['version']}, expected {rnd.base_version}: full resync next round",
                resync=True,
            )
        if values["checksum"] != rnd.base_checksum:
            raise RejectedReply(
                f"replica checksum {values['checksum']} differs from the server's {rnd.base_checksum}: "
                "full resync next round",
                resync=True,
            )
        momentum, buffers = floats.get("momentum"), floats.get("buffers")
        return ValidReply(node_id, upload, momentum, buffers, values)

    def _check_arrays(self, record: ArrayRecord, expected: dict[str, tuple[str, str, int]]) -> dict[str, torch.Tensor]:
        """Check each array of a reply against ``expected``; return its float32 ones (scales, momenta, buffers)."""
        d = self.num_parameters
        floats = {}
        for name, (stype, dtype, nbytes) in expected.items():
            arr = record[name]
            if not isinstance(arr, Array):
                raise RejectedReply(f"{name!r} is a {type(arr).__name__}, expected an Array")
            if dtype == "float32":  # scales, momenta and buffers: exact shape and size, finite
                a = torch.from_numpy(float_array(arr, (nbytes // 4,), name).copy())
                if not bool(torch.isfinite(a).all()) or (name == "scales" and bool((a < 0).any())):
                    raise RejectedReply(
                        f"Array {name!r} has non-finite{' or negative' if name == 'scales' else ''} values"
                    )
                floats[name] = a
                continue
            if arr.stype != stype or arr.dtype != dtype:
                raise RejectedReply(
                    f"Array {name!r} has stype {arr.stype!r} dtype {arr.dtype!r}, expected {stype!r} {dtype!r}"
                )
            if tuple(arr.shape) != (d,):
                raise RejectedReply(f"Array {name!r} shape {tuple(arr.shape)}, expected {(d,)}")
            if len(arr.data) != nbytes:
                raise RejectedReply(f"Array {name!r} has {len(arr.data)} bytes, expected {nbytes} for d={d}")
        return floats

    def _on_rejected(self, msg: Message, node_id: int, pid: int, err: RejectedReply, again: bool) -> None:
        """A refused reply from a node of this round: what it says about the node's replica."""
        rnd = self._round
        assert rnd is not None
        if node_id not in rnd.sent or again:
            return  # a stray reply says nothing about the node's replica
        if err.resync or (msg.has_error() and CLIENT_STATE_ERROR in msg.error.reason):
            self.state.version_of.pop(pid, None)  # its replica is unknown: the full model next time
            self._resyncs += int(err.resync)
            if msg.has_error() and node_id in rnd.seeded and SEED_MISMATCH in msg.error.reason:
                self.state.seed_failed.add(pid)  # the full model from now on
                self._tell_seed_mismatch(node_id)

    def _tell_seed_mismatch(self, node_id: int) -> None:
        """Say once why a client's x₀ from ``init_seed`` differs from ``initial_arrays``, and the fix."""
        if self._told_seed:
            return
        self._told_seed = True
        seed = self.init_seed
        log(
            WARNING,
            f"node {node_id} built x₀ with torch.manual_seed({seed}) and got a different model than initial_arrays: "
            f"with init_seed={seed}, build initial_arrays the way the clients build their model, after the same "
            f"seed (torch.manual_seed({seed}); ArrayRecord(Net().state_dict())), or leave init_seed=None. Until then "
            "each such node's first reply is lost and it is sent the full float32 model instead of the seed",
        )

    # ------------------------------------------------------------------ 2. aggregate
    @cached_property
    def _aggregate_replies(self) -> Aggregator:
        """The one function that turns a round's uploads into Δ, chosen once from the (read-only) options.

        :func:`flower_dlion.server_delta.choose_aggregator`: the packed twin of ``lion.aggregate``
        for the 1-bit sign upload with an exact broadcast (the default), the definition on
        ``Upload.total``'s S for the other exact ones, error-feedback quantization otherwise.
        """
        return choose_aggregator(self._kind, self.aggregation, self.broadcast_bits, self.server_momentum)

    # ------------------------------------------------------------------ 3. apply
    def _apply(self, valid: list[ValidReply], rnd: Round) -> tuple[float, float]:
        """Aggregate the valid replies into Δ, apply it to x, keep it for lagging clients.

        Also combines the round's momenta and buffers. Returns the share of tied coordinates
        and the agreement (mean |S| / (n·scale); NaN for ef-sign).
        """
        assert self.x is not None
        d, n = self.num_parameters, len(valid)
        update = self._aggregate_replies([r.upload for r in valid], self._shape, self.state)
        self._clipped, scales = update.clipped, update.scales
        history = self.state.anchored
        if history is not None:  # x = γ·xₐ − η·C (Δ = K·L, the K in η)
            signs = levels_to_signs(update.levels, update.num_levels)
            self.x.copy_(history.apply(signs, update.num_levels, update.encoded))
            self.state.version += 1
        else:
            weight_decay = self.weight_decay * self._lion_steps  # K local Lion steps' worth of decay
            s = None if scales is None else torch.tensor(scales)
            sizes = self._scale_sizes
            quantizers.apply_delta_(self.x, update.levels, update.num_levels, s, sizes, rnd.lr, weight_decay)
            self.state.version += 1
            broadcast = Broadcast(self.state.version, update.num_levels, rnd.lr, weight_decay, update.encoded, scales)
            self._remember(broadcast)
        agreement = update.sum_abs / (d * n * self._kind.agreement_scale(self._lion_steps))
        if rnd.momentum_sync:
            self.state.synced_momentum = median_momentum([r.momentum for r in valid if r.momentum is not None])
        if rnd.buffer_sync:
            self._combine_buffers(valid)
        return update.ties / d, agreement

    def _combine_buffers(self, replies: list[ValidReply]) -> None:
        """The server's buffers ← the median of the replies' (``bounds.robust_buffers``)."""
        assert self.spec is not None
        self._rest.update(robust_buffers(self.spec, [r.buffers.numpy() for r in replies if r.buffers is not None]))

    # ------------------------------------------------------------------ 4. report
    def _round_metrics(
        self,
        rnd: Round,
        replies: list[Message],
        valid: list[ValidReply],
        checked: CheckedReplies[ValidReply],
        applied: bool,
        tie_fraction: float,
        agreement: float,
    ) -> dict[str, int | float]:
        """The round's row: replies, faults, bytes as measured and as fp32 would have been, coin flips.

        Each key, its range in an honest run and when it signals a problem: docs/GUIDE.md, "The
        round's metrics". ``agreement`` is mean |S| / (n·K) for signs and sums; for ef-sign, whose
        S sums scaled signs (``_apply`` gives NaN), the same of the uploaded signs, mean |Σᵢ ±1| / n.
        """
        d, n = self.num_parameters, len(valid)
        bytes_up = sum(message_bytes(msg) for msg in replies)
        flip_fraction = self._coin_flip_fraction(valid, rnd.server_round)
        losses = [r.values["train-loss"] for r in valid]
        examples = [r.values["num-examples"] for r in valid]
        total = sum(examples)
        clipped, self._clipped = self._clipped, 0
        fp32_extra = sum(4 * d - len(r.upload.data) for r in valid)  # each valid reply's U as float32 instead
        if applied and math.isnan(agreement):  # ef-sign: S sums scaled signs; the agreement of the signs instead
            ones = codec.count_ones([r.upload.data for r in valid], d)  # votes for +1; Σ signs = 2·ones − n
            agreement = int(ones.mul_(2).sub_(n).abs_().sum(dtype=torch.int64)) / (d * n)
        return {
            "num-replies": n,
            "num-rejected": checked.rejected,
            "num-failed": len(set(rnd.sent) - checked.answered),
            "num-sampled": len(rnd.sent),
            "full-syncs": sum(1 for kind in rnd.sent.values() if kind == "full"),
            "catch-ups": sum(1 for b in rnd.chain_lengths.values() if b > 1),
            "checksum-mismatches": self._resyncs,
            "state-resets": self._state_resets,
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
            "clipped-scales": clipped,
        }

    def _coin_flip_fraction(self, valid: list[ValidReply], server_round: int) -> float:
        """The share of the uploaded signs that were coin flips; warns once when it is large."""
        d, n = self.num_parameters, len(valid)
        flip_fraction = sum(r.values.get("coin-flips", 0) for r in valid) / (d * n) if n else 0.0
        if flip_fraction > COIN_FLIP_WARNING and not self._told_flips:
            self._told_flips = True
            log(
                WARNING,
                "round %d: %.1f %% of the uploaded signs were coin flips: exact zeros of β₁·m + (1−β₁)·g, which "
                "1 bit cannot carry; those coordinates move by ±lr at random (metric coin-flip-fraction). Zero "
                "gradients come from ReLU units inactive on a whole batch (SiLU/GELU or a larger batch avoid it) "
                "and from input features that are always 0 (e.g. blank border pixels), whose first-layer weights "
                "then only drift and decay: harmless, but worth dropping those inputs",
                server_round,
                100 * flip_fraction,
            )
        return flip_fraction

    def result_row(self) -> dict[str, int | float]:
        """The last round's fields for an app's per-round log (the repository app writes them to ``results.jsonl``)."""
        m = self.history[-1]
        keys = ("num-rejected", "num-failed", "full-syncs", "catch-ups", "checksum-mismatches", "state-resets")
        keys += ("applied", "bytes-up-fp32", "bytes-down-fp32", "tie-fraction", "agreement", "coin-flip-fraction")
        return {key.replace("-", "_"): m[key] for key in keys}

    def result_summary(self, bytes_up: int, bytes_down: int) -> dict[str, float]:
        """How many times fewer bytes than float32 messages the run sent, up and down."""
        return {
            f"fp32_over_sent_{key}": sum(m[f"bytes-{key}-fp32"] for m in self.history) / max(sent, 1)
            for key, sent in (("up", bytes_up), ("down", bytes_down))
        }
