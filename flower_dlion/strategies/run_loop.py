"""The round loop of our strategies (Flower's ``Strategy.start``, from any round, with a hook) and the run's totals.

:func:`run_rounds` is what ``ServerModelStrategy.start`` runs: rounds of configure / send /
aggregate train, federated evaluation, the server's ``evaluate_fn``, then the per-round hook (the
app writes checkpoints there); it returns a :class:`DLionResult`, Flower's ``Result`` with the
run's totals (:func:`run_totals`, summed from the strategy's per-round ``history``), and logs
them as its closing line (:func:`totals_line`), with the rounds that were short of replies and why
(:func:`short_rounds`, :func:`short_text`).
"""

from __future__ import annotations

import io
import pprint
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.result import format_value
from flwr.supercore import log

__all__ = ["TOTALS", "DLionResult", "run_rounds", "run_totals", "short_rounds", "short_text", "totals_line"]


TOTALS = ("num-replies", "num-rejected", "num-failed", "bytes-up", "bytes-down", "bytes-up-fp32", "bytes-down-fp32")
"""The per-round metrics that :meth:`ServerModelStrategy.run_totals` sums over the run (those the strategy reports)."""


@dataclass
class DLionResult(Result):
    """Flower's ``Result`` (what ``start`` returns) with the run's totals.

    Attributes
    ----------
    totals : MetricRecord
        Sums over every round in the strategy's ``history`` (a resumed run's from round 1),
        from what the strategy measured on each round's train messages and their replies
        (hellos and evaluate messages are not counted): ``rounds`` (rounds aggregated),
        ``rounds-applied`` (rounds whose update was applied), ``num-replies`` (valid replies),
        ``num-rejected``, ``num-failed`` (sampled nodes without a reply), ``bytes-up``,
        ``bytes-down`` (measured), ``bytes-up-fp32``, ``bytes-down-fp32`` (the same messages with
        float32 payloads), and ``fp32-over-sent-up`` / ``fp32-over-sent-down`` (how many times
        fewer bytes than float32 were sent). A strategy that measures no bytes (the gradient
        baselines) has only the counts.
    short_rounds : int
        Rounds of the history with fewer valid replies than train messages sent (``num-replies``
        below ``num-sampled``), whatever else went right in them: a run whose rounds lose most of
        their replies says so in its closing line (:func:`short_text`) rather than end as if it were whole.
    short_reasons : dict[str, int]
        Why those rounds were short, summed over them, the most frequent first, zeros left out:
        ``"no reply"`` (sampled nodes without a reply within the timeout, ``num-failed``),
        ``"client error"`` (error replies: the client's handler raised, ``client-errors``) and
        ``"rejected"`` (other replies the server refused: malformed, stale, a replica mismatch).

    """

    totals: MetricRecord = field(default_factory=MetricRecord)
    short_rounds: int = 0
    short_reasons: dict[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        """Flower's representation, then the run's totals (and its short rounds, if any)."""
        totals = {key: format_value(value) for key, value in self.totals.items()}
        short = f"Short rounds (result.short_rounds): {self.short_rounds}, {self.short_reasons}\n"
        return (
            super().__repr__()
            + "\nRun totals (result.totals):\n"
            + pprint.pformat(totals, indent=2, sort_dicts=False)
            + "\n"
            + (short if self.short_rounds else "")
        )


def totals_line(totals: MetricRecord) -> str:
    """The closing log line of ``start``: rounds, replies and, where measured, the bytes against float32's.

    E.g. ``[flower-dlion] run totals (result.totals): 200 rounds, 2000 replies: 72.14 MB up, 114.20 MB
    down (fp32 would have been 2250.15 / 2250.62 MB: 31.2× / 19.7× fewer)`` (MB: 10⁶ bytes; the
    repository's default run); rejected replies and nodes without a reply are said where there were any.
    """
    rounds, replies = totals["rounds"], totals.get("num-replies", 0)
    line = f"[flower-dlion] run totals (result.totals): {rounds} rounds, {replies} replies"
    for key, what in (("num-rejected", "rejected"), ("num-failed", "without a reply")):
        if totals.get(key):
            line += f", {totals[key]} {what}"
    if "bytes-up" in totals:
        up, down, up32, down32 = (float(totals[f"bytes-{k}"]) / 1e6 for k in ("up", "down", "up-fp32", "down-fp32"))
        line += (
            f": {up:.2f} MB up, {down:.2f} MB down (fp32 would have been {up32:.2f} / {down32:.2f} MB: "
            f"{float(totals['fp32-over-sent-up']):.1f}× / {float(totals['fp32-over-sent-down']):.1f}× fewer)"
        )
    return line


def run_rounds(
    strategy: Strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_config: ConfigRecord,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    *,
    start_round: int = 1,
    on_round_end: Callable[[int], Any] | None = None,
) -> DLionResult:
    """Rounds ``start_round`` … ``num_rounds`` of ``strategy`` on ``grid`` (see ``ServerModelStrategy.start``).

    ``strategy`` is one of ours (a ``ServerModelStrategy``): besides Flower's ``Strategy`` methods
    it has ``history`` (the rounds' metrics), ``nodes`` (whose hellos wait ``timeout``) and ``num_rounds``.
    """
    log(INFO, "Starting %s strategy (rounds %d to %d):", type(strategy).__name__, start_round, num_rounds)
    strategy.summary()
    strategy.nodes.query_timeout = timeout
    strategy.num_rounds = num_rounds
    result = DLionResult()
    t_start = time.time()
    arrays = initial_arrays
    if evaluate_fn and start_round == 1:
        res = evaluate_fn(0, initial_arrays)
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    for current_round in range(start_round, num_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
        replies = grid.send_and_receive(
            messages=strategy.configure_train(current_round, arrays, train_config, grid), timeout=timeout
        )
        agg_arrays, agg_metrics = strategy.aggregate_train(current_round, replies)
        if agg_arrays is not None:
            result.arrays = arrays = agg_arrays
        if agg_metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_metrics)
            result.train_metrics_clientapp[current_round] = agg_metrics
        evaluations = list(strategy.configure_evaluate(current_round, arrays, evaluate_config, grid))
        if evaluations:
            agg_eval = strategy.aggregate_evaluate(current_round, grid.send_and_receive(evaluations, timeout=timeout))
            if agg_eval is not None:
                log(INFO, "\t└──> Aggregated evaluation MetricRecord: %s", agg_eval)
                result.evaluate_metrics_clientapp[current_round] = agg_eval
        if evaluate_fn:
            res = evaluate_fn(current_round, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[current_round] = res
        if on_round_end:
            on_round_end(current_round)
    log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
    result.totals = run_totals(strategy.history)
    result.short_rounds, result.short_reasons = short_rounds(strategy.history)
    for line in io.StringIO(str(result)):
        log(INFO, "\t%s", line.strip("\n"))
    rounds = int(result.totals["rounds"])
    closing = totals_line(result.totals) + short_text(result.short_rounds, rounds, result.short_reasons)
    log(WARNING if 2 * result.short_rounds > rounds else INFO, "%s", closing)
    return result


def run_totals(rows: Sequence[dict[str, Any]]) -> MetricRecord:
    """The run's totals over the per-round rows of a strategy's ``history`` (what :attr:`DLionResult.totals` holds).

    ``rounds`` and ``rounds-applied``, then the sum of each metric of :data:`TOTALS` that every
    round reports, and, with the bytes, ``fp32-over-sent-up`` / ``-down``: the float32 bytes
    over the bytes sent.
    """
    totals: dict[str, int | float] = {"rounds": len(rows), "rounds-applied": sum(int(r["applied"]) for r in rows)}
    for key in TOTALS:
        if rows and all(key in r for r in rows):
            totals[key] = sum(int(r[key]) for r in rows)
    for way in ("up", "down"):
        if f"bytes-{way}" in totals:
            totals[f"fp32-over-sent-{way}"] = totals[f"bytes-{way}-fp32"] / max(totals[f"bytes-{way}"], 1)
    return MetricRecord(totals)


def short_rounds(rows: Sequence[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """The rounds with fewer valid replies than sampled nodes, and why (what :class:`DLionResult` keeps).

    A row short of replies has ``num-replies`` < ``num-sampled``; its reasons are its
    ``num-failed`` ("no reply"; where a strategy reports none, the sampled nodes neither valid
    nor rejected), its ``client-errors`` ("client error") and the rest of its ``num-rejected``
    ("rejected"). Rows without ``num-sampled`` are not counted.
    """
    count, reasons = 0, {"no reply": 0, "client error": 0, "rejected": 0}
    for row in rows:
        sampled, valid = int(row.get("num-sampled", 0)), int(row.get("num-replies", 0))
        if valid >= sampled:
            continue
        count += 1
        rejected, errors = int(row.get("num-rejected", 0)), int(row.get("client-errors", 0))
        reasons["no reply"] += int(row.get("num-failed", max(sampled - valid - rejected, 0)))
        reasons["client error"] += errors
        reasons["rejected"] += max(rejected - errors, 0)
    return count, dict(sorted(((k, v) for k, v in reasons.items() if v), key=lambda kv: -kv[1]))


def short_text(short: int, rounds: int, reasons: dict[str, int]) -> str:
    """What the closing line adds for a run with short rounds ("" for none).

    E.g. ``; 4 of 5 rounds short of replies (fewer valid than sent, result.short_rounds): no reply 6,
    client error 3, rejected 1``.
    """
    if not short:
        return ""
    why = ": " + ", ".join(f"{reason} {count}" for reason, count in reasons.items()) if reasons else ""
    return f"; {short} of {rounds} rounds short of replies (fewer valid than sent, result.short_rounds){why}"
