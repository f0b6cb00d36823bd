"""SCAFFOLD (Karimireddy et al., ICML 2020) on Flower's FedAvg messages: drift control by control variates.

The server keeps a control variate c (one float32 array per trainable parameter) and sends it
beside the model; each client keeps its own cᵢ and corrects every local SGD step::

    client i:  y ← y − η·(g(y) + c − cᵢ)                      K times, from y = x
               cᵢ⁺ = cᵢ − c + (1 − β)·(x − y) / (K·η)           option II; β the SGD momentum
               sends y and Δcᵢ = cᵢ⁺ − cᵢ
    server:    x ← Σ nᵢ·yᵢ / Σ nᵢ                               FedAvg's weighted mean (η_g = 1)
               c ← c + (|S| / N)·mean(Δcᵢ)                       S: the round's valid replies, N: the nodes

(1 − β)/η is the inverse of heavy-ball SGD's effective step, which the paper's plain SGD (β = 0)
reduces to. Both directions carry two float32 models: the byte meter counts them.

Reference: S. P. Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from flower_dlion_app.protocol import CONTROL

__all__ = ["Scaffold"]


class Scaffold(FedAvg):
    """Flower's ``FedAvg`` with SCAFFOLD's control variates (see the module docstring).

    Takes ``FedAvg``'s keyword arguments. A reply whose Δcᵢ is missing, has other arrays than
    the model's float parameters, another shape, or values that are not finite is rejected
    (logged with its node) and counts neither for x nor for c; the other replies make the round.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.control: dict[str, np.ndarray] | None = None  # c; None: zeros (sent from round 2 on)
        self._num_nodes = 0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's messages, each with c (nothing in round 1: c = 0)."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._num_nodes = len(list(grid.get_node_ids()))
        if self.control is not None:
            for msg in messages:
                msg.content[CONTROL] = ArrayRecord({k: Array(v) for k, v in self.control.items()})
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The model from FedAvg's aggregate of the valid replies, c ← c + (|S|/N)·mean(Δcᵢ)."""
        valid: list[Message] = []
        deltas: list[dict[str, np.ndarray]] = []
        for msg in replies:
            if msg.has_error():
                valid.append(msg)  # FedAvg logs it
                continue
            try:
                delta = self._control_delta(msg, deltas[0] if deltas else self.control)
            except ValueError as err:
                log(WARNING, "round %d: rejected reply from node %d: %s", server_round, msg.metadata.src_node_id, err)
                continue
            del msg.content[CONTROL]  # FedAvg's checks expect one ArrayRecord
            valid.append(msg)
            deltas.append(delta)
        arrays, metrics = super().aggregate_train(server_round, valid)
        if deltas:
            weight = len(deltas) / max(self._num_nodes, len(deltas))
            base = self.control or {k: np.zeros_like(v) for k, v in deltas[0].items()}
            self.control = {
                k: (base[k] + weight * np.mean([d[k] for d in deltas], axis=0)).astype(np.float32) for k in base
            }
        return arrays, metrics

    def _control_delta(self, msg: Message, reference: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """The reply's Δcᵢ, checked against the model it sent and against c (or the round's first Δc)."""
        if CONTROL not in msg.content:
            raise ValueError(f"no '{CONTROL}' record (Δcᵢ): is its ClientApp a SCAFFOLD client?")
        delta = {k: a.numpy() for k, a in msg.content[CONTROL].items()}
        model = msg.content[self.arrayrecord_key] if self.arrayrecord_key in msg.content else ArrayRecord()
        for name, value in delta.items():
            if name not in model or tuple(model[name].shape) != value.shape:
                raise ValueError(f"Δc '{name}' of shape {value.shape} is not one of the model's arrays")
            if value.dtype != np.float32:
                raise ValueError(f"Δc '{name}' must be float32, got {value.dtype}")
            if not np.isfinite(value).all():
                raise ValueError(f"Δc '{name}' has non-finite values")
        if not delta or (reference is not None and set(delta) != set(reference)):
            want = "the model's parameters" if reference is None else sorted(reference)
            raise ValueError(f"Δc has arrays {sorted(delta)}, expected {want}")
        return delta
