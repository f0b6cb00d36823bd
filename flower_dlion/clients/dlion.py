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

One ``train`` message, in order (:meth:`DLionClient.train`), after it opens the node's state
(:func:`.state_home.open_state`, the one door to it: resident, else its persisted copy):

1. bring the replica x to the server's version (:meth:`.state_home.OpenState.catch_up` →
   :func:`replica.apply_message`, its form chosen once from the message: the full model,
   x₀ from a seed, or the Δs it missed, ``x ← x − lr·(Δ + wd·x)`` as the server applied them);
   age the momentum of a node that missed rounds (``stale-momentum``: keep, decay, reset);
   adopt the synced momentum if the server sent one (refused unless finite and within ±10⁶)
   (this and steps 2–3: :func:`.local_work.run_round`, which runs the round's
   :func:`.local_work.local_step`, chosen once from its options);
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
5. keep the node's state for the next round (:meth:`.state_home.OpenState.keep`): on the device
   (:class:`resident.Residents`, where the process lives on) and persisted on the host
   (:class:`.state_store.StateStore`: ``context.state`` or a
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
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from ..coin_flips import EXPLAIN_ABOVE, explain
from ..params import Binding, LossFn, cross_entropy_loss
from ..protocol import CLIENT_UPLOAD, HELLO, HELLO_ACTION, METRICS, OTHER_APP, SECURE
from ..round_records import ReplyMetrics, RoundConfig, hello_keys
from . import in_process
from .app_source import foreign_code
from .hooks import Tamper, UploadHook
from .in_process import PROCESS_LOCAL
from .link import ContextChoice, DecodeCost, node_choice
from .local_work import run_round
from .placement import Placement
from .replica import Apply
from .resident import Device, ReplicaPool, Residents, device_memory
from .secure_client import answer_query, check_train, mask_upload
from .settings import MAX_BATCHES, ClientSettings, DeviceMemoryError, resolve_device
from .state import ClientStateError
from .state_home import open_state
from .state_store import wait_for_writes

__all__ = [
    "ClientSettings",
    "ClientStateError",
    "DLionClient",
    "DeviceMemoryError",
    "Tamper",
    "UploadHook",
    "resolve_device",
]

logger = logging.getLogger("flower_dlion")

RESIDENT_SHARE = 0.25  # of the device's memory (the host's for the CPU) that resident node states may take by default


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
            device=device,
            state_dir=state_dir,
            state_in_context=state_in_context,
            momentum_dtype=momentum_dtype,
            max_resident=max_resident,
            link_mbps=link_mbps,
            max_batches=max_batches,
        )
        self._token = secrets.token_hex(8)  # which client this is, in every process a copy of it reaches
        self._devices: dict[torch.device, Device] = {}
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

    def _on(self, device: torch.device, settings: ClientSettings) -> Device:
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
            bound = Binding(placement.model(model))
            self._devices[device] = Device(bound=bound, placement=placement, pool=pool, residents=residents)
        return self._devices[device]

    def hello(self, msg: Message, context: Context) -> Message:
        """Say who this node is, what replica version it can start from and what its model holds (or secure keys)."""
        if SECURE in msg.content:
            return Message(content=RecordDict({SECURE: answer_query(msg.content[SECURE], context)}), reply_to=msg)
        if (why := foreign_code(self.model_fn)) is not None:  # another app's copy of this package runs here
            raise ClientStateError(f"node {context.node_id}: this node runs another app's code ({why}): {OTHER_APP}")
        settings = self.settings(context)
        here = self._on(resolve_device(settings.device), settings)
        request = msg.content[HELLO] if HELLO in msg.content else ConfigRecord()
        state_key, state_round = hello_keys(request, context.node_id)
        as_of = -1 if state_round is None else state_round
        door = open_state(
            context, settings, here, state_key=state_key, as_of=as_of, keep_round=0, told=self._told, hello=True
        )
        node = door.node
        if node is not None:
            here.residents.put(door.owner, node)
        answer = {
            "partition-id": int(context.node_config.get("partition-id", -1)),
            "version": -1 if node is None else node.version,
            "model": here.bound.described.encode(),  # frozen entries by checksum: they never travel
        }
        return Message(content=RecordDict({HELLO: ConfigRecord(answer)}), reply_to=msg)

    # ------------------------------------------------------------------ one round
    def train(
        self, msg: Message, context: Context, batches: Iterable[Any], *, tamper: UploadHook | None = None
    ) -> Message:
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
        tamper : UploadHook | None (default: None)
            For fault studies only: what the node changes in what it sends (:class:`UploadHook`:
            when each method is called, and what it may change).

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
        # no plain signs in a secure run
        check_train(msg.content, cfg.secure, cfg.state_key, cfg.server_round, context=context)
        door = open_state(  # the node's state: resident while current, else its persisted copy
            context,
            settings,
            here,
            state_key=cfg.state_key,
            as_of=cfg.as_of,
            keep_round=cfg.keep_round,
            told=self._told,
        )
        choice = node_choice(self._choices, self._decode_cost, door.owner, settings.link_mbps, context)
        lived, self._served = self._served > 0, self._served + 1
        env = Apply(
            placement=here.placement,
            pool=here.pool,
            spec=spec,
            node_id=context.node_id,
            round=cfg,
            seed_fn=self._seed_fn,
            context=choice,
        )
        before = None if door.node is None else door.node.version
        try:
            node = door.catch_up(msg.content, env)  # 1. the replica at the server's version
            with here.pool.holding(node.replica):  # nothing recycles it while this message runs
                arrays, work, flipped = run_round(  # 1. (the momentum) to 3.
                    node, before, cfg, msg.content, here, self.loss_fn, batches,
                    key=_node_key(context), node_id=context.node_id, hook=tamper,
                )  # fmt: skip
                if SECURE in msg.content:  # 3. the signs (and buffers) under the round's pairwise masks
                    arrays = mask_upload(arrays, msg.content[SECURE], context, spec, cfg.server_round)
                explained = flipped > EXPLAIN_ABOVE * spec.d and cfg.upload == "sign"  # many: say where they are
                metrics = ReplyMetrics(  # 4. the reply
                    num_examples=work.num_examples,
                    train_loss=sum(work.losses) / len(work.losses),
                    version=node.version,
                    checksum=node.replica.checksum,
                    coin_flips=flipped,
                    flips_explained=explain(node.m, node.replica.x, spec.layout) if explained else {},
                )
                content = RecordDict({CLIENT_UPLOAD: ArrayRecord(arrays), METRICS: metrics.to_record()})
                reply = Message(content=content, reply_to=msg)
                if choice.keeps and node.replica.depth == 2 and choice.wanted():
                    reply.content[METRICS]["context"] = node.version  # code the next Δ with the two before it
                # 5. kept for the next round: persisted, resident; a failed write said
                return door.keep(node, reply, spec=spec, momentum_dtype=settings.momentum_dtype, background=lived)
        except torch.cuda.OutOfMemoryError as err:
            door.forget()
            raise DeviceMemoryError(f"node {context.node_id}: {self._out_of_memory(spec.d, here)}") from err
        except BaseException:
            door.forget()  # the next message starts from the persisted copy, which is unchanged
            raise

    def _out_of_memory(self, d: int, here: Device) -> str:
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


def _node_key(context: Context) -> int:
    """The node's integer identity: its partition id, else its node id."""
    pid = context.node_config.get("partition-id")
    return int(pid) if pid is not None else int(context.node_id)
