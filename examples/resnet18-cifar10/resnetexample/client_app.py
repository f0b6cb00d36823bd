"""resnetexample: the ClientApp (D-Lion, or FedAvg with run config strategy = "fedavg")."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_dlion import DLionClient
from resnetexample.task import Net, load_data
from resnetexample.task import train as train_fn

app = ClientApp()
# 11M parameters: the client keeps x and m in state files, not in context.state (it says so once)
dlion = DLionClient(app, Net)


@app.train()
def train(msg: Message, context: Context):
    """One D-Lion step on this node's batches (or FedAvg's local epochs)."""
    cfg = context.run_config
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader = load_data(partition_id, num_partitions, cfg["batch-size"], cfg["data-dir"])
    if cfg["strategy"] == "dlion":
        return dlion.train(msg, context, trainloader)

    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loss = train_fn(model, trainloader, cfg["local-epochs"], msg.content["config"]["lr"], device)
    metrics = {"train_loss": loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
