"""The Distributed Lion client: the library's half of your ``ClientApp``.

Your app keeps its model, its data and its loss; :class:`DLionClient` keeps everything
Distributed Lion needs on the node (the replica x, the Lion momentum m, the error-feedback
residual, versions, catch-up, checksums, packing, the device, the state between rounds)::

    app = ClientApp()
    dlion = DLionClient(app, Net)  # answers the strategy's hello; Net: your nn.Module class

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        trainloader, _ = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
        return dlion.train(msg, context, trainloader)

One ``train`` message, in order (:meth:`DLionClient.train`):

1. bring the replica x to the server's version (:func:`replica.apply_message`: the full model,
   x₀ from a seed, or the Δs it missed, ``x ← x − lr·(Δ + wd·x)`` as the server applied them);
   age the momentum of a node that missed rounds (``stale-momentum``: keep, decay, reset);
   adopt the synced momentum if the server sent one (refused unless finite and within ±10⁶);
2. K = ``local-steps`` Lion steps (``lion.local_steps_``) on a copy of x, each on the mean gradient
   of ``accumulate`` batches from ``batches``; U = Σₖ δₖ (K = 1: plain D-Lion, δ = sign(β₁·m + (1−β₁)·g),
   m ← β₂·m + (1−β₂)·g); or K SGD steps and one Lion step on their change (``local-optimizer = "sgd"``);
3. encode U for the wire (the strategy's ``upload``): ``sign`` — 1 bit per parameter (exact
   zeros become a seeded coin flip; with K = 1, steps 2 and 3 are one fused pass,
   ``codec.pack_local_step_``); ``sum`` — the integer U; ``ef-sign`` — a scaled sign of U + e
   with error feedback (each kind in :mod:`flower_dlion.uploads`, which the strategy uses too); with
   secure aggregation, the signs under the round's pairwise masks (:mod:`.secure_client`);
4. reply with it, the loss, the number of examples, the replica's version and checksum (and
   the momentum or the buffers in the rounds that sync them);
5. keep the node's state for the next round: on the device (:class:`resident.Residents`, where the
   process lives on) and persisted on the host (:class:`state.StateStore`: ``context.state`` or a
   file; the resident state is used only while the persisted copy is still the one it wrote); a
   file that could not be written is said in the node's next reply (:mod:`.state_writes`).

Where each part runs: the host side (the persisted state, the message's payloads, the entropy
coder, checksums) works on numpy arrays, the device side (the replica, the momentum, the Lion
step) on tensors on the client's device, and :class:`placement.Placement` is the one place that
moves arrays between them.

Reproducibility: the batches are drawn, and the loss computed, under torch's RNG seeded by (the
strategy's seed, the node, the round), and so are the coin flips: the same run twice.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from ..coin_flips import EXPLAIN_ABOVE, explain
from ..params import Binding, LossFn, cross_entropy_loss, layout_fingerprint
from ..protocol import (
    CLIENT_UPLOAD,
    HELLO,
    HELLO_ACTION,
    METRICS,
    OTHER_APP,
    SECURE,
    to_array,
)
from ..round_records import ReplyMetrics, RoundConfig, hello_keys
from . import in_process
from .app_source import foreign_code
from .in_process import PROCESS_LOCAL
from .link import ContextChoice, DecodeCost
from .local_work import LocalWork, Tamper, adopt_momentum, age_momentum, round_generator, round_seed, upload_arrays
from .placement import Placement
from .replica import Apply, apply_message
from .resident import NodeState, ReplicaPool, Residents, device_memory
from .secure_client import answer_query, check_train, mask_upload
from .settings import MAX_BATCHES, ClientSettings, DeviceMemoryError, positive, resolve_device
from .state import ClientStateError, Expected
from .state_home import check_fits, node_store
from .state_store import StateStore, wait_for_writes
from .state_writes import said, tell

__all__ = ["ClientSettings", "ClientStateError", "DLionClient", "DeviceMemoryError", "Tamper", "resolve_device"]

logger = logging.getLogger("flower_dlion")

RESIDENT_SHARE = 0.25  # of the device's memory (the host's for the CPU) that resident node states may take by default


@dataclass
class _Device:
    """What a client holds per compute device: the model, the crossing to the host, the replicas, the residents."""

    bound: Binding
    placement: Placement
    pool: ReplicaPool
    residents: Residents
    grad: torch.Tensor | None = None  # the flat gradient's buffer, reused every step


class DLionClient:
    """Distributed Lion on a node: register it on your ``ClientApp``, call :meth:`train` from yours.

    Parameters
    ----------
    app : ClientApp | None
        Your ``ClientApp``: the client answers the strategy's hello (``query.dlion``) on it.
        None registers nothing (call :meth:`hello` from your own query handler).
    model_fn : Callable[[], nn.Module]
        Builds your model (your model class itself will do). Built once per device and
        reused; its values are overwritten from the replica in every message.
    loss_fn : Callable[[nn.Module, batch], Tensor] | None (default: None)
        The loss of one batch; the batch is on the model's device when it is called. None:
        ``cross_entropy(model(inputs), targets)`` for batches ``(inputs, targets)``.
    device, state_dir, state_in_context, momentum_dtype, max_resident, link_mbps, max_batches
        See :class:`ClientSettings`; checked now. Override :meth:`settings` to choose per node.

    Raises
    ------
    ValueError
        For a bad setting.

    Notes
    -----
    The model may have parameters in float32, bfloat16 or float16 (x and m are float32, the
    gradient is cast), frozen parameters, tied parameters and buffers: see
    :mod:`flower_dlion.params` for what happens to each. Integer parameters are refused.

    Where the process serving a node lives on between its messages (Flower's simulation
    workers, the in-process grid), the node's state stays on the device and the replica is
    shared by the nodes at one version; the persisted copy is still written every round
    (a file on a background thread once the process has served a message before), and a new
    process, a restarted node or a resumed run starts from it.

    """

    def __init__(
        self,
        app: ClientApp | None,
        model_fn: Callable[[], nn.Module],
        loss_fn: LossFn | None = None,
        *,
        device: str = "auto",
        state_dir: str | None = None,
        state_in_context: bool | None = None,
        momentum_dtype: str = "float32",
        max_resident: int | None = None,
        link_mbps: float | None = None,
        max_batches: int = MAX_BATCHES,
    ) -> None:
        if isinstance(model_fn, nn.Module) or not callable(model_fn):
            raise TypeError(
                f"model_fn must build the model (e.g. your model class Net, not Net()), got a {type(model_fn).__name__}"
            )
        self.model_fn = model_fn
        self.loss_fn: LossFn = loss_fn or cross_entropy_loss
        self._settings = ClientSettings(
            device, state_dir, state_in_context, momentum_dtype, max_resident, link_mbps, max_batches
        )
        self._token = secrets.token_hex(8)  # which client this is, in every process a copy of it reaches
        self._devices: dict[torch.device, _Device] = {}
        self._choices: dict[str, ContextChoice] = {}
        self._decode_cost = DecodeCost()  # of a context-coded Δ in this process, measured by whichever node applies one
        self._served = 0  # messages this process has handled: from the second on, files are written after the reply
        self._local = in_process.register(self._token, model_fn, self._devices, self._choices, self._decode_cost)
        self._told: set[str] = self._local.told
        if app is not None:
            app.query(HELLO_ACTION)(self.hello)

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in another process gets: the settings, not what this process holds (models, states)."""
        return {k: v for k, v in self.__dict__.items() if k not in (*PROCESS_LOCAL, "_served", "_local")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (Ray ships an app defined in a script with every message) finds what its process holds already."""
        self.__dict__.update(state)
        self._local, found = in_process.find(self._token, self.model_fn)
        self._served = int(found)
        self._devices, self._choices, self._decode_cost, self._told = self._local.shared()

    def wait(self) -> None:
        """Wait until the state files this process writes in the background are on disk (e.g. at a script's end)."""
        wait_for_writes()

    def settings(self, context: Context) -> ClientSettings:
        """The settings for this node (override to read them from the run or node config)."""
        return self._settings

    def _on(self, device: torch.device, settings: ClientSettings) -> _Device:
        """Everything this client holds for ``device`` (made on first use; its residents' limit from ``settings``)."""
        if device in self._devices:
            self._devices[device].residents.max_nodes = settings.max_resident
        else:
            model = self.model_fn()
            if not isinstance(model, nn.Module):
                raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
            pool, placement = ReplicaPool(), Placement(device)
            budget = int(RESIDENT_SHARE * device_memory(device))
            residents = Residents(pool, settings.max_resident, budget)
            self._devices[device] = _Device(Binding(placement.model(model)), placement, pool, residents)
        return self._devices[device]

    def hello(self, msg: Message, context: Context) -> Message:
        """Say who this node is, what replica version it can start from and what its model holds (or secure keys)."""
        if SECURE in msg.content:
            return Message(content=RecordDict({SECURE: answer_query(msg.content[SECURE], context)}), reply_to=msg)
        if (why := foreign_code(self.model_fn)) is not None:  # another app's copy of this package runs here
            raise ClientStateError(f"node {context.node_id}: this node runs another app's code ({why}): {OTHER_APP}")
        settings = self.settings(context)
        here = self._on(resolve_device(settings.device), settings)
        spec = here.bound.spec
        request = msg.content[HELLO] if HELLO in msg.content else ConfigRecord()
        state_key, state_round = hello_keys(request, context.node_id)
        store, owner = self._store(context, spec.d, state_key, -1 if state_round is None else state_round, 0)
        store.probe()  # a state folder this node cannot write fails now, not after round 1
        clients = int(context.node_config.get("num-partitions", 1))  # the simulation's virtual clients
        check_fits(store, spec.d, settings.momentum_dtype, context.node_id, clients)  # before round 1
        node = self._start(here, store, owner, context)
        if node is not None:
            here.residents.put(owner, node)
        answer = {
            "partition-id": int(context.node_config.get("partition-id", -1)),
            "version": -1 if node is None else node.version,
            "model": here.bound.described.encode(),  # frozen entries by checksum: they never travel
        }
        return Message(content=RecordDict({HELLO: ConfigRecord(answer)}), reply_to=msg)

    # ------------------------------------------------------------------ one round
    def train(self, msg: Message, context: Context, batches: Iterable[Any], *, tamper: Tamper | None = None) -> Message:
        """Handle one ``train`` message of :class:`~flower_dlion.DistributedLion` (steps in the module doc).

        Parameters
        ----------
        msg, context
            What your ``@app.train()`` handler received.
        batches : Iterable
            Where the round's batches come from, e.g. your ``DataLoader`` or a list: the round
            takes ``local-steps × accumulate`` batches (1 by default) from a fresh
            ``iter(batches)``, starting over with a new one when it runs out (2 batches and 5
            local steps: b₀ b₁ b₀ b₁ b₀; a shuffling ``DataLoader`` reshuffles each pass).
            Empty batches, or an iterator or generator that is used up (it cannot start over),
            fail the round with a ``ValueError`` that says so: an error reply, the state kept.
        tamper : Tamper | None (default: None)
            For fault studies only: what an attacking node changes (:class:`Tamper`).

        Returns
        -------
        Message
            The reply. Nothing is stored when this raises: the node keeps its state and the
            server sends it what it lacks next time.

        """
        settings = self.settings(context)
        here = self._on(resolve_device(settings.device), settings)
        spec = here.bound.spec
        cfg = RoundConfig.read(msg.content, context.node_id, max_batches=settings.max_batches)  # DistributedLion's?
        check_train(msg.content, cfg.secure, cfg.state_key, cfg.server_round, context)  # no plain signs in a secure run
        store, owner = self._store(context, spec.d, cfg.state_key, cfg.as_of, cfg.keep_round)
        choice = self._choice(owner, settings, context)
        lived, self._served = self._served > 0, self._served + 1
        node = self._start(here, store, owner, context)
        held = None
        try:
            before = None if node is None else node.version
            env = Apply(here.placement, here.pool, spec, context.node_id, cfg, self._seed_fn, choice)
            node = self._catch_up(msg, cfg, node, env, store)  # 1. the replica at the server's version
            here.pool.hold(held := node.replica)  # nothing recycles it while this message runs
            reply = self._round(msg, cfg, context, node, before, here, batches, tamper)  # 2.–4.
            if choice.keeps and node.replica.depth == 2 and choice.wanted():
                reply.content[METRICS]["context"] = node.version  # code the next Δ with the two before it
            host = here.placement.node_to_host(node, settings.momentum_dtype)  # 5. persisted, kept resident
            host.owner, host.layout = owner, layout_fingerprint(spec.layout)
            node.stamp, node.pending = store.save(host, background=lived)
            here.residents.put(owner, node)
            reply = tell(reply, owner, context.node_id, cfg.server_round - (node.pending is not None))  # failed writes
        except torch.cuda.OutOfMemoryError as err:
            here.residents.drop(owner)
            raise DeviceMemoryError(f"node {context.node_id}: {self._out_of_memory(spec.d, here)}") from err
        except BaseException:
            here.residents.drop(owner)  # the next message starts from the persisted copy, which is unchanged
            raise
        finally:
            if held is not None:
                here.pool.release(held)
        return reply

    @staticmethod
    def _catch_up(msg: Message, cfg: RoundConfig, node: NodeState | None, env: Apply, store: StateStore) -> NodeState:
        """The node at the server's version (:func:`apply_message`); what cannot be applied is refused by name."""
        try:
            return apply_message(msg.content, node, env)
        except ClientStateError as err:  # where its state was looked for (a deleted file), a write that failed
            where, failure = f" (its state: {store.where()})" if node is None else "", said(store.owner, env.node_id)
            if where or failure:
                raise ClientStateError(f"{err}{where}{failure}") from err
            raise
        except (KeyError, TypeError, ValueError) as err:  # a record or key missing, a value of another type
            raise ClientStateError(
                f"node {env.node_id}: the server's round {cfg.server_round} message is malformed "
                f"({type(err).__name__}: {err}): refused"
            ) from err

    def _round(
        self,
        msg: Message,
        cfg: RoundConfig,
        context: Context,
        node: NodeState,
        before: int | None,
        here: _Device,
        batches: Iterable[Any],
        tamper: Tamper | None,
    ) -> Message:
        """Steps 1 (the rest of it) to 4: momentum, local work, upload; the reply (``node`` updated).

        ``before``: the node's version before this message (None: it had no state).
        """
        server_round, seed, sync = cfg.server_round, cfg.seed, cfg.momentum_sync
        key = _node_key(context)
        bound, spec, device = here.bound, here.bound.spec, here.placement.device
        age_momentum(node, before, cfg)
        mask = adopt_momentum(node, msg.content, cfg, here.placement, spec.layout, context.node_id)
        bound.load_rest_(node.rest)

        # 2.–3. the local Lion steps and the upload
        gen = round_generator(device, seed, key, server_round)  # coin flips for exact zeros
        if here.grad is None:
            here.grad = torch.empty(spec.d, device=device)
        replica = (node.replica.x, node.replica.ident)
        work = LocalWork(
            bound,
            self.loss_fn,
            batches,
            accumulate=cfg.accumulate,
            out=here.grad,
            replica=replica,
            node_id=context.node_id,
        )
        flips: list[int] = []  # how many signs were coin flips (exact zeros of the Lion mix)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(round_seed(seed, key, server_round, 1))  # the batches' shuffles, dropout
            arrays = upload_arrays(node, cfg, spec.sizes, work, gen, tamper, flips)
        if sync:
            assert mask is not None
            arrays["momentum"] = to_array(here.placement.to_host(node.m[mask]))
        node.rest = node.rest | {name: t.clone() for name, t in bound.buffers().items()}  # the client's own buffers
        if cfg.buffers:
            arrays["buffers"] = to_array(here.placement.buffers_to_host(node.rest, [e.name for e in spec.buffers]))
        if tamper is not None:
            arrays = tamper.arrays(arrays)
        if SECURE in msg.content:  # the signs (and buffers) under the round's pairwise masks
            arrays = mask_upload(arrays, msg.content[SECURE], context, spec, server_round)
        node.round = server_round
        flipped = sum(flips)  # many (sign upload): the client says where they are (flower_dlion.coin_flips)
        explained = flipped > EXPLAIN_ABOVE * spec.d and cfg.upload == "sign"
        metrics = ReplyMetrics(
            num_examples=work.num_examples,
            train_loss=sum(work.losses) / len(work.losses),
            version=node.version,
            checksum=node.replica.checksum,
            coin_flips=flipped,
            flips_explained=explain(node.m, node.replica.x, spec.layout) if explained else {},
        )
        return Message(
            content=RecordDict({CLIENT_UPLOAD: ArrayRecord(arrays), METRICS: metrics.to_record()}), reply_to=msg
        )

    # ------------------------------------------------------------------ the node's state
    def _start(self, here: _Device, store: StateStore, owner: str, context: Context) -> NodeState | None:
        """The node's state for this message: resident while its persisted copy is the one it wrote, else that copy."""
        node = here.residents.get(owner)
        if node is not None:
            current = store.current()
            if current is not None and current[1] == node.stamp:
                return node
            here.residents.drop(owner)
            self._tell_once(
                "resident",
                "flower-dlion: node %d: its state on the device is not its persisted copy (%s, written %s): "
                "the persisted copy wins (logged once)",
                context.node_id,
                store.where(),
                "by another process, or changed since" if current is not None else "nowhere: none there",
            )
        spec = here.bound.spec
        rest = {e.name: tuple(e.shape) for e in spec.rest}
        expect = Expected(spec.d, owner, layout_fingerprint(spec.layout), rest, here.pool.idents())
        host = store.load(expect, context.node_id)
        return None if host is None else here.placement.host_to_node(host, here.pool)

    def _choice(self, owner: str, settings: ClientSettings, context: Context) -> ContextChoice:
        """The node's context-coding choice (kept per node: each has its own link)."""
        link = settings.link_mbps
        if link is None and "link-mbps" in context.node_config:
            link = float(context.node_config["link-mbps"])
            if not positive(link):
                raise ClientStateError(f"node {context.node_id}: node config link-mbps = {link!r} (a number > 0)")
        choice = self._choices.get(owner)
        if choice is None or choice.link_mbps != link:
            choice = self._choices[owner] = ContextChoice(link, self._decode_cost)
        return choice

    def _out_of_memory(self, d: int, here: _Device) -> str:
        return (
            f"the device ran out of memory with a model of {d:,} trainable values: each node's state takes "
            f"{4 * d / 1e6:.1f} MB (8 bytes a value with upload='ef-sign'; {len(here.residents)} resident), each "
            f"replica version {12 * d / 1e6:.1f} MB; set DLionClient(max_resident=...) lower (0: none), or give "
            "each client a larger share of the GPU (the simulation's client-resources-num-gpus)"
        )

    # ------------------------------------------------------------------ helpers
    def _seed_fn(self, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """x₀ and the rest of ``model_fn()`` built under ``torch.manual_seed(seed)`` on the host.

        The global RNG is left as it was.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            seeded = Binding(self.model_fn())  # built on the CPU: host tensors
        return seeded.flat_parameters().numpy(), {k: v.numpy() for k, v in seeded.rest().items()}

    def _store(self, context: Context, d: int, state_key: str, as_of: int, keep_round: int) -> tuple[StateStore, str]:
        """Where this node's state is persisted for this message, and whose it is (:func:`.state_store.node_store`)."""
        return node_store(context, self.settings(context), d, state_key, as_of, keep_round)

    def _tell_once(self, what: str, fmt: str, *args: object) -> None:
        if what not in self._told:
            self._told.add(what)
            logger.warning(fmt, *args)


def _node_key(context: Context) -> int:
    """The node's integer identity: its partition id, else its node id."""
    pid = context.node_config.get("partition-id")
    return int(pid) if pid is not None else int(context.node_id)
