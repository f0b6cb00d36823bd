"""What a D-Lion client's ``context.state`` costs per round as the model grows (issue 4, item 3).

Flower serializes a node's whole ``Context`` with every message (simulation and deployment):
our client keeps its replica x and momentum m there. For d = 10⁵ … 10⁷ this times one
round trip of the state (x and m, as a client of the chain downlink keeps them) — ``save_state``
→ ``context_to_proto`` → bytes → parse → ``context_from_proto`` → ``load_state`` — with float32
and bfloat16 momentum, against a reference measured in the same run: copying the float32
state's bytes (``torch.clone``). It also times our part alone, ``save_state`` then
``load_state`` on the same context without serializing it, so that the rest is what Flower's
serialization and parsing cost. A second table times the alternative, ``state-in-context =
false``: the state in a file alone (written over the older of its node's two slot files in a
temporary folder, so mostly to the page cache, and read back with every check a client makes),
plus the round trip of the context that is then left (no arrays). All of it is timed in
alternation (median of ``--repeat``). A client whose process lives on keeps the state on its
device between rounds and reads neither (``benchmarks/resnet18_round.py``).

Usage::

    python benchmarks/state_cost.py [--sizes 1e5,1e6,1e7] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module

from flower_dlion.clients.state import Expected, HostState, crc32
from flower_dlion.clients.state_store import StateStore


def save_state(context: Context, host: HostState) -> None:
    """Put ``host`` in ``context.state`` as a client stores it."""
    StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0).save(host)


def load_state(context: Context) -> HostState | None:
    """The state in ``context.state``, loaded and checked as a client loads it."""
    d = int(context.state["dlion.state"]["m"].shape[0]) if "dlion.state" in context.state else 0
    return StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0).load(Expected(d, "", "", {}), 1)


def host_state(d: int, dtype: str) -> HostState:
    """A node's state of d values: x and m (float32, or m as bfloat16's bits)."""
    g = torch.Generator().manual_seed(d)
    x, m = torch.randn(d, generator=g), torch.randn(d, generator=g) * 1e-3
    bits = m.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return HostState(7, 3, crc32(x.numpy()), bits if dtype == "bfloat16" else m.numpy(), m_dtype=dtype, x=x.numpy())


def round_trip(context: Context, state: HostState) -> int:
    """Store the state, serialize and parse the context, load the state; returns the serialized bytes."""
    save_state(context, state)
    data = context_to_proto(context).SerializeToString()
    proto = ProtoContext()
    proto.ParseFromString(data)
    assert load_state(context_from_proto(proto)) is not None
    return len(data)


def save_and_load(context: Context, state: HostState) -> None:
    """Our part of the round trip alone: store the state, load it from the same context (no serialization)."""
    save_state(context, state)
    assert load_state(context) is not None


def in_files(folder: Path, context: Context, state: HostState) -> int:
    """A round with ``state-in-context = false``: write the state file, round-trip the context, read the file."""
    state.round += 1
    store = StateStore(context, in_context=False, folder=folder, as_of=state.round, keep_round=0)
    store.save(state)
    proto = ProtoContext()
    proto.ParseFromString(context_to_proto(context).SerializeToString())
    assert context_from_proto(proto).state.get("dlion.state") is None
    assert store.load(Expected(state.m.size, "", "", {}), 1) is not None
    return max(p.stat().st_size for p in folder.glob("*.state"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e5,1e6,1e7")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"# context.state cost: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    context_rows, file_rows = [], []
    for d in (int(float(s)) for s in args.sizes.split(",")):
        states = {k: host_state(d, k) for k in ("float32", "bfloat16")}
        contexts = {k: Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}) for k in states}
        bare = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        sizes = {k: round_trip(contexts[k], states[k]) for k in states}
        times: dict[str, list[float]] = {k: [] for k in (*states, *(f"{k} {w}" for k in states for w in "of"), "copy")}
        blob = torch.empty(sizes["float32"] // 4 + 1)
        with tempfile.TemporaryDirectory() as tmp:
            file_sizes = {k: in_files(Path(tmp) / k, bare, states[k]) for k in states}
            for _ in range(args.repeat):  # interleaved, so that every variant sees the same machine state
                for k in states:
                    t0 = time.perf_counter()
                    round_trip(contexts[k], states[k])
                    t1 = time.perf_counter()
                    save_and_load(contexts[k], states[k])
                    t2 = time.perf_counter()
                    in_files(Path(tmp) / k, bare, states[k])
                    t3 = time.perf_counter()
                    times[k].append(t1 - t0)
                    times[f"{k} o"].append(t2 - t1)
                    times[f"{k} f"].append(t3 - t2)
                t0 = time.perf_counter()
                blob.clone()
                times["copy"].append(time.perf_counter() - t0)
        t_copy = statistics.median(times["copy"])
        for k in states:
            t, t_ours, t_file = (statistics.median(times[key]) for key in (k, f"{k} o", f"{k} f"))
            context_rows.append(
                f"| {d:.0e} | {k} | {sizes[k] / 1e6:.2f} MB | {t * 1e3:.1f} ms | {t_ours * 1e3:.1f} ms "
                f"| {max(t - t_ours, 0.0) / t:.0%} | {t_copy * 1e3:.2f} ms "
                f"| {t / t_copy:.0f}× | {sizes[k] / d:.1f} B/parameter |"
            )
            file_rows.append(
                f"| {d:.0e} | {k} | {t * 1e3:.1f} ms | {t_file * 1e3:.1f} ms | **{t / t_file:.1f}×** "
                f"| {file_sizes[k] / 1e6:.2f} MB |"
            )
    print(
        "| d | momentum | serialized state | round trip | save + load alone | Flower's serde | "
        "copy of the fp32 state's bytes | ratio | state bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(context_rows))
    print("\n`state-in-context = false` (`client-state-dir` set): the state in a file alone, per message\n")
    print("| d | momentum | in context: round trip | files only: write + read | context / files | file |")
    print("|---|---|---|---|---|---|")
    print("\n".join(file_rows))


if __name__ == "__main__":
    main()
