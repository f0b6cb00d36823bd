"""What a strategy's uplink and downlink read of it: its model (:class:`ModelView`) and its nodes (:class:`NodeView`).

Read-only views that always show the strategy's current values (x, the model's description, the
nodes' partitions, the run's key), so the two objects are given what they need, not the strategy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import quantizers
from ..params import ModelSpec
from .common import Layout

__all__ = ["ModelView", "NodeView"]


class ModelView:
    """A strategy's model as its uplink and downlink read it: always the strategy's current one.

    The view cannot rebind anything; the uplink updates x (and the buffers in ``rest``) in place.

    Parameters
    ----------
    strategy : DistributedLion
        (typed ``Any`` here: this module sits below the strategy that holds the views)
        The strategy whose model it shows.

    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @property
    def x(self) -> torch.Tensor | None:
        """The global model's trainable parameters, flat float32 (None before round 1)."""
        return self._strategy.x

    @property
    def spec(self) -> ModelSpec | None:
        """What the model holds (set with x)."""
        return self._strategy.spec

    @property
    def layout(self) -> Layout:
        """(name, shape) of each tensor of x."""
        return self._strategy._layout

    @property
    def sizes(self) -> list[int]:
        """The number of values of each tensor of x."""
        return self._strategy.sizes

    @property
    def num_parameters(self) -> int:
        """d, the length of x."""
        return self._strategy.num_parameters

    @property
    def rest(self) -> dict[str, np.ndarray]:
        """The buffers, by name (what a full model carries besides x)."""
        return self._strategy._rest

    @property
    def scale_sizes(self) -> list[int]:
        """The number of values under each scale of an upload or a broadcast (``scale_block``)."""
        return quantizers.scale_blocks(self.sizes, self._strategy.options.uplink.scale_block)

    @property
    def momentum_mask(self) -> torch.Tensor | None:
        """The parameters whose momentum is synchronized (``momentum_sync_layers``; set with x)."""
        return self._strategy._mask


class NodeView:
    """A strategy's nodes and run as its downlink reads them: partitions, seeds, the run's key, the checkpoint.

    Parameters
    ----------
    strategy : DistributedLion
        (typed ``Any`` here: this module sits below the strategy that holds the views)
        The strategy whose nodes it shows.

    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    def partition_of(self, node_id: int) -> int:
        """The partition (or node) key that the server files a node's replica under."""
        return self._strategy.partition_of(node_id)

    @property
    def sample_seed(self) -> int:
        """The seed of the sampling, also the clients' (their batch order and coin flips)."""
        return self._strategy.sample_seed

    @property
    def state_key(self) -> str:
        """The run's ``state_key`` ("" when none was given: the clients' state files do not outlive the run)."""
        return self._strategy.state_key

    @property
    def run_key(self) -> str:
        """The key the clients file their state under (``DistributedLion.run_key``)."""
        return self._strategy.run_key

    @property
    def checkpoint_round(self) -> int:
        """The latest checkpoint's round (clients keep their state as of it)."""
        return self._strategy.checkpoint_round
