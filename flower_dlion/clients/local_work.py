"""What a Distributed Lion client computes in a round: its gradients, its local Lion steps, its upload.

:class:`LocalWork` draws the round's batches and returns mean gradients; :func:`local_step`
chooses, once per round config, the step that runs the K local steps (``lion.local_steps_``, or
``lion.local_sgd`` then one Lion step for the FedSMU-style client; with K = 1 and the sign
upload, the step and its 1-bit pack are one pass, ``codec.pack_local_step_``) and encodes U as
the round's upload kind (:mod:`flower_dlion.uploads`).
:func:`age_momentum` and :func:`synced_momentum` handle the momentum of a node that missed rounds
and the server's synced momentum. The ClientApp's plumbing around them is :mod:`.dlion`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from .. import codec, drift, lion, quantizers, stochastic
from ..params import Binding, LossFn, layer_mask
from ..protocol import MOMENTUM, SIGN_STYPE, bits_array, sync_prefixes, to_array
from ..round_records import RoundConfig
from ..uploads import UPLOADS, Shape
from .drift_state import correction, keep_drift
from .hooks import UploadHook
from .placement import Placement
from .resident import Device, NodeState
from .state import ClientStateError

__all__ = [
    "MOMENTUM_LIMIT",
    "LocalStep",
    "LocalWork",
    "adopt_momentum",
    "age_momentum",
    "local_step",
    "round_generator",
    "round_seed",
    "run_round",
    "synced_momentum",
]

MOMENTUM_LIMIT = 1e6  # a synced momentum beyond this is no average of gradients a float32 model trains with


class LocalWork:
    """The gradients of one round: ``accumulate`` batches per local step, from a fresh iterator.

    The round's K·A batches come from ``iter(batches)``, made anew each round, starting over with
    a new ``iter(batches)`` when it runs out: 2 batches and K = 5 local steps give b₀ b₁ b₀ b₁ b₀
    (a shuffling ``DataLoader`` reshuffles at each new pass; ``num_examples`` counts each batch
    each time it is used). Where a fresh ``iter(batches)`` gives no batch either, ``ValueError``
    says why: ``batches`` is empty, or it is an iterator or generator that is used up (it gives
    its batches once: a round that needs more than it has left fails). The message names the node
    when ``node_id`` is given; the client keeps nothing of a round that raises (its state stays).

    ``out``: a buffer for the flat gradient, reused by every step (the caller uses each gradient
    before it asks for the next). ``replica``: the (x, key) of the round's replica; a gradient
    at that x tells the model its key (:meth:`Binding.load_x_`: loaded once per version).
    """

    def __init__(
        self,
        bound: Binding,
        loss_fn: LossFn,
        batches: Iterable[Any],
        *,
        accumulate: int,
        out: torch.Tensor | None = None,
        replica: tuple[torch.Tensor, object] | None = None,
        node_id: int | None = None,
    ) -> None:
        self.bound, self.loss_fn, self.batches, self.accumulate, self.out = bound, loss_fn, batches, accumulate, out
        self.replica = replica
        self.node_id = node_id
        self._it: Iterator[Any] | None = None
        self.losses: list[float] = []
        self.num_examples = 0

    def _next_batch(self) -> Any:
        """The round's next batch, from a new ``iter(batches)`` when the current one runs out (or ValueError)."""
        for fresh in (False, True):
            if self._it is None or fresh:
                self._it = iter(self.batches)
            try:
                return next(self._it)
            except StopIteration:
                continue
        raise ValueError(self._no_batch())

    def _no_batch(self) -> str:
        """Why ``batches`` gave no batch: empty, or an iterator that is used up."""
        who = "" if self.node_id is None else f"node {self.node_id}: "
        kind = type(self.batches).__name__
        if isinstance(self.batches, Iterator):  # iter() returns it, as it is: one pass only
            return (
                f"{who}batches is used up: it is an iterator ({kind}), which gives its batches once, and it ran out "
                f"after {len(self.losses)} batches this round (a round takes local-steps × accumulate batches, "
                "starting over when they run out); pass something that can be iterated again (a DataLoader, a list)"
            )
        return (
            f"{who}batches is empty: the round needs at least one batch, and the {kind} gave none (an empty "
            "partition? a DataLoader with drop_last=True and fewer examples than its batch_size?)"
        )

    def gradient(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Mean gradient at x over the ``accumulate`` batches of local step ``step``."""
        total = None
        for _ in range(self.accumulate):
            batch = self._next_batch()
            key = self.replica[1] if self.replica is not None and x is self.replica[0] else None
            loss, grad = self.bound.gradient(x, self.loss_fn, batch, out=self.out, key=key)
            if not math.isfinite(float(loss)):
                raise ValueError(f"the loss is {float(loss)} at local step {step}: nothing uploaded, the state is kept")
            self.losses.append(float(loss))
            self.num_examples += _batch_size(batch)
            total = (grad.clone() if self.accumulate > 1 else grad) if total is None else total.add_(grad)
        assert total is not None
        return total if self.accumulate == 1 else total.div_(self.accumulate)


Gradient = Callable[[torch.Tensor, int], torch.Tensor]  # (x, local step) → the gradient there
LocalStep = Callable[
    [NodeState, RoundConfig, list[int], LocalWork, torch.Generator, UploadHook | None, list[int]], dict[str, Array]
]  # (node, cfg, sizes, work, generator, hook, flips) → the reply's arrays for U


def local_step(cfg: RoundConfig, hook: UploadHook | None = None) -> LocalStep:
    """Steps 2–3 of a round with these options: chosen once per round config (as an optimizer picks its update).

    Each step runs the round's local steps from the node's replica and returns the reply's
    arrays for U (m and the error state updated); ``flips`` gets the number of signs sent as
    coin flips (exact zeros; the sign upload only):

    * ``_fused_sign``: K = 1, ``upload = "sign"``, no sign noise, no hook: the Lion step and
      its 1-bit pack in one pass over m and g (``codec.pack_local_step_``);
    * ``_lion_steps``: K Lion steps (``lion.local_steps_``), U encoded as ``cfg.upload``;
    * ``_sgd_then_lion`` (``local-optimizer = "sgd"``): K SGD steps, then one Lion step on
      their change g (FedSMU's client), fused as above where it may be;
    * ``_sgd_ef_sign`` (``local-optimizer = "sgd"``, ``upload = "ef-sign"``): g itself as a
      scaled sign with error feedback (FedAvg's update, compressed); with ``drift-correction``,
      ``_sgd_ef_sign_drift``, bound to the round's correction in :func:`run_round`.
    """
    fused = cfg.upload == "sign" and hook is None and cfg.sign_noise == 0.0  # the one-pass path, where K = 1
    if cfg.local_optimizer == "sgd":
        return _sgd_ef_sign if cfg.upload == "ef-sign" else (_sgd_then_fused if fused else _sgd_then_lion)
    return _fused_sign if fused and cfg.local_steps == 1 else _lion_steps


class _Round:
    """What every local step of a round shares: x, the scale blocks, the gradient (with drift control), the noise."""

    def __init__(
        self,
        state: NodeState,
        cfg: RoundConfig,
        sizes: list[int],
        work: LocalWork,
        gen: torch.Generator,
        shift: torch.Tensor | None = None,
    ) -> None:
        self.state, self.cfg, self.gen = state, cfg, gen
        self.x = x = state.replica.x  # shared by the nodes at this version: never changed here
        self.d = x.numel()
        self.sizes = quantizers.scale_blocks(sizes, cfg.scale_block)
        self.gradient: Gradient = work.gradient
        self.perturb = stochastic.perturber(self.sizes, cfg.sign_noise, cfg.sign_noise_kind, gen)  # None: exact
        mu = cfg.local_proximal_mu
        if mu:  # drift control: each local gradient gains μ·(x_local − x), x the round's replica
            self.gradient = lambda xk, k: work.gradient(xk, k).add_(xk - x, alpha=mu)
        if shift is not None:  # SCAFFOLD's drift correction: each local gradient gains c − cᵢ (flower_dlion.drift)
            base = self.gradient
            self.gradient = lambda xk, k: base(xk, k).add_(shift)

    def sgd(self) -> torch.Tensor:
        """K local SGD steps: g = x − x_K."""
        return lion.local_sgd(self.x, self.gradient, steps=self.cfg.local_steps, lr=self.cfg.local_lr)

    def fused(self, g: torch.Tensor, flips: list[int]) -> dict[str, Array]:
        """One Lion step on ``g`` and its 1-bit pack, one pass over m and g."""
        cfg = self.cfg
        packed = codec.pack_local_step_(self.state.m, g, cfg.beta1, cfg.beta2, self.gen, flips=flips)
        return {"signs": bits_array(packed, self.d, SIGN_STYPE)}

    def lion(
        self,
        gradient: Callable[[torch.Tensor, int], torch.Tensor],
        steps: int,
        hook: UploadHook | None,
        flips: list[int],
    ) -> dict[str, Array]:
        """``steps`` Lion steps on a copy of x (K = 1 never moves x), U encoded as the round's upload."""
        cfg, upload = self.cfg, self.cfg.upload
        x_local = self.x if steps == 1 else self.x.clone()
        u = lion.local_steps_(
            x_local,
            self.state.m,
            gradient,
            steps=steps,
            lr=cfg.local_lr,
            weight_decay=cfg.local_weight_decay,
            beta1=cfg.beta1,
            beta2=cfg.beta2,
            perturb=self.perturb if upload == "sign" else None,  # the sign upload: each step's sign stochastic
        )
        noise = self.perturb if upload == "ef-sign" else None  # ef-sign: the sign of U + e
        return self.encode(u, steps, hook, flips, noise)

    def encode(
        self, u: torch.Tensor, steps: int, hook: UploadHook | None, flips: list[int], noise: stochastic.Perturb | None
    ) -> dict[str, Array]:
        """U (after the hook) as the round's upload kind; the error state updated."""
        if hook is not None:
            u = hook.upload(u, self.gen)
        shape = Shape(self.d, self.sizes, steps)
        arrays, self.state.error = UPLOADS[self.cfg.upload].encode(u, self.state.error, shape, self.gen, flips, noise)
        return arrays


def _fused_sign(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    hook: UploadHook | None,
    flips: list[int],
) -> dict[str, Array]:
    """K = 1, the sign upload: one Lion step and its 1-bit pack in one pass (a :data:`LocalStep`)."""
    r = _Round(state, cfg, sizes, work, gen)
    return r.fused(r.gradient(r.x, 0), flips)


def _lion_steps(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    hook: UploadHook | None,
    flips: list[int],
) -> dict[str, Array]:
    """K Lion steps, U encoded as the round's upload (a :data:`LocalStep`)."""
    r = _Round(state, cfg, sizes, work, gen)
    return r.lion(r.gradient, cfg.local_steps, hook, flips)


def _sgd_then_fused(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    hook: UploadHook | None,
    flips: list[int],
) -> dict[str, Array]:
    """K SGD steps, then one Lion step on their change, fused with its pack (a :data:`LocalStep`)."""
    r = _Round(state, cfg, sizes, work, gen)
    return r.fused(r.sgd(), flips)


def _sgd_then_lion(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    hook: UploadHook | None,
    flips: list[int],
) -> dict[str, Array]:
    """K SGD steps, then one Lion step on their change g (a :data:`LocalStep`)."""
    r = _Round(state, cfg, sizes, work, gen)
    g = r.sgd()
    return r.lion(lambda x, k: g, 1, hook, flips)


def _sgd_ef_sign(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    hook: UploadHook | None,
    flips: list[int],
) -> dict[str, Array]:
    """K SGD steps, their change g sent as a scaled sign with error feedback (a :data:`LocalStep`)."""
    r = _Round(state, cfg, sizes, work, gen)
    return r.encode(r.sgd(), 1, hook, flips, r.perturb)


def _sgd_ef_sign_drift(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    hook: UploadHook | None,
    flips: list[int],
    *,
    diff: torch.Tensor | None,
) -> dict[str, Array]:
    """``_sgd_ef_sign`` with SCAFFOLD's h − hᵢ (None: uncorrected), hᵢ kept; a :data:`LocalStep` once bound."""
    shift = None if diff is None else drift.offset(diff, cfg.local_steps, cfg.local_lr)  # (h − hᵢ)/(K·η)
    r = _Round(state, cfg, sizes, work, gen, shift)
    u = r.sgd()
    h_new = drift.next_state(u, diff)  # hᵢ ← uᵢ − (h − hᵢ), before the encoding adds the error feedback to u
    arrays = r.encode(u, 1, hook, flips, r.perturb)
    keep_drift(state, h_new, arrays, cfg.server_round)
    return arrays


def run_round(
    node: NodeState,
    before: int | None,
    cfg: RoundConfig,
    content: RecordDict,
    here: Device,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    key: int,
    node_id: int,
    hook: UploadHook | None = None,
) -> tuple[dict[str, Array], LocalWork, int]:
    """Steps 1 (the momentum) to 3 of a round on ``here``: the reply's arrays; ``node`` updated.

    The momentum aged (:func:`age_momentum`; ``before``: the node's version before this
    message, None: it had none) and the server's adopted (:func:`adopt_momentum`), the round's
    :func:`local_step` run under torch's RNG seeded by (seed, ``key``, round), the momentum and
    buffers added in the rounds that send them, then ``hook``'s :meth:`~.hooks.UploadHook.arrays`.

    Returns
    -------
    tuple[dict[str, Array], LocalWork, int]
        The reply's arrays, the round's work (its losses and examples), and how many signs
        were coin flips (exact zeros of the Lion mix).

    """
    server_round, seed = cfg.server_round, cfg.seed
    bound, spec, placement = here.bound, here.bound.spec, here.placement
    device = placement.device
    age_momentum(node, before, cfg)
    step = local_step(cfg, hook)  # steps 2–3 for the round's options, chosen once
    if here.grad is None:
        here.grad = torch.empty(spec.d, device=device)
    replica = (node.replica.x, node.replica.ident)
    work = LocalWork(
        bound, loss_fn, batches, accumulate=cfg.accumulate, out=here.grad, replica=replica, node_id=node_id
    )
    gen = round_generator(device, seed, key, server_round)  # coin flips for exact zeros
    mask = adopt_momentum(node, content, cfg, placement=placement, layout=spec.layout, node_id=node_id)
    bound.load_rest_(node.rest)
    if cfg.drift_correction != "off":  # SCAFFOLD's h − hᵢ of the round (flower_dlion.drift), or None: uncorrected
        diff = correction(node, before, cfg, content, spec.sizes, node_id, placement)
        step = partial(_sgd_ef_sign_drift, diff=diff)
    flips: list[int] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(round_seed(seed, key, server_round, 1))  # the batches' shuffles, dropout
        arrays = step(node, cfg, spec.sizes, work, gen, hook, flips)
    momentum = None
    if cfg.momentum_sync:
        assert mask is not None
        momentum = placement.to_host(node.m[mask])
    node.rest = node.rest | {name: t.clone() for name, t in bound.buffers().items()}  # the client's own buffers
    buffers = placement.buffers_to_host(node.rest, [e.name for e in spec.buffers]) if cfg.buffers else None
    if momentum is not None:
        arrays["momentum"] = to_array(momentum)
    if buffers is not None:
        arrays["buffers"] = to_array(buffers)
    if hook is not None:
        arrays = hook.arrays(arrays)
    node.round = server_round
    return arrays, work, sum(flips)


def age_momentum(state: NodeState, before: int | None, cfg: RoundConfig) -> None:
    """``stale-momentum``: after k missed rounds (versions beyond the one its upload made), m ← β₂ᵏ·m or 0."""
    missed = 0 if before is None else state.version - before - 1
    if cfg.stale_momentum == "keep" or missed <= 0:
        return
    if cfg.stale_momentum == "decay":
        state.m.mul_(cfg.beta2**missed)
    else:
        state.m.zero_()


def adopt_momentum(
    node: NodeState,
    content: RecordDict,
    cfg: RoundConfig,
    placement: Placement,
    layout: Iterable[tuple[str, Sequence[int]]],
    node_id: int,
) -> torch.Tensor | None:
    """The synced momentum the server sent (if it did) into m; the mask of the synced parameters, or None.

    The mask (``momentum-sync-layers``' parameters, on the device) is made where the round syncs
    the momentum (``cfg.momentum_sync``: the reply carries them) or the message brings the server's.
    """
    if not (cfg.momentum_sync or MOMENTUM in content):
        return None
    host_mask = layer_mask(layout, sync_prefixes(cfg.momentum_sync_layers)).numpy()
    synced = synced_momentum(content[MOMENTUM], int(host_mask.sum()), node_id) if MOMENTUM in content else None
    mask = placement.to_device(host_mask)
    if synced is not None:
        node.m[mask] = placement.to_device(synced)
    return mask


def round_seed(*keys: int) -> int:
    """One 64-bit seed from integer keys (the run's seed, the node, the round, …)."""
    return int(np.random.SeedSequence([k % 2**64 for k in keys]).generate_state(1)[0])


def round_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A torch generator on ``device`` seeded from integer keys (seed, node, round): the round's coin flips."""
    return torch.Generator(device=device).manual_seed(round_seed(*keys))


def synced_momentum(record: ArrayRecord, count: int, node_id: int) -> np.ndarray:
    """The server's combination of the last sync round's momenta for the ``count`` synced parameters, checked.

    Refused (ClientStateError, the state kept) unless it has that shape and every value is
    finite and within ±:data:`MOMENTUM_LIMIT`. A host array: the caller places it in m.
    """
    m_avg = record["m"].numpy()
    if m_avg.shape != (count,) or m_avg.dtype != np.float32:
        raise ClientStateError(f"node {node_id}: momentum of {m_avg.dtype} {m_avg.shape}, expected float32 ({count},)")
    if not (np.isfinite(m_avg).all() and np.abs(m_avg).max(initial=0.0) <= MOMENTUM_LIMIT):
        raise ClientStateError(
            f"node {node_id}: the synced momentum has values outside ±{MOMENTUM_LIMIT:g} or non-finite ones: refused"
        )
    return m_avg


def _batch_size(batch: Any) -> int:
    """Examples in a batch: the length of the first tensor in it (1 if it holds none)."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() else 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return 1
