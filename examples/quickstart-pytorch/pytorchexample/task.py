"""pytorchexample: A Flower / PyTorch app (Fashion-MNIST, read offline)."""

import gzip
import os
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# Where the Fashion-MNIST IDX files are: $FASHION_MNIST_DIR, else Debian's dataset-fashion-mnist package
DATA_DIR = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))


class Net(nn.Module):
    """Small CNN with BatchNorm for 28×28 grey images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def _read_idx(name: str) -> np.ndarray:
    """One gzipped IDX file of Fashion-MNIST as a numpy array."""
    raw = gzip.open(DATA_DIR / f"{name}.gz", "rb").read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@cache
def fashion_mnist(split: str) -> TensorDataset:
    """The "train" or "t10k" split as (images normalized to [-1, 1], labels)."""
    images = torch.from_numpy(_read_idx(f"{split}-images-idx3-ubyte").copy()).float().div(127.5).sub(1.0)
    labels = torch.from_numpy(_read_idx(f"{split}-labels-idx1-ubyte").astype(np.int64))
    return TensorDataset(images.unsqueeze(1), labels)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load an IID partition of Fashion-MNIST: 80% to train, 20% to validate."""
    data = fashion_mnist("train")
    rows = torch.randperm(len(data), generator=torch.Generator().manual_seed(42))[partition_id::num_partitions]
    split = int(0.8 * len(rows))
    trainset = TensorDataset(*data[rows[:split]])
    valset = TensorDataset(*data[rows[split:]])
    trainloader = DataLoader(trainset, batch_size=batch_size, shuffle=True)
    valloader = DataLoader(valset, batch_size=batch_size)
    return trainloader, valloader


def load_centralized_dataset():
    """Load the test set."""
    return DataLoader(fashion_mnist("t10k"), batch_size=1000)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
