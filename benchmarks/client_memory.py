"""Memory per virtual client: many D-Lion clients of one model in one process (issue 48, item 4).

    .venv/bin/python benchmarks/client_memory.py [--model cnn|resnet18] [--clients 10 100] [--rounds 2]

Runs ``--clients`` virtual nodes of the model on the in-process grid (every node trains every
round, as in Flower's simulation with one worker process), with the library's defaults (the
default CNN keeps its persisted state in ``context.state``, ResNet-18's 11 M parameters in a
file per node). After the last round it reports, per client and per trainable parameter:

* what the client keeps on its device between messages: each node's own state (m; the undo of
  its last Δ; its buffers) and, once for all of them, the replicas (x, the anchor, the counts
  at each version some node holds), as ``DLionClient`` accounts them;
* the process's resident memory (RSS, from /proc) above what it held before the first round;
* the persisted copies: the bytes of ``context.state`` (what Flower's simulation keeps for
  every node) or of the state files on disk.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp
from flwr.common.serde import context_to_proto
from flwr.supercore.task_identity import TaskIdentity
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "resnet18-cifar10"))

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.testing import LocalGrid


def rss() -> int:
    """Bytes of this process's resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def model_and_batches(name: str, batch_size: int) -> tuple[type[torch.nn.Module], DataLoader]:
    """The model class and one loader of synthetic batches of its input shape (the data does not matter here)."""
    if name == "resnet18":
        from resnetexample.task import Net
    else:
        from flower_dlion_app.model import Net
    shape = (3, 32, 32) if name == "resnet18" else (1, 28, 28)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * batch_size, *shape, generator=g), torch.randint(0, 10, (4 * batch_size,)))
    return Net, DataLoader(data, batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["cnn", "resnet18"], default="cnn")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="the clients' device (cpu, cuda)")
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    net, batches = model_and_batches(args.model, args.batch_size)
    d = sum(p.numel() for p in net().parameters())
    cuda = args.device.startswith("cuda")
    machine = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# {args.model}: d = {d:,} trainable values; torch {torch.__version__}, {args.rounds} rounds, {machine}")
    print()
    print(
        "| clients | own state per client (B/param) | replicas, all clients (MB) | kept per client (B/param) "
        "| RSS growth per client (B/param) | device memory per client (B/param) | persisted per client (B/param) "
        "| where |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.clients:
        with tempfile.TemporaryDirectory() as tmp:
            app = ClientApp()
            client = DLionClient(app, net, state_dir=tmp if d >= 1 << 20 else None, device=args.device)

            @app.train()
            def train(msg, context, client=client):
                return client.train(msg, context, batches)

            gc.collect()
            before = rss()
            device_before = torch.cuda.memory_allocated() if cuda else 0
            grid = LocalGrid(app, n)
            torch.manual_seed(0)
            strategy = DistributedLion(lr=1e-3)
            arrays = ArrayRecord(net().state_dict())
            for rnd in range(1, args.rounds + 1):
                msgs = strategy.configure_train(rnd, arrays, ConfigRecord(), grid)
                strategy.aggregate_train(rnd, grid.send_and_receive(msgs))
            client.wait()
            gc.collect()
            grown = rss() - before
            on_device = (torch.cuda.memory_allocated() - device_before) / n if cuda else float("nan")
            here = client._devices[torch.device(args.device)]
            own = here.residents.nbytes() / n
            replicas = here.pool.nbytes()
            if d >= 1 << 20:
                persisted = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()) / n
                where = "files"
            else:
                persisted = sum(len(context_to_proto(grid.context(i)).SerializeToString()) for i in grid.node_ids) / n
                where = "context.state"
            kept = own + replicas / n
            print(
                f"| {n} | {own / d:.2f} | {replicas / 1e6:.0f} | {kept / d:.2f} | {grown / n / d:.2f} "
                f"| {on_device / d:.2f} | {persisted / d:.2f} | {where} |"
            )
            del grid, client, app, strategy


if __name__ == "__main__":
    main()
