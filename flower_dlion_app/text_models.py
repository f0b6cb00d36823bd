"""Character-level language models: the LEAF Shakespeare LSTM and a small decoder-only transformer.

Both take token ids ``x`` of shape (B, T) (``LongTensor``) and return logits. What they return
is chosen once, when the model is built (``last_only``), and can be overridden per call:

* ``last_only=True`` (the default): the logits of the LAST position only, shape (B, V): the
  next character after the window, as in LEAF's Shakespeare task (80 characters in, the 81st
  out). Batches ``(x [B, T], y [B])`` then train with the library's default loss,
  ``cross_entropy(model(inputs), targets)`` (:func:`flower_dlion.params.cross_entropy_loss`),
  so ``DLionClient(app, CharLSTM)`` needs no loss function.
* ``last_only=False``, or ``model(x, last_only=False)``: the logits of every position, shape
  (B, T, V), for language modelling on every position with targets ``y`` of shape (B, T)
  (the inputs shifted by one): pass ``loss_fn=sequence_loss`` to ``DLionClient``.

Every parameter is floating point (Distributed Lion signs real values); the transformer's output
head is tied to its token embedding, so :class:`flower_dlion.params.ModelSpec` lists
``head.weight`` as an ``alias`` of ``tok.weight`` and x holds that matrix once.

References: H. B. McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", 2017 (the Shakespeare LSTM); S. Caldas et al., "LEAF: A Benchmark for
Federated Settings", 2018; A. Radford et al., "Language Models are Unsupervised Multitask
Learners", 2019 (GPT-2).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TEXT_MODELS", "CharLSTM", "CharTransformer", "evaluate_text", "gpt2_small", "sequence_loss"]


class CharLSTM(nn.Module):
    """McMahan et al.'s / LEAF's Shakespeare LSTM: embedding(8) → LSTM(256) → LSTM(256) → linear head.

    At the defaults (V = 81) it has 820,185 parameters: the embedding V·8 = 648, the first LSTM
    layer 4·256·(8 + 256) + 2·4·256 = 272,384, the second 4·256·(256 + 256) + 2·4·256 = 526,336,
    the head 256·V + V = 20,817.

    Parameters
    ----------
    vocab_size : int (default: 81)
        Number of distinct characters V.
    embed_dim : int (default: 8)
        Size of a character's embedding.
    hidden : int (default: 256)
        Hidden size of each LSTM layer.
    layers : int (default: 2)
        Number of stacked LSTM layers.
    last_only : bool (default: True)
        ``forward`` returns the last position's logits (B, V); False: every position's (B, T, V).

    """

    def __init__(
        self, vocab_size: int = 81, embed_dim: int = 8, hidden: int = 256, layers: int = 2, *, last_only: bool = True
    ) -> None:
        super().__init__()
        self.last_only = last_only
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor, last_only: bool | None = None) -> torch.Tensor:
        """Logits for token ids ``x`` (B, T): (B, V) for the last position, or (B, T, V) (see the class)."""
        h, _ = self.lstm(self.embed(x))
        if self.last_only if last_only is None else last_only:
            h = h[:, -1]
        return self.head(h)


class Block(nn.Module):
    """A pre-norm transformer block: ``h + attn(rmsnorm(h))``, then ``h + mlp(rmsnorm(h))``; no biases.

    Parameters
    ----------
    dim : int
        Width of the residual stream.
    heads : int
        Attention heads (``dim`` must be a multiple).
    mlp_ratio : int
        The MLP's hidden width is ``mlp_ratio · dim`` (GELU).
    dropout : float
        Dropout on the attention weights and on each branch's output, in training only.

    """

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim = {dim} is not a multiple of heads = {heads}")
        self.heads, self.dropout = heads, dropout
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim, bias=False)
        self.out = nn.Linear(mlp_ratio * dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The block applied to the residual stream ``h`` (B, T, dim)."""
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, heads, T, c / heads)
        h = h + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return h + self.drop(self.out(F.gelu(self.fc(self.norm2(h)))))


class CharTransformer(nn.Module):
    """A decoder-only transformer in miniature ("GPT-2++"): pre-norm RMSNorm blocks, causal attention, tied head.

    Token embedding + learned positional embedding → ``depth`` × :class:`Block` → RMSNorm →
    linear head whose weight IS the token embedding's (``self.head.weight = self.tok.weight``).
    No biases anywhere. GPT-2's initialization: N(0, 0.02) for every matrix and embedding, the
    residual branches' output projections (``proj``, ``out``) scaled by 1/√(2·depth); RMSNorm
    weights 1. Trainable values (the tied matrix once)::

        V·dim + context·dim + depth·(2·dim + 4·dim² + 2·mlp_ratio·dim²) + dim

    3,189,248 at the defaults (V = 81, context = 80, dim = 256, depth = 4, mlp_ratio = 4);
    :func:`gpt2_small`: 124,337,664.

    Parameters
    ----------
    vocab_size : int (default: 81)
        Number of distinct tokens V.
    context : int (default: 80)
        Longest input (positions of the positional embedding); longer inputs raise ``ValueError``.
    dim, depth, heads, mlp_ratio : int (defaults: 256, 4, 4, 4)
        Width, number of blocks, attention heads per block, MLP expansion.
    dropout : float (default: 0.0)
        Dropout after the embeddings, on attention weights and on each branch (training only).
    last_only : bool (default: True)
        ``forward`` returns the last position's logits (B, V); False: every position's (B, T, V).

    """

    def __init__(
        self,
        vocab_size: int = 81,
        context: int = 80,
        dim: int = 256,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        last_only: bool = True,
    ) -> None:
        super().__init__()
        self.context, self.last_only = context, last_only
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix, listed twice in state_dict()
        for name, p in self.named_parameters():  # the tied matrix once (named_parameters removes duplicates)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, x: torch.Tensor, last_only: bool | None = None) -> torch.Tensor:
        """Logits for token ids ``x`` (B, T ≤ context): (B, V) for the last position, or (B, T, V) (see the class)."""
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"input of {t} tokens, longer than the model's context of {self.context}")
        h = self.drop(self.tok(x) + self.pos(torch.arange(t, device=x.device)))
        for block in self.blocks:
            h = block(h)
        if self.last_only if last_only is None else last_only:
            h = h[:, -1]  # the final norm and the head on the last position only
        return self.head(self.norm(h))


def gpt2_small(
    vocab_size: int = 50257, context: int = 1024, dropout: float = 0.0, last_only: bool = True
) -> CharTransformer:
    """A GPT-2-small-sized :class:`CharTransformer`: dim 768, 12 blocks of 12 heads, tied embeddings.

    124,337,664 trainable values at the defaults (GPT-2's own, with biases and LayerNorm's
    shifts, has 124,439,808). ``dropout``, ``last_only``: as :class:`CharTransformer`'s.
    """
    return CharTransformer(vocab_size, context, 768, 12, 12, 4, dropout, last_only)


TEXT_MODELS: dict[str, Callable[..., nn.Module]] = {"char-lstm": CharLSTM, "char-transformer": CharTransformer}


def sequence_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over every position: a ``loss_fn`` for ``DLionClient`` with batches ``(x [B, T], y [B, T])``.

    Calls ``model(x, last_only=False)`` (both models here take it).
    """
    x, y = batch
    logits = model(x, last_only=False)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def evaluate_text(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> tuple[float, float]:
    """Mean cross-entropy per predicted character (nats) and accuracy of ``model`` on ``(x, y)``.

    Parameters
    ----------
    model : nn.Module
        A model of this module (it must take ``last_only``); evaluated in ``eval()`` mode, without
        gradients, on the device of its parameters; its training mode is restored after.
    x : torch.Tensor
        Token ids, (N, T).
    y : torch.Tensor
        Targets: (N,) for the next character after each window (the last position's logits),
        or (N, T) for every position.
    batch_size : int (default: 256)
        Windows per forward pass.

    Returns
    -------
    tuple[float, float]
        (loss per character, accuracy), both over all ``y.numel()`` targets.

    """
    if y.dim() not in (1, 2) or y.shape != x.shape[: y.dim()]:
        raise ValueError(f"targets of shape {tuple(y.shape)} for inputs of shape {tuple(x.shape)}: (N,) or (N, T)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, correct = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                xb, yb = x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
                logits = model(xb, last_only=y.dim() == 1).flatten(0, -2)
                total += float(F.cross_entropy(logits.float(), yb.flatten(), reduction="sum"))
                correct += int((logits.argmax(-1) == yb.flatten()).sum())
    finally:
        model.train(was_training)
    n = max(y.numel(), 1)
    return total / n, correct / n
