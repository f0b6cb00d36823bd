"""The downlink of Distributed Lion: an object that builds what each sampled node is sent, only what it lacks.

:class:`Downlink` is given the strategy's options, its :class:`~.server_state.ServerState`, its
:class:`~.global_model.GlobalModel` and its run (a :class:`Run`: the nodes' partitions, the run's
keys; ``DistributedLion.down``);
``DistributedLion.configure_train`` asks it for each node's message (:meth:`Downlink.message_for`).
A node's message holds the round's config (:meth:`Downlink.round_config`) and, by what the server
knows of the node's replica (``ServerState.version_of``), one of:

- nothing more (``kind = "none"``): its replica is at the current version;
- the anchored downlink (:mod:`flower_dlion.anchored_counts`, the default for a vote with exact
  broadcast): the smallest of the entropy-coded counts since its version, x₀'s seed and the
  counts since version 0, or the anchor xₐ and the counts since it (``_anchored_content``); an option
  that cannot be the smallest is never coded (``_anchored_choice``: no coding for in-sync nodes);
- the chain: the packed Δs it missed, one by one (``_chain_since``; the strategy hands each
  round's Δ from the uplink to :meth:`Downlink.end_round`);
- the full model (float32), or x₀'s seed and the Δs since: a new node, a lost replica, a
  checksum mismatch.

The client's side of the same message is :mod:`flower_dlion.clients.replica`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from logging import WARNING
from typing import Protocol

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore import log

from .. import entropy
from ..anchored_counts import AnchoredHistory, Segment
from ..params import layout_fingerprint, state_checksum
from ..protocol import (
    CODED_STYPE,
    CONFIG,
    LEVELS_STYPE,
    MOMENTUM,
    REST,
    SERVER_UPDATE,
    USER_CONFIG,
    message_bytes,
    to_array,
)
from ..round_records import RoundConfig
from .global_model import GlobalModel
from .options import Options
from .server_state import Broadcast, Round, ServerState, ValidReply

__all__ = ["Downlink", "Run", "payload_crc"]

Content = tuple[RecordDict, str, int]  # a message's content, its kind and its payload length in bytes
Option = tuple[int, str, int, list[Segment]]  # an anchored catch-up: its bytes, kind, base version, segments


class Run(Protocol):
    """What the downlink reads of the strategy's run: its nodes' partitions, seeds and keys (the strategy is one)."""

    sample_seed: int  # the seed of the sampling, also the clients' (their batch order and coin flips)
    state_key: str  # "" when none was given: the clients' state files do not outlive the run
    checkpoint_round: int  # the latest checkpoint's round (clients keep their state as of it)

    @property
    def run_key(self) -> str:
        """The key the clients file their state under."""
        ...

    def partition_of(self, node_id: int) -> int:
        """The partition (or node) key that the server files a node's replica under (-1 if unknown)."""
        ...


class Downlink:
    """The downlink of :class:`~flower_dlion.strategies.dlion.DistributedLion` (``strategy.down``).

    Builds each sampled node's train message and keeps the encoded Δs of the chain downlink.

    Parameters
    ----------
    options : Options
        The strategy's options (read-only).
    state : ServerState
        The server's state, shared with the uplink (x's version, what each replica holds, the
        anchored history or the kept Δs, x₀'s checksum, the synced momentum).
    model : GlobalModel
        The strategy's model, read here: x, its layout and sizes, the rest.
    nodes : Run
        The strategy's nodes and run: partitions, the sampling seed, the run's key, the checkpoint round.

    """

    def __init__(self, options: Options, state: ServerState, model: GlobalModel, nodes: Run) -> None:
        self.options = options
        self.state = state
        self.model = model
        self.nodes = nodes

    @property
    def anchored(self) -> bool:
        """Whether the downlink is anchored (``downlink="anchored"``, or "auto" where it applies)."""
        return self.options.anchored

    def start(self) -> None:
        """Set up what the downlink keeps once x is known: x₀'s checksum and, anchored, the history at x₀."""
        x, step, down = self.model.x, self.options.step, self.options.downlink
        assert x is not None
        self.state.x0_checksum = state_checksum(x, self.model.rest)
        if self.anchored:
            k, d = self.options.local.lion_steps, self.model.num_parameters
            memory = 32 * d if down.max_history_bytes is None else down.max_history_bytes
            self.state.anchored = AnchoredHistory(
                x.clone(), 1.0 - step.lr * step.weight_decay * k, step.lr * k, down.anchor_every,
                entropy.blocks_of(self.model.sizes), memory,
            )  # fmt: skip

    def message_for(
        self, node_id: int, server_round: int, rnd: Round, config: ConfigRecord, extra: RecordDict | None = None
    ) -> Message:
        """The train message for one node; adds it to ``rnd`` (kind sent, bytes, as fp32 would have been).

        ``extra``: more records for the message (secure aggregation's peers), counted in its bytes.
        """
        content, kind, payload_len = self._content_for(node_id, server_round, rnd)
        if len(config):  # the ServerApp's train_config, where FedAvg puts it
            content[USER_CONFIG] = config
        for name, record in (extra or {}).items():
            content[name] = record
        if self.state.synced_momentum is not None:  # the median of the last sync round's momenta
            content[MOMENTUM] = ArrayRecord({"m": Array(self.state.synced_momentum.numpy())})
        msg = Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=str(server_round))
        size = message_bytes(msg)
        rnd.sent[node_id] = kind
        rnd.bytes_down += size
        needs_model = kind != "none" or node_id in rnd.seeded
        rnd.bytes_down_fp32 += size - payload_len + (4 * self.model.num_parameters if needs_model else 0)
        return msg

    def round_config(self, server_round: int, rnd: Round) -> ConfigRecord:
        """The keys every client gets this round (:class:`RoundConfig`: non-default values only, to save bytes)."""
        step, local, up, sync = self.options.step, self.options.local, self.options.uplink, self.options.sync
        sgd, local_lion = local.local_optimizer == "sgd", local.local_optimizer == "lion" and local.local_steps > 1
        files = bool(self.nodes.state_key)  # files that outlive the run: as of which round, and which round to keep
        return RoundConfig(
            server_round=server_round,
            version=self.state.version,
            seed=self.nodes.sample_seed,
            beta1=step.beta1,
            beta2=step.beta2,
            local_steps=local.local_steps,
            accumulate=local.accumulate,
            local_optimizer=local.local_optimizer,
            local_lr=float(local.local_lr or 0.0) if sgd else rnd.lr if local_lion else 0.0,
            local_weight_decay=step.weight_decay if local_lion else 0.0,
            local_proximal_mu=local.local_proximal_mu,
            stale_momentum=local.stale_momentum,
            drift_correction=local.drift_correction,
            drift_limits=tuple(self.state.drift_limits or ()) if local.drift_correction != "off" else (),
            upload=up.upload,
            scale_block=up.scale_block,
            sign_noise=up.sign_noise,
            sign_noise_kind=up.sign_noise_kind,
            momentum_sync=rnd.momentum_sync,
            buffers=rnd.buffer_sync,
            momentum_sync_layers=",".join(sync.momentum_sync_layers) if sync.momentum_sync_every else "",
            state_key=self.nodes.run_key,  # the client's state is this run's alone
            state_round=server_round - 1 if files else None,
            keep_round=self.nodes.checkpoint_round if files else 0,
            secure=self.options.secure.secure,
            checksum=rnd.base_checksum,  # the node checks its replica against it before it keeps anything
        ).to_record()

    def end_round(self, valid: list[ValidReply], rnd: Round, broadcast: Broadcast | None) -> None:
        """What the round leaves the downlink: the replicas it confirmed, and its Δ for the chain downlink.

        ``valid``: the replies that passed their checks (:meth:`confirm`); ``broadcast``: the
        applied Δ, encoded (:meth:`remember`; None: none applied, or the anchored downlink).
        """
        self.confirm(valid, rnd)
        if broadcast is not None:
            self.remember(broadcast)

    def confirm(self, valid: list[ValidReply], rnd: Round) -> None:
        """The nodes of the valid replies hold the round's base version (and the context they named).

        The others keep their last confirmed version.
        """
        for reply in valid:
            pid = self.nodes.partition_of(reply.node_id)
            self.state.version_of[pid] = rnd.base_version
            self.state.context_of[pid] = int(reply.values.get("context", -1))

    def forget_stale_replica(self, pid: int, node_id: int, version: int) -> bool:
        """Keep the partition's version if the node (at ``version``) can start from it; else it gets the full model.

        Returns
        -------
        bool
            Whether the node's replica was forgotten (a state reset: a restarted node, or one at another version).

        """
        known = self.state.version_of.get(pid)
        if known is None or known == version or (not self.anchored and known <= version <= self.state.version):
            return False  # a new partition (full model), or a node that holds its replica (Δs since `known`)
        self.state.version_of.pop(pid)
        log(
            WARNING,
            "partition %d (node %d) %s: it gets the full model%s",
            pid,
            node_id,
            "has no state (a restarted SuperNode?)" if version < 0 else f"is at version {version}, not {known}",
            " and starts a fresh momentum" if version < 0 else "",
        )
        return True

    def _content_for(self, node_id: int, server_round: int, rnd: Round) -> Content:
        """The message content for one node, its kind, and its payload length in bytes."""
        assert self.model.x is not None
        round_config = self.round_config(server_round, rnd)
        pid = self.nodes.partition_of(node_id)
        have = self.state.version_of.get(pid)
        if self.state.anchored is not None and have != self.state.version:
            return self._anchored_content(node_id, pid, have, round_config, rnd)
        if have is None and self.options.downlink.init_seed is not None and pid not in self.state.seed_failed:
            if self.state.version == 0 or self._chain_since(0) is not None:  # x₀ from the seed, then the Δs
                have = 0
                rnd.seeded.add(node_id)
                round_config.update(self._seed_config())
        chain = self._chain_since(have) if have is not None else None
        if have == self.state.version:
            round_config.update({"kind": "none", "base-version": have})
            return RecordDict({CONFIG: round_config}), "none", 0
        if chain is not None:
            assert have is not None
            return self._chain_content(node_id, have, chain, round_config, rnd)
        round_config.update({"kind": "full", "base-version": -1, "layout": layout_fingerprint(self.model.layout)})
        round_config["payload-crc"] = [rnd.base_checksum]  # the payload is x
        payload = ArrayRecord({"payload": to_array(self.model.x.numpy())})
        content = RecordDict({CONFIG: round_config, SERVER_UPDATE: payload})
        self._add_rest(content)
        return content, "full", 4 * self.model.num_parameters

    def _seed_config(self) -> dict[str, int | str]:
        """The config keys that tell a node to build x₀ from the seed (and check it)."""
        seed = self.options.downlink.init_seed
        assert seed is not None
        return {
            "init-seed": seed,
            "init-checksum": self.state.x0_checksum,
            "layout": layout_fingerprint(self.model.layout),
        }

    def _add_rest(self, content: RecordDict) -> None:
        """Add the buffers to a message that carries the full model (frozen parameters never travel)."""
        if self.model.rest:
            content[REST] = ArrayRecord({name: to_array(a) for name, a in self.model.rest.items()})

    def _chain_content(
        self, node_id: int, have: int, chain: list[Broadcast], round_config: ConfigRecord, rnd: Round
    ) -> Content:
        """The chain downlink's message: the packed Δs since version ``have``, with their rates and scales."""
        rnd.chain_lengths[node_id] = len(chain)
        payload = b"".join(b.payload for b in chain)
        round_config.update(
            {
                "kind": "deltas",
                "base-version": have,
                "num-levels": [b.num_levels for b in chain],
                "lr": [b.lr for b in chain],
                "weight-decay": [b.weight_decay for b in chain],
            }
        )
        if any(b.scales is not None for b in chain):
            ones = (1.0,) * len(self.model.scale_sizes(self.options.uplink.scale_block))
            round_config["scales"] = [v for b in chain for v in (b.scales if b.scales is not None else ones)]
        round_config["payload-crc"] = payload_crc(rnd, [b.payload for b in chain])
        array = Array(dtype="level", shape=(len(chain) * self.model.num_parameters,), stype=LEVELS_STYPE, data=payload)
        return (
            RecordDict({CONFIG: round_config, SERVER_UPDATE: ArrayRecord({"payload": array})}),
            "deltas",
            len(payload),
        )

    def _anchored_content(
        self, node_id: int, pid: int, have: int | None, round_config: ConfigRecord, rnd: Round
    ) -> Content:
        """The anchored downlink's message for one node: the smallest that brings it to x.

        The counts since its version, x₀'s seed and the counts since 0, or the anchor and the
        counts since it (see :mod:`flower_dlion.anchored_counts`).
        """
        history = self.state.anchored
        assert history is not None
        size, kind, base, segments = self._anchored_choice(pid, have)
        round_config.update({"kind": "full" if kind == "full" else "counts", "base-version": base})
        round_config["anchor-every"] = self.options.downlink.anchor_every
        records: dict[str, Array] = {}
        parts: list[bytes | torch.Tensor] = []  # the payload's parts, in the order the client reads them (payload-crc)
        if kind == "seed":
            rnd.seeded.add(node_id)
            round_config.update(self._seed_config())
        if kind == "full":  # base is the anchor's version
            round_config.update({"anchor-version": base, "layout": layout_fingerprint(self.model.layout)})
            records["payload"] = to_array(history.anchor.numpy())
            parts.append(history.anchor)
        if segments:
            if kind != "full":
                rnd.chain_lengths[node_id] = self.state.version - base
            round_config.update(
                {
                    "segment-end": [s.end for s in segments],
                    "segment-decay": [s.decay for s in segments],
                    "segment-step": [s.step for s in segments],
                    "segment-refresh": [int(s.refresh) for s in segments],
                    "segment-context": [int(s.context) for s in segments],
                    "segment-bytes": [len(s.payload) for s in segments],
                }
            )
            if any(s.levels for s in segments):  # a single Δ as its packed levels (2 or 3), 0: entropy-coded
                round_config["segment-levels"] = [s.levels for s in segments]
            data = b"".join(s.payload for s in segments)
            parts.extend(s.payload for s in segments)
            records["counts"] = Array(dtype="coded", shape=(len(data),), stype=CODED_STYPE, data=data)
        content = RecordDict({CONFIG: round_config})
        if records:
            round_config["payload-crc"] = payload_crc(rnd, parts)
            content[SERVER_UPDATE] = ArrayRecord(records)
        if kind == "full":
            self._add_rest(content)
        return content, "full" if kind == "full" else "counts", size

    def _anchored_choice(self, pid: int, have: int | None) -> Option:
        """The smallest of :meth:`_anchored_options` (the first of equal size), building only options that can win.

        An option is built (its counts entropy-coded) only when its least possible size is below
        the smallest built so far (:meth:`_may_win`): the anchor's option (≥ 4·d bytes, float32)
        is not coded for a node whose counts or seed option is no larger, so in-sync nodes cost no
        coding. What each node gets is what the smallest of all the options would be, bit for bit.
        """
        best: Option | None = None
        for least, build in self._anchored_options(pid, have):
            if best is not None and not self._may_win(least, best[0]):
                continue  # at least `least` bytes: never strictly smaller than the best, which wins a tie
            option = build()
            if option is not None and (best is None or option[0] < best[0]):
                best = option
        assert best is not None, "the anchor's option is always there"
        return best

    @staticmethod
    def _may_win(least: int, best: int) -> bool:
        """Whether an option of at least ``least`` bytes can be chosen over one of ``best`` bytes (built earlier)."""
        return least < best

    def _anchored_options(self, pid: int, have: int | None) -> list[tuple[int, Callable[[], Option | None]]]:
        """What could bring a node at version ``have`` to x, in order: (least bytes, build) each.

        ``build()`` gives (bytes, kind, base version, segments), or None where the option cannot be
        made: the counts since ``have`` (if still kept), x₀'s seed and the counts since 0 (with
        ``init_seed``), and always the anchor (float32) and the counts since it.
        """
        history = self.state.anchored
        assert history is not None and self.model.x is not None
        version, d = self.state.version, self.model.num_parameters

        def option(kind: str, base: int, segments: list[Segment] | None, extra: int = 0) -> Option | None:
            return None if segments is None else (extra + sum(len(s.payload) for s in segments), kind, base, segments)

        options: list[tuple[int, Callable[[], Option | None]]] = []
        if have is not None:
            context = self.state.context_of.get(pid) == have
            options.append((0, lambda: option("counts", have, history.segments(have, context) or None)))
        seeded = self.options.downlink.init_seed is not None and pid not in self.state.seed_failed
        if seeded:  # x₀ from the seed, also for a known node
            options.append((0, lambda: option("seed", 0, history.segments(0) if version else [])))
        start = history.epoch.start  # whose version is no longer served; the counts since the anchor: always kept

        def anchor_option() -> Option | None:
            segments = history.segments(start) if version > start else []
            assert segments is not None, "the counts since the anchor are always kept"
            return option("full", start, segments, 4 * d)

        options.append((4 * d, anchor_option))
        return options

    def _chain_since(self, have: int) -> list[Broadcast] | None:
        """The Δs from version ``have`` to now, if kept and smaller than the full model."""
        needed = self.state.version - have
        if needed <= 0 or needed > len(self.state.broadcasts):
            return None
        chain = list(self.state.broadcasts)[-needed:]
        if chain[0].version != have + 1 or sum(len(b.payload) for b in chain) >= 4 * self.model.num_parameters:
            return None
        return chain

    def remember(self, broadcast: Broadcast) -> None:
        """Keep encoded Δs for lagging clients, up to ``max_history_bytes``."""
        self.state.broadcasts.append(broadcast)
        most = self.options.downlink.max_history_bytes
        limit = 4 * self.model.num_parameters if most is None else most
        while self.state.broadcasts and sum(len(b.payload) for b in self.state.broadcasts) > limit:
            self.state.broadcasts.popleft()


def payload_crc(rnd: Round, parts: list[bytes | torch.Tensor]) -> list[int]:
    """The CRC-32 of each part of a payload (``payload-crc``), each computed once a round.

    The parts are what the client reads, in order: the float32 model or anchor (a tensor), then
    each Δ or segment (bytes). The nodes in sync share one Δ, so its CRC is computed once.
    """
    out = []
    for part in parts:
        known = rnd.crcs.get(id(part))
        if known is None or known[0] is not part:
            data = part if isinstance(part, bytes) else part.numpy().view(np.uint8)
            known = rnd.crcs[id(part)] = (part, zlib.crc32(data))
        out.append(known[1])
    return out
