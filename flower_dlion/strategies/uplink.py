"""The uplink of Distributed Lion: an object that checks each reply, aggregates the uploads into Δ and applies it.

:class:`Uplink` is given the strategy's options, its :class:`~.server_state.ServerState` and a
read-only view of its model (``DistributedLion.up``); ``DistributedLion.aggregate_train``
calls it in this order:

1. ``check_replies``: each reply's envelope, arrays, metrics, replica version and checksum
   (``check_reply``); for a refused one ``on_rejected`` decides whether its node needs the full model.
2. ``aggregate_replies``: Δ of the valid uploads as levels with their broadcast bytes, by the one
   function :func:`flower_dlion.strategies.server_delta.choose_aggregator` picked for the options (the math:
   ``lion.aggregate``; for packed 1-bit signs its twin ``codec.aggregate_packed``). Nothing here
   computes Δ.
3. ``apply``: x ← x − lr·(Δ + wd·x) (anchored: C ← C + Δ, x = γ·xₐ − η·C), combine the round's
   momenta and buffers by medians; it returns the encoded Δ, which the strategy hands to its
   downlink to keep for clients that fall behind.
4. ``round_metrics``: the round's row of ``results.jsonl``, with the round's :class:`RoundCounts`;
   the state writes its nodes report as failed decide whether the run stops (:mod:`.state_writes`,
   ``take_stop``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, partial
from logging import WARNING
from typing import TYPE_CHECKING

import torch
from flwr.app import Array, ArrayRecord, Message
from flwr.supercore import log

from .. import codec, quantizers
from ..bounds import mean_buffers, median_momentum, moment_count, robust_buffers
from ..coin_flips import CAUSES, WARN_ABOVE
from ..protocol import (
    CLIENT_STATE_ERROR,
    CLIENT_UPLOAD,
    EXPLAINED_FLIPS,
    MASKED_STYPE,
    METRICS,
    NOTICE,
    OPTIONAL_REPLY_METRICS,
    REPLY_METRICS,
    SEED_MISMATCH,
    RejectedReply,
    check_envelope,
    float_array,
    message_bytes,
    read_metrics,
)
from ..secure import masking
from ..uploads import Parsed, Shape, upload_kind
from .options import OptionAttribute, Options
from .replies import CheckedReplies, Reply, check_each
from .run_stops import RunStopped
from .server_delta import Aggregator, choose_aggregator, counts_delta
from .server_state import Broadcast, Round, ServerState, Unmasked, ValidReply
from .state_writes import Reported, StateWrites, note

if TYPE_CHECKING:
    from .views import ModelView

__all__ = ["Applied", "RoundCounts", "Uplink"]

STATE_LOST = ("has no replica", ": replica at version")  # a client's errors (clients/replica.py) for a state it lacks


@dataclass
class RoundCounts:
    """What the round in progress counted, for its metrics (a fresh one each round).

    Attributes
    ----------
    resyncs : int
        Replies that showed a replica checksum or version mismatch (``checksum-mismatches``).
    state_resets : int
        Nodes found without their state since the last round (``state-resets``): by their hello
        (the downlink finds them), or by their reply (no replica, or an older one: a virtual client
        served where its state files are not).
    clipped : int
        ef-sign scales cut to the median (``clipped-scales``).
    write_failures : dict[int, tuple[int, WriteFailure]]
        Nodes whose reply (valid or not) reports that they could not write their state, with
        their partition and the failure (``state-write-failures``; :mod:`.state_writes`).

    """

    resyncs: int = 0
    state_resets: int = 0
    clipped: int = 0
    write_failures: Reported = field(default_factory=dict)


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

    Checks the round's replies, turns the valid ones into Δ, applies Δ to x, and reports the round.

    Parameters
    ----------
    options : Options
        The strategy's options (read-only); ``uplink.aggregation`` is ``options.uplink.aggregation``.
    state : ServerState
        The server's state, shared with the downlink (x's version, the anchored history, the
        replicas' versions, the error feedback and momentum of the broadcast).
    model : ModelView
        The strategy's model, read-only: x (updated in place), its layout and sizes, the rest.

    """

    # Each option read here by its argument name: ``self.aggregation`` is ``self.options.uplink.aggregation``.
    aggregation = OptionAttribute("uplink")
    upload = OptionAttribute("uplink")
    broadcast_bits = OptionAttribute("uplink")
    server_momentum = OptionAttribute("uplink")
    weight_decay = OptionAttribute("step")
    init_seed = OptionAttribute("downlink")

    def __init__(self, options: Options, state: ServerState, model: ModelView) -> None:
        self.options = options
        self.state = state
        self.model = model
        self.kind = upload_kind(options.uplink.upload)
        self.told_flips = False  # the coin-flip warning was logged
        self.told_seed = False  # the init-seed mismatch warning was logged
        self.writes = StateWrites()  # the failed state writes nodes reported
        self.stop: RunStopped | None = None  # asked for by a round's replies (no node can keep its state)

    @property
    def lion_steps(self) -> int:
        """K for local Lion steps, 1 for the sgd client: Δ's scale and decay."""
        return self.options.local.lion_steps

    @property
    def shape(self) -> Shape:
        """The model's size and K, as the upload kinds take them."""
        return Shape(self.model.num_parameters, self.model.scale_sizes, self.lion_steps)

    # ------------------------------------------------------------------ 1. check
    def _expected_arrays(self, rnd: Round) -> dict[str, tuple[str, str, int]]:
        """Array name → (stype or "", dtype, bytes) that a valid reply holds this round."""
        if self.options.secure.secure:  # b bit planes of the masked signs, b for the round's participants
            bits = masking.mask_bits(max(1, len(rnd.participants)))
            out = {"masked": (MASKED_STYPE, "level", bits * masking.plane_bytes(self.model.num_parameters))}
            if rnd.buffer_sync:  # the buffers' moments in Z_{2^64} (bounds.buffer_moments)
                assert self.model.spec is not None
                out["masked-buffers"] = (MASKED_STYPE, "uint64", 8 * moment_count(self.model.spec))
            return out
        out = self.kind.expected(self.shape)
        if rnd.momentum_sync:
            assert self.model.momentum_mask is not None
            out["momentum"] = ("numpy.ndarray", "float32", 4 * int(self.model.momentum_mask.sum()))
        if rnd.buffer_sync:
            assert self.model.spec is not None
            out["buffers"] = ("numpy.ndarray", "float32", 4 * self.model.spec.num_buffer_values)
        return out

    def check_replies(self, replies: list[Reply], rnd: Round, counts: RoundCounts) -> CheckedReplies[ValidReply]:
        """Each reply checked (:meth:`check_reply`), then what each refused one says of its node (on_rejected)."""
        out = check_each(replies, partial(self.check_reply, rnd=rnd))
        for reply, err in out.refused:
            self.on_rejected(reply.msg, reply.node_id, reply.partition, err, reply.again, rnd, counts)
        return out

    def check_reply(self, msg: Message, rnd: Round) -> ValidReply:
        """Validate one reply; return it parsed, or raise RejectedReply."""
        node_id = msg.metadata.src_node_id
        check_envelope(msg, rnd.sent.keys(), rnd.server_round, (CLIENT_UPLOAD, METRICS), optional=(NOTICE,))
        content = msg.content
        record = content[CLIENT_UPLOAD]
        expected = self._expected_arrays(rnd)
        if not isinstance(record, ArrayRecord) or set(record.keys()) != set(expected):
            got = sorted(record.keys()) if isinstance(record, ArrayRecord) else type(record).__name__
            raise RejectedReply(f"'{CLIENT_UPLOAD}' must be an ArrayRecord holding {sorted(expected)}, got {got}")
        floats = self._check_arrays(record, expected)
        d = self.model.num_parameters
        if "masked" in expected:  # uniform in Z_{2^b} whatever the signs: nothing more to check
            upload = Parsed(record["masked"].data)
        else:
            upload = self.kind.parse(record[self.kind.main].data, floats, self.shape)
        values = read_metrics(content, METRICS, REPLY_METRICS, optional=OPTIONAL_REPLY_METRICS)
        flips = values.get("coin-flips", 0)
        if not (isinstance(flips, int) and 0 <= flips <= d):
            raise RejectedReply(f"metric 'coin-flips' is {flips!r}, expected an integer in [0, {d}]")
        self._check_explained(values)
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
        masked = record["masked-buffers"].data if "masked-buffers" in expected else None
        return ValidReply(node_id, upload, momentum, buffers, values, masked)

    def _check_arrays(self, record: ArrayRecord, expected: dict[str, tuple[str, str, int]]) -> dict[str, torch.Tensor]:
        """Check each array of a reply against ``expected``; return its float32 ones (scales, momenta, buffers)."""
        d = self.model.num_parameters
        floats = {}
        for name, (stype, dtype, nbytes) in expected.items():
            arr = record[name]
            if not isinstance(arr, Array):
                raise RejectedReply(f"{name!r} is a {type(arr).__name__}, expected an Array")
            if dtype == "float32":  # scales, momenta and buffers: exact shape and size, finite
                if arr.dtype == "float32" and (got := tuple(arr.shape)) != (nbytes // 4,):  # another model's: final
                    raise RejectedReply(f"Array {name!r} shape {got}, expected {(nbytes // 4,)}", final=True)
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
            shape = (nbytes // 8,) if dtype == "uint64" else (d,)  # masked buffers: one uint64 a value
            if tuple(arr.shape) != shape:  # the node's model has another layout (final: left out of sampling)
                raise RejectedReply(f"Array {name!r} shape {tuple(arr.shape)}, expected {shape}", final=True)
            if len(arr.data) != nbytes:
                raise RejectedReply(f"Array {name!r} has {len(arr.data)} bytes, expected {nbytes} for d={d}")
        return floats

    def on_rejected(
        self, msg: Message, node_id: int, pid: int, err: RejectedReply, again: bool, rnd: Round, counts: RoundCounts
    ) -> None:
        """A refused reply from a node of round ``rnd``: what it says about the node's replica (``counts.resyncs``)."""
        if node_id not in rnd.sent or again:
            return  # a stray reply says nothing about the node's replica
        note(counts.write_failures, rnd.server_round, msg, node_id, pid)  # it could not write its state
        if err.resync or (msg.has_error() and CLIENT_STATE_ERROR in msg.error.reason):
            self.state.version_of.pop(pid, None)  # its replica is unknown: the full model next time
            counts.resyncs += int(err.resync)
            reason = msg.error.reason if msg.has_error() else ""
            counts.state_resets += any(lost in reason for lost in STATE_LOST)  # e.g. on a machine without its files
            if msg.has_error() and node_id in rnd.seeded and SEED_MISMATCH in msg.error.reason:
                self.state.seed_failed.add(pid)  # the full model from now on
                self._tell_seed_mismatch(node_id)

    def _tell_seed_mismatch(self, node_id: int) -> None:
        """Say once why a client's x₀ from ``init_seed`` differs from ``initial_arrays``, and the fix."""
        if self.told_seed:
            return
        self.told_seed = True
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
    def aggregate_replies(self) -> Aggregator:
        """The one function that turns a round's uploads into Δ, chosen once from the (read-only) options.

        :func:`flower_dlion.strategies.server_delta.choose_aggregator`: the packed twin of ``lion.aggregate``
        for the 1-bit sign upload with an exact broadcast (the default), the definition on
        ``Upload.total``'s S for the other exact ones, error-feedback quantization otherwise.
        """
        return choose_aggregator(self.kind, self.aggregation, self.broadcast_bits, self.server_momentum)

    # ------------------------------------------------------------------ 3. apply
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
            update = counts_delta(unmasked.planes, n, self.shape, how=self.aggregation)
        else:
            update = self.aggregate_replies([r.upload for r in valid], self.shape, self.state)
        counts.clipped, scales = update.clipped, update.scales
        broadcast = None
        history = self.state.anchored
        if history is not None:  # x = γ·xₐ − η·C (Δ = K·L, the K in η), written into x
            history.apply_levels(update.levels, update.num_levels, update.encoded, out=self.model.x)
            self.state.version += 1
        else:
            weight_decay = self.weight_decay * self.lion_steps  # K local Lion steps' worth of decay
            s = None if scales is None else torch.tensor(scales)
            sizes = self.model.scale_sizes
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

    # ------------------------------------------------------------------ 4. report
    def round_metrics(
        self,
        rnd: Round,
        replies: list[Message],
        valid: list[ValidReply],
        checked: CheckedReplies[ValidReply],
        outcome: Applied | None,
        counts: RoundCounts,
    ) -> dict[str, int | float]:
        """The round's row: replies, faults, bytes as measured and as fp32 would have been, coin flips.

        Each key, its range in an honest run and when it signals a problem: docs/USER_GUIDE.md, "The
        round's metrics". ``agreement`` is mean |S| / (n·K) for signs and sums; for ef-sign, whose
        S sums scaled signs (``apply`` gives NaN), the same of the uploaded signs, mean |Σᵢ ±1| / n.
        """
        d, n = self.model.num_parameters, len(valid)
        self._close_writes(rnd, replies, checked, counts)
        bytes_up = sum(message_bytes(msg) for msg in replies)
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
        return {
            "num-replies": n,
            "num-rejected": checked.rejected,
            "num-failed": len(set(rnd.sent) - checked.answered),
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
            "client-errors": sum(1 for msg in replies if msg.has_error()),
        }

    def _close_writes(self, rnd: Round, replies: list[Message], checked: CheckedReplies, counts: RoundCounts) -> None:
        """Read the failed state writes the valid replies report; the stop when every node that answered did."""
        for msg in replies:  # the rejected ones were read by on_rejected, with the partition the server knows
            if not msg.has_error() and NOTICE in msg.content and msg.metadata.src_node_id in rnd.sent:
                note(counts.write_failures, rnd.server_round, msg, msg.metadata.src_node_id)
        stop = self.writes.close(counts.write_failures, rnd.server_round, checked.answered & rnd.sent.keys())
        self.stop = self.stop or stop

    def take_stop(self) -> RunStopped | None:
        """The stop a round asked for (:meth:`.state_writes.StateWrites.close`), once: ``start``'s loop raises it."""
        stop, self.stop = self.stop, None
        return stop

    def _check_explained(self, values: dict[str, float]) -> None:
        """The ``coin-flips-*`` metrics (:mod:`flower_dlion.coin_flips`), when present: in their ranges."""
        tensors = len(self.model.layout)
        tensor, share, cause = (values.get(k) for k in EXPLAINED_FLIPS)
        if tensor is not None and not (isinstance(tensor, int) and 0 <= tensor < tensors):
            raise RejectedReply(f"metric 'coin-flips-tensor' is {tensor!r}, expected an integer in [0, {tensors})")
        if share is not None and not 0.0 <= share <= 1.0:
            raise RejectedReply(f"metric 'coin-flips-share' is {share!r}, expected a number in [0, 1]")
        if cause is not None and cause not in CAUSES:
            raise RejectedReply(f"metric 'coin-flips-cause' is {cause!r}, expected one of {sorted(CAUSES)}")

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
