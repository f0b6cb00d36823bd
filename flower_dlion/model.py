"""The shipped model: a small CNN for 28×28 grey images, without BatchNorm.

Lion updates trainable parameters only; a model with float buffers (BatchNorm running
statistics) would need them synchronized separately, so the shipped model has none.
Parameters are flattened in ``named_parameters()`` order; :func:`layout` names that
order so a server and a client can check that they agree before exchanging bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "Net",
    "evaluate",
    "flat_gradient",
    "flat_parameters",
    "layer_mask",
    "layout",
    "layout_fingerprint",
    "load_flat_",
    "num_parameters",
    "seeded_net",
]


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


def seeded_net(seed: int) -> Net:
    """``Net()`` initialized from ``torch.manual_seed(seed)``, without touching the global RNG.

    The server's initial model; a client given the same seed builds the same x₀ (checked by
    checksum), so the first download can be a seed instead of the model.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net()


def layer_mask(names_and_shapes: Iterable[tuple[str, Sequence[int]]], prefixes: Sequence[str]) -> torch.Tensor:
    """Boolean mask over the flat parameters: True for tensors whose name starts with a prefix.

    An empty ``prefixes`` selects every parameter.
    """
    parts = []
    for name, shape in names_and_shapes:
        n = 1
        for s in shape:
            n *= int(s)
        parts.append(torch.full((n,), not prefixes or name.startswith(tuple(prefixes)), dtype=torch.bool))
    return torch.cat(parts)


def num_parameters(model: nn.Module) -> int:
    """Number of trainable scalars d."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def layout_fingerprint(names_and_shapes: Iterable[tuple[str, Sequence[int]]]) -> str:
    """A short fingerprint of parameter names, shapes and their order (sha256 prefix)."""
    desc = ";".join(f"{name}:{tuple(int(s) for s in shape)}" for name, shape in names_and_shapes)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def layout(model: nn.Module) -> str:
    """:func:`layout_fingerprint` of the model's trainable parameters."""
    return layout_fingerprint((name, p.shape) for name, p in model.named_parameters() if p.requires_grad)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All trainable parameters as one flat float32 vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).float()


def flat_gradient(
    model: nn.Module, x: torch.Tensor, images: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy loss at the flat parameters ``x`` and its gradient as one flat vector."""
    load_flat_(model, x)
    loss = nn.functional.cross_entropy(model(images), labels)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def load_flat_(model: nn.Module, x: torch.Tensor) -> None:
    """Copy the flat vector ``x`` into the model's trainable parameters."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                n = p.numel()
                p.copy_(x[offset : offset + n].view_as(p))
                offset += n
    if offset != x.numel():
        raise ValueError(f"flat vector has {x.numel()} values, the model has {offset} parameters")


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
