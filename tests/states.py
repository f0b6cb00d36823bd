"""Test helpers: a node's persisted state as CPU tensors, and what a client makes of a message."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, RecordDict

from flower_dlion.clients.placement import Placement
from flower_dlion.clients.replica import Apply, apply_message
from flower_dlion.clients.resident import NodeState, Replica, ReplicaPool
from flower_dlion.clients.state import STATE_META, HostState, crc32
from flower_dlion.clients.state_store import STATE_WHERE, StateStore, read_state_header, wait_for_writes
from flower_dlion.lion import anchored
from flower_dlion.params import ModelSpec
from flower_dlion.protocol import CONFIG
from flower_dlion.round_records import RoundConfig

CPU = torch.device("cpu")


@dataclass
class View:
    """A node's state as stored in its context, as CPU tensors (m in float32)."""

    x: torch.Tensor
    m: torch.Tensor
    version: int
    round: int
    error: torch.Tensor | None
    anchor: torch.Tensor | None
    counts: torch.Tensor | None
    previous: int
    undo: bytes
    host: HostState


def load_state(context: Context) -> HostState | None:
    """The state a node keeps (``context.state``, or the files it names), as stored, with x.

    Not checked (``check_state`` is what a client applies); None where there is none.
    """
    where = context.state[STATE_WHERE] if STATE_WHERE in context.state else None
    folder = Path(str(where["folder"])) if where is not None and STATE_META not in context.state else None
    store = StateStore(context, in_context=folder is None, folder=folder, as_of=-1, keep_round=0)
    if folder is not None:
        wait_for_writes()
        found = store._newest_file()
        host = None if found is None else store._from_file(found[1])
    elif store._use_context():
        host = store._from_context(0)
    else:
        return None
    if host is None:
        return None
    if host.x is None and host.anchor is not None and host.counts is not None:
        counts = torch.from_numpy(host.counts.astype(np.int32))
        host.x = anchored(torch.from_numpy(host.anchor), counts, host.decay, host.step).numpy()
    return host


def save_state(context: Context, host: HostState) -> None:
    """Put ``host`` in ``context.state`` as a client stores it (with a new stamp)."""
    StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0).save(host)


def load(context: Context) -> View | None:
    """The node's state in ``context.state`` (None: none)."""
    host = load_state(context)
    if host is None:
        return None
    assert host.x is not None
    m = torch.from_numpy(host.m.copy())
    if host.m_dtype == "bfloat16":
        m = m.view(torch.int16).view(torch.bfloat16).float()
    counts = None if host.counts is None else torch.from_numpy(host.counts.astype(np.int32))
    return View(
        torch.from_numpy(host.x.copy()), m, host.version, host.round,
        None if host.error is None else torch.from_numpy(host.error.copy()),
        None if host.anchor is None else torch.from_numpy(host.anchor.copy()), counts,
        host.previous, host.undo, host,
    )  # fmt: skip


def node_at(x: np.ndarray, version: int = 0, m: torch.Tensor | None = None) -> NodeState:
    """A node whose replica is ``x`` (the chain downlink's form) at ``version``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    replica = Replica(version=version, x=torch.from_numpy(x.copy()), checksum=crc32(x))
    return NodeState(replica=replica, m=torch.zeros(x.size) if m is None else m)


def apply(content: RecordDict, node: NodeState | None, spec: ModelSpec, node_id: int = 1) -> NodeState:
    """The node after the client applies ``content`` (a train message's) on the CPU."""
    env = Apply(Placement(CPU), ReplicaPool(), spec, node_id, RoundConfig.parse(content[CONFIG], node_id))
    return apply_message(content, node, env)


def replica_after(content: RecordDict, context: Context, spec: ModelSpec, node_id: int) -> torch.Tensor:
    """The x a client whose state is in ``context`` holds after applying ``content``."""
    host = load_state(context)
    pool, placement = ReplicaPool(), Placement(CPU)
    node = None if host is None else NodeState.from_host(host, pool, placement)
    env = Apply(placement, pool, spec, node_id, RoundConfig.parse(content[CONFIG], node_id))
    return apply_message(content, node, env).replica.x


def newest_file(folder: Path) -> Path:
    """A node's state file of the highest round in ``folder`` (its slots and kept rounds)."""
    files = [(int((read_state_header(p) or {"round": -1})["round"]), p) for p in folder.glob("*.state")]
    assert files, f"no state file in {folder}"
    return max(files)[1]


def rounds_in(folder: Path) -> list[int]:
    """The rounds of the state files in ``folder``, ascending."""
    return sorted(int((read_state_header(p) or {"round": -1})["round"]) for p in folder.glob("*.state"))
