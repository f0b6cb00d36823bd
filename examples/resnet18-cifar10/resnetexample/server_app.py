"""resnetexample: the ServerApp (D-Lion, or FedAvg with run config strategy = "fedavg")."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_dlion import DistributedLion
from resnetexample.task import Net, load_centralized_dataset, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train ResNet-18, evaluating it on the server every ``eval-every`` rounds."""
    cfg = context.run_config
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    if cfg["strategy"] == "dlion":
        strategy = DistributedLion(lr=cfg["learning-rate"], weight_decay=cfg["weight-decay"])
        train_config = ConfigRecord()
    else:
        strategy = FedAvg(fraction_evaluate=0.0)
        train_config = ConfigRecord({"lr": cfg["learning-rate"]})
    testloader = load_centralized_dataset(cfg["data-dir"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round % cfg["eval-every"] and server_round != cfg["num-server-rounds"]:
            return None
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(model, testloader, device)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=train_config,
        num_rounds=cfg["num-server-rounds"],
        evaluate_fn=global_evaluate,
    )
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
