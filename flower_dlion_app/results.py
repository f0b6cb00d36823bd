"""What a run writes: one row per round in ``results.jsonl``, and ``summary.json`` at the end.

A row holds the round's evaluation (when it was evaluated), the bytes measured on the round's
messages by :class:`~flower_dlion_app.metering.MeteredGrid` (train messages and hellos), and the
fields the strategy itself adds (``strategy.result_row()``: D-Lion's full syncs, catch-ups, ties…).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from flwr.app import MessageType
from flwr.serverapp.strategy import Strategy

from flower_dlion import DistributedLion
from flower_dlion.strategies.run_loop import short_rounds
from flower_dlion_app.metering import MeteredGrid

__all__ = ["Recorder"]


DLION_ROW_KEYS = (
    *("num-rejected", "num-failed", "full-syncs", "catch-ups", "checksum-mismatches", "state-resets"),
    *("applied", "bytes-up-fp32", "bytes-down-fp32", "tie-fraction", "agreement", "coin-flip-fraction"),
)  # D-Lion's round metrics that results.jsonl keeps (docs/USER_GUIDE.md, "The round's metrics")


def strategy_row(strategy: Strategy) -> dict[str, Any]:
    """The strategy's own fields of the last round's row: D-Lion's metrics, a baseline's ``result_row()``."""
    if isinstance(strategy, DistributedLion):
        return {key.replace("-", "_"): strategy.history[-1][key] for key in DLION_ROW_KEYS}
    result_row = getattr(strategy, "result_row", None)  # Flower's own strategies have none
    return {} if result_row is None else result_row()


def fp32_ratios(strategy: Strategy, bytes_up: int, bytes_down: int) -> dict[str, float]:
    """How many times fewer bytes than float32 messages a D-Lion run sent, up and down (others: none)."""
    if not isinstance(strategy, DistributedLion):
        return {}
    return {
        f"fp32_over_sent_{key}": sum(m[f"bytes-{key}-fp32"] for m in strategy.history) / max(sent, 1)
        for key, sent in (("up", bytes_up), ("down", bytes_down))
    }


def _json_number(value: float | int | None) -> float | int | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value


class Recorder:
    """The rows of a run so far, appended to ``results.jsonl`` as each round ends.

    Parameters
    ----------
    out_dir : Path
        The results directory.
    metered : MeteredGrid
        The grid whose exchanges are the bytes of each round.
    rows, evals, elapsed
        From a checkpoint when resuming: the rows so far, the evaluated accuracies by round,
        and the wall and evaluation seconds of the runs before (``{"before": s, "eval": s}``).

    """

    def __init__(
        self,
        out_dir: Path,
        metered: MeteredGrid,
        rows: list[dict[str, Any]] | None = None,
        evals: dict[int, float] | None = None,
        elapsed: dict[str, float] | None = None,
    ) -> None:
        self.path = out_dir / "results.jsonl"
        self.metered = metered
        self.rows = list(rows or [])
        self.evals = dict(evals or {})
        self.elapsed = dict(elapsed or {"before": 0.0, "eval": 0.0})
        self.t_start = time.perf_counter()
        self._seen = len(metered.exchanges)  # exchanges before the current round
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def wall(self) -> float:
        """Seconds of the whole run so far, the runs before a resume included."""
        return self.elapsed["before"] + time.perf_counter() - self.t_start

    def record(
        self, server_round: int, accuracy: float | None, loss: float | None, strategy: Strategy
    ) -> dict[str, Any]:
        """Append round ``server_round``'s row (round 0: the initial model) and return it."""
        if accuracy is not None:
            self.evals[server_round] = accuracy
        row: dict[str, Any] = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "train_loss": None,
            "bytes_up": 0,
            "bytes_down": 0,
            "num_sent": 0,
            "num_replies": 0,
            "num_errors": 0,
        }
        if server_round > 0:
            this_round, self._seen = self.metered.exchanges[self._seen :], len(self.metered.exchanges)
            row["bytes_up"] = sum(e.bytes_up for e in this_round)  # train and hello messages
            row["bytes_down"] = sum(e.bytes_down for e in this_round)
            ex = next((e for e in reversed(this_round) if e.message_type == MessageType.TRAIN), None)
            if ex is not None:  # none: the round sent no train message (e.g. too few nodes could mask)
                row.update(
                    {"train_loss": ex.train_loss, "num_sent": ex.num_sent, "num_replies": ex.num_replies,
                     "num_errors": ex.num_errors}
                )  # fmt: skip
            row.update(strategy_row(strategy))
        row["wall_time_s"] = round(self.wall(), 3)
        row = {k: _json_number(v) for k, v in row.items()}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def summary(
        self,
        strategy: Strategy,
        *,
        name: str,
        eval_set: str,
        num_rounds: int,
        num_parameters: int,
        resumed_from_round: int | None,
        config: dict[str, Any],
        status: str = "completed",
        reason: str | None = None,
        stopped_in_round: int | None = None,
    ) -> dict[str, Any]:
        """The run's totals: accuracy, time, MB up and down, bytes per reply, the strategy's own ratios.

        ``status`` is "completed", "stopped" for a run that could not learn (``reason``: the
        strategy's ``RunStopped`` message, ``stopped_in_round``: its round; both only then), or
        "failed" for a run ended by another error (``reason``: its type and message, ``stopped_in_round``:
        the round in progress).
        """
        exchanges = self.metered.exchanges
        train = [e for e in exchanges if e.message_type == MessageType.TRAIN]
        up, down = sum(e.bytes_up for e in exchanges), sum(e.bytes_down for e in exchanges)
        replies = sum(e.num_replies - e.num_errors for e in train)
        d = num_parameters
        summary: dict[str, Any] = {
            "status": status,
            **({"reason": reason, "stopped_in_round": stopped_in_round} if status != "completed" else {}),
            "strategy": name,
            "eval_set": eval_set,
            "final_accuracy": self.evals.get(num_rounds),
            "best_accuracy": max(self.evals.values(), default=None),
            "rounds": num_rounds,
            "wall_time_s": round(self.wall(), 2),
            "eval_time_s": round(self.elapsed["eval"], 2),
            "num_parameters": d,
            "total_mb_up": up / 1e6,
            "total_mb_down": down / 1e6,
            "bytes_up_per_reply": sum(e.bytes_up for e in train) / max(replies, 1),
            "fp32_model_bytes": 4 * d,
            "resumed_from_round": resumed_from_round,
            "config": config,
        }
        short, why = short_rounds(getattr(strategy, "history", []))  # rounds with fewer valid replies than sent
        summary |= {"short_rounds": short, "short_reasons": why}
        return summary | fp32_ratios(strategy, up, down)
