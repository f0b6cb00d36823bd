"""ClientApp of the repository's Fashion-MNIST app: the public client API, plus the baselines' clients.

* ``dlion-vote``, ``dlion-mean``, ``signsgd-vote``: :class:`flower_dlion.DLionClient`, as any
  user's app uses it, fed with this node's Fashion-MNIST partition (:class:`PartitionBatches`)
  and with its settings taken from the run config;
* ``global-lion``, ``global-adamw``, ``terngrad``: ``clients/gradient.py`` (stateless,
  gradient out);
* ``fedavg`` and Flower's robust aggregators (``fedmedian``, ``fedtrimmedavg``, ``krum``,
  ``multikrum``, ``bulyan``): ``clients/fedavg.py`` (local SGD epochs, model out).

The hello of our strategies (a ``query.dlion`` message) is answered by the DLionClient.

Fault studies: with run config ``fail-fraction`` f > 0, a node raises in a train message with
probability f (seeded by seed, partition and round); with ``byzantine-fraction`` the first k
partitions attack as ``byzantine-mode`` says (``clients/attacks.py``: flipped or random signs,
lies about scales or momentum, "a little is enough"), through DLionClient's ``tamper``.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flower_dlion.clients.dlion import ClientSettings, DLionClient, UploadHook
from flower_dlion_app.clients import fedavg, gradient
from flower_dlion_app.clients.attacks import attacker
from flower_dlion_app.clients.common import PartitionBatches, byzantine, inject_failure, partition_id
from flower_dlion_app.config import DLION_STRATEGIES, FEDAVG_FAMILY, read_config
from flower_dlion_app.model import MODELS, Net

BASELINES = {
    "global-lion": gradient.train,
    "global-adamw": gradient.train,
    "terngrad": gradient.train,
} | dict.fromkeys(FEDAVG_FAMILY, fedavg.train)


class FashionMNISTClient(DLionClient):
    """The app's D-Lion client: its settings come from the run config (``device``, ``client-state-dir`` …)."""

    def settings(self, context: Context) -> ClientSettings:
        """The run config's ``device``, ``client-state-dir``, ``state-in-context``, ``momentum-dtype`` and the rest.

        Also ``max-resident`` and ``link-mbps`` (0 and -1: None), and ``max-local-batches``.

        Also builds the run config's ``model`` from now on (a run of another model replaces the
        model objects, and the states kept on the device, of the last one).
        """
        cfg = read_config(context.run_config)
        if self.model_fn is not MODELS[cfg["model"]]:
            self.model_fn = MODELS[cfg["model"]]
            self._devices.clear()
        return ClientSettings(
            device=cfg["device"],
            state_dir=cfg["client-state-dir"] or None,
            state_in_context=cfg["state-in-context"],
            momentum_dtype=cfg["momentum-dtype"],
            max_resident=None if cfg["max-resident"] < 0 else cfg["max-resident"],
            link_mbps=cfg["link-mbps"] or None,
            max_batches=cfg["max-local-batches"],
        )


app = ClientApp()
dlion = FashionMNISTClient(app, Net)


def tamper_for(settings: dict[str, Any], context: Context) -> UploadHook | None:
    """The fault study's attacker (``clients/attacks.py``) on a Byzantine node; None on an honest one."""
    if not byzantine(settings, *partition_id(context)):
        return None
    return attacker(settings["byzantine-mode"], steps=settings["local-steps"], factor=settings["byzantine-scale"])


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
