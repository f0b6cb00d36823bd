"""The FedAvg client: ``local-epochs`` epochs of SGD on the whole partition, then the model.

Speaks Flower's own ``FedAvg`` messages: receives "arrays" (the global model) and
"config" (lr, momentum, weight-decay, local-epochs, batch-size, seed, server-round),
replies "arrays" (the local model) and "metrics" (num-examples, train-loss). The
optimizer (``torch.optim.SGD``) starts fresh every round, as in McMahan et al. (2017).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from ..data import to_tensor
from .common import partition, setup

__all__ = ["train"]


def train(msg: Message, context: Context) -> Message:
    """Handle one FedAvg ``train`` message."""
    settings, device, model = setup(context)
    cfg = msg.content["config"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    ds, rows, pid = partition(context, settings)
    images, labels = to_tensor(ds.x_train[rows]).to(device), torch.from_numpy(ds.y_train[rows]).to(device)
    opt = torch.optim.SGD(
        model.parameters(),
        lr=float(cfg["lr"]),
        momentum=float(cfg["momentum"]),
        weight_decay=float(cfg["weight-decay"]),
    )
    rng = np.random.default_rng([int(cfg["seed"]), pid, int(cfg["server-round"])])
    batch_size = int(cfg["batch-size"])
    model.train()
    total, seen = 0.0, 0
    for _ in range(int(cfg["local-epochs"])):
        order = torch.from_numpy(rng.permutation(rows.size)).to(device)
        for start in range(0, rows.size, batch_size):
            idx = order[start : start + batch_size]
            loss = nn.functional.cross_entropy(model(images[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * idx.numel()
            seen += idx.numel()
    reply = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": int(rows.size), "train-loss": total / max(seen, 1)}),
        }
    )
    return Message(content=reply, reply_to=msg)
