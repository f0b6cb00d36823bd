"""ClientApp entry point: one ``train`` handler per family of strategies (run config ``strategy``).

* ``dlion-vote``, ``dlion-mean``, ``signsgd-vote``: ``clients/dlion.py`` (replica and
  momentum in ``context.state``, packed signs out);
* ``global-lion``, ``global-adamw``, ``terngrad``: ``clients/gradient.py`` (stateless,
  gradient out);
* ``fedavg``: ``clients/fedavg.py`` (local SGD epochs, model out).

A ``query`` message is answered with the node's partition id and the replica versions it
holds (``protocol.HELLO``): our strategies sample and keep track of nodes by partition id.
With run config ``fail-fraction`` f > 0, a node raises in a train message with
probability f (seeded by seed, partition and round: a reproducible fault study).
"""

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .clients import dlion, fedavg, gradient
from .clients.common import inject_failure, partition_id
from .config import DLION_STRATEGIES, read_config
from .protocol import HELLO

HANDLERS = {
    "dlion-vote": dlion.train,
    "dlion-mean": dlion.train,
    "signsgd-vote": dlion.train,
    "global-lion": gradient.train,
    "global-adamw": gradient.train,
    "terngrad": gradient.train,
    "fedavg": fedavg.train,
}

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the handler of the configured strategy (after the injected failure, if any)."""
    settings = read_config(context.run_config)
    if settings["fail-fraction"]:
        inject_failure(settings, partition_id(context)[0], int(msg.metadata.group_id))
    return HANDLERS[settings["strategy"]](msg, context)


@app.query()
def hello(msg: Message, context: Context) -> Message:
    """Say which partition this node trains on and which replica versions it can start from."""
    settings = read_config(context.run_config)
    pid, num_partitions = partition_id(context)
    version = -1
    request = msg.content[HELLO] if HELLO in msg.content else ConfigRecord()
    if settings["strategy"] in DLION_STRATEGIES and isinstance(request, ConfigRecord):
        version = dlion.held_version(context, settings, request)
    reply = {"partition-id": pid, "num-partitions": num_partitions, "version": version}
    return Message(content=RecordDict({HELLO: MetricRecord(reply)}), reply_to=msg)
