"""edgeapp: the ServerApp. Evaluates on the Fashion-MNIST test set when the SuperLink's machine has it."""

import logging

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from edgeapp.task import EdgeNet, images
from flower_dlion import DistributedLion
from flower_dlion_app.data import load_fashion_mnist

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Distributed Lion over the connected devices."""
    cfg = context.run_config
    strategy = DistributedLion(
        lr=cfg["learning-rate"],
        fraction_train=cfg["fraction-train"],
        min_available_nodes=cfg["min-available-nodes"],
        min_train_nodes=cfg["min-train-nodes"],
        secure=cfg["secure"],
    )
    try:
        test = load_fashion_mnist()
        x, y = images(test.x_test), torch.from_numpy(test.y_test)
    except FileNotFoundError:
        logging.warning("no Fashion-MNIST test set on this machine: no server-side evaluation")
        x = y = None

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if x is None or (server_round % 10 and server_round != cfg["num-server-rounds"]):
            return None
        model = EdgeNet()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x).argmax(1) == y).float().mean())
        print(f"round {server_round}: test accuracy {accuracy:.4f}")
        return MetricRecord({"accuracy": accuracy})

    torch.manual_seed(0)
    strategy.start(grid, ArrayRecord(EdgeNet().state_dict()), num_rounds=cfg["num-server-rounds"], evaluate_fn=evaluate)
