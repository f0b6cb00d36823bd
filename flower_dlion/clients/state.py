"""What a D-Lion client persists of a node between rounds, on the host, and the checks a loaded copy passes.

Host side only: everything here is numpy arrays and numbers (:class:`HostState`). A tensor on
the client's compute device never reaches this module; :meth:`.resident.NodeState.to_host` and
:meth:`.resident.NodeState.from_host` convert between the two (through :mod:`.placement`), and
a tensor handed here by mistake fails on the CPU as it would on a GPU (:func:`check_state` and
the writers of :mod:`.state_store` take numpy arrays only).

What is persisted of a node (:class:`HostState`):

* its own state: the Lion momentum m (float32, or the 16 bits of bfloat16), the error-feedback
  residual e (``upload="ef-sign"``), the drift correction's hᵢ, its round and its last upload's signs
  and scales (``drift``, ``drift-round``, ``drift-signs``, ``drift-scales``: :mod:`flower_dlion.drift`;
  optional, so files without them load and are the same format), its buffers (``rest``), what it takes
  to undo its last catch-up (``previous``, ``undo``), its version and round;
* its replica: x itself (the chain downlink), or the anchor's version and the integer counts C
  since it (int8, int16 or int32, the narrowest that holds them) with γ and η (the anchored
  downlink), from which x = γ·xₐ − η·C is recomputed when the state is loaded. The anchor xₐ is
  in the context, or, with files, in one file per anchor shared by the run's nodes
  (``<run>/anchors/``: it changes once every ``anchor-every`` rounds);
* the CRC-32 of x (``checksum``), the run and node it belongs to (``owner``), the model's
  layout, and a ``stamp`` that changes with every write: a client that kept the node's state
  resident on its device uses it only while the persisted copy still has that stamp.

Every load is checked (:func:`check_state`): format, structure, shapes, dtypes, finiteness, the
CRC-32 of the file and of x, the owner and the layout. A state that fails is refused: the node
says which copy (the file, or ``context.state``) and why, the copy is dropped (a file is renamed
``*.refused``), and the node starts as a new one (the server sends it the seed or the anchor).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context

from ..lion import anchored
from ..protocol import ClientStateError

__all__ = [
    "STATE_DIR_ENV",
    "ClientStateError",
    "Expected",
    "HostState",
    "StateRefused",
    "check_state",
    "crc32",
    "default_state_dir",
    "narrow_counts",
    "node_label",
]

logger = logging.getLogger("flower_dlion")

STATE_ARRAYS = "dlion.state"
STATE_REST = "dlion.rest"
STATE_META = "dlion.state-meta"
CONTEXT_LIMIT = 1 << 30  # bytes of state above which context.state is refused (protobuf's limit is 2 GiB a message)
FORMAT = 2  # of the persisted state (1: x, m, anchor and int32 counts as torch.save'd tensors, no owner or stamp)
COUNT_LIMIT = 1 << 30  # |C| beyond this is no count of votes
CONTEXTS = 9  # a coder context is 0–8 (flower_dlion.anchored_counts)


class StateRefused(ValueError):
    """A persisted state that cannot be used: truncated, corrupted, non-finite, or another run's, model's or node's."""


def crc32(a: np.ndarray) -> int:
    """CRC-32 of an array's bytes (x's float32 bytes: the replica checksum every reply carries)."""
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8))


@dataclass
class HostState:
    """A node's state as persisted, on the host: numpy arrays and numbers (see the module doc)."""

    version: int  # number of Δs applied to x since the start
    round: int  # the server round whose train message left the node in this state
    checksum: int  # CRC-32 of x
    m: np.ndarray  # Lion momentum: float32, or uint16 holding bfloat16's bits (m_dtype "bfloat16")
    owner: str = ""  # "<run key>/<node label>"
    layout: str = ""  # the model's layout fingerprint (params.layout_fingerprint)
    m_dtype: str = "float32"
    error: np.ndarray | None = None  # error-feedback residual, float32
    drift: np.ndarray | None = None  # the drift correction's hᵢ, float32 (checked where it is used: flower_dlion.drift)
    drift_round: int = -1  # the round whose upload made it
    drift_signs: np.ndarray | None = None  # that upload's packed signs, uint8, and its scales, float32: until the
    drift_scales: np.ndarray | None = None  # next message says where the server cut them (flower_dlion.drift)
    rest: dict[str, np.ndarray] = field(default_factory=dict)  # the buffers, by name
    x: np.ndarray | None = None  # float32; persisted only without an anchor (else recomputed on load)
    anchor: np.ndarray | None = None  # xₐ, float32
    anchor_version: int = 0
    anchor_checksum: int = 0
    counts: np.ndarray | None = None  # C since the anchor: int8, int16 or int32
    decay: float = 1.0  # γ of x at ``version``
    step: float = 0.0  # η
    recent: np.ndarray | None = None  # the context of the two last Δs at ``version``, uint8 (0–8)
    depth: int = 0  # how many of those Δs ``recent`` holds
    previous: int = -1  # the version before the last catch-up (-1: none)
    undo: bytes = b""  # that catch-up's counts (flower_dlion.clients.replica)
    stamp: str = ""  # changes with every write

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-node arrays as stored (not the anchor: in files it is shared by the run's nodes)."""
        counts = None if self.counts is None else narrow_counts(self.counts)  # here: off a background write's caller
        out = {"m": self.m, "e": self.error, **self.drift_arrays(), "counts": counts, "recent": self.recent}
        if self.anchor is None:
            out["x"] = self.x
        return {k: v for k, v in out.items() if v is not None}

    def drift_arrays(self) -> dict[str, np.ndarray | None]:
        """The drift correction's arrays by their stored names (None: absent)."""
        return {"drift": self.drift, "drift-signs": self.drift_signs, "drift-scales": self.drift_scales}

    def meta(self) -> dict[str, int | float | str]:
        """The numbers and names stored besides the arrays."""
        return {
            "format": FORMAT,
            "version": self.version,
            "round": self.round,
            "checksum": self.checksum,
            "owner": self.owner,
            "layout": self.layout,
            "m-dtype": self.m_dtype,
            "anchor-version": self.anchor_version,
            "anchor-checksum": self.anchor_checksum,
            "decay": self.decay,
            "step": self.step,
            "depth": self.depth,
            "previous": self.previous,
            "stamp": self.stamp,
        } | ({"drift-round": self.drift_round} if self.drift is not None else {})

    @classmethod
    def from_parts(
        cls,
        meta: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
        rest: Mapping[str, np.ndarray],
        anchor: np.ndarray | None,
        undo: bytes,
    ) -> HostState:
        """The state from what :meth:`meta` and :meth:`arrays` stored (``StateRefused`` for a missing entry)."""
        try:
            if int(meta["format"]) != FORMAT:
                raise StateRefused(f"format {meta['format']}, this client reads format {FORMAT}")
            return cls(
                version=int(meta["version"]),
                round=int(meta["round"]),
                checksum=int(meta["checksum"]),
                m=arrays["m"],
                owner=str(meta["owner"]),
                layout=str(meta["layout"]),
                m_dtype=str(meta["m-dtype"]),
                error=arrays.get("e"),
                drift=arrays.get("drift"),
                drift_signs=arrays.get("drift-signs"),
                drift_scales=arrays.get("drift-scales"),
                drift_round=int(meta.get("drift-round", -1)),
                rest=dict(rest),
                x=arrays.get("x"),
                anchor=anchor,
                anchor_version=int(meta["anchor-version"]),
                anchor_checksum=int(meta["anchor-checksum"]),
                counts=arrays.get("counts"),
                decay=float(meta["decay"]),
                step=float(meta["step"]),
                recent=arrays.get("recent"),
                depth=int(meta["depth"]),
                previous=int(meta["previous"]),
                undo=bytes(undo),
                stamp=str(meta["stamp"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, StateRefused):
                raise
            raise StateRefused(f"incomplete ({err!r})") from err


@dataclass(frozen=True)
class Expected:
    """What a node's persisted state must be: for this run and node, this model."""

    d: int
    owner: str
    layout: str
    rest: dict[str, tuple[int, ...]]  # the buffers: name → shape
    held: frozenset = frozenset()  # replicas this process holds (.resident.Ident): their x is not recomputed


def check_state(host: HostState, expect: Expected) -> None:
    """Refuse (``StateRefused``, saying why) a state that does not fit ``expect`` or is damaged.

    Sets ``host.x`` from the anchor and counts when it was not stored, and checks it against
    ``host.checksum``; not where ``expect.held`` has the replica (the process holds x, checked
    when it was made: the anchor need not even be read, see :meth:`.state_store.StateStore.load`).
    """
    if host.owner != expect.owner:
        raise StateRefused(f"it belongs to {host.owner!r}, not {expect.owner!r}")
    if host.layout != expect.layout:
        raise StateRefused(f"it was saved for model layout {host.layout}, this model's is {expect.layout}")
    in_range = host.version >= 0 and host.round >= 0 and -1 <= host.previous < max(host.version, 1)
    if not in_range or host.depth not in (0, 1, 2):
        raise StateRefused(
            f"version {host.version}, round {host.round}, previous {host.previous}, depth {host.depth} are out of range"
        )
    _check_own(host, expect)
    if _check_replica(host, expect.d, ident(host) in expect.held):
        return
    assert host.x is not None
    if crc32(host.x) != host.checksum:
        raise StateRefused(f"x's checksum is {crc32(host.x)}, it was saved with {host.checksum}")


def _check_own(host: HostState, expect: Expected) -> None:
    """The node's own arrays: m, e, its buffers, the coder context, the undo record."""
    d = expect.d
    m_kind = {"float32": np.float32, "bfloat16": np.uint16}.get(host.m_dtype)
    _check_array("m", host.m, d, (m_kind,) if m_kind else ())
    if host.m_dtype == "bfloat16":
        if bool(np.any((host.m & 0x7F80) == 0x7F80)):  # exponent all ones: inf or nan
            raise StateRefused("the momentum m has non-finite values")
    elif not np.isfinite(host.m).all():
        raise StateRefused("the momentum m has non-finite values")
    if host.error is not None:
        _check_array("e", host.error, d, (np.float32,))
        if not np.isfinite(host.error).all():
            raise StateRefused("the error-feedback residual e has non-finite values")
    sizes = {k: v.size for k, v in host.rest.items()}
    if sizes != {k: math.prod(shape) for k, shape in expect.rest.items()}:
        found = {k: v.shape for k, v in host.rest.items()}
        raise StateRefused(f"its buffers are {found}, the model's are {expect.rest}")
    for name, a in host.rest.items():
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise StateRefused(f"{name!r} has non-finite values")
        host.rest[name] = a.reshape(expect.rest[name])  # a scalar comes back from an Array as (1,)
    if host.recent is not None:
        _check_array("recent", host.recent, d, (np.uint8,))
        if int(host.recent.max(initial=0)) >= CONTEXTS:
            raise StateRefused(f"its coder context has values above {CONTEXTS - 1}")
    if host.undo[:1] not in (b"", b"C", b"L"):
        raise StateRefused("its undo record is malformed")


def ident(host: HostState) -> tuple[int, int, int, int]:
    """Which replica the state is at (:data:`.resident.Ident`): version, x's, the anchor's version, its checksum."""
    return (host.version, host.checksum, host.anchor_version, host.anchor_checksum)


def _check_replica(host: HostState, d: int, held: bool) -> bool:
    """The replica: x itself, or the anchor and the counts (x recomputed from them into ``host.x``).

    ``held``: the process holds that replica; only the counts are checked (no x is computed).
    Returns whether that is what happened.
    """
    if held and host.counts is not None:
        _check_counts(host, d)
        return True
    if (host.anchor is None) != (host.counts is None):
        raise StateRefused("it has an anchor without counts, or counts without an anchor")
    if host.anchor is None:
        if host.x is None:
            raise StateRefused("it has no replica (neither x nor an anchor with counts)")
        _check_array("x", host.x, d, (np.float32,))
        if not np.isfinite(host.x).all():
            raise StateRefused("x has non-finite values")
        return
    assert host.counts is not None
    _check_array("anchor", host.anchor, d, (np.float32,))
    if not np.isfinite(host.anchor).all() or crc32(host.anchor) != host.anchor_checksum:
        raise StateRefused("the anchor is not the one it was saved with (checksum) or has non-finite values")
    _check_counts(host, d)
    counts = torch.from_numpy(host.counts.astype(np.int32, copy=False))
    host.x = anchored(torch.from_numpy(host.anchor), counts, host.decay, host.step).numpy()
    return False


def _check_counts(host: HostState, d: int) -> None:
    """The counts since the anchor, γ, η and the anchor's version (|C| checked without a wider copy)."""
    assert host.counts is not None
    _check_array("counts", host.counts, d, (np.int8, np.int16, np.int32))
    wide = host.counts.dtype == np.int32  # int8 and int16 hold nothing beyond ±2¹⁵ < COUNT_LIMIT
    if wide and not -COUNT_LIMIT <= int(host.counts.min(initial=0)) <= int(host.counts.max(initial=0)) <= COUNT_LIMIT:
        raise StateRefused(f"its counts exceed ±{COUNT_LIMIT}")
    if not (np.isfinite(host.decay) and np.isfinite(host.step) and 0 < host.decay <= 1 and host.step >= 0):
        raise StateRefused(f"decay {host.decay} and step {host.step} are out of range")
    if not host.anchor_version <= host.version:
        raise StateRefused(f"anchor version {host.anchor_version} is after version {host.version}")


def _check_array(name: str, a: Any, d: int, dtypes: tuple[type, ...]) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} is a {type(a).__name__}, not a host numpy array: convert it in clients.placement")
    if a.shape != (d,) or not any(a.dtype == t for t in dtypes):
        allowed = " or ".join(np.dtype(t).name for t in dtypes) or "none"
        raise StateRefused(f"{name} is {a.dtype} {a.shape}, the model needs {allowed} ({d},)")


STATE_DIR_ENV = "FLOWER_DLION_STATE_DIR"  # a machine's default state folder (each Ray node's own, or shared storage)


def default_state_dir() -> Path:
    """Where state files go when the client names no folder.

    ``$FLOWER_DLION_STATE_DIR`` where it is set in the process serving the node (a Ray node
    passes its environment to its workers), else ``<tmp>/flower-dlion-state-<uid>``.
    """
    chosen = os.environ.get(STATE_DIR_ENV, "")
    if chosen:
        return Path(chosen).expanduser()
    return Path(tempfile.gettempdir()) / f"flower-dlion-state-{os.getuid() if hasattr(os, 'getuid') else 0}"


def node_label(context: Context) -> str:
    """``partition-<id>`` when the node config names one, else ``node-<node id>``."""
    pid = context.node_config.get("partition-id")
    return f"partition-{int(pid)}" if pid is not None else f"node-{context.node_id}"


def narrow_counts(counts: np.ndarray) -> np.ndarray:
    """C in the narrowest of int8, int16 and int32 that holds it (votes of an epoch rarely pass ±127)."""
    low, high = (int(v) for v in (counts.min(initial=0), counts.max(initial=0)))
    for dtype in (np.int8, np.int16):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return counts.astype(dtype)
    return counts
