"""The gradient-baseline client (global Lion, global AdamW, TernGrad): stateless.

One ``train`` message: take the full model x the server sent, compute the gradient of
the loss on ``batch-size`` samples of the partition, and reply with it as float32
(``encoding="fp32"``) or TernGrad-ternarized (``quantizers.ternarize``: T float32
scalers followed by the trits, 5 per byte, in one flat Array).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from flower_dlion import codec, quantizers
from flower_dlion.clients.dlion import ClientStateError
from flower_dlion.params import ModelSpec, layout_fingerprint
from flower_dlion.protocol import to_array
from flower_dlion_app.clients.common import batch, seeded_generator, setup
from flower_dlion_app.model import flat_gradient
from flower_dlion_app.protocol import GRAD_CONFIG, GRAD_METRICS, GRAD_MODEL, GRAD_UPDATE, TERNGRAD_STYPE

__all__ = ["encode_terngrad", "train"]


def encode_terngrad(g: torch.Tensor, sizes: list[int], generator: torch.Generator) -> Array:
    """TernGrad payload: the per-tensor scalers (float32) then the trits (5 per byte)."""
    levels, scales = quantizers.ternarize(g, sizes, generator=generator)
    data = scales.cpu().numpy().astype(np.float32).tobytes() + codec.encode_levels(levels, 3).cpu().numpy().tobytes()
    return Array(dtype="terngrad", shape=(g.numel(),), stype=TERNGRAD_STYPE, data=data)


def train(msg: Message, context: Context) -> Message:
    """Handle one ``train`` message: gradient at the received x, sent as fp32 or TernGrad."""
    settings, device, model = setup(context)
    round_config = msg.content[GRAD_CONFIG]
    spec = ModelSpec.from_module(model)
    d, mine = spec.d, layout_fingerprint(spec.layout)
    if round_config.get("layout", mine) != mine:
        raise ClientStateError(f"node {context.node_id}: server model layout {round_config['layout']} != {mine}")
    x = msg.content[GRAD_MODEL]["x"].numpy()
    if x.shape != (d,) or x.dtype != np.float32:
        raise ClientStateError(f"node {context.node_id}: model has {x.shape} {x.dtype}, expected ({d},) float32")
    server_round, seed = int(round_config["server-round"]), int(round_config.get("seed", settings["seed"]))
    batch_size = int(round_config.get("batch-size", settings["batch-size"]))
    images, labels, pid = batch(
        context, settings, server_round=server_round, seed=seed, batch_size=batch_size, device=device
    )
    loss, g = flat_gradient(model, torch.from_numpy(x).to(device), images, labels)
    if round_config["encoding"] == "fp32":
        payload = to_array(g.cpu().numpy())
    elif round_config["encoding"] == "terngrad":
        payload = encode_terngrad(g, spec.sizes, seeded_generator(device, seed, pid, server_round))
    else:
        raise ClientStateError(f"node {context.node_id}: unknown encoding {round_config['encoding']!r}")
    reply = RecordDict(
        {
            GRAD_UPDATE: ArrayRecord({"payload": payload}),
            GRAD_METRICS: MetricRecord({"num-examples": int(labels.numel()), "train-loss": float(loss)}),
        }
    )
    return Message(content=reply, reply_to=msg)
