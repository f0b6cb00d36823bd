"""The FedAvg client: ``local-epochs`` epochs of SGD on the whole partition, then the model.

Speaks Flower's own ``FedAvg`` messages: receives "arrays" (the global model) and
"config" (lr, momentum, weight-decay, local-epochs, local-batches (0: whole epochs; k: only
the first k minibatches of each epoch), batch-size, seed, server-round),
replies "arrays" (the local model) and "metrics" (num-examples, train-loss). The
optimizer (``torch.optim.SGD``) starts fresh every round, as in McMahan et al. (2017).
With FedProx's "proximal-mu" μ > 0 in the config, each batch's loss gains μ/2·‖w − x‖², x
the model received (Li et al., 2020).

Faults for studies: with ``byzantine-fraction`` the first k partitions send
x + s·(−u) (``byzantine-mode = "flip"``) or x + s·‖u‖·ξ/‖ξ‖ with Gaussian ξ
(``"random"``) instead of x + u, where u is their honest update and s is
``byzantine-scale``.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from ..data import to_tensor
from .common import byzantine, partition, partition_id, setup

__all__ = ["train"]


def train(msg: Message, context: Context) -> Message:
    """Handle one FedAvg ``train`` message."""
    settings, device, model = setup(context)
    round_config = msg.content["config"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    ds, rows, pid = partition(context, settings)
    images, labels = to_tensor(ds.x_train[rows]).to(device), torch.from_numpy(ds.y_train[rows]).to(device)
    opt = torch.optim.SGD(
        model.parameters(),
        lr=float(round_config["lr"]),
        momentum=float(round_config["momentum"]),
        weight_decay=float(round_config["weight-decay"]),
    )
    rng = np.random.default_rng([int(round_config["seed"]), pid, int(round_config["server-round"])])
    batch_size = int(round_config["batch-size"])
    mu = float(round_config.get("proximal-mu", 0.0))
    anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 else []
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
            opt.step()
            seen += idx.numel()
    state = model.state_dict()
    if byzantine(settings, *partition_id(context)):  # a fault study's attacker
        state = _attack(msg.content["arrays"].to_torch_state_dict(), state, settings, rng)
    reply = RecordDict(
        {
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
