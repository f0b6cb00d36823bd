"""Where a D-Lion client keeps its replica between rounds: ``context.state``, a file, or both.

The state (:class:`ReplicaState`) is the replica x, the Lion momentum m, the error-feedback
residual e (``upload="ef-sign"``), the replica's version, the round that left it so, and the
rest of the model (frozen parameters, the client's own buffers).

``context.state`` is kept by Flower across rounds but serialized with every message, which
from about 10⁶ parameters costs far more than a file (docs/PERFORMANCE.md, §3); it is also lost
when a SuperNode restarts. A :class:`StateStore` therefore keeps the state

* in ``context.state`` (``in_context``), and/or
* in ``<folder>/r<round>.pt`` (``folder``): the file a restarted SuperNode starts from, and the
  one a resumed ServerApp asks for by round (``state-round``); only the newest file and the one
  of the server's latest checkpoint (``keep-round``) are kept.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context

from ..protocol import to_array

__all__ = [
    "ClientStateError",
    "ReplicaState",
    "StateStore",
    "default_state_dir",
    "load_state",
    "node_label",
    "save_state",
]

STATE_ARRAYS = "dlion.state"
STATE_REST = "dlion.rest"
STATE_META = "dlion.state-meta"
CONTEXT_LIMIT = 1 << 30  # bytes of state above which context.state is refused (protobuf's limit is 2 GiB a message)


class ClientStateError(RuntimeError):
    """The node's stored state or configuration cannot serve the message it received."""


@dataclass
class ReplicaState:
    """A client's persistent Distributed Lion state."""

    x: torch.Tensor  # replica of the global parameters, float32 (d,)
    m: torch.Tensor  # Lion momentum, float32 (d,)
    version: int  # number of Δs applied to x since the start
    error: torch.Tensor | None = None  # error-feedback residual of the ef-sign upload, float32 (d,)
    round: int = 0  # the server round whose train message left the node in this state
    rest: dict[str, torch.Tensor] = field(default_factory=dict)  # frozen parameters and buffers, by name
    # the anchored downlink (flower_dlion.downlink): x = γ·anchor − η·counts
    anchor: torch.Tensor | None = None  # xₐ, float32 (d,)
    counts: torch.Tensor | None = None  # C since the anchor, int32 (d,)
    recent: torch.Tensor | None = None  # the two last Δs as a coder context, uint8 (d,)
    anchor_version: int = 0
    recent_version: int = -1  # the version ``recent`` belongs to
    depth: int = 0  # how many of the two last Δs ``recent`` holds
    previous: int = -1  # the version before the last catch-up, which ``undo`` takes the counts back to (-1: none)
    undo: bytes = b""  # that catch-up's counts: coded (flower_dlion.entropy) or, for one Δ, packed trits

    def tensors(self) -> dict[str, torch.Tensor]:
        """x, m and, where they are used, e (error feedback) and the anchored downlink's arrays."""
        out = {"x": self.x, "m": self.m, "e": self.error, "anchor": self.anchor, "counts": self.counts}
        return {k: v for k, v in (out | {"recent": self.recent}).items() if v is not None}

    def meta(self) -> dict[str, int | bytes]:
        """The anchored downlink's integers (with the version and round, what is stored besides tensors)."""
        return {
            "version": self.version,
            "round": self.round,
            "anchor-version": self.anchor_version,
            "recent-version": self.recent_version,
            "depth": self.depth,
            "previous": self.previous,
            "undo": self.undo,
        }

    def with_meta(self, meta: dict, tensors: dict[str, torch.Tensor]) -> ReplicaState:
        """The state with the anchored downlink's fields read back from :meth:`meta` and :meth:`tensors`."""
        return replace(
            self,
            anchor=tensors.get("anchor"),
            counts=tensors.get("counts"),
            recent=tensors.get("recent"),
            anchor_version=int(meta.get("anchor-version", 0)),
            recent_version=int(meta.get("recent-version", -1)),
            depth=int(meta.get("depth", 0)),
            previous=int(meta.get("previous", -1)),
            undo=_as_bytes(meta.get("undo", b"")),
        )

    def on_host(self, momentum_dtype: str) -> ReplicaState:
        """The state as it is stored: on the host, m as bfloat16 with that momentum dtype.

        A GPU client's context, state file and checksum all read this one copy, and m crosses
        in 2 bytes per value when it is stored in 2. This is the one place m is rounded to
        bfloat16, once per round; the next message loads it back as float32.
        """
        m = self.m.detach().to(torch.bfloat16) if momentum_dtype == "bfloat16" else self.m.detach()
        error = None if self.error is None else self.error.detach().cpu()
        rest = {k: v.detach().cpu() for k, v in self.rest.items()}
        anchored = {k: None if v is None else v.detach().cpu() for k, v in self._anchored().items()}
        return replace(self, x=self.x.detach().cpu(), m=m.cpu(), error=error, rest=rest, **anchored)

    def _anchored(self) -> dict[str, torch.Tensor | None]:
        return {"anchor": self.anchor, "counts": self.counts, "recent": self.recent}


def _as_bytes(value: bytes | torch.Tensor) -> bytes:
    """Bytes stored as such (context) or as a uint8 tensor (files, which ``weights_only`` loads without bytes)."""
    return value.numpy().tobytes() if isinstance(value, torch.Tensor) else bytes(value)


def default_state_dir() -> Path:
    """Where state files go when the client keeps its state out of the context but names no folder."""
    return Path(tempfile.gettempdir()) / f"flower-dlion-state-{os.getuid() if hasattr(os, 'getuid') else 0}"


def node_label(context: Context) -> str:
    """``partition-<id>`` when the node config names one, else ``node-<node id>``."""
    pid = context.node_config.get("partition-id")
    return f"partition-{int(pid)}" if pid is not None else f"node-{context.node_id}"


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy; bfloat16 (which numpy lacks) as float32, exactly."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


class StateStore:
    """The state of one node for one message: where it is read from and written to.

    Parameters
    ----------
    context : Context
        The node's context.
    in_context : bool
        Keep the state in ``context.state``.
    folder : Path | None
        Keep the state in files there too (or only there, without ``in_context``).
    as_of : int
        Start from the state as of the end of this round (-1: the newest there is).
    keep_round : int
        The server's latest checkpoint: the state file of that round is kept.

    """

    def __init__(self, context: Context, *, in_context: bool, folder: Path | None, as_of: int, keep_round: int) -> None:
        if not in_context and folder is None:
            raise ClientStateError(f"node {context.node_id}: the state must go to the context or to files")
        self.context = context
        self.in_context = in_context
        self.folder = folder
        self.as_of = as_of
        self.keep_round = keep_round

    # ------------------------------------------------------------------ read
    def load(self, d: int, device: torch.device) -> ReplicaState | None:
        """The node's state as of the end of round ``as_of``, or None for a node that has none.

        ``context.state`` when it holds it; otherwise the newest state file at or before that
        round (a restarted SuperNode, or a resumed ServerApp in a new run whose contexts start
        empty).
        """
        state = self._from_context(d, device)
        if self.folder is None or (state is not None and (self.as_of < 0 or state.round <= self.as_of)):
            return state
        return self._from_file(d, device)

    def _from_context(self, d: int, device: torch.device) -> ReplicaState | None:
        cs = self.context.state
        if STATE_ARRAYS not in cs and STATE_META not in cs:
            return None
        try:
            stored = {name: a.numpy() for name, a in cs[STATE_ARRAYS].items()}
            rest = {name: a.numpy() for name, a in cs[STATE_REST].items()} if STATE_REST in cs else {}
            meta = cs[STATE_META]
            if "x" not in stored or "m" not in stored:
                raise KeyError(f"arrays {sorted(stored)} lack 'x' or 'm'")
            version, saved_round = int(meta["version"]), int(meta.get("round", 0))
            m_bf16 = meta.get("m-dtype", "float32") == "bfloat16"
        except Exception as err:
            raise ClientStateError(f"node {self.context.node_id}: stored state is incomplete ({err!r})") from err
        bad = {name: a.shape for name, a in stored.items() if a.shape != (d,)}
        if bad:
            raise ClientStateError(f"node {self.context.node_id}: stored state has shapes {bad}, model has d={d}")
        t = {name: torch.from_numpy(a).to(device) for name, a in stored.items()}  # Array.numpy(): fresh arrays
        if m_bf16:  # stored as the raw 16 bits of bfloat16 (numpy has no bfloat16)
            t["m"] = t["m"].view(torch.bfloat16).float()
        rest_t = {name: torch.from_numpy(a).to(device) for name, a in rest.items()}
        return ReplicaState(t["x"], t["m"], version, t.get("e"), saved_round, rest_t).with_meta(dict(meta), t)

    def _saved_rounds(self) -> list[int]:
        """Rounds of the complete state files (``r<round>.pt``), ascending."""
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(int(p.stem[1:]) for p in self.folder.glob("r*.pt") if p.stem[1:].isdigit())

    def _from_file(self, d: int, device: torch.device) -> ReplicaState | None:
        assert self.folder is not None
        rounds = [r for r in self._saved_rounds() if self.as_of < 0 or r <= self.as_of]
        if not rounds:
            return None
        path = self.folder / f"r{rounds[-1]}.pt"
        saved = torch.load(path, map_location=device, weights_only=True)
        if saved["x"].shape != (d,) or saved["m"].shape != (d,):
            raise ClientStateError(f"state file {path} has shape {tuple(saved['x'].shape)}, d={d}")
        m = saved["m"].float()  # stored as bfloat16 with momentum-dtype = "bfloat16"
        state = ReplicaState(saved["x"], m, int(saved["version"]), saved.get("e"), int(saved["round"]), saved["rest"])
        return state.with_meta(saved, saved)

    # ------------------------------------------------------------------ write
    def save(self, host: ReplicaState) -> None:
        """Store ``host`` (on the host, as :meth:`ReplicaState.on_host` gives it) where this store keeps it."""
        if self.in_context:
            self._to_context(host)
        if self.folder is not None:
            self._to_file(host)

    def _to_context(self, host: ReplicaState) -> None:
        """x, m (and e) and the rest in ``context.state``; an m in bfloat16 in 2 bytes per value."""
        bf16 = host.m.dtype == torch.bfloat16  # m as the raw 16 bits of bfloat16 (numpy has no bfloat16)
        arrays = {k: (v.view(torch.int16) if k == "m" and bf16 else v).numpy() for k, v in host.tensors().items()}
        cs = self.context.state
        cs[STATE_ARRAYS] = ArrayRecord({k: to_array(a) for k, a in arrays.items()})
        if host.rest:
            cs[STATE_REST] = ArrayRecord({k: to_array(_numpy(v)) for k, v in host.rest.items()})
        cs[STATE_META] = ConfigRecord(host.meta() | {"m-dtype": "bfloat16" if bf16 else "float32"})

    def _to_file(self, host: ReplicaState) -> None:
        """Write ``r<round>.pt`` atomically; keep besides it only the newest file at or before ``keep_round``.

        ``keep_round`` is the server's latest checkpoint (0: none yet), the round a resumed
        ServerApp starts from; the file just written is the one a restarted SuperNode starts
        from. Every other file is deleted: older rounds, and rounds after this one (a resumed
        run's dead future).
        """
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"r{host.round}.pt"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        undo = (
            torch.frombuffer(bytearray(host.undo), dtype=torch.uint8)
            if host.undo
            else torch.zeros(0, dtype=torch.uint8)
        )
        torch.save(host.meta() | {"undo": undo, "rest": host.rest} | host.tensors(), tmp)  # weights_only: no bytes
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
        rounds = self._saved_rounds()
        kept = max((r for r in rounds if r <= self.keep_round), default=None)
        for r in rounds:
            if r not in (kept, host.round):
                (self.folder / f"r{r}.pt").unlink(missing_ok=True)


def load_state(context: Context, d: int, device: torch.device) -> ReplicaState | None:
    """The state a node keeps in ``context.state`` (None if it has none): for tests and inspection."""
    return StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0).load(d, device)


def save_state(context: Context, state: ReplicaState) -> None:
    """Put ``state`` (on the host) in ``context.state`` as the client stores it."""
    StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0).save(state)
