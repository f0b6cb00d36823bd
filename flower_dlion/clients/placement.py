"""The one place where a client's arrays cross between the host and its compute device.

Host side: the persisted state (:mod:`.state`, numpy arrays), the message's payloads, the
entropy coder, checksums. Device side: the node's state and replicas (:mod:`.resident`,
tensors on the client's device), the model, the Lion step. :class:`Placement` converts between
them, and nothing else in the client moves a tensor across: a CPU client runs exactly the code a
GPU client runs, where these conversions are views instead of copies.

Each crossing is one copy on a GPU: a host array to the device (:meth:`Placement.to_device`),
a tensor to pinned host memory (:meth:`Placement.to_host`, which torch's caching host allocator
reuses). What every node at one version shares (x, the anchor, the counts) crosses once per
version and process, cached on the replica (:meth:`Placement.replica_on_host`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .resident import NodeState, Replica, ReplicaPool
from .state import HostState, crc32

__all__ = ["Placement"]


class Placement:
    """Moves a client's arrays between the host (numpy) and ``device`` (torch).

    Parameters
    ----------
    device : torch.device
        The client's compute device.

    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # ------------------------------------------------------------------ arrays
    def model(self, model: nn.Module) -> nn.Module:
        """The user's model on the device (once per client and device)."""
        return model.to(self.device)

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the device (the CPU: the same memory)."""
        if not isinstance(a, np.ndarray):
            raise TypeError(f"to_device takes a host numpy array, got a {type(a).__name__}")
        t = torch.from_numpy(a if a.flags.writeable else a.copy())
        return t if self.device.type == "cpu" else t.to(self.device)

    def bytes_to_device(self, data: bytes) -> torch.Tensor:
        """Received bytes as a uint8 tensor on the device."""
        return self.to_device(np.frombuffer(bytearray(data), dtype=np.uint8))

    def buffers_to_host(self, rest: dict[str, torch.Tensor], names: list[str]) -> np.ndarray:
        """The buffers ``names`` of ``rest``, in that order, as one flat float32 vector on the host."""
        return self.to_host(torch.cat([rest[name].detach().reshape(-1).float() for name in names]))

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        """A tensor as a host array (the CPU: the same memory; a GPU: one copy into pinned memory).

        bfloat16 comes as its 16 bits (uint16: numpy has no bfloat16).
        """
        t = t.detach()
        bits = t.dtype == torch.bfloat16
        if bits:
            t = t.view(torch.int16)
        if t.device.type != "cpu":
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            t = pinned.copy_(t)
        a = t.numpy()
        return a.view(np.uint16) if bits else a

    # ------------------------------------------------------------------ states
    def replica_on_host(self, replica: Replica, name: str) -> np.ndarray:
        """The replica's ``x``, ``anchor`` or ``counts`` on the host, copied once per replica."""
        if name not in replica.host:
            replica.host[name] = self.to_host(getattr(replica, name))
        return replica.host[name]

    def new_replica(self, x: torch.Tensor, version: int) -> Replica:
        """A replica of ``x`` (on the device) at ``version``, with its checksum (x crosses to the host once)."""
        replica = Replica(version, x, 0)
        replica.checksum = crc32(self.replica_on_host(replica, "x"))
        return replica

    def node_to_host(self, node: NodeState, momentum_dtype: str) -> HostState:
        """The node's state to persist: on the host, m in ``momentum_dtype``.

        With ``momentum_dtype = "bfloat16"`` this is the one place m is rounded, on the device
        too: the resident state and the persisted copy stay the same bits.
        """
        replica = node.replica
        if momentum_dtype == "bfloat16":
            rounded = node.m.to(torch.bfloat16)
            node.m.copy_(rounded)
            m = self.to_host(rounded)
        else:
            m = self.to_host(node.m)
        host = HostState(
            version=replica.version,
            round=node.round,
            checksum=replica.checksum,
            m=m,
            m_dtype=momentum_dtype,
            error=None if node.error is None else self.to_host(node.error),
            rest={k: self.to_host(v) for k, v in node.rest.items()},
            recent=replica.recent if replica.depth else None,
            depth=replica.depth if replica.recent is not None else 0,
            previous=node.previous,
            undo=node.undo,
        )
        if replica.anchor is None:
            host.x = self.replica_on_host(replica, "x")
        else:
            host.anchor = self.replica_on_host(replica, "anchor")
            host.counts = self.replica_on_host(replica, "counts")
            host.anchor_version, host.anchor_checksum = replica.anchor_version, replica.anchor_checksum
            host.decay, host.step = replica.decay, replica.step
        return host

    def host_to_node(self, host: HostState, pool: ReplicaPool) -> NodeState:
        """A checked persisted state (``host.x`` set, :func:`.state.check_state`) on the device.

        Its replica comes from ``pool`` when this process holds it already.
        """
        assert host.x is not None, "check_state sets x"
        ident = (host.version, host.checksum, host.anchor_version, host.anchor_checksum)
        replica = pool.find(ident)
        if replica is None:
            replica = Replica(host.version, self.to_device(host.x), host.checksum)
            replica.host["x"] = host.x
            if host.anchor is not None:
                assert host.counts is not None
                anchor = pool.anchor(host.anchor_version, host.anchor_checksum)
                replica.anchor = anchor if anchor is not None else self.to_device(host.anchor)
                replica.counts = self.to_device(host.counts.astype(np.int32))
                replica.anchor_version, replica.anchor_checksum = host.anchor_version, host.anchor_checksum
                replica.decay, replica.step = host.decay, host.step
            if host.recent is not None and host.depth:
                replica.recent, replica.depth = host.recent, host.depth
            replica = pool.add(replica)
        if host.m_dtype == "bfloat16":
            m = self.to_device(host.m.view(np.int16)).view(torch.bfloat16).float()
        else:
            m = self.to_device(host.m)
        error = None if host.error is None else self.to_device(host.error)
        rest = {k: self.to_device(v) for k, v in host.rest.items()}
        return NodeState(replica, m, error, rest, host.round, host.previous, host.undo, host.stamp)
