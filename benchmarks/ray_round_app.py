"""The ClientApps of ``benchmarks/ray_round.py``: D-Lion's and FedAvg's, one step on one batch each.

Layout "module" imports this file as ``ray_round_app`` (as ``flwr run`` loads an app: Ray
pickles the handlers by reference and each worker imports the module once). Layout "script"
executes this same source at the top level of the ``__main__`` script (as a notebook defines its
apps: Ray pickles them, and the ``DLionClient`` they use, by value with every actor task).
"""

import time

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from ray_round_support import batch_for, build_model, note_call

from flower_dlion import DLionClient

# D-Lion: the public API of README.md (one local Lion step on one batch, the strategy's defaults)
dlion_app = ClientApp()
dlion = DLionClient(dlion_app, build_model)


@dlion_app.train()
def dlion_train(msg: Message, context: Context) -> Message:
    empty = len(dlion._devices) == 0  # the probe: this call found the client holding nothing
    t0 = time.perf_counter()
    reply = dlion.train(msg, context, [batch_for(context.node_config["partition-id"])])
    note_call("dlion", msg, context, time.perf_counter() - t0, dlion, empty)
    return reply


# FedAvg: load the arrays, one SGD step on one batch, send the arrays back
fedavg_app = ClientApp()


@fedavg_app.train()
def fedavg_train(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    model = build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = batch_for(context.node_config["partition-id"])
    optimizer = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
    model.train()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    metrics = MetricRecord({"train_loss": loss.item(), "num-examples": len(labels)})
    reply = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)
    note_call("fedavg", msg, context, time.perf_counter() - t0)
    return reply
