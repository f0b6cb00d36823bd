"""The Distributed Lion client: replica and momentum in ``context.state``, packed update out.

One ``train`` message, in order:

1. bring the replica x to the server's version: take the full model, build x₀ from the
   seed the server names (``init = "seed"``), and/or apply the received Δs
   (``x ← x − lr·(Δ + wd·x)``, the same function the server uses); adopt the averaged
   momentum if the server sent one (``momentum-sync-every``);
2. local work: K = ``local-steps`` Lion steps (``lion.local_steps_``) on a copy of x, each on
   the average gradient of ``accumulate`` minibatches of ``batch-size`` samples; U = Σₖ δₖ
   (with K = 1 this is plain D-Lion's δ = sign(β₁·m + (1−β₁)·g), then m ← β₂·m + (1−β₂)·g);
3. encode U for the wire (``upload``): ``sign`` — sign(U), 1 bit per parameter (exact
   zeros become a seeded coin flip; with K = 1 steps 2 and 3 are one fused pass,
   ``codec.pack_local_step_``, with the same result); ``sum`` — the integer U, ⌈log₂(2K+1)⌉ bits;
   ``ef-sign`` — a scaled sign of U + e with one float32 scale per tensor, the
   quantization error e kept for the next round (error feedback);
4. reply with it, the loss, the number of examples, the replica's version and its checksum
   (and its momentum in a momentum-sync round);
5. store x, m, e and the version back in ``context.state`` (and, with run config
   ``client-state-dir``, in a file per round, so that the node's state survives a restart
   of its SuperNode and a resumed ServerApp finds it; see :func:`restore_state`). With
   ``state-in-context = false`` only in the file: Flower serializes the whole context with
   every message, which costs far more than the file from 10⁶ parameters up.

Faults for studies: with ``byzantine-fraction`` the first k partitions upload −U
(``byzantine-mode = "flip"``) or K·(random signs) (``"random"``) instead of U.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from .. import codec, lion, quantizers
from ..model import flat_gradient, flat_parameters, layer_mask, layout, seeded_net
from ..protocol import (
    CONFIG,
    DELTA,
    LEVELS_STYPE,
    METRICS,
    MOMENTUM,
    SEED_MISMATCH,
    SIGN_STYPE,
    UPDATE,
    bits_array,
    checksum,
    sync_prefixes,
    to_array,
)
from .common import ClientStateError, batch, byzantine, partition_id, resolve_device, seeded_generator, setup

__all__ = [
    "ClientStateError",
    "ReplicaState",
    "apply_message",
    "held_version",
    "load_state",
    "resolve_device",
    "restore_state",
    "save_state",
    "train",
]

STATE_ARRAYS = "dlion.state"
STATE_META = "dlion.state-meta"


@dataclass
class ReplicaState:
    """A client's persistent Distributed Lion state."""

    x: torch.Tensor  # replica of the global parameters, float32 (d,)
    m: torch.Tensor  # Lion momentum, float32 (d,)
    version: int  # number of Δs applied to x since the start
    error: torch.Tensor | None = None  # error-feedback residual of the ef-sign upload, float32 (d,)
    round: int = 0  # the server round whose train message left the node in this state


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
        stored = {name: arrays[name].numpy() for name in arrays}
        if "x" not in stored or "m" not in stored:
            raise KeyError(f"arrays {sorted(stored)} lack 'x' or 'm'")
        version = int(meta["version"])
        saved_round = int(meta.get("round", 0))
        m_bf16 = meta.get("m-dtype", "float32") == "bfloat16"
    except Exception as err:
        raise ClientStateError(f"node {context.node_id}: stored state is incomplete ({err!r})") from err
    bad = {name: a.shape for name, a in stored.items() if a.shape != (d,)}
    if bad:
        raise ClientStateError(f"node {context.node_id}: stored state has shapes {bad}, model has d={d}")
    tensors = {name: torch.from_numpy(a).to(device) for name, a in stored.items()}  # Array.numpy(): fresh arrays
    if m_bf16:  # stored as the raw 16 bits of bfloat16 (numpy has no bfloat16)
        tensors["m"] = tensors["m"].view(torch.bfloat16).float()
    return ReplicaState(tensors["x"], tensors["m"], version, tensors.get("e"), saved_round)


def _state_arrays(state: ReplicaState) -> dict[str, torch.Tensor]:
    """The tensors a stored state holds: x, m and, with error feedback, e."""
    return {"x": state.x, "m": state.m} | ({"e": state.error} if state.error is not None else {})


def save_state(context: Context, state: ReplicaState) -> None:
    """Store x, m (and e) and the version in ``context.state`` (kept by Flower across rounds).

    ``state`` is on the host, as :func:`_on_host` gives it: an m in bfloat16 (momentum-dtype
    ``"bfloat16"``) is stored in 2 bytes per value, and :func:`load_state` gives it back as float32.
    """
    bf16 = state.m.dtype == torch.bfloat16  # m as the raw 16 bits of bfloat16 (numpy has no bfloat16)
    host = {k: (v.view(torch.int16) if k == "m" and bf16 else v).numpy() for k, v in _state_arrays(state).items()}
    context.state[STATE_ARRAYS] = ArrayRecord({k: to_array(a) for k, a in host.items()})
    context.state[STATE_META] = ConfigRecord(
        {"version": state.version, "round": state.round, "m-dtype": "bfloat16" if bf16 else "float32"}
    )


def _on_host(state: ReplicaState, momentum_dtype: str) -> ReplicaState:
    """The state as it is stored, on the host: x, m (as bfloat16 with that momentum dtype) and e copied once.

    A GPU client's context, state file and checksum all read this one copy, and m crosses
    in 2 bytes per value when it is stored in 2. On the CPU nothing is copied but m's bfloat16.
    This is the one place m is rounded to bfloat16, once per round: the next message loads it
    back as float32 (:func:`load_state`, :func:`_read_state_file`), on every path.
    """
    m = state.m.detach().to(torch.bfloat16) if momentum_dtype == "bfloat16" else state.m.detach()
    error = None if state.error is None else state.error.detach().cpu()
    return replace(state, x=state.x.detach().cpu(), m=m.cpu(), error=error)


# ---------------------------------------------------------------- state files (client-state-dir)
def _state_folder(settings: dict[str, Any], key: str, pid: int) -> Path | None:
    """``<client-state-dir>/<state-key>/partition-<pid>``, or None when state files are off."""
    if not settings["client-state-dir"] or not key:
        return None
    return Path(settings["client-state-dir"]).expanduser() / key / f"partition-{pid}"


def _saved_rounds(folder: Path) -> list[int]:
    """Rounds of the complete state files in ``folder`` (``r<round>.pt``), ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(p.stem[1:]) for p in folder.glob("r*.pt") if p.stem[1:].isdigit())


def _write_state_file(folder: Path, state: ReplicaState, keep_round: int) -> None:
    """Write ``r<round>.pt`` atomically; keep besides it only the newest file at or before ``keep_round``.

    ``state`` is on the host, as :func:`_on_host` gives it (an m in bfloat16 is written in
    2 bytes per value). ``keep_round`` is the server's latest checkpoint (0: none yet), the
    round a resumed ServerApp starts from; the file just written is the one a restarted
    SuperNode starts from. Every other file is deleted: older rounds, and rounds after this
    one (a resumed run's dead future).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"r{state.round}.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"version": state.version, "round": state.round} | _state_arrays(state), tmp)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    rounds = _saved_rounds(folder)
    kept = max((r for r in rounds if r <= keep_round), default=None)
    for r in rounds:
        if r not in (kept, state.round):
            (folder / f"r{r}.pt").unlink(missing_ok=True)


def _read_state_file(folder: Path, as_of_round: int, d: int, device: torch.device) -> ReplicaState | None:
    """The newest state saved at or before ``as_of_round``, or None."""
    rounds = [r for r in _saved_rounds(folder) if r <= as_of_round]
    if not rounds:
        return None
    saved = torch.load(folder / f"r{rounds[-1]}.pt", map_location=device, weights_only=True)
    if saved["x"].shape != (d,) or saved["m"].shape != (d,):
        raise ClientStateError(f"state file {folder}/r{rounds[-1]}.pt has shape {tuple(saved['x'].shape)}, d={d}")
    m = saved["m"].float()  # stored as bfloat16 with momentum-dtype = "bfloat16"
    return ReplicaState(saved["x"], m, int(saved["version"]), saved.get("e"), int(saved["round"]))


def restore_state(
    context: Context, settings: dict[str, Any], cfg: ConfigRecord, d: int, device: torch.device
) -> ReplicaState | None:
    """The node's state as of the end of round ``state-round`` (the server says which).

    ``context.state`` when it holds it; otherwise, with ``client-state-dir``, the newest
    state file at or before that round (a restarted SuperNode, or a resumed ServerApp in
    a new run whose contexts start empty); None for a node that has no state.
    """
    state = load_state(context, d, device)
    as_of = int(cfg.get("state-round", -1))
    folder = _state_folder(settings, str(cfg.get("state-key", "")), partition_id(context)[0])
    if folder is None or as_of < 0 or (state is not None and state.round <= as_of):
        return state
    return _read_state_file(folder, as_of, d, device)


def held_version(context: Context, settings: dict[str, Any], request: ConfigRecord) -> int:
    """Version of the replica :func:`restore_state` would start from, -1 for none."""
    model = setup(context)[2]
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = restore_state(context, settings, request, d, torch.device("cpu"))
    return -1 if state is None else state.version


def _seeded_state(cfg: ConfigRecord, d: int, device: torch.device, node_id: int) -> ReplicaState:
    """x₀ built from the server's seed, checked against the server's checksum of x₀."""
    x0 = flat_parameters(seeded_net(int(cfg["init-seed"])))
    if x0.numel() != d or checksum(x0) != int(cfg["init-checksum"]):
        raise ClientStateError(
            f"node {node_id}: {SEED_MISMATCH} {cfg['init-seed']} has checksum {checksum(x0)}, the server's is "
            f"{cfg['init-checksum']} (a different torch version?); the server will send the full model"
        )
    return ReplicaState(x0.to(device), torch.zeros(d, device=device), 0)


def apply_message(
    content: RecordDict,
    state: ReplicaState | None,
    d: int,
    device: torch.device,
    node_id: int,
    model_layout: str,
    sizes: Sequence[int] | None = None,
) -> ReplicaState:
    """Bring the replica to the version the server sent (full model, seed, Δ chain).

    ``sizes`` (values per tensor, in flat order) is needed for Δs with per-tensor scales.
    """
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
        if state is None:
            return ReplicaState(x, torch.zeros(d, device=device), version)
        return ReplicaState(x, state.m, version, state.error)  # a resync keeps its momentum
    if state is None and "init-seed" in cfg:
        if cfg.get("layout", model_layout) != model_layout:
            raise ClientStateError(f"node {node_id}: server model layout {cfg['layout']} != client's {model_layout}")
        state = _seeded_state(cfg, d, device, node_id)
    if state is None:
        raise ClientStateError(
            f"node {node_id} has no replica (new node, or its state was lost) but received kind={kind!r}; "
            "the server must send the full model"
        )
    base = int(cfg["base-version"])
    if kind == "none" and state.version != base:
        raise ClientStateError(f"node {node_id}: replica at version {state.version}, server's is {base}")
    if not base <= state.version <= version:
        raise ClientStateError(
            f"node {node_id}: replica at version {state.version}, update goes from version {base} to {version}"
        )
    skip = state.version - base  # Δs this replica already has (it applied them, its reply was lost)
    if kind == "deltas":
        arr = content[UPDATE]["payload"]
        if arr.stype != LEVELS_STYPE:
            raise ClientStateError(f"node {node_id}: update stype {arr.stype!r}, expected {LEVELS_STYPE!r}")
        buf = codec.as_uint8(arr.data).to(device)  # packed bytes go to the device
        scales = list(cfg.get("scales", []))
        num_tensors = len(scales) // len(cfg["num-levels"]) if scales else 0
        if scales and sizes is None:
            raise ClientStateError(f"node {node_id}: update has per-tensor scales but no tensor sizes were given")
        if scales and num_tensors != len(sizes or ()):
            raise ClientStateError(
                f"node {node_id}: {len(scales)} scales for {len(cfg['num-levels'])} Δs "
                f"of a model of {len(sizes or ())} tensors"
            )
        offset = 0
        for i, (num_levels, lr, wd) in enumerate(zip(cfg["num-levels"], cfg["lr"], cfg["weight-decay"], strict=True)):
            size = codec.encoded_size(d, num_levels)
            narrow = num_levels <= 256 and not scales  # bytes: a quarter of int32's memory; apply_levels_ reads them
            dtype = torch.uint8 if narrow else torch.int32
            levels = codec.decode_levels(buf[offset : offset + size], num_levels, d, dtype)
            s = None
            if scales:
                s = torch.tensor(scales[i * num_tensors : (i + 1) * num_tensors], dtype=torch.float32, device=device)
            if i >= skip:  # x ← x − lr·(Δ + wd·x), as the server applied it
                quantizers.apply_delta_(state.x, levels, num_levels, s, sizes or [d], lr, wd)
            offset += size
        if offset != buf.numel():
            raise ClientStateError(f"node {node_id}: update has {buf.numel()} bytes, its Δs use {offset}")
    elif kind != "none":
        raise ClientStateError(f"node {node_id}: unknown update kind {kind!r}")
    state.version = version
    return state


def _encode_upload(
    u: torch.Tensor, state: ReplicaState, cfg: ConfigRecord, sizes: Sequence[int], gen: torch.Generator
) -> dict[str, Array]:
    """The reply's arrays for the sum of local directions ``u`` (see step 3 of the module doc)."""
    d, upload, steps = u.numel(), str(cfg.get("upload", "sign")), int(cfg.get("local-steps", 1))
    if upload == "sign":
        return {"signs": bits_array(codec.pack_signs(u, generator=gen), d, SIGN_STYPE)}  # 1 bit
    if upload == "sum":
        levels = (u + steps).to(torch.int32)  # U ∈ [−K, K] → 0 … 2K
        data = codec.encode_levels(levels, 2 * steps + 1)
        return {"levels": bits_array(data, d, LEVELS_STYPE, dtype="level")}
    if upload == "ef-sign":
        if state.error is None:
            state.error = torch.zeros_like(u)
        levels, scales = quantizers.ef_quantize_(u, state.error, sizes, 2)  # scaled sign of U + e; e ← rest
        return {
            "signs": bits_array(codec.pack_bits(levels > 0), d, SIGN_STYPE),
            "scales": Array(scales.cpu().numpy().astype(np.float32)),
        }
    raise ClientStateError(f"unknown upload {upload!r}")


def train(msg: Message, context: Context) -> Message:
    """Handle one ``train`` message (see the module docstring for the steps)."""
    settings, device, model = setup(context)
    cfg = msg.content[CONFIG]
    folder = _state_folder(settings, str(cfg.get("state-key", "")), partition_id(context)[0])
    if folder is None and not settings["state-in-context"]:
        raise ClientStateError(
            f"node {context.node_id}: run-config state-in-context = false keeps the state in files only, "
            "but the server sent no 'state-key' (a strategy built without state_key?): nothing trained, nothing lost"
        )
    names_shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in names_shapes]
    d = sum(sizes)

    state = apply_message(
        msg.content, restore_state(context, settings, cfg, d, device), d, device, context.node_id, layout(model), sizes
    )  # 1. replica up to date
    sync = int(cfg.get("momentum-sync", 0))
    if sync or MOMENTUM in msg.content:  # parameters whose momentum is synchronized
        mask = layer_mask(names_shapes, sync_prefixes(str(cfg.get("momentum-sync-layers", "")))).to(device)
    if MOMENTUM in msg.content:  # the server's average of the momenta of the last sync round
        m_avg = msg.content[MOMENTUM]["m"].numpy()
        if m_avg.shape != (int(mask.sum()),):
            raise ClientStateError(
                f"node {context.node_id}: momentum of shape {m_avg.shape}, expected ({int(mask.sum())},)"
            )
        state.m[mask] = torch.from_numpy(m_avg.copy()).to(device)

    server_round, seed = int(cfg["server-round"]), int(cfg.get("seed", settings["seed"]))
    batch_size = int(cfg.get("batch-size", settings["batch-size"]))
    steps, accumulate = int(cfg.get("local-steps", 1)), int(cfg.get("accumulate", 1))
    losses, num_examples, pid = [], 0, 0

    def gradient(x: torch.Tensor, k: int) -> torch.Tensor:
        """Mean gradient at x over the ``accumulate`` minibatches of local step k."""
        nonlocal num_examples, pid
        total = None
        for a in range(accumulate):
            images, labels, pid = batch(
                context,
                settings,
                server_round=server_round,
                seed=seed,
                batch_size=batch_size,
                device=device,
                step=k * accumulate + a,
            )
            loss, grad = flat_gradient(model, x, images, labels)
            losses.append(float(loss))
            num_examples += int(labels.numel())
            total = grad if total is None else total.add_(grad)
        assert total is not None
        return total if accumulate == 1 else total.div_(accumulate)

    beta1, beta2 = float(cfg["beta1"]), float(cfg["beta2"])
    attacker = byzantine(settings, *partition_id(context))  # a fault study's attacker
    gen = seeded_generator(device, seed, pid, server_round)  # coin flips for exact zeros
    if steps == 1 and str(cfg.get("upload", "sign")) == "sign" and not attacker:  # 2–3 as one pass over m and g
        g = gradient(state.x, 0)
        packed = codec.pack_local_step_(state.m, g, beta1, beta2, gen)  # δ packed as computed, m updated
        arrays = {"signs": bits_array(packed, d, SIGN_STYPE)}
    else:
        x_local = state.x if steps == 1 else state.x.clone()  # K = 1 never moves x (see local_steps_)
        u = lion.local_steps_(  # 2. U = Σₖ δₖ, m updated
            x_local,
            state.m,
            gradient,
            steps=steps,
            lr=float(cfg.get("local-lr", 0.0)),
            weight_decay=float(cfg.get("local-weight-decay", 0.0)),
            beta1=beta1,
            beta2=beta2,
        )
        if attacker:
            if settings["byzantine-mode"] == "flip":
                u = -u
            else:
                u = steps * (2.0 * torch.randint(0, 2, u.shape, generator=gen, device=device) - 1.0)
        arrays = _encode_upload(u, state, cfg, sizes, gen)  # 3. on the device, only bytes leave it
    if sync:
        arrays["momentum"] = to_array(state.m[mask].cpu().numpy())

    state.round = server_round
    host = _on_host(state, settings["momentum-dtype"])  # 5. persist for the next round, from one host copy
    if settings["state-in-context"]:  # else in the state file alone (below): no model-sized state in each message
        save_state(context, host)
    reply = RecordDict(
        {
            DELTA: ArrayRecord(arrays),
            METRICS: MetricRecord(
                {
                    "num-examples": num_examples,
                    "train-loss": sum(losses) / len(losses),
                    "version": state.version,
                    "checksum": checksum(host.x),
                }
            ),
        }
    )
    if folder is not None:
        _write_state_file(folder, host, int(cfg.get("keep-round", 0)))
    return Message(content=reply, reply_to=msg)
