"""What a Distributed Lion message holds, shared by the strategy and the client.

Server → client (``train``)::

    "dlion.config"  ConfigRecord  server-round, kind ("full" | "deltas" | "none"),
                                  base-version, version, num-levels[], lr[], weight-decay[],
                                  beta1, beta2, batch-size, seed, layout
    "dlion.update"  ArrayRecord   one Array "payload": the full x (float32) for kind "full",
                                  the encoded Δs back to back (stype "dlion.levels") for "deltas"

Client → server::

    "dlion.delta"    ArrayRecord   one Array "signs": dtype "bit", shape (d,),
                                   stype "dlion.sign1", ⌈d/8⌉ bytes
    "dlion.metrics"  MetricRecord  num-examples, train-loss, version, checksum

Versions count the Δs applied to x since the start. ``checksum`` is the CRC-32 of the
client's replica (float32 bytes) at ``version``, the point where it computed δ.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from flwr.app import Array, Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

__all__ = [
    "CONFIG",
    "DELTA",
    "LEVELS_STYPE",
    "METRICS",
    "SIGN_STYPE",
    "UPDATE",
    "bits_array",
    "checksum",
    "message_bytes",
]

CONFIG = "dlion.config"
UPDATE = "dlion.update"
DELTA = "dlion.delta"
METRICS = "dlion.metrics"
SIGN_STYPE = "dlion.sign1"
LEVELS_STYPE = "dlion.levels"
REPLY_METRICS = ("num-examples", "train-loss", "version", "checksum")


def bits_array(packed: torch.Tensor, count: int, stype: str) -> Array:
    """Wrap packed bytes (any device) as one flat Flower Array of ``count`` values."""
    data = packed.cpu().numpy().tobytes()  # the only device → host copy: the packed bits
    return Array(dtype="bit", shape=(count,), stype=stype, data=data)


def checksum(x: torch.Tensor) -> int:
    """CRC-32 of a float32 replica's bytes (equal replicas ⇔ equal bytes)."""
    return zlib.crc32(np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32).tobytes())


def message_bytes(message: Message) -> int:
    """Bytes a message puts on the wire: its serialized objects as Flower 1.41+ sends them.

    Flower sends a message as a tree of content-addressed objects (message, record dict,
    records, arrays, array chunks), each deflated with a small header; this sums the
    deflated size of every distinct object in the tree.
    """
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
