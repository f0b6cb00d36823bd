"""How many uploaded signs are coin flips in honest runs, and where: the measurement behind the warning's threshold.

    .venv/bin/python benchmarks/coin_flips.py [--rounds 20] [--nodes 10]

Each model trains under ``DistributedLion`` (vote, lr 1e-3) on the in-process grid, every message
serialized, Fashion-MNIST split Dirichlet(0.5) over the nodes, batch 32, seed 0:

- ``repo-cnn``: the repository's CNN (SiLU);
- ``relu-cnn``: niid_bench's CNN (LeNet-5: two 5×5 convolutions and three linear layers, ReLU);
- ``relu-mlp``: 784 → 200 → 200 → 10 with ReLU (FedAvg's paper's MLP: first-layer weights of
  always-blank pixels);
- ``lora-mlp``: a frozen 784 → 256 → 10 MLP whose two layers carry rank-8 LoRA adapters (B = 0 at
  the start), only the adapters trained.

Prints, per model, the round's ``coin-flip-fraction`` (min, median, max over the rounds and its
first three rounds), and what the clients' ``coin-flips-*`` metrics named in the first round that
explained them (tensor, share, cause). The warning's threshold (``coin_flips.WARN_ABOVE``) sits
above the honest ReLU models' rounds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.coin_flips import CAUSES
from flower_dlion.testing import LocalGrid
from flower_dlion_app.data import load_fashion_mnist, partition_indices, to_tensor
from flower_dlion_app.model import Net


class ReluCNN(nn.Module):
    """niid_bench's CNN for 28×28 images (LeNet-5 with ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 4 * 4, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def relu_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10)
    )


class LoraLinear(nn.Module):
    """A frozen linear layer plus a rank-r adapter ``B @ A`` (B = 0 at the start, as LoRA's)."""

    def __init__(self, fan_in: int, fan_out: int, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, fan_in) / fan_in**0.5)
        self.lora_B = nn.Parameter(torch.zeros(fan_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


class LoraMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = LoraLinear(784, 256), LoraLinear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x.flatten(1))))


MODELS = {"repo-cnn": Net, "relu-cnn": ReluCNN, "relu-mlp": relu_mlp, "lora-mlp": LoraMLP}


def run(name: str, rounds: int, nodes: int) -> None:
    ds = load_fashion_mnist()
    parts = partition_indices(ds.y_train, partitioner="dirichlet", num_partitions=nodes, alpha=0.5)
    app, explained = ClientApp(), []
    client = DLionClient(app, MODELS[name])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rows = parts[int(context.node_config["partition-id"])]
        data = TensorDataset(to_tensor(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows]))
        reply = client.train(msg, context, DataLoader(data, batch_size=32, shuffle=True))
        if "coin-flips-cause" in reply.content["dlion.metrics"] and not explained:
            explained.append(dict(reply.content["dlion.metrics"]))
        return reply

    torch.manual_seed(0)
    strategy = DistributedLion(lr=1e-3, min_available_nodes=nodes)
    strategy.start(LocalGrid(app, nodes), ArrayRecord(MODELS[name]().state_dict()), num_rounds=rounds, timeout=5)
    fractions = [h["coin-flip-fraction"] for h in strategy.history]
    first = ", ".join(f"{100 * f:.2f}" for f in fractions[:3])
    low, mid, high = (100 * f(fractions) for f in (min, statistics.median, max))
    print(f"{name:9s} d={strategy.num_parameters:>7,} flips % min {low:6.2f} median {mid:6.2f} max {high:6.2f} "
          f"(rounds 1-3: {first})")  # fmt: skip
    if explained:
        m = explained[0]
        tensor = strategy.spec.layout[int(m["coin-flips-tensor"])][0]
        cause = int(m["coin-flips-cause"])
        print(f"          first explained: {100 * m['coin-flips-share']:.0f} % of its zero-momentum coordinates in "
              f"'{tensor}', cause {cause}: {CAUSES[cause][:60]}…")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="rounds per model (default 20)")
    parser.add_argument("--nodes", type=int, default=10, help="nodes (default 10)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args()
    for name in args.models.split(","):
        run(name, args.rounds, args.nodes)


if __name__ == "__main__":
    main()
