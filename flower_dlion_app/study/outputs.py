"""What a sweep cell writes besides its JSON file, and how its log lines name it.

* ``<out>/cells/<name>.csv``: the cell's metrics at every round, one row per round (round 0 is the
  untrained model), from the run's ``results.jsonl``: the cell's identity (``cell``, ``label``,
  ``strategy``, ``partition``, ``num_clients``, ``seed``), then ``round``, ``accuracy``, ``loss``
  (on the evaluation set; empty in rounds that were not evaluated), ``train_loss``,
  ``bytes_up`` / ``bytes_down`` (that round's bytes, all clients together), ``cum_bytes_up`` /
  ``cum_bytes_down`` (cumulative, all clients together), ``wall_time_s``, then every further
  metric the strategy records (``num_replies``, ``tie_fraction``, …) in the order it first
  appears. Every cell's CSV has the identity columns, so a study's CSVs concatenate into one
  table (``pandas.concat(map(pandas.read_csv, glob("<out>/cells/*.csv")))``).
* `cell_logging`: while a cell runs, every log line (Flower's, this package's, Python warnings)
  starts with ``[<cell name>]``, so the interleaved output of parallel workers can be told apart.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["CSV_COLUMNS", "CellLogFilter", "cell_logging", "round_rows", "write_rounds_csv"]

IDENTITY = ("cell", "label", "strategy", "partition", "num_clients", "seed")
CSV_COLUMNS = (
    *IDENTITY,
    "round",
    "accuracy",
    "loss",
    "train_loss",
    "bytes_up",
    "bytes_down",
    "cum_bytes_up",
    "cum_bytes_down",
    "wall_time_s",
)


def round_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results.jsonl``'s rows with the cumulative bytes (``cum_bytes_up``, ``cum_bytes_down``) added."""
    rows, up, down = [], 0, 0
    for row in results:
        up += row["bytes_up"]
        down += row["bytes_down"]
        rows.append({**row, "cum_bytes_up": up, "cum_bytes_down": down})
    return rows


def _cell_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)  # repr: a float's every bit


def write_rounds_csv(path: Path, identity: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write one cell's per-round CSV (the module docstring lists the columns) atomically.

    Parameters
    ----------
    path : Path
        The CSV file, ``<out>/cells/<name>.csv``.
    identity : dict
        The values of the identity columns (``cell``, ``label``, …), repeated on every row.
    rows : list of dict
        `round_rows` of the run.

    """
    extra: list[str] = []
    for row in rows:
        extra += [k for k in row if k not in CSV_COLUMNS and k not in extra]
    columns = [*CSV_COLUMNS, *extra]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        values = {**row, **identity}
        writer.writerow([_cell_text(values.get(c)) for c in columns])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buffer.getvalue())
    os.replace(tmp, path)


class CellLogFilter(logging.Filter):
    """Prefix every record that passes with ``[<cell>] `` (once, however many handlers it meets)."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        self.cell = cell

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the prefix and the ``cell`` attribute (for formats that use ``%(cell)s``); keep the record."""
        if getattr(record, "cell", None) is None:
            record.cell = self.cell
            record.msg = f"[{self.cell}] {record.msg}"
        return True


def _handlers() -> list[logging.Handler]:
    """Every handler a record can reach: the root's, every named logger's, and logging's last resort."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values())]
    found: list[logging.Handler] = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):  # placeholders have no handlers
            if handler not in found:
                found.append(handler)
    if logging.lastResort is not None and logging.lastResort not in found:
        found.append(logging.lastResort)
    return found


@contextlib.contextmanager
def cell_logging(cell: str) -> Iterator[None]:
    """While inside, log lines and Python warnings start with ``[<cell>]``; everything is restored after.

    Parameters
    ----------
    cell : str
        The cell's name.

    """
    log_filter = CellLogFilter(cell)
    handlers = _handlers()
    for handler in handlers:
        handler.addFilter(log_filter)
    captured = getattr(warnings.showwarning, "__module__", "") == "logging"  # already sent to logging
    if not captured:
        logging.captureWarnings(True)  # warnings (e.g. flwr-datasets') become log records: prefixed too
    try:
        yield
    finally:
        if not captured:
            logging.captureWarnings(False)
        for handler in handlers:
            handler.removeFilter(log_filter)
