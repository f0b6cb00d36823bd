"""The repository app's models: small CNNs for 28×28 grey images (and, by name, the text models), and their evaluation.

Any ``nn.Module`` works with the library (:mod:`flower_dlion.params`). :class:`Net` is the
default federation's, kept without BatchNorm so that its results stay comparable with the
study's; :class:`NetBN` is the same CNN with BatchNorm after each convolution (run config
``model = "cnn-bn"``), a second model for the studies whose buffers stay with the clients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flower_dlion.params import Binding, cross_entropy_loss
from flower_dlion_app.text_models import TEXT_MODELS

__all__ = ["MODELS", "Net", "NetBN", "evaluate", "flat_gradient", "flat_parameters", "seeded_net"]


class Net(nn.Module):
    """conv5×5(16) → pool → conv5×5(32) → pool → fc(512) → fc(10); 281,034 parameters.

    SiLU rather than ReLU: with ReLU a feature that is 0 for a whole minibatch gives its
    weights an exactly-zero gradient, which a 1-bit sign cannot carry
    (``benchmarks/zero_signs.py`` measures how often that happens).
    """

    def __init__(self, num_classes: int = 10, activation: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5),
            activation(),
            nn.MaxPool2d(2),  # 28 → 24 → 12
            nn.Conv2d(16, 32, 5),
            activation(),
            nn.MaxPool2d(2),  # 12 → 8 → 4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 512), activation(), nn.Linear(512, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of shape (B, 1, 28, 28)."""
        return self.classifier(self.features(x))


class NetBN(Net):
    """:class:`Net` with BatchNorm after each convolution; 281,130 parameters and 98 buffer values."""

    def __init__(self, num_classes: int = 10, activation: type[nn.Module] = nn.SiLU) -> None:
        super().__init__(num_classes, activation)
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5),
            nn.BatchNorm2d(16),
            activation(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5),
            nn.BatchNorm2d(32),
            activation(),
            nn.MaxPool2d(2),
        )


MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": Net, "cnn-bn": NetBN} | TEXT_MODELS  # run config ``model``


def seeded_net(seed: int, model: str = "cnn") -> nn.Module:
    """``MODELS[model]()`` initialized from ``torch.manual_seed(seed)``, without touching the global RNG.

    The server's initial model; a client given the same seed builds the same x₀ (checked by
    checksum), so the first download can be a seed instead of the model.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[model]()


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All trainable parameters as one flat float32 vector (a copy): x as D-Lion lays it out."""
    return Binding(model).flat_parameters()


def flat_gradient(
    model: nn.Module, x: torch.Tensor, images: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy loss at the flat parameters ``x`` and its gradient as one flat vector."""
    return Binding(model).gradient(x, cross_entropy_loss, (images, labels))


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 2000
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on a labelled set."""
    model.eval()
    total_loss, correct = 0.0, 0
    for i in range(0, labels.numel(), batch_size):
        logits = model(images[i : i + batch_size])
        y = labels[i : i + batch_size]
        total_loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return total_loss / labels.numel(), correct / labels.numel()
