"""shakespearelm: the ClientApp. Only the LoRA adapters train and travel; the base stays on the node."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flower_dlion import DLionClient
from shakespearelm.task import RUN_CONFIG, RoleBatches, lm_loss, lora_model, role_of


def use_run_config(msg: Message, context: Context, call_next) -> Message:
    """Before every message (the strategy's hello too): lora_model() reads this run's config."""
    RUN_CONFIG.update(context.run_config)
    return call_next(msg, context)


# Flower ClientApp
app = ClientApp(mods=[use_run_config])
dlion = DLionClient(app, lora_model, lm_loss)


@app.train()
def train(msg: Message, context: Context):
    """One Distributed Lion step of the adapters on a batch of this node's role."""
    role = role_of(context.node_config["partition-id"], context.node_config["num-partitions"])
    batches = RoleBatches(role, context.run_config["batch-size"])
    return dlion.train(msg, context, batches)
