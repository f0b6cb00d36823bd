"""Where a round's coin flips come from: the tensor that holds most of them and the likely cause.

A sign the client uploads is a coin flip where β₁·m + (1−β₁)·g is exactly 0: a coordinate whose
gradient has been 0 in every step so far (its momentum is still 0). A client whose flips exceed
:data:`EXPLAIN_ABOVE` of its signs explains them in three reply metrics (:func:`explain`):

- ``coin-flips-tensor``: the index, in the model's trainable order, of the tensor with the most
  coordinates whose momentum is exactly 0 after the step (m = 0 ⇔ the old m and g were 0);
- ``coin-flips-share``: that tensor's share of those coordinates;
- ``coin-flips-cause``: :data:`ADAPTER` (1) when most of them sit in tensors whose sibling (the
  same module's other parameter, e.g. LoRA's ``lora_A`` beside an all-zero ``lora_B``) is all
  zeros in x: an adapter initialised to zero, whose partner's gradient is 0 until it moves;
  :data:`FIRST_LAYER` (2) when most sit in whole input columns of the first trainable tensor:
  input features that are always 0 (blank border pixels of a flattened image); :data:`INACTIVE`
  (3) otherwise, e.g. whole output rows: units whose activation is 0 on every example so far
  (ReLU units that never fired).

The server (:meth:`flower_dlion.strategies.uplink.Uplink.round_metrics`) warns once per run
when the round's fraction exceeds :data:`WARN_ABOVE`, naming the tensor and the cause.
Imports torch only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ADAPTER", "CAUSES", "EXPLAIN_ABOVE", "FIRST_LAYER", "INACTIVE", "WARN_ABOVE", "explain"]

EXPLAIN_ABOVE = 0.01  # a client explains its flips above 1 % of its signs
WARN_ABOVE = 0.30  # the server warns above 30 %: honest ReLU models reach 27.1 % in round 1 (docs/INTERNALS.md)
ADAPTER, FIRST_LAYER, INACTIVE = 1, 2, 3
CAUSES = {
    ADAPTER: (
        "adapter matrices initialised to zero (LoRA's B = 0 gives A a zero gradient until B moves; it passes "
        "after the first rounds)"
    ),
    FIRST_LAYER: (
        "first-layer weights of input features that are always 0 (e.g. blank border pixels): they only drift "
        "and decay; harmless, but worth dropping those inputs"
    ),
    INACTIVE: (
        "units inactive on every example so far (ReLU units that never fired: SiLU/GELU or a larger batch avoid "
        "it); harmless while the share stays steady"
    ),
}


def explain(m: torch.Tensor, x: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]]) -> dict[str, int | float]:
    """The three ``coin-flips-*`` metrics of a client's reply (see the module doc) from its momentum and replica.

    ``m`` and ``x`` are flat (d,) tensors in the trainable order of ``layout`` (name, shape).
    """
    sizes = [math.prod(shape) for _, shape in layout]
    zeros = torch.stack([part.eq(0).sum() for part in torch.split(m.detach(), sizes)]).cpu().tolist()
    total = sum(zeros)
    if total == 0:
        return {}
    top = max(range(len(zeros)), key=zeros.__getitem__)
    xs = torch.split(x.detach(), sizes)
    zero_matrices = {_owner(name) for (name, shape), part in zip(layout, xs, strict=True)
                     if len(shape) >= 2 and not part.any()}  # fmt: skip
    beside = sum(z for (name, _), z, part in zip(layout, zeros, xs, strict=True)
                 if _owner(name) in zero_matrices and part.any())  # fmt: skip
    if 2 * beside > total:
        cause = ADAPTER
    elif top == 0 and _zero_inputs(torch.split(m.detach(), sizes)[0], layout[0][1]):
        cause = FIRST_LAYER
    else:
        cause = INACTIVE
    return {"coin-flips-tensor": top, "coin-flips-share": zeros[top] / total, "coin-flips-cause": cause}


def _zero_inputs(m: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a weight's zeros are mostly whole input columns (features always 0), not output rows (dead units)."""
    if len(shape) < 2:
        return False
    zero = m.reshape(shape[0], -1).eq(0)
    columns = int(zero.all(dim=0).sum()) * shape[0]
    rows = int(zero.all(dim=1).sum()) * zero.shape[1]
    return columns > rows


def _owner(name: str) -> str:
    """The module a parameter belongs to, an adapter's matrices sharing one: ``q.lora_A.weight`` → ``q``.

    Other parameters: the name less its last component (``fc.weight`` → ``fc``).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if "lora" in part.lower() or "adapter" in part.lower():
            return ".".join(parts[:i])
    return ".".join(parts[:-1])
