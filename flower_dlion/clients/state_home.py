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

The one door to a node's state for a message is :func:`open_state`: it finds where the state
is persisted (:func:`node_store`), starts from the node's resident state while its persisted
copy is still the one it wrote, else from that copy (:meth:`.resident.NodeState.from_host`), and
the :class:`OpenState` it returns brings the node to the server's version (:meth:`OpenState.catch_up`)
and keeps it for the next message (:meth:`OpenState.keep`: persisted, resident, a failed write said).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import Context, Message, RecordDict

from ..params import ModelSpec, layout_fingerprint
from ..protocol import ClientStateError
from .placement import Placement
from .replica import Apply, apply_message
from .resident import Device, NodeState, Residents
from .state import CONTEXT_LIMIT, Expected, default_state_dir, node_label
from .state_store import StateStore
from .state_writes import said, tell

if TYPE_CHECKING:
    from .settings import ClientSettings

__all__ = ["CONTEXT_BYTES", "FILE_BYTES", "OpenState", "check_fits", "node_store", "open_state", "probe"]

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


@dataclass
class OpenState:
    """One node's state for one message, from :func:`open_state`: where it is kept and what the message starts from.

    Attributes
    ----------
    store : StateStore
        Where its state is persisted.
    owner : str
        Whose state it is (``<run key>/<node label>``).
    node : NodeState | None
        The state the message starts from (None: the node has none).
    residents : Residents
        The device's resident states (this node's is kept there).
    placement : Placement
        The crossing between the host and the device.

    """

    store: StateStore
    owner: str
    node: NodeState | None
    residents: Residents
    placement: Placement

    def catch_up(self, content: RecordDict, env: Apply) -> NodeState:
        """The node at the server's version (:func:`.replica.apply_message`); what cannot be applied is refused by name.

        A refusal says where a node without state looked for it (a deleted file), and a write of
        its state that failed.
        """
        node, cfg = self.node, env.round
        try:
            return apply_message(content, node, env)
        except ClientStateError as err:
            where, failure = (
                f" (its state: {self.store.where()})" if node is None else "",
                said(self.owner, env.node_id),
            )
            if where or failure:
                raise ClientStateError(f"{err}{where}{failure}") from err
            raise
        except (KeyError, TypeError, ValueError) as err:  # a record or key missing, a value of another type
            raise ClientStateError(
                f"node {env.node_id}: the server's round {cfg.server_round} message is malformed "
                f"({type(err).__name__}: {err}): refused"
            ) from err

    def keep(
        self, node: NodeState, reply: Message, *, spec: ModelSpec, momentum_dtype: str, background: bool
    ) -> Message:
        """Step 5: ``node`` persisted (m in ``momentum_dtype``) and resident; ``reply`` with any failed write.

        ``background``: write a state file after the reply has gone (a process that lives on).
        """
        host = node.to_host(self.placement, momentum_dtype)
        host.owner, host.layout = self.owner, layout_fingerprint(spec.layout)
        node.stamp, node.pending = self.store.save(host, background=background)
        self.residents.put(self.owner, node)
        context = self.store.context
        return tell(reply, self.owner, context.node_id, node.round - (node.pending is not None))

    def forget(self) -> None:
        """Drop the node's resident state: its next message starts from the persisted copy (unchanged)."""
        self.residents.drop(self.owner)


def open_state(
    context: Context,
    settings: ClientSettings,
    here: Device,
    *,
    state_key: str,
    as_of: int,
    keep_round: int,
    told: set[str],
    hello: bool = False,
) -> OpenState:
    """The node's state for this message: resident while its persisted copy is the one it wrote, else that copy.

    ``here``: the client's device (its model, residents and replicas). ``state_key``, ``as_of``,
    ``keep_round``: see :func:`node_store`. ``told``: what this client
    has logged once already. ``hello``: before round 1, a state folder this node cannot write,
    or a federation whose states cannot fit (:func:`check_fits`), fails now.
    """
    spec, residents, placement = here.bound.spec, here.residents, here.placement
    store, owner = node_store(context, settings, d=spec.d, state_key=state_key, as_of=as_of, keep_round=keep_round)
    if hello:
        probe(store)
        clients = int(context.node_config.get("num-partitions", 1))  # the simulation's virtual clients
        check_fits(store, d=spec.d, momentum_dtype=settings.momentum_dtype, node_id=context.node_id, clients=clients)
    node = residents.get(owner)
    if node is not None:
        current = store.current()
        if current is not None and current[1] == node.stamp:
            return OpenState(store, owner, node, residents, placement)
        residents.drop(owner)
        if "resident" not in told:
            told.add("resident")
            logger.warning(
                "flower-dlion: node %d: its state on the device is not its persisted copy (%s, written %s): "
                "the persisted copy wins (logged once)",
                context.node_id,
                store.where(),
                "by another process, or changed since" if current is not None else "nowhere: none there",
            )
    rest = {e.name: tuple(e.shape) for e in spec.rest}
    layout = layout_fingerprint(spec.layout)
    expect = Expected(d=spec.d, owner=owner, layout=layout, rest=rest, held=residents.pool.idents())
    host = store.load(expect, context.node_id)
    node = None if host is None else NodeState.from_host(host, residents.pool, placement)
    return OpenState(store, owner, node, residents, placement)


def probe(store: StateStore) -> None:
    """Write and remove a small file in the store's folder, or raise ClientStateError saying why it cannot."""
    if store.folder is None:
        return
    path = store.folder / f".probe.{os.getpid()}"
    try:
        store.folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"flower-dlion")
        path.unlink()
    except OSError as err:
        raise ClientStateError(
            f"node {store.context.node_id}: its state folder {store.folder} cannot be written ({err}); choose a "
            "writable one: run config 'client-state-dir', DLionClient(state_dir=...)"
        ) from err


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
