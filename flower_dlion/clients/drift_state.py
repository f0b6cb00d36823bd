"""A client's drift correction for one round (``drift-correction = "scaffold"``): h − hᵢ, or why none.

The math is :mod:`flower_dlion.drift`. Here: whether the node's state hᵢ may be used this round, and
h, the Δ̂ of the round before as the message brought it. The rule, said plainly:

* hᵢ missing (a new node, a state saved without it), of the wrong shape, or non-finite: the node
  starts anew (a log line names it and why), runs this round uncorrected, and keeps hᵢ ← uᵢ;
* hᵢ made in an older round than the one before this (the node missed a round, or its last
  upload was in another run's round), or a message that is not exactly the one Δ after the
  node's version (a resync with the full model, a catch-up of several Δs, a round that applied
  nothing): uncorrected, hᵢ ← uᵢ (logged at INFO level);
* otherwise h = Δ̂ of that one Δ (its levels times its scales, as every replica applies it), hᵢ
  loses what the server cut of its upload's scales (the message's ``drift-limits``; limits that do
  not fit its upload: uncorrected, logged) and the correction is h − hᵢ.

hᵢ is never sent: it lives in the node's state (:class:`~.resident.NodeState`, persisted with it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from flwr.app import Array, RecordDict

from .. import codec, drift, quantizers
from ..protocol import CONFIG, SERVER_UPDATE
from ..round_records import RoundConfig
from .placement import Placement
from .resident import NodeState

__all__ = ["correction", "keep_drift", "last_broadcast"]

logger = logging.getLogger("flower_dlion")


def correction(
    node: NodeState,
    before: int | None,
    cfg: RoundConfig,
    content: RecordDict,
    sizes: Sequence[int],
    node_id: int,
    placement: Placement,
) -> torch.Tensor | None:
    """The h − hᵢ of this round (on the node's device), or None: the round runs uncorrected (see the module doc).

    ``before``: the node's version before this message (None: it had no state); ``sizes``: the model's
    tensors (cut into ``cfg.scale_block`` blocks here, as the broadcast's scales are). A state that cannot
    be used is dropped here (``node.drift = None``) and the reason logged, naming the node.
    """
    h, sizes = last_broadcast(content, before, cfg, sizes)  # read first: the checks below only use it
    d = node.m.numel()
    why = drift.problem(node.drift, d)
    if why is not None:
        level = logging.INFO if node.drift is None else logging.WARNING
        logger.log(level, "flower-dlion: node %d: drift-correction state refused, %s: it starts anew (round %d runs "
                   "uncorrected)", node_id, why, cfg.server_round)  # fmt: skip
        node.drift = None
        return None
    assert node.drift is not None
    if node.drift.round != cfg.server_round - 1:
        logger.info("flower-dlion: node %d: its drift-correction state is of round %d, not %d (a missed round): "
                    "round %d runs uncorrected and it starts anew", node_id, node.drift.round,
                    cfg.server_round - 1, cfg.server_round)  # fmt: skip
        return None
    if h is None:
        logger.info("flower-dlion: node %d: round %d's message is not the one Δ after its version: it runs "
                    "uncorrected and its drift-correction state starts anew", node_id, cfg.server_round)  # fmt: skip
        return None
    own, h_own = node.drift, node.drift.h
    if own.signs is not None and cfg.drift_limits:  # hᵢ as the server decoded the upload: less what it cut
        if len(cfg.drift_limits) != len(sizes) or own.scales is None or len(own.scales) != len(sizes):
            logger.info("flower-dlion: node %d: round %d's drift-limits do not fit its upload: it runs uncorrected "
                        "and starts anew", node_id, cfg.server_round)  # fmt: skip
            return None
        bits = codec.unpack_bits(own.signs, d)
        limits = torch.tensor(cfg.drift_limits, dtype=torch.float32)
        cut = drift.clipped_part(bits, torch.from_numpy(own.scales), limits, sizes)
        h_own = own.h - placement.to_device(cut.numpy(), "drift")  # a new tensor: a round that fails keeps hᵢ
    return placement.to_device(h.numpy(), "drift").sub_(h_own)  # h crosses once, hᵢ stays


def last_broadcast(
    content: RecordDict, before: int | None, cfg: RoundConfig, sizes: Sequence[int]
) -> tuple[torch.Tensor | None, list[int]]:
    """Δ̂ of the message's one Δ from version ``before`` (float32, host; None where it brings anything else).

    Also returns ``sizes`` cut into the round's scale blocks (``cfg.scale_block``), as the broadcast's
    scales are. The message was checked and applied already (:mod:`.replica`, :func:`.integrity.check_steps`):
    its levels decode, its scales and steps are in range.
    """
    blocks = quantizers.scale_blocks(sizes, cfg.scale_block)
    round_config = content[CONFIG]
    one = before is not None and cfg.version == before + 1 and round_config.get("kind") == "deltas"
    if not (one and int(round_config.get("base-version", -1)) == before and SERVER_UPDATE in content):
        return None, blocks
    levels, scales = list(round_config["num-levels"]), list(round_config.get("scales", []))
    if len(levels) != 1 or len(scales) != len(blocks):
        return None, blocks
    decoded = codec.decode_levels(content[SERVER_UPDATE]["payload"].data, levels[0], sum(blocks), torch.int32)
    return quantizers.dequantize(decoded, levels[0], torch.tensor(scales, dtype=torch.float32), blocks), blocks


def keep_drift(node: NodeState, h_new: torch.Tensor, arrays: dict[str, Array], rnd: int) -> None:
    """Keep ``h_new`` = uᵢ − (h − hᵢ) (:func:`flower_dlion.drift.next_state`) as ``node.drift`` of round ``rnd``.

    With it the upload's signs and scales (host copies), until the next round's message says where the
    server cut the scales (:func:`correction`).
    """
    signs = np.frombuffer(arrays["signs"].data, dtype=np.uint8).copy()
    scales = arrays["scales"].numpy().astype(np.float32, copy=True)
    node.drift = drift.Drift(h_new, rnd, signs, scales)
