"""Small torch models for the library's tests: a user's own models, no import of the repository's app."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Net"]


class Net(nn.Module):
    """conv5×5(16) → pool → conv5×5(32) → pool → fc(512) → fc(10), SiLU; 281,034 parameters.

    The repository app's default CNN (``flower_dlion_app.model.Net``), layer for layer: the same
    state_dict names and shapes, the same values under the same torch seed.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5), nn.SiLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.SiLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 512), nn.SiLU(), nn.Linear(512, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of shape (B, 1, 28, 28)."""
        return self.classifier(self.features(x))
