"""The Distributed Lion client: replica and momentum in ``context.state``, packed δ out.

One ``train`` message, in order:

1. bring the replica x to the server's version: take the full model, or apply the
   received Δs (``x ← x − lr·(Δ + wd·x)``, the same function the server uses);
2. compute the gradient g of the loss at x on ``batch-size`` samples of the partition;
3. δ = sign(β₁·m + (1−β₁)·g), then m ← β₂·m + (1−β₂)·g (``lion.local_step_``);
4. pack δ to one bit per parameter on the device and reply with it, the loss, the
   number of examples, the replica's version and its checksum;
5. store x, m and the version back in ``context.state``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from .. import codec, lion
from ..model import flat_gradient, layout, num_parameters
from ..protocol import CONFIG, DELTA, LEVELS_STYPE, METRICS, SIGN_STYPE, UPDATE, bits_array, checksum
from .common import ClientStateError, batch, resolve_device, seeded_generator, setup

__all__ = ["ClientStateError", "ReplicaState", "apply_message", "load_state", "resolve_device", "save_state", "train"]

STATE_ARRAYS = "dlion.state"
STATE_META = "dlion.state-meta"


@dataclass
class ReplicaState:
    """A client's persistent Distributed Lion state."""

    x: torch.Tensor  # replica of the global parameters, float32 (d,)
    m: torch.Tensor  # Lion momentum, float32 (d,)
    version: int  # number of Δs applied to x since the start


def load_state(context: Context, d: int, device: torch.device) -> ReplicaState | None:
    """The stored state, or None for a node that has none yet.

    Raises
    ------
    ClientStateError
        When a state exists but is incomplete or has the wrong size.

    """
    if STATE_ARRAYS not in context.state and STATE_META not in context.state:
        return None
    try:
        arrays = context.state[STATE_ARRAYS]
        meta = context.state[STATE_META]
        x, m = arrays["x"].numpy(), arrays["m"].numpy()
        version = int(meta["version"])
    except Exception as err:
        raise ClientStateError(f"node {context.node_id}: stored state is incomplete ({err!r})") from err
    if x.shape != (d,) or m.shape != (d,):
        raise ClientStateError(f"node {context.node_id}: stored state has {x.shape}/{m.shape} values, model has d={d}")
    return ReplicaState(torch.from_numpy(x.copy()).to(device), torch.from_numpy(m.copy()).to(device), version)


def save_state(context: Context, state: ReplicaState) -> None:
    """Store x, m and the version in ``context.state`` (kept by Flower across rounds)."""
    context.state[STATE_ARRAYS] = ArrayRecord(
        {"x": Array(state.x.detach().cpu().numpy()), "m": Array(state.m.detach().cpu().numpy())}
    )
    context.state[STATE_META] = ConfigRecord({"version": state.version})


def apply_message(
    content: RecordDict, state: ReplicaState | None, d: int, device: torch.device, node_id: int, model_layout: str
) -> ReplicaState:
    """Bring the replica to the version the server sent (full model or Δ chain)."""
    cfg = content[CONFIG]
    kind, version = cfg["kind"], int(cfg["version"])
    if kind == "full":
        if cfg.get("layout", model_layout) != model_layout:
            raise ClientStateError(f"node {node_id}: server model layout {cfg['layout']} != client's {model_layout}")
        payload = content[UPDATE]["payload"].numpy()
        if payload.shape != (d,) or payload.dtype != np.float32:
            raise ClientStateError(
                f"node {node_id}: full model has {payload.shape} {payload.dtype}, expected ({d},) float32"
            )
        x = torch.from_numpy(payload.copy()).to(device)
        m = state.m if state is not None else torch.zeros(d, device=device)  # a resync keeps its momentum
        return ReplicaState(x, m, version)
    if state is None:
        raise ClientStateError(
            f"node {node_id} has no replica (new node, or its state was lost) but received kind={kind!r}; "
            "the server must send the full model"
        )
    base = int(cfg["base-version"])
    if state.version != base:
        raise ClientStateError(f"node {node_id}: replica at version {state.version}, update is for version {base}")
    if kind == "deltas":
        arr = content[UPDATE]["payload"]
        if arr.stype != LEVELS_STYPE:
            raise ClientStateError(f"node {node_id}: update stype {arr.stype!r}, expected {LEVELS_STYPE!r}")
        buf = codec.as_uint8(arr.data).to(device)  # packed bytes go to the device
        offset = 0
        for num_levels, lr, wd in zip(cfg["num-levels"], cfg["lr"], cfg["weight-decay"], strict=True):
            size = codec.encoded_size(d, num_levels)
            levels = codec.decode_levels(buf[offset : offset + size], num_levels, d)
            lion.apply_update_(state.x, codec.levels_to_values(levels, num_levels), lr, wd)
            offset += size
        if offset != buf.numel():
            raise ClientStateError(f"node {node_id}: update has {buf.numel()} bytes, its Δs use {offset}")
    elif kind != "none":
        raise ClientStateError(f"node {node_id}: unknown update kind {kind!r}")
    state.version = version
    return state


def train(msg: Message, context: Context) -> Message:
    """Handle one ``train`` message (see the module docstring for the steps)."""
    settings, device, model = setup(context)
    cfg = msg.content[CONFIG]
    d = num_parameters(model)

    state = apply_message(
        msg.content, load_state(context, d, device), d, device, context.node_id, layout(model)
    )  # 1. replica up to date

    server_round, seed = int(cfg["server-round"]), int(cfg.get("seed", settings["seed"]))
    batch_size = int(cfg.get("batch-size", settings["batch-size"]))
    images, labels, pid = batch(
        context, settings, server_round=server_round, seed=seed, batch_size=batch_size, device=device
    )

    loss, grad = flat_gradient(model, state.x, images, labels)  # 2. gradient at x

    delta = lion.local_step_(state.m, grad, float(cfg["beta1"]), float(cfg["beta2"]))  # 3. δ, then m
    gen = seeded_generator(device, seed, pid, server_round)  # coin flips for exact zeros
    packed = codec.pack_signs(delta, generator=gen)  # 4. one bit per parameter, on the device

    reply = RecordDict(
        {
            DELTA: ArrayRecord({"signs": bits_array(packed, d, SIGN_STYPE)}),
            METRICS: MetricRecord(
                {
                    "num-examples": int(labels.numel()),
                    "train-loss": float(loss),
                    "version": state.version,
                    "checksum": checksum(state.x),
                }
            ),
        }
    )
    save_state(context, state)  # 5. persist for the next round
    return Message(content=reply, reply_to=msg)
