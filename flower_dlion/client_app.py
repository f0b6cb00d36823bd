"""ClientApp entry point: one ``train`` handler per family of strategies (run config ``strategy``).

* ``dlion-vote``, ``dlion-mean``, ``signsgd-vote``: ``clients/dlion.py`` (replica and
  momentum in ``context.state``, packed signs out);
* ``global-lion``, ``global-adamw``, ``terngrad``: ``clients/gradient.py`` (stateless,
  gradient out);
* ``fedavg``: ``clients/fedavg.py`` (local SGD epochs, model out).
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .clients import dlion, fedavg, gradient
from .config import read_config

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
    """Run the handler of the configured strategy."""
    return HANDLERS[read_config(context.run_config)["strategy"]](msg, context)
