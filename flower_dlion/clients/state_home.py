"""Where a node's state lives between its rounds, and whether a federation's states fit there.

A node's state (:class:`~.state.HostState`: m, the counts since the anchor, e, its buffers) is
persisted in a file per node by default, under the client's ``state_dir``, else
``$FLOWER_DLION_STATE_DIR``, else a folder in the temporary directory
(:func:`~.state.default_state_dir`). A file costs no memory while the node is idle, which is
what a cross-device simulation needs (10,000 virtual clients, 1 % of them a round, each one back
after ~100 rounds). ``context.state`` (``state_in_context=True``) travels with every message,
so the state follows a virtual client to whichever machine of a Ray cluster serves it, at the
cost of 9–10 bytes a parameter of memory in the simulation's process for every client ever
touched; :func:`check_fits` refuses a federation whose contexts cannot fit, before round 1.

Host side only: paths, sizes, numbers.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import Context

from ..protocol import ClientStateError
from .state import CONTEXT_LIMIT, default_state_dir, node_label
from .state_store import StateStore

if TYPE_CHECKING:
    from .settings import ClientSettings

__all__ = ["CONTEXT_BYTES", "FILE_BYTES", "check_fits", "node_store"]

logger = logging.getLogger("flower_dlion")

# Bytes a trainable value of one node's persisted state takes (docs/PERFORMANCE.md, "Cross-device scale"):
CONTEXT_BYTES = 9.2  # context.state: m (4), the anchor (4), the counts (1, int8), the undo (0.2)
FILE_BYTES = 10.4  # files: two slots (the round before survives a write cut short) of m, the counts and the undo
FIT_SHARE = 0.8  # of the available memory (context.state) or free disk (files) that the federation's states may take
_told: set[str] = set()


def node_store(
    context: Context, settings: ClientSettings, d: int, state_key: str, as_of: int, keep_round: int
) -> tuple[StateStore, str]:
    """Where this node's state is persisted for this message (see :class:`~.settings.ClientSettings`), and whose it is.

    ``state_key``: the run's identity the server sends (unique per run, even where run ids
    repeat: in-process grids, parallel sweeps); ``run-<run id>`` from a server that sends none.
    ``as_of``: start from the state as of the end of that round (-1: the newest).
    """
    in_context = bool(settings.state_in_context)  # None (auto): files, whose memory does not grow with the clients
    if in_context and 8 * d > CONTEXT_LIMIT:
        if "too-large" not in _told:
            _told.add("too-large")
            logger.warning(
                "flower-dlion: %d trainable values (%.1f GB of x and m) are too large for context.state: "
                "the client keeps them in state files instead",
                d,
                8 * d / 1e9,
            )
        in_context = False
    run = state_key or f"run-{context.run_id}"
    owner = f"{run}/{node_label(context)}"
    root = settings.state_dir or (None if in_context else str(default_state_dir()))
    folder = None if root is None else Path(root).expanduser() / run / node_label(context)
    store = StateStore(context, in_context=in_context, folder=folder, as_of=as_of, keep_round=keep_round, owner=owner)
    return store, owner


def check_fits(store: StateStore, d: int, momentum_dtype: str, node_id: int, clients: int) -> None:
    """Refuse, before round 1, a federation of ``clients`` nodes whose states cannot fit where they are kept.

    ``context.state`` is kept for every client in the simulation's process: ``clients`` ×
    :data:`CONTEXT_BYTES` × d against the host's available memory (the OOM killer otherwise,
    rounds later). Files: ``clients`` × :data:`FILE_BYTES` × d against the folder's free disk
    (every client touched at least once, the worst case) is only logged: a run that samples a
    few clients a round may touch far fewer.

    Raises
    ------
    ClientStateError
        With the per-client cost, the number of clients, what is available and what to set.

    """
    if clients <= 1:
        return
    half = 2.0 if momentum_dtype == "bfloat16" else 0.0  # m in bfloat16: 2 bytes a value fewer
    if store.in_context:
        per_client = (CONTEXT_BYTES - half) * d
        available = _available_memory()
        if available is not None and clients * per_client > FIT_SHARE * available:
            raise ClientStateError(
                f"node {node_id}: {clients:,} clients keeping their state in context.state need "
                f"{clients * per_client / 1e9:.1f} GB ({per_client / 1e6:.2f} MB a client: {d:,} values × "
                f"{per_client / d:.1f} B) in the simulation's process, more than {FIT_SHARE:.0%} of the "
                f"{available / 1e9:.1f} GB available: keep the state in files (state_in_context=False; the app's "
                "run config 'state-in-context' = false), whose memory does not grow with the clients"
            )
        return
    if store.folder is None or "disk" in _told:
        return
    per_client = (FILE_BYTES - 2 * half) * d
    free = _free_disk(store.folder)
    if free is not None and clients * per_client > FIT_SHARE * free:
        _told.add("disk")
        logger.warning(
            "flower-dlion: %d clients, each touched at least once, would need %.1f GB of state files (%.2f MB a "
            "client) under %s, which has %.1f GB free: the run fails when the disk fills unless fewer clients "
            "train (a state folder elsewhere: run config 'client-state-dir' or FLOWER_DLION_STATE_DIR)",
            clients,
            clients * per_client / 1e9,
            per_client / 1e6,
            store.folder,
            free / 1e9,
        )


def _available_memory() -> int | None:
    """The host's available memory in bytes (Linux: MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _free_disk(folder: Path) -> int | None:
    """Free bytes on the filesystem that holds (or will hold) ``folder``."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None
