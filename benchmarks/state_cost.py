"""What a D-Lion client's ``context.state`` costs per round as the model grows (issue 4, item 3).

Flower serializes a node's whole ``Context`` with every message (simulation and deployment):
our client keeps its replica x and momentum m there. For d = 10⁵ … 10⁷ this times one
round trip of the state — ``save_state`` → ``context_to_proto`` → bytes → parse →
``context_from_proto`` → ``load_state`` — with float32 and bfloat16 momentum, against a
reference measured in the same run: copying the float32 state's bytes (``torch.clone``).
Both dtypes are timed in alternation (median of ``--repeat``).

Usage::

    python benchmarks/state_cost.py [--sizes 1e5,1e6,1e7] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from flwr.app import Context, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module

from flower_dlion.clients.dlion import ReplicaState, load_state, save_state


def round_trip(context: Context, state: ReplicaState, dtype: str, d: int) -> int:
    """Store the state, serialize and parse the context, load the state; returns the serialized bytes."""
    save_state(context, state, dtype)
    data = context_to_proto(context).SerializeToString()
    proto = ProtoContext()
    proto.ParseFromString(data)
    loaded = load_state(context_from_proto(proto), d, torch.device("cpu"))
    assert loaded is not None
    return len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e5,1e6,1e7")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"# context.state cost: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| d | momentum | serialized state | round trip | copy of the fp32 state's bytes | ratio | state bytes |")
    print("|---|---|---|---|---|---|---|")
    for d in (int(float(s)) for s in args.sizes.split(",")):
        states = {"float32": ReplicaState(torch.randn(d), torch.randn(d) * 1e-3, 7, None, 3)}
        states["bfloat16"] = ReplicaState(states["float32"].x, states["float32"].m.to(torch.bfloat16).float(), 7)
        contexts = {k: Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}) for k in states}
        sizes = {k: round_trip(contexts[k], states[k], k, d) for k in states}
        times: dict[str, list[float]] = {k: [] for k in (*states, "copy")}
        blob = torch.empty(sizes["float32"] // 4 + 1)
        for _ in range(args.repeat):  # interleaved, so that both dtypes see the same machine state
            for k in states:
                t0 = time.perf_counter()
                round_trip(contexts[k], states[k], k, d)
                times[k].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            blob.clone()
            times["copy"].append(time.perf_counter() - t0)
        t_copy = statistics.median(times["copy"])
        for k in states:
            t = statistics.median(times[k])
            print(
                f"| {d:.0e} | {k} | {sizes[k] / 1e6:.2f} MB | {t * 1e3:.1f} ms | {t_copy * 1e3:.2f} ms "
                f"| {t / t_copy:.0f}× | {sizes[k] / d:.1f} B/parameter |"
            )


if __name__ == "__main__":
    main()
