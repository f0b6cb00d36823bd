"""Where a D-Lion client persists a node's state (:class:`~.state.HostState`): a file per node or ``context.state``.

Files in ``folder`` (the default, :mod:`.state_home`) and/or ``context.state`` (``in_context``);
with files alone, ``context.state`` keeps only where they went (round, machine, folder), so a
message served on a machine that cannot see them says so (:data:`MOVED`). Files: the
file a restarted SuperNode starts from, and the one a resumed ServerApp asks for by round
(``state-round``); only the newest file and the one of the server's latest checkpoint
(``keep-round``) are kept. A file is written to a temporary name and renamed, so a reader
sees the old file or the new one; a client whose process lives on writes it on a background
thread after the reply has gone (``save(background=True)``) and leaves a ``.pending`` marker
that readers in other processes wait for. A write that fails (a full or read-only folder: ``ENOSPC``,
``EROFS``) leaves the older copy, is logged and kept, and the node's next reply says so (:mod:`.state_writes`).

Host side only, numpy arrays and numbers, as :mod:`.state`. Files have a format of their own
(:func:`write_state_file`: magic, a JSON header, the arrays, CRC-32), are read only when they
name this node's run and node (``owner``), and what a write cut short leaves behind (temporary
files, ``.pending`` markers of a dead process) is removed at the next write.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import secrets
import socket
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context

from ..protocol import ClientStateError, to_array
from .state import FORMAT, STATE_ARRAYS, STATE_META, STATE_REST, Expected, HostState, StateRefused, check_state
from .state_writes import alive, failed, writer_pid

__all__ = ["StateStore", "read_state_file", "read_state_header", "require_host", "wait_for_writes", "write_state_file"]

logger = logging.getLogger("flower_dlion")
MAGIC = b"DLS2"  # a state file's first bytes (format 2)
PENDING_WAIT_S = 120.0  # how long a reader waits for another process's write of a newer state file
STATE_WHERE = "dlion.state-where"  # context.state of a node whose state is in files: which machine and folder hold them
MOVED = (
    "a virtual client that Ray schedules on another machine of a cluster finds no state unless the state folder "
    "is shared storage (run config 'client-state-dir', or FLOWER_DLION_STATE_DIR on every Ray node)"
)

_WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlion-state")  # joined at exit
_PENDING: set[concurrent.futures.Future] = set()


def wait_for_writes() -> None:
    """Wait until every state file this process is writing in the background is on disk."""
    for future in list(_PENDING):
        concurrent.futures.wait([future])


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
        if found is not None:
            return str(found[1])
        mark = dict(self.context.state[STATE_WHERE]) if STATE_WHERE in self.context.state else {}
        if not mark:
            return f"{self.folder or 'context.state'} (no state there)"
        host, here = str(mark.get("host", "?")), socket.gethostname()
        return (
            f"{self.folder} (no state there; its round {mark.get('round')} state went to {mark.get('folder')} "
            f"on {host}{', this machine' if host == here else f', not this machine ({here})'}: "
            f"{'deleted since?' if host == here else MOVED}; it resyncs)"
        )

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
                host = self._from_file(found[1], expect.held)
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

    def _from_file(self, path: Path, held: frozenset = frozenset()) -> HostState:
        """The state in ``path``; its anchor too, unless the process holds its replica (``held``)."""
        meta, arrays = read_state_file(path)
        rest = {k.removeprefix("rest/"): v for k, v in arrays.items() if k.startswith("rest/")}
        undo = arrays.pop("undo", np.zeros(0, np.uint8)).tobytes()
        anchor = None
        which = [int(meta.get(k, -1)) for k in ("version", "checksum", "anchor-version", "anchor-checksum")]
        if "counts" in arrays and tuple(which) not in held:
            anchor = self._read_anchor(which[2], which[3])
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
                pid = writer_pid(path.name)
                if pid is not None and pid != os.getpid() and not alive(pid):
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
        """Whether a live process (this one too) is writing a state file of round ``newest`` or newer.

        Of ``newest`` too: a slot written over in place may show the new round in its header
        while its arrays are still being written (a reader in another process then saw a CRC
        mismatch and put the node's state aside: Flower's simulation, a node moving between workers).
        """
        assert self.folder is not None
        for marker in self.folder.glob(".r*.pending.*"):
            round_text, _, pid_text = marker.name[2:].partition(".pending.")
            if not (round_text.isdigit() and pid_text.isdigit()):
                continue
            if int(round_text) >= newest and (self.as_of < 0 or int(round_text) <= self.as_of) and alive(int(pid_text)):
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
        context is always written now (Flower serializes it once the handler returns). A file that
        cannot be written (an ``OSError``) is not raised: :func:`.state_writes.failed` keeps it for the reply.
        """
        require_host(host)
        host.stamp = secrets.token_hex(8)
        if self.in_context:
            self._to_context(host)
        if self.folder is None:
            return host.stamp, None
        if not self.in_context:  # where the files are, for a message that does not find them (another machine)
            self._drop(None)  # an older copy in the context (another mode's) would shadow the files
            where = {"round": host.round, "host": socket.gethostname(), "folder": str(self.folder)}
            self.context.state[STATE_WHERE] = ConfigRecord(where)
        marker = self.folder / f".r{host.round}.pending.{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            marker.touch()  # before the reply goes: a reader in another process waits for the file
        except OSError as err:  # a full or read-only folder: kept, and said in this reply (.state_writes)
            failed(self.owner, self.context, host.round, marker, err)
            return host.stamp, None
        if not background:
            self._to_file(host, marker)
            return host.stamp, None
        future = _WRITER.submit(self._to_file, host, marker)
        _PENDING.add(future)
        future.add_done_callback(_PENDING.discard)
        return host.stamp, future

    def _to_context(self, host: HostState) -> None:
        arrays = host.arrays() | ({"anchor": host.anchor} if host.anchor is not None else {})
        meta = host.meta() | {"undo": host.undo}
        cs = self.context.state
        cs[STATE_ARRAYS] = ArrayRecord({k: to_array(np.ascontiguousarray(a)) for k, a in arrays.items()})
        if host.rest:
            cs[STATE_REST] = ArrayRecord({k: to_array(np.ascontiguousarray(a)) for k, a in host.rest.items()})
        elif STATE_REST in cs:
            del cs[STATE_REST]
        cs[STATE_META] = ConfigRecord(meta)

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
        at: Path = self.folder  # what is being written, for a write that fails (.state_writes)
        try:
            self._sweep()
            if host.anchor is not None:
                anchor_path = self._anchor_path(host.anchor_version, host.anchor_checksum)
                if not anchor_path.exists():  # once per anchor for all the run's nodes
                    anchor_path.parent.mkdir(parents=True, exist_ok=True)
                    at = tmp = anchor_path.with_name(f".{anchor_path.stem}.{os.getpid()}.tmp.npy")
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
            write_state_file(at := target, host, in_place=True)
            kept_path = None if kept is None else kept[1]
            for r, p in self._files():  # this node's only (a file whose header does not read is left alone)
                old_kept = p.name.startswith("r") and p != kept_path
                if p != target and r >= 0 and (old_kept or r >= host.round):
                    p.unlink(missing_ok=True)
        except OSError as err:  # a full or read-only folder: the older copy stays; the next reply says so
            failed(self.owner, self.context, host.round, at, err)
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)


def require_host(host: HostState) -> None:
    """A ``TypeError`` for anything but numpy arrays in ``host``: on the CPU as on a GPU, where a tensor fails later."""
    named = {"m": host.m, "e": host.error, "x": host.x, "anchor": host.anchor, "counts": host.counts}
    named |= host.drift_arrays()
    named |= {"recent": host.recent} | {f"rest {k!r}": v for k, v in host.rest.items()}
    for name, a in named.items():
        if a is not None and not isinstance(a, np.ndarray):
            raise TypeError(f"{name} is a {type(a).__name__}, not a host numpy array: convert it in clients.placement")


# --------------------------------------------------------------------------- the file format
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
