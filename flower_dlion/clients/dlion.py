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
2. K = ``local-steps`` Lion steps (``lion.local_steps_``) on a copy of x, each on the mean
   gradient of ``accumulate`` batches taken from ``batches``; U = Σₖ δₖ (with K = 1 this is
   plain D-Lion: δ = sign(β₁·m + (1−β₁)·g), then m ← β₂·m + (1−β₂)·g). With
   ``local-optimizer = "sgd"`` (FedSMU's client) K SGD steps at ``local-lr`` instead
   (``lion.local_sgd``), and one Lion step on their model change g = x − x_K. With
   ``local-proximal-mu`` μ each local gradient gains μ·(x_local − x) (drift control);
3. encode U for the wire (the strategy's ``upload``): ``sign`` — 1 bit per parameter (exact
   zeros become a seeded coin flip; with K = 1, steps 2 and 3 are one fused pass,
   ``codec.pack_local_step_``); ``sum`` — the integer U; ``ef-sign`` — a scaled sign of U + e
   with error feedback (each kind in :mod:`flower_dlion.uploads`, which the strategy uses too);
4. reply with it, the loss, the number of examples, the replica's version and checksum (and
   the momentum or the buffers in the rounds that sync them);
5. store the state for the next round (:class:`state.StateStore`).

Reproducibility: the batches are drawn, and the loss computed, under torch's RNG seeded by
(the strategy's seed, the node, the round), so a ``DataLoader(shuffle=True)`` and dropout give
the same run twice; the coin flips for exact zeros come from a generator seeded the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from ..params import Binding, LossFn, cross_entropy_loss, layer_mask, state_checksum
from ..protocol import (
    CONFIG,
    HELLO,
    HELLO_ACTION,
    METRICS,
    MOMENTUM,
    UPLOAD,
    sync_prefixes,
    to_array,
)
from .local_work import LocalWork, Tamper, adopt_momentum, age_momentum, upload_arrays
from .replica import apply_message
from .state import CONTEXT_LIMIT, ClientStateError, ReplicaState, StateStore, default_state_dir, node_label

__all__ = ["ClientSettings", "ClientStateError", "DLionClient", "Tamper", "resolve_device"]

logger = logging.getLogger("flower_dlion")

AUTO_FILES_FROM = 1 << 20  # trainable values from which the state goes to files by default (docs/PERFORMANCE.md §3)


@dataclass(frozen=True)
class ClientSettings:
    """Where a node computes and keeps its state.

    Parameters
    ----------
    device : str (default: "auto")
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``.
    state_dir : str | None (default: None)
        A folder for state files (``<state_dir>/<run>/<node>/r<round>.pt``): the node's state then
        survives a SuperNode restart and a resumed ServerApp finds it. None: files only where
        the state stays out of the context, in a temporary folder.
    state_in_context : bool | None (default: None)
        Keep the state in ``context.state`` too. None: yes below 2²⁰ trainable values, files
        from there up (Flower serializes the context with every message).
    momentum_dtype : {"float32", "bfloat16"} (default: "float32")
        How m is stored between rounds (bfloat16: half the bytes; computed in float32).

    """

    device: str = "auto"
    state_dir: str | None = None
    state_in_context: bool | None = None
    momentum_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        if self.momentum_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"momentum_dtype must be 'float32' or 'bfloat16', got {self.momentum_dtype!r}")
        if self.state_in_context not in (None, True, False):
            raise ValueError(f"state_in_context must be True, False or None (auto), got {self.state_in_context!r}")


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ClientStateError(f"device {name!r} requested but torch.cuda.is_available() is False on this node")
    return torch.device(name)


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
    device, state_dir, state_in_context, momentum_dtype
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
    ) -> None:
        if isinstance(model_fn, nn.Module) or not callable(model_fn):
            raise TypeError(
                f"model_fn must build the model (e.g. your model class Net, not Net()), got a {type(model_fn).__name__}"
            )
        self.model_fn = model_fn
        self.loss_fn: LossFn = loss_fn or cross_entropy_loss
        self._settings = ClientSettings(device, state_dir, state_in_context, momentum_dtype)
        self._bindings: dict[torch.device, Binding] = {}
        self._told: set[str] = set()
        if app is not None:
            app.query(HELLO_ACTION)(self.hello)

    def settings(self, context: Context) -> ClientSettings:
        """The settings for this node (override to read them from the run or node config)."""
        return self._settings

    def binding(self, device: torch.device) -> Binding:
        """The model object on ``device`` and its spec (built on first use)."""
        if device not in self._bindings:
            model = self.model_fn()
            if not isinstance(model, nn.Module):
                raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
            self._bindings[device] = Binding(model.to(device))
        return self._bindings[device]

    # ------------------------------------------------------------------ the hello
    def hello(self, msg: Message, context: Context) -> Message:
        """Say who this node is, which replica version it can start from, and what its model holds."""
        bound = self.binding(resolve_device(self.settings(context).device))
        request = msg.content[HELLO] if HELLO in msg.content else ConfigRecord()
        store = self._store(context, request, bound.spec.d, server_round=0)
        state = store.load(bound.spec.d, torch.device("cpu"))
        answer = {
            "partition-id": int(context.node_config.get("partition-id", -1)),
            "version": -1 if state is None else state.version,
            "model": bound.spec.encode(),
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
            Where the round's batches come from, e.g. your ``DataLoader``: the round takes
            ``local-steps × accumulate`` batches (1 by default) from a fresh iterator,
            starting over when it runs out.
        tamper : Tamper | None (default: None)
            For fault studies only: what an attacking node changes (:class:`Tamper`).

        Returns
        -------
        Message
            The reply. Nothing is stored when this raises: the node keeps its state and the
            server sends it what it lacks next time.

        """
        settings = self.settings(context)
        device = resolve_device(settings.device)
        bound = self.binding(device)
        spec = bound.spec
        if CONFIG not in msg.content:
            raise ClientStateError(
                f"node {context.node_id}: a train message with records {sorted(msg.content.keys())}, not "
                f"DistributedLion's '{CONFIG}': does the ServerApp start DistributedLion?"
            )
        round_config = msg.content[CONFIG]
        server_round, seed, key = (
            int(round_config["server-round"]),
            int(round_config.get("seed", 0)),
            _node_key(context),
        )
        store = self._store(context, round_config, spec.d, server_round)

        # 1. the replica at the server's version, and the synced momentum
        loaded = store.load(spec.d, device)
        before = None if loaded is None else loaded.version  # apply_message moves it in place
        state = apply_message(msg.content, loaded, spec, device, context.node_id, self._seed_fn)
        age_momentum(state, before, round_config, context.node_id)
        sync = bool(round_config.get("momentum-sync", 0))
        mask = None
        if sync or MOMENTUM in msg.content:  # parameters whose momentum is synchronized
            mask = layer_mask(spec.layout, sync_prefixes(str(round_config.get("momentum-sync-layers", "")))).to(device)
        if MOMENTUM in msg.content:
            adopt_momentum(state, msg.content[MOMENTUM], mask, context.node_id)
        bound.load_rest_(state.rest)

        # 2.–3. the local Lion steps and the upload
        gen = _generator(device, seed, key, server_round)  # coin flips for exact zeros
        work = LocalWork(bound, self.loss_fn, batches, accumulate=int(round_config.get("accumulate", 1)))
        flips: list[int] = []  # how many signs were coin flips (exact zeros of the Lion mix)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_seed(seed, key, server_round, 1))  # the batches' shuffles, dropout
            arrays = upload_arrays(state, round_config, spec.sizes, work, gen, tamper, flips, context.node_id)
        if sync:
            assert mask is not None
            arrays["momentum"] = to_array(state.m[mask].cpu().numpy())
        state.rest.update({name: t.clone() for name, t in bound.buffers().items()})  # the client's own buffers
        if round_config.get("buffers", 0):
            arrays["buffers"] = to_array(_flat_buffers(state, spec))
        if tamper is not None:
            arrays = tamper.arrays(arrays)

        # 4.–5. reply, and keep the state for the next round
        state.round = server_round
        host = state.on_host(settings.momentum_dtype)  # one host copy for the context, the file and the checksum
        metrics = {
            "num-examples": work.num_examples,
            "train-loss": sum(work.losses) / len(work.losses),
            "version": state.version,
            "checksum": state_checksum(host.x),
            "coin-flips": sum(flips),
        }
        if state.depth == 2 and state.recent_version == state.version:  # the next Δ can be coded with it as context
            metrics["context"] = state.version
        store.save(host)
        return Message(content=RecordDict({UPLOAD: ArrayRecord(arrays), METRICS: MetricRecord(metrics)}), reply_to=msg)

    # ------------------------------------------------------------------ helpers
    def _seed_fn(self, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x₀ and the rest of ``model_fn()`` built under ``torch.manual_seed(seed)`` (the global RNG untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            seeded = Binding(self.model_fn())
        return seeded.flat_parameters(), seeded.rest()

    def _store(self, context: Context, round_config: ConfigRecord, d: int, server_round: int) -> StateStore:
        """Where this node's state lives for this message (see :class:`ClientSettings`)."""
        s = self.settings(context)
        in_context = s.state_in_context
        if in_context is None:
            in_context = d < AUTO_FILES_FROM
            if not in_context:
                self._tell_once(
                    "files",
                    "flower-dlion: %d trainable values: the client keeps x and m in state files under %s, not in "
                    "context.state, which Flower serializes with every message (DLionClient(state_in_context=...) "
                    "chooses)",
                    d,
                    s.state_dir or default_state_dir(),
                )
        elif in_context and 8 * d > CONTEXT_LIMIT:
            self._tell_once(
                "too-large",
                "flower-dlion: %d trainable values (%.1f GB of x and m) are too large for context.state: "
                "the client keeps them in state files instead",
                d,
                8 * d / 1e9,
            )
            in_context = False
        root = s.state_dir or (None if in_context else str(default_state_dir()))
        folder = None
        if root is not None:
            run = str(round_config.get("state-key", "")) or f"run-{context.run_id}"
            folder = Path(root).expanduser() / run / node_label(context)
        as_of = int(round_config.get("state-round", server_round - 1 if server_round else -1))
        return StateStore(
            context,
            in_context=in_context,
            folder=folder,
            as_of=as_of,
            keep_round=int(round_config.get("keep-round", 0)),
        )

    def _tell_once(self, what: str, fmt: str, *args: object) -> None:
        if what not in self._told:
            self._told.add(what)
            logger.warning(fmt, *args)


def _flat_buffers(state: ReplicaState, spec: Any) -> np.ndarray:
    """The client's buffers in spec order, as one flat float32 vector."""
    return torch.cat([state.rest[e.name].detach().reshape(-1).float().cpu() for e in spec.buffers]).numpy()


def _node_key(context: Context) -> int:
    """The node's integer identity: its partition id, else its node id."""
    pid = context.node_config.get("partition-id")
    return int(pid) if pid is not None else int(context.node_id)


def _seed(*keys: int) -> int:
    return int(np.random.SeedSequence([k % 2**64 for k in keys]).generate_state(1)[0])


def _generator(device: torch.device, *keys: int) -> torch.Generator:
    """A torch generator on ``device`` seeded from integer keys (seed, node, round)."""
    return torch.Generator(device=device).manual_seed(_seed(*keys))
