"""edgeapp: the ClientApp each device runs. No partition-id: the node is known by its (authenticated) node id."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from edgeapp.task import EdgeNet, load_local_data
from flower_dlion import DLionClient

app = ClientApp()
dlion = DLionClient(app, EdgeNet)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One Distributed Lion step on this device's own data."""
    trainloader = load_local_data(context.node_config["data-dir"], context.run_config["batch-size"])
    return dlion.train(msg, context, trainloader)
