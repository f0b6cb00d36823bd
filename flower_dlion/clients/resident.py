"""What a client keeps on its compute device between messages: each node's own state, and replicas shared by version.

Device side: tensors on the client's device (host arrays come and go through :mod:`.placement`).
The conversions between a node's state here and its persisted copy on the host
(:class:`~.state.HostState`) are beside the types: :meth:`NodeState.to_host`,
:meth:`NodeState.from_host`; so is the one host copy of a replica's arrays
(:meth:`Replica.on_host`, :meth:`Replica.of`).

A node's state splits in two (:class:`NodeState`):

* what is its own: the Lion momentum m, the error-feedback residual e, its buffers, what undoes
  its last catch-up;
* its :class:`Replica`: x at its version (and, with the anchored downlink, the anchor xₐ and the
  counts C since it). Every node at the same version holds the same replica, bit for bit (the
  server checks each reply's checksum of x), so a process that serves several nodes (Flower's
  simulation runs many virtual nodes in each worker) holds it once: the :class:`ReplicaPool`
  gives the replica a message makes to every node that receives the same message at the same
  version, and the second node does not decode or compute it again.

A replica is never changed in place: a message makes a new one, into the buffers of a replica
no node holds any more (a fresh 4-byte tensor per parameter costs page faults on the CPU, about
as much as the arithmetic). :class:`Residents` keeps the nodes' states between their messages,
up to a memory budget (least recently used out first); the persisted copy (:mod:`.state`) is
what a node starts from when its resident state is gone or no longer current.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..drift import Drift
from ..params import Binding
from .placement import Placement
from .state import HostState, crc32

__all__ = ["Device", "NodeState", "Replica", "ReplicaPool", "Residents", "device_memory"]

logger = logging.getLogger("flower_dlion")

RESIDENT_ROUNDS = 3  # a node's state stays on the device while it trained in one of its run's last 3 rounds
Ident = tuple[int, int, int, int]  # version, checksum of x, anchor version, checksum of the anchor


@dataclass(eq=False)
class Replica:
    """x at one version, as every node at that version holds it: shared, never changed in place."""

    version: int
    x: torch.Tensor  # float32 (d,), on the device
    checksum: int  # CRC-32 of x
    anchor: torch.Tensor | None = None  # xₐ (anchored downlink), float32 (d,)
    anchor_version: int = 0
    anchor_checksum: int = 0
    counts: torch.Tensor | None = None  # C since the anchor, int32 (d,)
    decay: float = 1.0  # γ of x at ``version``
    step: float = 0.0  # η
    recent: np.ndarray | None = None  # host: the coder context of the two last Δs at ``version`` (uint8)
    depth: int = 0  # how many of those Δs ``recent`` holds (2: a Δ coded with it can be decoded)
    host: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # host copies made so far (x, anchor, counts)

    @property
    def ident(self) -> Ident:
        """What the replica is: its version, x's checksum and its anchor's."""
        return (self.version, self.checksum, self.anchor_version, self.anchor_checksum)

    def nbytes(self) -> int:
        """Bytes on the device (the anchor counted whole, although replicas of one epoch share it)."""
        return sum(t.numel() * t.element_size() for t in (self.x, self.anchor, self.counts) if t is not None)

    @classmethod
    def of(cls, x: torch.Tensor, version: int, placement: Placement) -> Replica:
        """A replica of ``x`` (on the device) at ``version``, with its checksum (x crosses to the host once)."""
        replica = cls(version=version, x=x, checksum=0)
        replica.checksum = crc32(replica.on_host("x", placement, "x-crc"))
        return replica

    def on_host(self, name: str, placement: Placement, label: str | None = None) -> np.ndarray:
        """The replica's ``x``, ``anchor`` or ``counts`` on the host, copied once per replica.

        The copy is counted under ``label`` (default: ``name``); a copy the replica holds
        already crosses nothing.
        """
        if name not in self.host:
            self.host[name] = placement.to_host(getattr(self, name), label or name)
        return self.host[name]


@dataclass(eq=False)
class NodeState:
    """One node's state on the device: its own arrays and the replica it is at."""

    replica: Replica
    m: torch.Tensor  # Lion momentum, float32 (d,)
    error: torch.Tensor | None = None  # error-feedback residual (upload "ef-sign"), float32 (d,)
    drift: Drift | None = None  # the drift correction's hᵢ and its round (flower_dlion.drift)
    rest: dict[str, torch.Tensor] = field(default_factory=dict)  # the buffers, by name
    round: int = 0  # the server round whose train message left the node in this state
    previous: int = -1  # the version before the last catch-up (-1: none)
    undo: bytes = b""  # that catch-up's counts, to take it back should its reply be lost (.replica)
    stamp: str = ""  # the stamp of the persisted copy this state is (clients.state)
    pending: concurrent.futures.Future | None = None  # the background write of that copy

    @property
    def version(self) -> int:
        """The replica's version: Δs applied to x since the start."""
        return self.replica.version

    def nbytes(self) -> int:
        """Bytes of the node's own tensors (not its replica's)."""
        own = [self.m, self.error, None if self.drift is None else self.drift.h, *self.rest.values()]
        return sum(t.numel() * t.element_size() for t in own if t is not None) + len(self.undo)

    def to_host(self, placement: Placement, momentum_dtype: str) -> HostState:
        """The node's state to persist: on the host, m in ``momentum_dtype``.

        With ``momentum_dtype = "bfloat16"`` this is the one place m is rounded, on the device
        too: the resident state and the persisted copy stay the same bits.
        """
        replica = self.replica
        if replica.anchor is None:  # what the nodes at this version share: copied once per replica
            shared = {"x": replica.on_host("x", placement)}
        else:
            shared = {name: replica.on_host(name, placement) for name in ("anchor", "counts")}
        if momentum_dtype == "bfloat16":
            rounded = self.m.to(torch.bfloat16)
            self.m.copy_(rounded)
            m = placement.to_host(rounded, "m-persist")
        else:
            m = placement.to_host(self.m, "m-persist")
        host = HostState(
            version=replica.version,
            round=self.round,
            checksum=replica.checksum,
            m=m,
            m_dtype=momentum_dtype,
            error=None if self.error is None else placement.to_host(self.error, "e-persist"),
            drift=None if self.drift is None else placement.to_host(self.drift.h, "drift-persist"),
            drift_round=-1 if self.drift is None else self.drift.round,
            drift_signs=None if self.drift is None else self.drift.signs,  # host arrays already
            drift_scales=None if self.drift is None else self.drift.scales,
            rest={k: placement.to_host(v, "rest-persist") for k, v in self.rest.items()},
            recent=replica.recent if replica.depth else None,
            depth=replica.depth if replica.recent is not None else 0,
            previous=self.previous,
            undo=self.undo,
        )
        if replica.anchor is None:
            host.x = shared["x"]
        else:
            host.anchor, host.counts = shared["anchor"], shared["counts"]
            host.anchor_version, host.anchor_checksum = replica.anchor_version, replica.anchor_checksum
            host.decay, host.step = replica.decay, replica.step
        return host

    @classmethod
    def from_host(cls, host: HostState, pool: ReplicaPool, placement: Placement) -> NodeState:
        """A checked persisted state (``host.x`` set, :func:`.state.check_state`) on the device.

        Its replica comes from ``pool`` when this process holds it already. A replica loaded here
        keeps the host arrays it was loaded from (x, the anchor, the counts, all checked): they
        do not cross back to be persisted or decoded on the host.
        """
        replica = pool.find((host.version, host.checksum, host.anchor_version, host.anchor_checksum))
        if replica is None:
            assert host.x is not None, "check_state sets x where the pool does not hold the replica"
            replica = Replica(version=host.version, x=placement.to_device(host.x, "load"), checksum=host.checksum)
            replica.host["x"] = host.x
            if host.anchor is not None:
                assert host.counts is not None
                anchor = pool.anchor(host.anchor_version, host.anchor_checksum)
                replica.anchor = anchor if anchor is not None else placement.to_device(host.anchor, "load")
                replica.host["anchor"] = host.anchor  # the same bits (check_state checked its checksum)
                counts = host.counts.astype(np.int32)
                replica.counts = placement.to_device(counts, "load")
                replica.host["counts"] = counts  # the same values: the next persisted copy crosses nothing
                replica.anchor_version, replica.anchor_checksum = host.anchor_version, host.anchor_checksum
                replica.decay, replica.step = host.decay, host.step
            if host.recent is not None and host.depth:
                replica.recent, replica.depth = host.recent, host.depth
            replica = pool.add(replica)
        if host.m_dtype == "bfloat16":
            m = placement.to_device(host.m.view(np.int16), "load").view(torch.bfloat16).float()
        else:
            m = placement.to_device(host.m, "load")
        return cls(
            replica=replica,
            m=m,
            error=None if host.error is None else placement.to_device(host.error, "load"),
            drift=_drift(host, placement),
            rest={k: placement.to_device(v, "load") for k, v in host.rest.items()},
            round=host.round,
            previous=host.previous,
            undo=host.undo,
            stamp=host.stamp,
        )

    def wait(self) -> None:
        """Wait for this state's background write (a failed write is logged, the next load finds the older copy)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except Exception as err:
                logger.warning("flower-dlion: a state file could not be written (%r): the node's older copy stays", err)


def _drift(host: HostState, placement: Placement) -> Drift | None:
    """The drift correction's state on the device (hᵢ; its upload's signs and scales stay on the host)."""
    if host.drift is None:
        return None
    return Drift(placement.to_device(host.drift, "load"), host.drift_round, host.drift_signs, host.drift_scales)


class ReplicaPool:
    """The replicas of one device in this process, found by what made them or by what they are.

    Parameters
    ----------
    keep : int (default: 2)
        The newest replicas made, kept while no node holds them: a node whose message comes
        after another's finds the replica that one made, and a node whose state is loaded from
        its file finds the replica of the version before (a round's start) without computing x
        again, also where no state stays resident.

    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._replicas: OrderedDict[Ident, Replica] = OrderedDict()  # least recently made first
        self._made_by: dict[Any, tuple[Ident, bytes]] = {}  # what made it (a message applied to a replica) → it, a note
        self._holders: dict[Ident, int] = {}
        self._free: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
        self.hits = 0  # replicas found made, for benchmarks

    def idents(self) -> frozenset[Ident]:
        """What the replicas held here are."""
        return frozenset(self._replicas)

    def find(self, ident: Ident) -> Replica | None:
        """The replica that is ``ident``, if this process holds it."""
        return self._replicas.get(ident)

    def anchor(self, version: int, checksum: int) -> torch.Tensor | None:
        """The anchor tensor of that version and checksum, if a replica here has it (replicas of one epoch share it)."""
        for replica in self._replicas.values():
            if replica.anchor is not None and (replica.anchor_version, replica.anchor_checksum) == (version, checksum):
                return replica.anchor
        return None

    def made(self, key: Any) -> tuple[Replica, bytes] | None:
        """The replica made by ``key`` before, if it is still here, and the note kept with it."""
        ident, note = self._made_by.get(key, (None, b""))
        replica = None if ident is None else self._replicas.get(ident)
        if replica is None:
            return None
        self.hits += 1
        return replica, note

    def add(self, replica: Replica, key: Any = None, note: bytes = b"") -> Replica:
        """Keep ``replica`` (made by ``key``, with a ``note``); the one already here if it is the same replica."""
        kept = self._replicas.get(replica.ident)
        if kept is None:
            self._replicas[replica.ident] = kept = replica
        elif replica.depth > kept.depth:  # the same x, with more of the coder's context
            kept.recent, kept.depth = replica.recent, replica.depth
        if kept is not replica:
            self.recycle(replica)
        if key is not None:
            self._made_by[key] = (kept.ident, note)
        self._trim()
        return kept

    def discard(self, replica: Replica) -> None:
        """Forget ``replica`` and what made it (a replica found wrong): no node finds it again."""
        ident = replica.ident
        if self._replicas.get(ident) is replica and ident not in self._holders:
            del self._replicas[ident]
        self._made_by = {k: v for k, v in self._made_by.items() if v[0] != ident}

    def hold(self, replica: Replica) -> None:
        """A node holds ``replica`` (it stays until released)."""
        self._holders[replica.ident] = self._holders.get(replica.ident, 0) + 1

    @contextlib.contextmanager
    def holding(self, replica: Replica) -> Iterator[Replica]:
        """Hold ``replica`` for the ``with`` block (nothing recycles it meanwhile), then release it."""
        self.hold(replica)
        try:
            yield replica
        finally:
            self.release(replica)

    def release(self, replica: Replica) -> None:
        """A node no longer holds ``replica``."""
        left = self._holders.get(replica.ident, 0) - 1
        if left > 0:
            self._holders[replica.ident] = left
        else:
            self._holders.pop(replica.ident, None)
        self._trim()

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized tensor like ``like``: a dropped replica's buffer when there is one."""
        free = self._free.get((like.device, like.dtype, like.numel()))
        return free.pop() if free else torch.empty_like(like)

    def give(self, t: torch.Tensor) -> None:
        """Take back a buffer from :meth:`buffer` that is no longer used."""
        free = self._free.setdefault((t.device, t.dtype, t.numel()), [])
        if len(free) < 2 and all(t is not f for f in free):
            free.append(t)

    def recycle(self, replica: Replica) -> None:
        """Reuse the buffers of a replica no one holds (its x and counts are its own; anchors are shared)."""
        for t in (replica.x, replica.counts):
            if t is not None:
                self.give(t)

    def nbytes(self) -> int:
        """Bytes of the replicas kept (an anchor shared by several counted once)."""
        anchors = {id(r.anchor): r.anchor for r in self._replicas.values() if r.anchor is not None}
        tensors = [t for r in self._replicas.values() for t in (r.x, r.counts) if t is not None]
        own = sum(t.numel() * t.element_size() for t in tensors)
        return own + sum(a.numel() * a.element_size() for a in anchors.values())

    def __len__(self) -> int:
        return len(self._replicas)

    def _trim(self) -> None:
        """Drop the replicas no node holds but the ``keep`` newest made."""
        recent = set(list(self._replicas)[-self.keep :]) if self.keep else set()
        for ident in [i for i in self._replicas if i not in self._holders and i not in recent]:
            self.recycle(self._replicas.pop(ident))
        if len(self._made_by) > 4 * len(self._replicas) + 16:
            self._made_by = {k: v for k, v in self._made_by.items() if v[0] in self._replicas}


class Residents:
    """The nodes' states kept on the device between their messages, least recently used out first.

    A node stays while it trained in one of the run's last ``rounds`` rounds: in a cross-device
    simulation (10,000 virtual clients, 1 % a round) a node comes back after ~100 rounds, and
    keeping it would cost its m for all that time to save one file read; the nodes of every
    round stay where all train every round.

    Parameters
    ----------
    pool : ReplicaPool
        Where their replicas are.
    max_nodes : int | None
        At most this many nodes (None: no count limit; 0: none kept).
    max_bytes : int
        At most this many bytes of the nodes' own tensors. An evicted node's persisted copy is
        current (it is written every round): its next message starts from it.
    rounds : int (default: RESIDENT_ROUNDS)
        Nodes whose last round is more than this many rounds behind the newest of their run's go.

    """

    def __init__(self, pool: ReplicaPool, max_nodes: int | None, max_bytes: int, rounds: int = 0) -> None:
        self.pool = pool
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self.rounds = rounds or RESIDENT_ROUNDS
        self._nodes: OrderedDict[str, tuple[NodeState, Replica]] = OrderedDict()  # the state, the replica it holds

    def get(self, owner: str) -> NodeState | None:
        """The resident state of ``owner`` (its background write finished), or None."""
        entry = self._nodes.get(owner)
        if entry is None:
            return None
        entry[0].wait()
        self._nodes.move_to_end(owner)
        return entry[0]

    def put(self, owner: str, node: NodeState) -> None:
        """Keep ``node`` as ``owner``'s state (its replica held), then trim to the budget."""
        self.pool.hold(node.replica)
        old = self._nodes.pop(owner, None)
        if old is not None:
            if old[0] is not node:
                old[0].wait()
            self.pool.release(old[1])
        self._nodes[owner] = (node, node.replica)
        run = owner.rpartition("/")[0]
        for stale in [o for o, (n, _) in self._nodes.items() if n.round < node.round - self.rounds]:
            if stale.rpartition("/")[0] == run:  # another run's nodes go by the budget alone
                self.drop(stale)
        while self._nodes and (
            self.nbytes() > self.max_bytes or (self.max_nodes is not None and len(self._nodes) > self.max_nodes)
        ):
            self.drop(next(iter(self._nodes)))

    def drop(self, owner: str) -> None:
        """Forget ``owner``'s resident state (after its background write)."""
        entry = self._nodes.pop(owner, None)
        if entry is not None:
            entry[0].wait()
            self.pool.release(entry[1])

    def __len__(self) -> int:
        return len(self._nodes)

    def nbytes(self) -> int:
        """Bytes of the resident nodes' own tensors."""
        return sum(node.nbytes() for node, _ in self._nodes.values())


@dataclass
class Device:
    """What a client holds per compute device: the model, the crossing to the host, the replicas, the residents."""

    bound: Binding
    placement: Placement
    pool: ReplicaPool
    residents: Residents
    grad: torch.Tensor | None = None  # the flat gradient's buffer, reused every step


def device_memory(device: torch.device) -> int:
    """Bytes of memory on ``device`` (the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30
