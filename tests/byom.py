"""A user's own app for the tests of the public client API: a model with BatchNorm, a frozen layer, a tied weight.

Data: 28×28 Fashion-MNIST images of one class-skewed partition per node, in a ``DataLoader``
(tuples ``(images, labels)``), as a user's app would hand them over.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flower_dlion import DLionClient

from . import fashion


class ByomNet(nn.Module):
    """784 → 512 → 64 (frozen, then BatchNorm) → 64 → 64 (tied to the layer before) → 10: d = 406,794."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(784, 512)
        with torch.random.fork_rng(devices=[]):  # a pretrained layer: every node and the server load the same
            torch.manual_seed(2024)
            self.frozen = nn.Linear(512, 64).requires_grad_(False)
        self.bn = nn.BatchNorm1d(64)
        self.proj = nn.Linear(64, 64, bias=False)
        self.tied = nn.Linear(64, 64, bias=False)
        self.tied.weight = self.proj.weight
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.embed(x.flatten(1)))
        h = F.silu(self.bn(self.frozen(h)))
        h = F.silu(self.tied(F.silu(self.proj(h))))
        return self.head(h)


@functools.cache
def partition(pid: int, num_partitions: int) -> TensorDataset:
    """One Dirichlet(0.5) partition of the Fashion-MNIST training set."""
    ds = fashion.load()
    rows = fashion.dirichlet_partitions(num_partitions, alpha=0.5)[pid]
    return TensorDataset(fashion.to_tensor(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows]))


def test_set(n: int = 2000) -> tuple[torch.Tensor, torch.Tensor]:
    ds = fashion.load()
    return fashion.to_tensor(ds.x_test[:n]), torch.from_numpy(ds.y_test[:n])


def accuracy(model: nn.Module) -> float:
    x, y = test_set()
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


app = ClientApp()
dlion = DLionClient(app, ByomNet, state_in_context=True)


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config.get("partition-id", context.node_id % 4))
    loader = DataLoader(partition(pid, 4), batch_size=32, shuffle=True)
    return dlion.train(msg, context, loader)


def initial_state(seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return {k: v.detach().numpy().copy() for k, v in ByomNet().state_dict().items()}
