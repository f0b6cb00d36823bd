"""resnetexample: ResNet-18 (torchvision) on CIFAR-10 read from a folder, synthetic images when there is none."""

import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torchvision.transforms import Compose, Normalize, ToTensor

logger = logging.getLogger(__name__)
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def Net() -> nn.Module:
    """ResNet-18 for 32×32 images: a 3×3 stem without max-pooling (11,173,962 parameters, 20 BatchNorms)."""
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


@cache
def cifar10(data_dir: str, train: bool) -> Dataset:
    """CIFAR-10 in torchvision's layout (``<data_dir>/cifar-10-batches-py``), else synthetic images.

    The synthetic stand-in has CIFAR-10's shape and 10 classes, each a fixed random colour
    pattern plus noise, so that a model can learn it; it is for trying the app without the data.
    """
    folder = Path(data_dir).expanduser() if data_dir else None
    if folder is not None and (folder / "cifar-10-batches-py").is_dir():
        transform = Compose([ToTensor(), Normalize(MEAN, STD)])
        return torchvision.datasets.CIFAR10(str(folder), train=train, download=False, transform=transform)
    logger.warning("CIFAR-10 not found in data-dir %r: synthetic images of the same shape instead", data_dir)
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 3, 32, 32, generator=gen)
    n = 2000 if train else 500
    gen.manual_seed(1 if train else 2)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = patterns[labels] + 2.0 * torch.randn(n, 3, 32, 32, generator=gen)
    return TensorDataset(images, labels)


def load_data(partition_id: int, num_partitions: int, batch_size: int, data_dir: str) -> DataLoader:
    """An IID partition of the training set."""
    data = cifar10(data_dir, train=True)
    rows = torch.randperm(len(data), generator=torch.Generator().manual_seed(42))[partition_id::num_partitions]
    return DataLoader(Subset(data, rows.tolist()), batch_size=batch_size, shuffle=True)


def load_centralized_dataset(data_dir: str) -> DataLoader:
    """The test set."""
    return DataLoader(cifar10(data_dir, train=False), batch_size=250)


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """Local SGD epochs (FedAvg's client)."""
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


def test(net: nn.Module, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy on the test set."""
    net.to(device)
    net.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += F.cross_entropy(outputs, labels, reduction="sum").item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return loss / len(testloader.dataset), correct / len(testloader.dataset)
