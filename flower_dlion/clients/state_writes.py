"""The writes of a node's state files: whose they are (markers and temporary files) and those that failed.

A state file may be written on a background thread after the reply has gone
(:meth:`~.state_store.StateStore.save`), so a write of round t that fails (a full disk:
``ENOSPC``; a read-only or quota-limited folder) is known at round t + 1 at the earliest. The
store keeps such a failure here (:func:`failed`, logged at WARNING with the node, the path and
the errno), and the node's next reply says so (:func:`tell`: a
:data:`~flower_dlion.protocol.NOTICE` record; :func:`said`: the text its error reply adds), so
that the server can count it, log it by node and stop a run in which no node can keep its
state. A failure is said once, in the first reply the node sends after it is known; in the
process that saw it (a node served by another process next finds an older copy, as before).

Temporary files and markers carry their writer's process id (:func:`writer_pid`), so that what
a write cut short left behind is removed by the next writer once that process is gone (:func:`alive`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from flwr.app import Context, Message

from ..protocol import NOTICE, WriteFailure

__all__ = ["alive", "failed", "said", "tell", "writer_pid"]

logger = logging.getLogger("flower_dlion")

_LOCK = threading.Lock()  # the writer thread records, the message's thread takes
_FAILED: dict[str, WriteFailure] = {}  # whose state (owner) → the latest write of it that failed, not yet said
_LEFT_BEHIND = re.compile(r"\.(?:.+\.(\d+)\.tmp(?:\.npy)?|r\d+\.pending\.(\d+)|probe\.(\d+))")


def failed(owner: str, context: Context, server_round: int, path: Path | None, err: OSError) -> WriteFailure:
    """Keep (and log) that ``owner``'s state of ``server_round`` could not be written to ``path``: ``err``.

    The path is the error's own file name where it has one (an ``open`` or ``mkdir``), else
    ``path`` (the file being written when a write ran out of space).
    """
    pid = int(context.node_config.get("partition-id", -1))
    where = str(err.filename) if err.filename is not None else str(path)
    failure = WriteFailure(
        node_id=context.node_id,
        partition=pid,
        path=where,
        errno=err.errno or 0,
        error=err.strerror or str(err),
        round=server_round,
    )
    logger.warning(
        "flower-dlion: %s (its round %d state; the node's older copy stays; its next reply tells the server)",
        failure.text(),
        server_round,
    )
    with _LOCK:
        _FAILED[owner or f"node-{context.node_id}"] = failure
    return failure


def _take(owner: str, node_id: int, upto: int | None = None) -> WriteFailure | None:
    with _LOCK:
        key = owner or f"node-{node_id}"
        failure = _FAILED.get(key)
        return _FAILED.pop(key) if failure is not None and (upto is None or failure.round <= upto) else None


def tell(reply: Message, owner: str, node_id: int, upto: int) -> Message:
    """``reply`` with a :data:`NOTICE` record of ``owner``'s failed write of round ``upto`` or before, not yet said.

    A client passes the round before its message's while this round's write goes on in the
    background (whether it fails is known after the reply: said in the next one, whatever the
    thread's timing), else its message's round (a write done, or refused, before the reply).
    """
    failure = _take(owner, node_id, upto)
    if failure is not None:
        reply.content[NOTICE] = failure.to_record()
    return reply


def said(owner: str, node_id: int) -> str:
    """What an error reply adds about ``owner``'s failed write (``"; node 7: could not write …"``), or ""."""
    failure = _take(owner, node_id)
    return "" if failure is None else f"; {failure.text()}"


def writer_pid(name: str) -> int | None:
    """The writer's process id in a temporary file's or marker's name, None for any other name.

    ``.<file>.<pid>.tmp[.npy]`` (a file being written), ``.r<round>.pending.<pid>`` (a write
    announced), ``.probe.<pid>`` (a hello's probe).
    """
    match = _LEFT_BEHIND.fullmatch(name)
    return None if match is None else int(next(g for g in match.groups() if g is not None))


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
