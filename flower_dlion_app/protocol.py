"""What the app's baseline messages hold: the wire keys of SCAFFOLD and the gradient baselines.

The Distributed Lion messages are the library's (:mod:`flower_dlion.protocol`); these are the
app's own baselines'.

SCAFFOLD (``strategies/scaffold.py``, ``clients/fedavg.py``) adds one record to Flower's
``FedAvg`` messages ("arrays", "config"; reply "arrays", "metrics")::

    server → client  "control"  ArrayRecord  c, the server's control variate, one Array per parameter
    client → server  "control"  ArrayRecord  Δcᵢ, the change of the client's own control variate

The gradient baselines (global Lion, global AdamW, TernGrad; ``strategies/global_opt.py``,
``clients/gradient.py``)::

    server → client  "grad.config"  ConfigRecord  server-round, encoding ("fp32" | "terngrad"),
                                                  batch-size, seed, layout
                     "grad.model"   ArrayRecord   one Array "x": the full model, float32 (d,)
    client → server  "grad.update"  ArrayRecord   one Array "payload": the gradient as float32 (d,),
                                                  or TernGrad (stype "terngrad.v1"): T float32
                                                  scalers, then the d trits, 5 per byte
                     "grad.metrics" MetricRecord  num-examples, train-loss
"""

from __future__ import annotations

__all__ = ["CONTROL", "GRAD_CONFIG", "GRAD_METRICS", "GRAD_MODEL", "GRAD_UPDATE", "TERNGRAD_STYPE"]

CONTROL = "control"  # SCAFFOLD: c server → client, Δcᵢ client → server
GRAD_CONFIG = "grad.config"
GRAD_MODEL = "grad.model"
GRAD_UPDATE = "grad.update"
GRAD_METRICS = "grad.metrics"
TERNGRAD_STYPE = "terngrad.v1"
