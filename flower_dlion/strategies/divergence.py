"""The divergence watch of :class:`~flower_dlion.strategies.dlion.DistributedLion`: a train loss that runs away.

Round t's train loss Lₜ is the ``train-loss`` the strategy reports for it (the example-weighted
mean of its valid replies' own ``train-loss``). With f = ``divergence_factor`` and
R = ``divergence_rounds``, the watch keeps the running minimum mₜ = min_{s<t} Lₛ over the earlier
rounds with a finite loss (m₁ = ∞) and the streak

    kₜ = kₜ₋₁ + 1  if Lₜ > f · mₜ or Lₜ is not finite,  else 0      (k₀ = 0; f · mₜ = ∞ unless 0 < mₜ < ∞)

and warns in round t when kₜ ≥ R, or when a node's own ``train-loss`` in a reply is not finite (the
reply check rejects such a reply, so it is read here from the reply itself). A round without a valid
reply leaves m and k as they are. The warning names the round, Lₜ, mₜ, f and the nodes (node id and
partition) whose own loss is above f · mₜ or not finite; with ``stop_on_divergence`` the run stops
there (:class:`~.run_stops.RunStopped`).

:func:`update` is pure (a :class:`DivergenceState` in, the next one and the warning out); :func:`replay`
rebuilds the state from a run's history of round metrics (a resumed run goes on with the same m and k).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.supercore import log

from .run_stops import RunStopped

__all__ = [
    "DivergenceOptions",
    "DivergenceState",
    "replay",
    "report",
    "round_loss",
    "update",
    "watch",
]

NodeKey = tuple[int, int]  # (node id, partition)
SHOWN_NODES = 5  # nodes a warning names (then "and k more")


@dataclass(frozen=True, kw_only=True)
class DivergenceOptions:
    """When the divergence watch warns, and whether it stops the run (the strategy's arguments of the same names).

    Raises
    ------
    ValueError
        ``divergence_factor`` not a number > 1 (``math.inf`` allowed: watch for non-finite losses
        only), ``divergence_rounds`` not an integer >= 1, or ``stop_on_divergence`` not a bool.

    """

    divergence_factor: float = 10.0
    divergence_rounds: int = 1
    stop_on_divergence: bool = False

    def __post_init__(self) -> None:
        factor, rounds = self.divergence_factor, self.divergence_rounds
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1.0:
            raise ValueError(
                f"divergence_factor must be a number > 1 (math.inf: watch for non-finite losses only), got {factor!r}"
            )
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"divergence_rounds must be an integer >= 1, got {rounds!r}")
        if not isinstance(self.stop_on_divergence, bool):
            raise ValueError(f"stop_on_divergence must be True or False, got {self.stop_on_divergence!r}")

    def describe(self) -> list[str]:
        """The strategy summary's line, none at the defaults."""
        if self == DivergenceOptions():
            return []
        f, r, stop = self.divergence_factor, self.divergence_rounds, self.stop_on_divergence
        return [f"divergence watch: divergence_factor={f:g} | divergence_rounds={r} | stop_on_divergence={stop}"]


@dataclass(frozen=True)
class DivergenceState:
    """What the watch keeps between rounds: the running minimum m of the finite round losses and the streak k."""

    minimum: float = math.inf  # min of the finite train losses of the rounds so far (∞: none yet)
    streak: int = 0  # rounds in a row whose loss was above divergence_factor × the minimum before it


def round_loss(metrics: Mapping[str, Any]) -> float | None:
    """The round's ``train-loss`` from its metrics, None when it had no valid reply (``num-replies`` 0)."""
    if not metrics.get("num-replies", 1) or "train-loss" not in metrics:
        return None
    return float(metrics["train-loss"])


def update(
    state: DivergenceState,
    options: DivergenceOptions,
    server_round: int,
    loss: float | None,
    node_losses: Mapping[NodeKey, float] | None = None,
) -> tuple[DivergenceState, str | None]:
    """The state after ``server_round`` and its warning (None: no divergence seen), as the module doc says.

    ``loss``: the round's train loss (None: no valid reply); ``node_losses``: each node's own, by
    (node id, partition) (:func:`.replies.reported_losses`).
    """
    f, minimum = options.divergence_factor, state.minimum
    threshold = f * minimum if 0.0 < minimum < math.inf else math.inf  # a loss that reaches 0 or below: no ratio
    streak = state.streak
    if loss is not None:
        streak = streak + 1 if (not math.isfinite(loss) or loss > threshold) else 0
        minimum = min(minimum, loss) if math.isfinite(loss) else minimum
    node_losses = node_losses or {}
    non_finite = sorted(key for key, v in node_losses.items() if not math.isfinite(v))
    diverging = loss is not None and streak >= options.divergence_rounds
    new = DivergenceState(minimum, streak)
    if not (diverging or non_finite):
        return new, None
    above = sorted(key for key, v in node_losses.items() if not math.isfinite(v) or v > threshold)
    what = []
    if diverging:
        times = f"{streak} round{'s' if streak > 1 else ''}"
        what.append(f"train-loss above divergence_factor × its running minimum for {times} in a row")
    if non_finite:
        what.append(f"a non-finite train-loss from {len(non_finite)} node{'s' if len(non_finite) > 1 else ''}")
    text = (
        f"round {server_round}: divergence: {' and '.join(what)}: train-loss {_number(loss)}, running minimum "
        f"{_number(state.minimum)}, divergence_factor {f:g} (threshold {_number(threshold)}), divergence_rounds "
        f"{options.divergence_rounds}; nodes above the threshold or not finite: {_nodes(above, node_losses)}"
    )
    return new, text


def report(warning: str | None, options: DivergenceOptions, server_round: int) -> None:
    """Log ``warning`` (if any) at WARNING; with ``stop_on_divergence``, stop the run with it.

    Raises
    ------
    RunStopped
        With ``stop_on_divergence`` and a warning: "the run cannot learn: round t: divergence: …".

    """
    if warning is None:
        return
    if options.stop_on_divergence:
        log(WARNING, "%s. Stopping the run (stop_on_divergence=True)", warning)
        raise RunStopped(f"{warning} (stop_on_divergence=True)", server_round)
    log(WARNING, "%s. Lower lr or local_steps; stop_on_divergence=True stops the run here", warning)


def watch(
    state: DivergenceState,
    options: DivergenceOptions,
    server_round: int,
    metrics: Mapping[str, Any],
    node_losses: Mapping[NodeKey, float],
) -> DivergenceState:
    """:func:`update` with the round's metrics (:func:`round_loss`), then :func:`report`: the strategy's hook.

    Raises
    ------
    RunStopped
        With ``stop_on_divergence``, in a round that warns.

    """
    state, warning = update(state, options, server_round, round_loss(metrics), node_losses)
    report(warning, options, server_round)
    return state


def replay(options: DivergenceOptions, history: Iterable[Mapping[str, Any]]) -> DivergenceState:
    """The state after the rounds of ``history`` (the strategy's metrics, one dict a round), as a resume needs it."""
    state = DivergenceState()
    for metrics in history:
        state, _ = update(state, options, int(metrics.get("round", 0)), round_loss(metrics))
    return state


def _number(value: float | None) -> str:
    """A loss in a warning: 4 significant digits, "none" for no valid reply or no earlier round."""
    return "none" if value is None or value == math.inf else f"{value:.4g}"


def _nodes(keys: list[NodeKey], losses: Mapping[NodeKey, float]) -> str:
    """``node 5 (partition 2): nan, node 7 (partition 3): 41.2`` (the first few), or "none"."""
    if not keys:
        return "none"
    shown = ", ".join(f"node {n} (partition {p}): {losses[(n, p)]:.4g}" for n, p in keys[:SHOWN_NODES])
    return shown + (f" (and {len(keys) - SHOWN_NODES} more)" if len(keys) > SHOWN_NODES else "")
