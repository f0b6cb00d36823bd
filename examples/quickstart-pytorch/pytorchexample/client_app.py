"""pytorchexample: A Flower / PyTorch app."""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_dlion import DLionClient
from pytorchexample.task import Net, load_data
from pytorchexample.task import test as test_fn

# Flower ClientApp
app = ClientApp()
dlion = DLionClient(app, Net)


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    trainloader, _ = load_data(partition_id, num_partitions, batch_size)

    # One Distributed Lion step: the library keeps the model, the momentum and the state
    return dlion.train(msg, context, trainloader)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""

    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    _, valloader = load_data(partition_id, num_partitions, batch_size)

    # Call the evaluation function
    eval_loss, eval_acc = test_fn(
        model,
        valloader,
        device,
    )

    # Construct and return reply Message
    metrics = {
        "eval_loss": eval_loss,
        "eval_acc": eval_acc,
        "num-examples": len(valloader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"metrics": metric_record})
    return Message(content=content, reply_to=msg)
