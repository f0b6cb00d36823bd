"""edgeapp: a small mobile-style CNN and each device's own data (``<data-dir>/train.npz``)."""

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def _separable(c_in: int, c_out: int) -> nn.Sequential:
    """Depthwise 3×3, pointwise 1×1, BatchNorm, SiLU."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in, bias=False),
        nn.Conv2d(c_in, c_out, 1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.SiLU(),
    )


class EdgeNet(nn.Module):
    """A depthwise-separable CNN for 28×28 grey images (about 30 k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.SiLU())
        self.blocks = nn.Sequential(_separable(32, 64), nn.MaxPool2d(2), _separable(64, 128), nn.MaxPool2d(2))
        self.head = nn.Linear(128 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).flatten(1))


def images(x: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) → float32 (N, 1, 28, 28) in [-1, 1]."""
    return torch.from_numpy(x).float().div(127.5).sub(1.0).unsqueeze(1)


def load_local_data(data_dir: str, batch_size: int) -> DataLoader:
    """This device's training data: ``<data-dir>/train.npz`` with ``x`` (uint8, N×28×28) and ``y`` (labels)."""
    path = Path(data_dir).expanduser() / "train.npz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: start the SuperNode with --node-config \"data-dir='<folder>'\"")
    with np.load(path) as data:
        dataset = TensorDataset(images(data["x"]), torch.from_numpy(data["y"].astype(np.int64)))
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)
