"""What a Distributed Lion client computes in a round: its gradients, its local Lion steps, its upload.

:class:`LocalWork` draws the round's batches and returns mean gradients; :func:`upload_arrays`
runs the K local steps (``lion.local_steps_``, or ``lion.local_sgd`` then one Lion step for the
FedSMU-style client; with K = 1 and the sign upload, the step and its 1-bit pack are one pass,
``codec.pack_local_step_``) and encodes U as the round's upload kind (:mod:`flower_dlion.uploads`).
:func:`age_momentum` and :func:`synced_momentum` handle the momentum of a node that missed rounds
and the server's synced momentum. The ClientApp's plumbing around them is :mod:`.dlion`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from .. import codec, lion, quantizers, stochastic
from ..params import Binding, LossFn, layer_mask
from ..protocol import MOMENTUM, SIGN_STYPE, bits_array, sync_prefixes
from ..round_records import PROXIMAL_LIMIT, RoundConfig
from ..uploads import UPLOADS, Shape
from .placement import Placement
from .resident import NodeState
from .state import ClientStateError

__all__ = [
    "MOMENTUM_LIMIT",
    "PROXIMAL_LIMIT",
    "LocalWork",
    "Tamper",
    "adopt_momentum",
    "age_momentum",
    "round_generator",
    "round_seed",
    "synced_momentum",
    "upload_arrays",
]

MOMENTUM_LIMIT = 1e6  # a synced momentum beyond this is no average of gradients a float32 model trains with


class Tamper:
    """For fault studies only: what an attacking node changes in what it sends. This one changes nothing.

    :meth:`upload` sees U = Σₖ δₖ before it is encoded (the fused path is then not taken);
    :meth:`arrays` sees the reply's encoded arrays (``signs``/``levels``, ``scales``,
    ``momentum``, ``buffers``) before they are sent.
    """

    def upload(self, u: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """What the node uploads instead of U (the round's seeded generator at hand)."""
        return u

    def arrays(self, arrays: dict[str, Array]) -> dict[str, Array]:
        """The reply's arrays as sent."""
        return arrays


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


def upload_arrays(
    state: NodeState,
    cfg: RoundConfig,
    sizes: list[int],
    work: LocalWork,
    gen: torch.Generator,
    tamper: Tamper | None,
    flips: list[int],
) -> dict[str, Array]:
    """Steps 2–3: the local Lion steps and the reply's arrays for U (m and the error state updated).

    ``cfg``: the round's options, already range-checked (:class:`RoundConfig`). ``flips`` gets
    the number of signs sent as coin flips (exact zeros; the sign upload only).
    """
    x = state.replica.x  # shared by the nodes at this version: never changed here
    d = x.numel()
    steps, upload, beta1, beta2 = cfg.local_steps, cfg.upload, cfg.beta1, cfg.beta2
    sizes = quantizers.scale_blocks(sizes, cfg.scale_block)
    gradient = work.gradient
    perturb = stochastic.perturber(sizes, cfg.sign_noise, cfg.sign_noise_kind, gen)  # None: deterministic signs
    mu = cfg.local_proximal_mu
    if mu:  # drift control: each local gradient gains μ·(x_local − x), x the round's replica
        gradient = lambda xk, k: work.gradient(xk, k).add_(xk - x, alpha=mu)  # noqa: E731
    if cfg.local_optimizer == "sgd":  # K local SGD steps: g = x − x_K
        g = lion.local_sgd(x, gradient, steps=steps, lr=cfg.local_lr)
        if upload == "ef-sign":  # g itself, a scaled sign with error feedback (FedAvg's update, compressed)
            if tamper is not None:
                g = tamper.upload(g, gen)
            arrays, state.error = UPLOADS[upload].encode(g, state.error, Shape(d, sizes, 1), gen, flips, perturb)
            return arrays
        steps, gradient = 1, lambda x, k: g  # FedSMU's client: one Lion step on g
    if steps == 1 and upload == "sign" and tamper is None and perturb is None:  # one fused pass over m and g
        packed = codec.pack_local_step_(state.m, gradient(x, 0), beta1, beta2, gen, flips=flips)
        return {"signs": bits_array(packed, d, SIGN_STYPE)}
    x_local = x if steps == 1 else x.clone()  # K = 1 never moves x (see local_steps_)
    u = lion.local_steps_(
        x_local,
        state.m,
        gradient,
        steps=steps,
        lr=cfg.local_lr,
        weight_decay=cfg.local_weight_decay,
        beta1=beta1,
        beta2=beta2,
        perturb=perturb if upload == "sign" else None,  # the sign upload: each step's sign stochastic
    )
    if tamper is not None:
        u = tamper.upload(u, gen)
    noise = perturb if upload == "ef-sign" else None  # ef-sign: the sign of U + e
    arrays, state.error = UPLOADS[upload].encode(u, state.error, Shape(d, sizes, steps), gen, flips, noise)
    return arrays


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
    mask = placement.to_device(layer_mask(layout, sync_prefixes(cfg.momentum_sync_layers)).numpy())
    if MOMENTUM in content:
        synced = synced_momentum(content[MOMENTUM], int(mask.sum()), node_id)
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
