"""The FedAvg client: ``local-epochs`` epochs of SGD on the whole partition, then the model.

Speaks Flower's own ``FedAvg`` messages: receives "arrays" (the global model) and
"config" (lr, momentum, weight-decay, local-epochs, local-batches (0: whole epochs; k: only
the first k minibatches of each epoch), batch-size, seed, server-round),
replies "arrays" (the local model) and "metrics" (num-examples, train-loss). The
optimizer (``torch.optim.SGD``) starts fresh every round, as in McMahan et al. (2017).
With FedProx's "proximal-mu" μ > 0 in the config, each batch's loss gains μ/2·‖w − x‖², x
the model received (Li et al., 2020). With run config ``strategy = "scaffold"`` each step's
gradient gains c − cᵢ (c: the message's "control" record, zeros without one; cᵢ: this
node's, in ``context.state``), and the reply's "control" record holds
Δcᵢ = −c + (1 − β)·(x − y)/(K·η) (:mod:`flower_dlion_app.strategies.scaffold`).

Faults for studies: with ``byzantine-fraction`` the first k partitions send
x + s·(−u) (``byzantine-mode = "flip"``) or x + s·‖u‖·ξ/‖ξ‖ with Gaussian ξ
(``"random"``) instead of x + u, where u is their honest update and s is
``byzantine-scale``.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from flower_dlion.clients.state import ClientStateError
from flower_dlion_app.clients.common import byzantine, partition, partition_id, setup
from flower_dlion_app.protocol import CONTROL

__all__ = ["train"]

OWN_CONTROL = "scaffold-control"  # cᵢ in context.state


def train(msg: Message, context: Context) -> Message:
    """Handle one FedAvg ``train`` message."""
    settings, device, model = setup(context)
    round_config = msg.content["config"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    ds, rows, pid = partition(context, settings)
    images, labels = (t.to(device) for t in ds.train(rows))
    opt = torch.optim.SGD(
        model.parameters(),
        lr=float(round_config["lr"]),
        momentum=float(round_config["momentum"]),
        weight_decay=float(round_config["weight-decay"]),
    )
    rng = np.random.default_rng([int(round_config["seed"]), pid, int(round_config["server-round"])])
    batch_size = int(round_config["batch-size"])
    mu = float(round_config.get("proximal-mu", 0.0))
    scaffold = settings["strategy"] == "scaffold"
    anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 or scaffold else []
    controls = _controls(msg, context, model) if scaffold else {}  # before training: a refusal keeps the state
    correction = {name: torch.from_numpy(c - ci).to(device) for name, (c, ci) in controls.items()}
    steps = 0
    model.train()
    total, seen = 0.0, 0
    max_batches = int(round_config.get("local-batches", 0))  # 0: whole epochs
    for _ in range(int(round_config["local-epochs"])):
        order = torch.from_numpy(rng.permutation(rows.size)).to(device)
        starts = range(0, rows.size, batch_size)
        for start in starts[:max_batches] if max_batches else starts:
            idx = order[start : start + batch_size]
            loss = nn.functional.cross_entropy(model(images[idx]), labels[idx])
            total += loss.item() * idx.numel()
            if mu > 0:
                pull = sum((p - p0).pow(2).sum() for p, p0 in zip(model.parameters(), anchor, strict=True))
                loss = loss + mu / 2 * pull
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for name, p in model.named_parameters():
                if name in correction:
                    p.grad.add_(correction[name])  # SCAFFOLD: g + c − cᵢ
            opt.step()
            steps += 1
            seen += idx.numel()
    state = model.state_dict()
    if byzantine(settings, *partition_id(context)):  # a fault study's attacker
        state = _attack(msg.content["arrays"].to_torch_state_dict(), state, settings, rng)
    records = {}
    if scaffold:
        factor = (1.0 - float(round_config["momentum"])) / (max(steps, 1) * float(round_config["lr"]))
        records[CONTROL] = _control_delta(controls, context, model, anchor, factor)
    reply = RecordDict(
        {
            **records,
            "arrays": ArrayRecord(state),
            "metrics": MetricRecord(
                {
                    "num-examples": int(rows.size) if not max_batches else seen // int(round_config["local-epochs"]),
                    "train-loss": total / max(seen, 1),
                }
            ),
        }
    )
    return Message(content=reply, reply_to=msg)


def _controls(msg: Message, context: Context, model: nn.Module) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """SCAFFOLD's (c, cᵢ) per parameter name: c from the message, cᵢ from ``context.state``, zeros where absent."""
    server = msg.content[CONTROL] if CONTROL in msg.content else ArrayRecord()
    own = context.state[OWN_CONTROL] if OWN_CONTROL in context.state else ArrayRecord()
    out = {}
    for name, p in model.named_parameters():
        c = server[name].numpy() if name in server else np.zeros(p.shape, np.float32)
        ci = own[name].numpy() if name in own else np.zeros(p.shape, np.float32)
        if c.shape != tuple(p.shape) or not np.isfinite(c).all():
            raise ClientStateError(
                f"node {context.node_id}: the server's control variate {name!r} has shape {c.shape} (the "
                f"parameter's: {tuple(p.shape)}) or non-finite values: refused"
            )
        out[name] = (c, ci)
    return out


def _control_delta(
    controls: dict[str, tuple[np.ndarray, np.ndarray]],
    context: Context,
    model: nn.Module,
    anchor: list[torch.Tensor],
    factor: float,
) -> ArrayRecord:
    """Δcᵢ = cᵢ⁺ − cᵢ with cᵢ⁺ = cᵢ − c + factor·(x − y), factor = (1 − β)/(K·η); cᵢ⁺ goes to ``context.state``."""
    delta, updated = {}, {}
    for (name, p), x in zip(model.named_parameters(), anchor, strict=True):
        c, ci = controls[name]
        d = (-c + factor * (x - p.detach()).cpu().numpy()).astype(np.float32)
        delta[name], updated[name] = Array(d), Array((ci + d).astype(np.float32))
    context.state[OWN_CONTROL] = ArrayRecord(updated)
    return ArrayRecord(delta)


def _attack(
    sent: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], settings: dict, rng: np.random.Generator
) -> dict[str, torch.Tensor]:
    """The Byzantine model: the honest update u = trained − sent flipped or randomized, times s."""
    scale = settings["byzantine-scale"]
    out = {}
    for name, x in sent.items():
        x = x.to(trained[name].device)
        u = trained[name] - x
        if settings["byzantine-mode"] == "flip":
            out[name] = x - scale * u
        else:
            xi = torch.from_numpy(rng.standard_normal(u.shape).astype(np.float32)).to(u.device)
            out[name] = x + scale * u.norm() * xi / xi.norm().clamp_min(1e-12)
    return out
