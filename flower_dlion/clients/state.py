"""Where a D-Lion client persists its state between rounds, on the host: ``context.state`` or a file per node.

Host side only: everything here is numpy arrays and numbers (:class:`HostState`). A tensor on
the client's compute device never reaches this module; :mod:`.placement` converts between the
two, in one place, and a tensor handed here by mistake fails on the CPU as it would on a GPU
(:func:`check_state` and the writers take numpy arrays only).

What is persisted of a node (:class:`HostState`):

* its own state: the Lion momentum m (float32, or the 16 bits of bfloat16), the error-feedback
  residual e (``upload="ef-sign"``), its buffers and frozen parameters (``rest``), what it takes
  to undo its last catch-up (``previous``, ``undo``), its version and round;
* its replica: x itself (the chain downlink), or the anchor's version and the integer counts C
  since it (int8, int16 or int32, the narrowest that holds them) with γ and η (the anchored
  downlink), from which x = γ·xₐ − η·C is recomputed when the state is loaded. The anchor xₐ is
  in the context, or, with files, in one file per anchor shared by the run's nodes
  (``<run>/anchors/``: it changes once every ``anchor-every`` rounds);
* the CRC-32 of x (``checksum``), the run and node it belongs to (``owner``), the model's
  layout, and a ``stamp`` that changes with every write: a client that kept the node's state
  resident on its device uses it only while the persisted copy still has that stamp.

Where: ``context.state`` (``in_context``) and/or ``<folder>/r<round>.state`` (``folder``): the
file a restarted SuperNode starts from, and the one a resumed ServerApp asks for by round
(``state-round``); only the newest file and the one of the server's latest checkpoint
(``keep-round``) are kept. A file is written to a temporary name and renamed, so a reader
sees the old file or the new one; a client whose process lives on writes it on a background
thread after the reply has gone (``save(background=True)``) and leaves a ``.pending`` marker
that readers in other processes wait for.

Every load is checked (:func:`check_state`): format, structure, shapes, dtypes, finiteness, the
CRC-32 of the file and of x, the owner and the layout. A state that fails is refused: the node
says which copy (the file, or ``context.state``) and why, the copy is dropped (a file is renamed
``*.refused``), and the node starts as a new one (the server sends it the seed or the anchor).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import re
import secrets
import struct
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context

from ..lion import anchored
from ..protocol import to_array

__all__ = [
    "ClientStateError",
    "Expected",
    "HostState",
    "StateRefused",
    "StateStore",
    "check_state",
    "crc32",
    "default_state_dir",
    "load_state",
    "node_label",
    "read_state_file",
    "read_state_header",
    "save_state",
    "wait_for_writes",
]

logger = logging.getLogger("flower_dlion")

STATE_ARRAYS = "dlion.state"
STATE_REST = "dlion.rest"
STATE_META = "dlion.state-meta"
CONTEXT_LIMIT = 1 << 30  # bytes of state above which context.state is refused (protobuf's limit is 2 GiB a message)
FORMAT = 2  # of the persisted state (1: x, m, anchor and int32 counts as torch.save'd tensors, no owner or stamp)
MAGIC = b"DLS2"
COUNT_LIMIT = 1 << 30  # |C| beyond this is no count of votes
CONTEXTS = 9  # a coder context is 0–8 (flower_dlion.downlink)
PENDING_WAIT_S = 120.0  # how long a reader waits for another process's write of a newer state file


class ClientStateError(RuntimeError):
    """The node's stored state or configuration cannot serve the message it received."""


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
    rest: dict[str, np.ndarray] = field(default_factory=dict)  # frozen parameters and buffers, by name
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
        out = {"m": self.m, "e": self.error, "counts": counts, "recent": self.recent}
        if self.anchor is None:
            out["x"] = self.x
        return {k: v for k, v in out.items() if v is not None}

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
        }

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
    rest: dict[str, tuple[int, ...]]  # frozen parameters and buffers: name → shape


def check_state(host: HostState, expect: Expected) -> None:
    """Refuse (``StateRefused``, saying why) a state that does not fit ``expect`` or is damaged.

    Sets ``host.x`` from the anchor and counts when it was not stored, and checks it against
    ``host.checksum``.
    """
    d = expect.d
    if host.owner != expect.owner:
        raise StateRefused(f"it belongs to {host.owner!r}, not {expect.owner!r}")
    if host.layout != expect.layout:
        raise StateRefused(f"it was saved for model layout {host.layout}, this model's is {expect.layout}")
    in_range = host.version >= 0 and host.round >= 0 and -1 <= host.previous < max(host.version, 1)
    if not in_range or host.depth not in (0, 1, 2):
        raise StateRefused(
            f"version {host.version}, round {host.round}, previous {host.previous}, depth {host.depth} are out of range"
        )
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
        raise StateRefused(f"its frozen parameters and buffers are {found}, the model's are {expect.rest}")
    for name, a in host.rest.items():
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise StateRefused(f"{name!r} has non-finite values")
        host.rest[name] = a.reshape(expect.rest[name])  # a scalar comes back from an Array as (1,)
    if (host.anchor is None) != (host.counts is None):
        raise StateRefused("it has an anchor without counts, or counts without an anchor")
    if host.anchor is None:
        if host.x is None:
            raise StateRefused("it has no replica (neither x nor an anchor with counts)")
        _check_array("x", host.x, d, (np.float32,))
        if not np.isfinite(host.x).all():
            raise StateRefused("x has non-finite values")
    else:
        assert host.counts is not None
        _check_array("anchor", host.anchor, d, (np.float32,))
        _check_array("counts", host.counts, d, (np.int8, np.int16, np.int32))
        if not np.isfinite(host.anchor).all() or crc32(host.anchor) != host.anchor_checksum:
            raise StateRefused("the anchor is not the one it was saved with (checksum) or has non-finite values")
        if int(np.abs(host.counts.astype(np.int64)).max(initial=0)) > COUNT_LIMIT:
            raise StateRefused(f"its counts exceed ±{COUNT_LIMIT}")
        if not (np.isfinite(host.decay) and np.isfinite(host.step) and 0 < host.decay <= 1 and host.step >= 0):
            raise StateRefused(f"decay {host.decay} and step {host.step} are out of range")
        if not host.anchor_version <= host.version:
            raise StateRefused(f"anchor version {host.anchor_version} is after version {host.version}")
        counts = torch.from_numpy(host.counts.astype(np.int32, copy=False))
        host.x = anchored(torch.from_numpy(host.anchor), counts, host.decay, host.step).numpy()
    if host.recent is not None:
        _check_array("recent", host.recent, d, (np.uint8,))
        if int(host.recent.max(initial=0)) >= CONTEXTS:
            raise StateRefused(f"its coder context has values above {CONTEXTS - 1}")
    if host.undo[:1] not in (b"", b"C", b"L"):
        raise StateRefused("its undo record is malformed")
    if crc32(host.x) != host.checksum:
        raise StateRefused(f"x's checksum is {crc32(host.x)}, it was saved with {host.checksum}")


def _require_host(host: HostState) -> None:
    """A ``TypeError`` for anything but numpy arrays in ``host``: on the CPU as on a GPU, where a tensor fails later."""
    named = {"m": host.m, "e": host.error, "x": host.x, "anchor": host.anchor, "counts": host.counts}
    named |= {"recent": host.recent} | {f"rest {k!r}": v for k, v in host.rest.items()}
    for name, a in named.items():
        if a is not None and not isinstance(a, np.ndarray):
            raise TypeError(f"{name} is a {type(a).__name__}, not a host numpy array: convert it in clients.placement")


def _check_array(name: str, a: Any, d: int, dtypes: tuple[type, ...]) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} is a {type(a).__name__}, not a host numpy array: convert it in clients.placement")
    if a.shape != (d,) or not any(a.dtype == t for t in dtypes):
        allowed = " or ".join(np.dtype(t).name for t in dtypes) or "none"
        raise StateRefused(f"{name} is {a.dtype} {a.shape}, the model needs {allowed} ({d},)")


def default_state_dir() -> Path:
    """Where state files go when the client keeps its state out of the context but names no folder."""
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


# --------------------------------------------------------------------------- files
_WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlion-state")  # joined at exit
_PENDING: set[concurrent.futures.Future] = set()


def wait_for_writes() -> None:
    """Wait until every state file this process is writing in the background is on disk."""
    for future in list(_PENDING):
        concurrent.futures.wait([future])


def write_state_file(path: Path, host: HostState, *, in_place: bool = False) -> None:
    """``host`` as one file: magic, header (JSON), the arrays' bytes, CRC-32 of all before it.

    Written to a temporary name and renamed (readers see the old file or the new one), or,
    ``in_place``, over the file that is there: its pages are reused, about 5× faster for a
    state of 10⁷ values (new pages and freeing the old ones cost more than the copy); a reader
    of a half-written file finds its CRC wrong (:class:`StateStore` alternates two such files).
    """
    arrays = host.arrays() | {f"rest/{k}": v for k, v in host.rest.items()}
    if host.undo:
        arrays["undo"] = np.frombuffer(host.undo, dtype=np.uint8)
    table = [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]
    header = json.dumps({"meta": host.meta(), "arrays": table}, separators=(",", ":")).encode()
    target = path if in_place else path.with_name(f".{path.name}.{os.getpid()}.tmp")
    crc = 0
    with open(target, "r+b" if in_place and target.exists() else "wb") as f:
        for part in [MAGIC + struct.pack("<I", len(header)) + header, *arrays.values()]:
            view = memoryview(np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part).cast("B")
            f.write(view)
            crc = zlib.crc32(view, crc)  # releases the GIL on large buffers
        f.write(struct.pack("<I", crc))
        f.truncate()
    if not in_place:
        os.replace(target, path)


def read_state_header(path: Path) -> dict[str, Any] | None:
    """The meta of a state file's header (a few hundred bytes read), or None where it is not readable."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8 or head[:4] != MAGIC:
                return None
            (length,) = struct.unpack_from("<I", head, 4)
            meta = json.loads(f.read(length))["meta"]
            return meta if isinstance(meta, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_state_file(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header's meta and the arrays (writable, no copy beyond the read) of a state file.

    Raises ``StateRefused`` for a damaged file.
    """
    size = path.stat().st_size
    data = bytearray(size)
    with open(path, "rb") as f:
        if f.readinto(data) != size:
            raise StateRefused("it was truncated while being read")
    if size < len(MAGIC) + 8 or data[:4] != MAGIC:
        raise StateRefused(f"not a state file of format {FORMAT} ({size} bytes, starts {bytes(data[:4])!r})")
    if zlib.crc32(memoryview(data)[:-4]) != struct.unpack_from("<I", data, size - 4)[0]:
        raise StateRefused(f"CRC-32 mismatch over its {size} bytes (truncated or corrupted)")
    (length,) = struct.unpack_from("<I", data, 4)
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
        offset, arrays = 8 + length, {}
        for name, dtype, shape in header["arrays"]:
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(data, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)
            offset += arrays[name].nbytes
        if offset != size - 4:
            raise ValueError(f"its arrays end at byte {offset}, the file at {size - 4}")
        return header["meta"], arrays
    except (KeyError, TypeError, ValueError) as err:
        raise StateRefused(f"malformed header ({err})") from err


class StateStore:
    """The persisted state of one node for one message: where it is read from and written to.

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
    owner : str (default: "")
        Whose state this is (``<run key>/<node label>``): files in ``folder`` that name another
        owner are neither read nor replaced nor deleted ("": every readable file is this node's).

    """

    def __init__(
        self, context: Context, *, in_context: bool, folder: Path | None, as_of: int, keep_round: int, owner: str = ""
    ) -> None:
        if not in_context and folder is None:
            raise ClientStateError(f"node {context.node_id}: the state must go to the context or to files")
        self.context = context
        self.in_context = in_context
        self.folder = folder
        self.as_of = as_of
        self.keep_round = keep_round
        self.owner = owner

    def probe(self) -> None:
        """Write and remove a small file in the folder, or raise ClientStateError saying why it cannot be written."""
        if self.folder is None:
            return
        probe = self.folder / f".probe.{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"flower-dlion")
            probe.unlink()
        except OSError as err:
            raise ClientStateError(
                f"node {self.context.node_id}: its state folder {self.folder} cannot be written ({err}); choose a "
                "writable one: run config 'client-state-dir', DLionClient(state_dir=...)"
            ) from err

    # ------------------------------------------------------------------ which copy
    def _context_round(self) -> int | None:
        meta = self.context.state[STATE_META] if STATE_META in self.context.state else None
        try:
            return None if meta is None else int(meta["round"])
        except (KeyError, TypeError, ValueError):
            return -1  # there, but unreadable: load() says why

    def _use_context(self) -> bool:
        r = self._context_round()
        return r is not None and (self.folder is None or self.as_of < 0 or r <= self.as_of)

    def current(self) -> tuple[int, str] | None:
        """(round, stamp) of the copy this message starts from, or None where there is none; cheap.

        A file another process is still writing is waited for (``.pending`` markers).
        """
        if self._use_context():
            meta = self.context.state[STATE_META]
            return int(meta.get("round", -1)), str(meta.get("stamp", ""))
        found = self._newest_file()
        if found is None:
            return None
        meta = read_state_header(found[1]) or {}
        return int(meta.get("round", -1)), str(meta.get("stamp", ""))

    def where(self) -> str:
        """The copy this message starts from, for messages: the file's path or ``context.state``."""
        if self._use_context():
            return "context.state"
        found = self._newest_file()
        return str(found[1]) if found is not None else f"{self.folder or 'context.state'} (no state there)"

    # ------------------------------------------------------------------ read
    def load(self, expect: Expected, node_id: int) -> HostState | None:
        """The node's checked state, or None: none there, or refused (logged with the copy and the reason, dropped).

        From files, a refused one gives way to the next newest (the other slot: a round older).
        """
        if self._use_context():
            try:
                host = self._from_context()
                check_state(host, expect)
                return host
            except StateRefused as err:
                self._refused(node_id, "context.state", err)
                self._drop(None)
                return None
        while (found := self._newest_file()) is not None:
            try:
                host = self._from_file(found[1])
                check_state(host, expect)
                return host
            except (StateRefused, OSError) as err:
                self._refused(node_id, str(found[1]), err)
                self._drop(found[1])
        return None

    @staticmethod
    def _refused(node_id: int, where: str, err: Exception) -> None:
        logger.warning(
            "flower-dlion: node %d: its state in %s is refused: %s; the node starts anew", node_id, where, err
        )

    def _from_context(self, d: int = 0) -> HostState:
        cs = self.context.state
        try:
            arrays = {name: a.numpy() for name, a in cs[STATE_ARRAYS].items()} if STATE_ARRAYS in cs else {}
            rest = {name: a.numpy() for name, a in cs[STATE_REST].items()} if STATE_REST in cs else {}
            meta = dict(cs[STATE_META])
        except Exception as err:  # Array.numpy() of damaged bytes raises anything numpy's reader raises
            raise StateRefused(f"unreadable ({err!r})") from err
        anchor = arrays.pop("anchor", None)
        undo = meta.pop("undo", b"")
        if not isinstance(undo, bytes):
            raise StateRefused("its undo record is not bytes")
        return HostState.from_parts(meta, arrays, rest, anchor, undo)

    def _from_file(self, path: Path) -> HostState:
        meta, arrays = read_state_file(path)
        rest = {k.removeprefix("rest/"): v for k, v in arrays.items() if k.startswith("rest/")}
        undo = arrays.pop("undo", np.zeros(0, np.uint8)).tobytes()
        anchor = None
        if "counts" in arrays:
            anchor = self._read_anchor(int(meta.get("anchor-version", -1)), int(meta.get("anchor-checksum", -1)))
        return HostState.from_parts(meta, arrays, rest, anchor, undo)

    def _anchor_path(self, version: int, checksum: int) -> Path:
        assert self.folder is not None
        return self.folder.parent / "anchors" / f"a{version}-{checksum & 0xFFFFFFFF:08x}.npy"

    def _read_anchor(self, version: int, checksum: int) -> np.ndarray:
        path = self._anchor_path(version, checksum)
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise StateRefused(f"its anchor {path} cannot be read ({err})") from err

    def _files(self) -> list[tuple[int, Path]]:
        """(round, path) of the node's state files whose header reads, oldest first.

        The two slots (``slot-0.state``, ``slot-1.state``, overwritten in turn) and a kept
        checkpoint's round (``r<round>.state``).
        """
        if self.folder is None or not self.folder.is_dir():
            return []
        out = []
        for path in self.folder.glob("*.state"):
            meta = read_state_header(path)
            if meta is not None and self.owner and meta.get("owner") != self.owner:
                continue  # another run's or node's: not read, not replaced, not deleted
            try:
                out.append((int(meta["round"]) if meta is not None else -1, path))
            except (KeyError, TypeError, ValueError):
                out.append((-1, path))
        return sorted(out, key=lambda rp: (rp[0], rp[1].name.startswith("slot")))

    def _mine(self, path: Path) -> bool:
        """Whether this node may write ``path``: not there, a state file of this owner, or one that does not read."""
        if not path.exists():
            return True
        meta = read_state_header(path)
        return meta is None or not self.owner or meta.get("owner") == self.owner

    def _sweep(self) -> None:
        """Remove what a write of this node's that was cut short left: temporary files and markers of dead processes."""
        assert self.folder is not None
        for folder in (self.folder, self.folder.parent / "anchors"):
            for path in folder.glob(".*"):
                pid = _writer_pid(path.name)
                if pid is not None and pid != os.getpid() and not _alive(pid):
                    path.unlink(missing_ok=True)

    def _newest_file(self) -> tuple[int, Path] | None:
        """The newest state file at or before ``as_of``, after waiting for a newer one another process is writing.

        One whose header does not read counts as the oldest (load() refuses it, saying why).
        """
        if self.folder is None:
            return None
        deadline = time.monotonic() + PENDING_WAIT_S
        while True:
            files = [f for f in self._files() if self.as_of < 0 or f[0] <= self.as_of]
            newest = files[-1][0] if files else -1
            if not self._pending_after(newest) or time.monotonic() > deadline:
                return files[-1] if files else None
            time.sleep(0.005)

    def _pending_after(self, newest: int) -> bool:
        """Whether a live process (this one too) is writing a state file newer than round ``newest``."""
        assert self.folder is not None
        for marker in self.folder.glob(".r*.pending.*"):
            round_text, _, pid_text = marker.name[2:].partition(".pending.")
            if not (round_text.isdigit() and pid_text.isdigit()):
                continue
            if int(round_text) > newest and (self.as_of < 0 or int(round_text) <= self.as_of) and _alive(int(pid_text)):
                return True
        return False

    def _drop(self, path: Path | None) -> None:
        """Take a refused copy out of the way, so that it is not read again."""
        if path is None:
            for key in (STATE_ARRAYS, STATE_REST, STATE_META):
                if key in self.context.state:
                    del self.context.state[key]
            return
        try:
            os.replace(path, path.with_name(path.name + ".refused"))
        except OSError:
            pass

    # ------------------------------------------------------------------ write
    def save(self, host: HostState, *, background: bool = False) -> tuple[str, concurrent.futures.Future | None]:
        """Store ``host`` where this store keeps it; returns its new stamp and, for a background write, its future.

        ``background``: write the file on the writer thread (after the reply has gone); the
        caller waits for the future before it uses or replaces this node's state again. The
        context is always written now (Flower serializes it once the handler returns).
        """
        _require_host(host)
        host.stamp = secrets.token_hex(8)
        if self.in_context:
            self._to_context(host)
        if self.folder is None:
            return host.stamp, None
        self.folder.mkdir(parents=True, exist_ok=True)
        marker = self.folder / f".r{host.round}.pending.{os.getpid()}"
        marker.touch()  # before the reply goes: a reader in another process waits for the file
        if not background:
            self._to_file(host, marker)
            return host.stamp, None
        future = _WRITER.submit(self._to_file, host, marker)
        _PENDING.add(future)
        future.add_done_callback(_PENDING.discard)
        return host.stamp, future

    def _to_context(self, host: HostState) -> None:
        arrays = host.arrays() | ({"anchor": host.anchor} if host.anchor is not None else {})
        cs = self.context.state
        cs[STATE_ARRAYS] = ArrayRecord({k: to_array(np.ascontiguousarray(a)) for k, a in arrays.items()})
        if host.rest:
            cs[STATE_REST] = ArrayRecord({k: to_array(np.ascontiguousarray(a)) for k, a in host.rest.items()})
        elif STATE_REST in cs:
            del cs[STATE_REST]
        cs[STATE_META] = ConfigRecord(host.meta() | {"undo": host.undo})

    def _to_file(self, host: HostState, marker: Path | None = None) -> None:
        """Write the state over the older of the two slots (and the anchor once); keep the checkpoint's round.

        ``keep_round`` is the server's latest checkpoint (0: none yet), the round a resumed
        ServerApp starts from: the newest state at or before it is kept as ``r<round>.state``
        (a slot that holds it is renamed so, never overwritten). The slot written is never the
        newest one: a write cut short leaves the state of the round before. Every other file of
        this node is deleted: older kept rounds, and rounds from this one on (a resumed run's
        dead future).
        """
        assert self.folder is not None
        try:
            self._sweep()
            if host.anchor is not None:
                anchor_path = self._anchor_path(host.anchor_version, host.anchor_checksum)
                if not anchor_path.exists():  # once per anchor for all the run's nodes
                    anchor_path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = anchor_path.with_name(f".{anchor_path.stem}.{os.getpid()}.tmp.npy")
                    np.save(tmp, host.anchor)
                    os.replace(tmp, anchor_path)
            files = self._files()
            kept = max((f for f in files if 0 <= f[0] <= self.keep_round), default=None) if self.keep_round else None
            if kept is not None and kept[1].name.startswith("slot"):  # the checkpoint's round: out of the slots
                kept = (kept[0], kept[1].rename(self.folder / f"r{kept[0]}.state"))
                files = self._files()
            slots = {p: -2 for i in (0, 1) if self._mine(p := self.folder / f"slot-{i}.state")}
            if not slots:
                raise ClientStateError(f"{self.folder} holds another run's or node's state files: not replaced")
            slots |= {p: r for r, p in files if p in slots}
            newest = max(slots.values())
            target = min(slots, key=lambda p: (slots[p] < host.round and slots[p] == newest, slots[p]))
            write_state_file(target, host, in_place=True)
            kept_path = None if kept is None else kept[1]
            for r, p in self._files():  # this node's only (a file whose header does not read is left alone)
                old_kept = p.name.startswith("r") and p != kept_path
                if p != target and r >= 0 and (old_kept or r >= host.round):
                    p.unlink(missing_ok=True)
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)


_LEFT_BEHIND = re.compile(r"\.(?:.+\.(\d+)\.tmp(?:\.npy)?|r\d+\.pending\.(\d+)|probe\.(\d+))")


def _writer_pid(name: str) -> int | None:
    """The writer's process id in a temporary file's or marker's name, None for any other name.

    ``.<file>.<pid>.tmp[.npy]`` (a file being written), ``.r<round>.pending.<pid>`` (a write
    announced), ``.probe.<pid>`` (a hello's probe).
    """
    match = _LEFT_BEHIND.fullmatch(name)
    return None if match is None else int(next(g for g in match.groups() if g is not None))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_state(context: Context) -> HostState | None:
    """The state a node keeps in ``context.state``, as stored, with x (from the anchor): for tests and inspection.

    Not checked (:func:`check_state` is what a client applies); None where there is none.
    """
    store = StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0)
    if not store._use_context():
        return None
    host = store._from_context(0)
    if host.x is None and host.anchor is not None and host.counts is not None:
        counts = torch.from_numpy(host.counts.astype(np.int32))
        host.x = anchored(torch.from_numpy(host.anchor), counts, host.decay, host.step).numpy()
    return host


def save_state(context: Context, host: HostState) -> None:
    """Put ``host`` in ``context.state`` as a client stores it (with a new stamp): for tests."""
    StateStore(context, in_context=True, folder=None, as_of=-1, keep_round=0).save(host)
