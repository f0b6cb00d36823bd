"""The server's global model: one object that owns x and what describes it, handed to the uplink and the downlink.

x is the flat float32 vector of the model's trainable parameters; the rest of the model's
state_dict is its buffers (``rest``, sent with the full model) and its frozen parameters (kept to
be returned, never sent: :mod:`flower_dlion.params`). The strategy holds one :class:`GlobalModel`
(``strategy.model``) and gives the same object to its links, which read it and update x and the
buffers in place; ``strategy.x``, ``strategy.spec`` and ``strategy.num_parameters`` read it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from .. import quantizers
from ..coin_flips import CAUSES
from ..params import ModelSpec, layer_mask
from ..protocol import EXPLAINED_FLIPS, RejectedReply, to_array
from ..uploads import Shape

__all__ = ["GlobalModel", "Layout"]

Layout = list[tuple[str, tuple[int, ...]]]


class GlobalModel:
    """The global model: x, its description (spec, layout, sizes), the rest of its state_dict, the momentum mask.

    Empty (``x`` None) until :meth:`take` sets it from the initial arrays in round 1, or
    :meth:`load_dict` from a checkpoint.

    Attributes
    ----------
    x : torch.Tensor | None
        The trainable parameters, flat float32 (updated in place by the uplink).
    spec : ModelSpec | None
        What the model holds (set with x).
    layout : Layout
        (name, shape) of each tensor of x.
    rest : dict[str, np.ndarray]
        The buffers, by name (what a full model carries besides x).
    frozen : dict[str, np.ndarray]
        The initial arrays' frozen parameters: never sent, returned by :meth:`arrays`.
    dtypes : dict[str, np.dtype]
        Each initial array's name and dtype: how :meth:`arrays` returns it.
    momentum_mask : torch.Tensor | None
        The parameters whose momentum is synchronized (:meth:`mask_momentum`; None: not set).

    """

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.spec: ModelSpec | None = None
        self.layout: Layout = []
        self.rest: dict[str, np.ndarray] = {}
        self.frozen: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.momentum_mask: torch.Tensor | None = None

    @property
    def num_parameters(self) -> int:
        """d, the length of x (0 before the first round)."""
        return 0 if self.x is None else self.x.numel()

    @property
    def sizes(self) -> list[int]:
        """The number of values of each tensor of x, in flat order."""
        return [math.prod(shape) for _, shape in self.layout]

    def scale_sizes(self, scale_block: int) -> list[int]:
        """The number of values under each scale of an upload or a broadcast (``scale_block``; 0: one per tensor)."""
        return quantizers.scale_blocks(self.sizes, scale_block)

    def shape(self, scale_block: int, steps: int) -> Shape:
        """The model's size, scale blocks and K (``steps``), as the upload kinds take them."""
        return Shape(self.num_parameters, self.scale_sizes(scale_block), steps)

    def check_flips(self, values: dict[str, float]) -> None:
        """Check a reply's coin-flips metrics (:mod:`flower_dlion.coin_flips`) against the model.

        ``coin-flips``: an integer in [0, d]; when the client explains them, ``coin-flips-tensor``
        an index of the layout, ``coin-flips-share`` in [0, 1] and ``coin-flips-cause`` one of
        :data:`~flower_dlion.coin_flips.CAUSES`.

        Raises
        ------
        RejectedReply
            Naming the first metric out of its range.

        """
        d, tensors = self.num_parameters, len(self.layout)
        flips = values.get("coin-flips", 0)
        if not (isinstance(flips, int) and 0 <= flips <= d):
            raise RejectedReply(f"metric 'coin-flips' is {flips!r}, expected an integer in [0, {d}]")
        tensor, share, cause = (values.get(k) for k in EXPLAINED_FLIPS)
        if tensor is not None and not (isinstance(tensor, int) and 0 <= tensor < tensors):
            raise RejectedReply(f"metric 'coin-flips-tensor' is {tensor!r}, expected an integer in [0, {tensors})")
        if share is not None and not 0.0 <= share <= 1.0:
            raise RejectedReply(f"metric 'coin-flips-share' is {share!r}, expected a number in [0, 1]")
        if cause is not None and cause not in CAUSES:
            raise RejectedReply(f"metric 'coin-flips-cause' is {cause!r}, expected one of {sorted(CAUSES)}")

    def mask_momentum(self, prefixes: tuple[str, ...]) -> None:
        """Set :attr:`momentum_mask` to the parameters named by ``prefixes`` (``momentum_sync_layers``; empty: all)."""
        self.momentum_mask = layer_mask(self.layout, prefixes)

    def take(self, values: dict[str, np.ndarray], spec: ModelSpec | None, checksums: dict[str, int]) -> None:
        """Take x and the rest from the initial arrays (``values``, name → array), described by ``spec``.

        ``spec`` None: every array is trainable. ``checksums``: the initial frozen tensors' (filled as computed).

        Raises
        ------
        ValueError
            When ``spec`` (the clients' model description) does not match the arrays: the
            message names the first differing tensor.

        """
        spec = ModelSpec.of_arrays(values) if spec is None else spec
        spec.check_arrays(values, checksums)
        self.spec = spec
        self.layout = spec.layout
        self.dtypes = {name: a.dtype for name, a in values.items()}
        self.x = torch.cat(
            [
                torch.from_numpy(np.ascontiguousarray(values[e.name], dtype=np.float32)).reshape(-1)
                for e in spec.trainable
            ]
        ).clone()
        self.rest = {e.name: np.array(values[e.name]) for e in spec.rest}
        self.frozen = {e.name: values[e.name] for e in spec.of_kind("frozen") if e.name in values}

    def arrays(self) -> ArrayRecord:
        """The model as an ArrayRecord with the initial names, shapes and dtypes (a state_dict)."""
        assert self.x is not None and self.spec is not None
        flat, offset, out = self.x.numpy(), 0, {}
        for e in self.spec.trainable:
            out[e.name] = flat[offset : offset + e.size].reshape(e.shape).astype(self.dtypes[e.name], copy=False)
            offset += e.size
        out |= self.rest | self.frozen
        for e in self.spec.of_kind("alias"):
            if e.target in out:  # not an alias of a frozen parameter the server holds no copy of
                out[e.name] = out[e.target]
        return ArrayRecord({name: to_array(out[name]) for name in self.dtypes})  # the values copied once

    def to_dict(self) -> dict[str, Any]:
        """The model's part of a checkpoint (torch-saveable): x, spec, rest, frozen, out-dtypes."""
        return {
            "x": None if self.x is None else self.x.clone(),
            "spec": None if self.spec is None else self.spec.encode(),
            "rest": {name: torch.from_numpy(a.copy()) for name, a in self.rest.items()},
            "frozen": {name: torch.from_numpy(np.array(a)) for name, a in self.frozen.items()},
            "out-dtypes": {name: str(dtype) for name, dtype in self.dtypes.items()},
        }

    def load_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`to_dict` (the momentum mask is left to the strategy: :meth:`mask_momentum`)."""
        self.x = None if state["x"] is None else state["x"].clone()
        self.spec = None if state["spec"] is None else ModelSpec.decode(state["spec"])
        self.layout = [] if self.spec is None else self.spec.layout
        self.rest = {name: t.numpy().copy() for name, t in state["rest"].items()}
        self.frozen = {name: t.numpy().copy() for name, t in state.get("frozen", {}).items()}
        self.dtypes = {name: np.dtype(dtype) for name, dtype in state["out-dtypes"].items()}
