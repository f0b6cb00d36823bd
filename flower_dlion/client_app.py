"""ClientApp of the repository's Fashion-MNIST app: the public client API, plus the baselines' clients.

* ``dlion-vote``, ``dlion-mean``, ``signsgd-vote``: :class:`flower_dlion.DLionClient`, as any
  user's app uses it, fed with this node's Fashion-MNIST partition (:class:`PartitionBatches`)
  and with its settings taken from the run config;
* ``global-lion``, ``global-adamw``, ``terngrad``: ``clients/gradient.py`` (stateless,
  gradient out);
* ``fedavg``: ``clients/fedavg.py`` (local SGD epochs, model out).

The hello of our strategies (a ``query.dlion`` message) is answered by the DLionClient.

Fault studies: with run config ``fail-fraction`` f > 0, a node raises in a train message with
probability f (seeded by seed, partition and round); with ``byzantine-fraction`` the first k
partitions upload −U (``byzantine-mode = "flip"``) or K·(random signs) (``"random"``) instead
of U (through DLionClient's ``tamper``).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .clients import fedavg, gradient
from .clients.common import PartitionBatches, byzantine, inject_failure, partition_id
from .clients.dlion import ClientSettings, DLionClient, Tamper
from .config import DLION_STRATEGIES, read_config
from .model import Net

BASELINES = {
    "global-lion": gradient.train,
    "global-adamw": gradient.train,
    "terngrad": gradient.train,
    "fedavg": fedavg.train,
}


class FashionMNISTClient(DLionClient):
    """The app's D-Lion client: its settings come from the run config (``device``, ``client-state-dir`` …)."""

    def settings(self, context: Context) -> ClientSettings:
        """``device``, ``client-state-dir``, ``state-in-context`` and ``momentum-dtype`` of the run config."""
        cfg = read_config(context.run_config)
        return ClientSettings(
            device=cfg["device"],
            state_dir=cfg["client-state-dir"] or None,
            state_in_context=cfg["state-in-context"],
            momentum_dtype=cfg["momentum-dtype"],
        )


app = ClientApp()
dlion = FashionMNISTClient(app, Net)


def tamper_for(settings: dict[str, Any], context: Context) -> Tamper | None:
    """The Byzantine upload of a fault study's attacker (None for an honest node)."""
    if not byzantine(settings, *partition_id(context)):
        return None
    if settings["byzantine-mode"] == "flip":
        return lambda u, gen: -u
    steps = settings["local-steps"]
    return lambda u, gen: steps * (2.0 * torch.randint(0, 2, u.shape, generator=gen, device=u.device) - 1.0)


def server_round(msg: Message) -> int:
    """The round a train message belongs to: its group id (our strategies), else FedAvg's config."""
    if msg.metadata.group_id:
        return int(msg.metadata.group_id)
    return int(msg.content["config"]["server-round"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the handler of the configured strategy (after the injected failure, if any)."""
    settings = read_config(context.run_config)
    if settings["fail-fraction"]:
        inject_failure(settings, partition_id(context)[0], server_round(msg))
    if settings["strategy"] in DLION_STRATEGIES:
        batches = PartitionBatches(context, settings, server_round(msg))
        return dlion.train(msg, context, batches, tamper=tamper_for(settings, context))
    return BASELINES[settings["strategy"]](msg, context)
