"""Turn a sweep's cell files into tables (Markdown) and plots (PNG).

Usage::

    python -m flower_dlion.study.report examples/study.toml [--tuning examples/tune.toml]
        [--out docs/RESULTS.md] [--figures docs/figures]

Writes the generated part of ``--out`` between ``<!-- BEGIN GENERATED -->`` and
``<!-- END GENERATED -->`` (text outside the markers is kept, so the written analysis
survives a regeneration), and one PNG per partition into ``--figures``: accuracy vs round
and accuracy vs cumulative bytes per client (log x), one column per number of clients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .sweep import load_study

__all__ = ["load_cells", "main", "mean_std", "results_tables", "tuning_table", "write_report"]

BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def load_cells(study_file: Path) -> list[dict[str, Any]]:
    """The finished cells of a study (cells not run yet are left out).

    Each record gets ``label``: the strategy or variant name the tables and plots show.
    """
    out, cells = load_study(study_file)
    records = []
    for cell in cells:
        path = out / "cells" / f"{cell.name}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            if record.get("key") == cell.key():
                record["label"] = cell.label
                records.append(record)
    return records


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std`` (sample std; just the value for one seed)."""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _group(records: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in keys)].append(r)
    return groups


def _order(values: Iterable[Any], reference: Sequence[Any]) -> list[Any]:
    values = set(values)
    return [v for v in reference if v in values]


def results_tables(records: list[dict[str, Any]], study: dict[str, Any]) -> str:
    """Accuracy tables per partition and a bytes table, as Markdown."""
    strategies = _order((r["label"] for r in records), study["strategies"])
    clients = _order((r["num_clients"] for r in records), study["num-clients"])
    partitions = _order((r["partition"] for r in records), study["partitions"])
    by = _group(records, "label", "partition", "num_clients")
    lines = []
    for metric, title in (("final_accuracy", "Final test accuracy"), ("best_accuracy", "Best test accuracy")):
        lines.append(f"### {title} (mean ± std over seeds; seeds per cell in brackets)\n")
        for part in partitions:
            lines.append(f"**{part}**\n")
            lines.append("| strategy | " + " | ".join(f"n = {n}" for n in clients) + " |")
            lines.append("|---|" + "---|" * len(clients))
            for s in strategies:
                cells = []
                for n in clients:
                    group = by.get((s, part, n), [])
                    vals = [g["summary"][metric] for g in group if g["summary"][metric] is not None]
                    cells.append(f"{mean_std(vals)} [{len(vals)}]" if vals else "–")
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append("### Bytes per client over the whole run (measured on the messages; mean over cells)\n")
    header = " | ".join(f"n = {n}: up / down MB" for n in clients)
    lines.append(f"| strategy | rounds | {header} | up bits / param / round |")
    lines.append("|---|---|" + "---|" * (len(clients) + 1))
    for s in strategies:
        row, bits = [], []
        rounds = sorted({g["summary"]["rounds"] for g in records if g["label"] == s})
        for n in clients:
            group = [g for g in records if g["label"] == s and g["num_clients"] == n]
            if not group:
                row.append("–")
                continue
            up = statistics.mean(g["summary"]["total_mb_up"] / n for g in group)
            down = statistics.mean(g["summary"]["total_mb_down"] / n for g in group)
            row.append(f"{up:.2f} / {down:.2f}")
            bits += [8 * g["summary"]["bytes_up_per_reply"] / g["summary"]["num_parameters"] for g in group]
        lines.append(
            f"| {s} | {', '.join(map(str, rounds))} | " + " | ".join(row) + f" | {statistics.mean(bits):.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


def tuning_table(records: list[dict[str, Any]], swept: str = "lr") -> str:
    """One row per strategy: the validation accuracy at each value of the swept key; the best in bold."""
    lines = ["| strategy | " + f"{swept}: validation accuracy (best in bold) |", "|---|---|"]
    for s, group in _group(records, "label").items():
        group = sorted(group, key=lambda g: g["run_config"][swept])
        best = max(g["summary"]["final_accuracy"] for g in group)
        cells = []
        for g in group:
            text = f"{g['run_config'][swept]:g}: {g['summary']['final_accuracy']:.4f}"
            cells.append(f"**{text}**" if g["summary"]["final_accuracy"] == best else text)
        lines.append(f"| {s[0]} | " + ", ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_partition(records: list[dict[str, Any]], study: dict[str, Any], partition: str, path: Path) -> None:
    """Accuracy vs round (top) and vs cumulative bytes per client (bottom, log x), one column per n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = _order((r["num_clients"] for r in records), study["num-clients"])
    strategies = _order((r["label"] for r in records), study["strategies"])
    fig, axes = plt.subplots(2, len(clients), figsize=(4 * len(clients), 7), squeeze=False)
    colors = {s: f"C{i}" for i, s in enumerate(study["strategies"])}
    for j, n in enumerate(clients):
        for s in strategies:
            group = [r for r in records if r["partition"] == partition and r["num_clients"] == n and r["label"] == s]
            for k, r in enumerate(sorted(group, key=lambda g: g["seed"])):
                ev = r["evals"]
                kw = {"color": colors[s], "alpha": 0.9 if k == 0 else 0.4, "label": s if k == 0 else None}
                axes[0][j].plot([e["round"] for e in ev], [e["accuracy"] for e in ev], marker=".", **kw)
                per_client = [(e["cum_bytes_up"] + e["cum_bytes_down"]) / n for e in ev]
                axes[1][j].plot(per_client[1:], [e["accuracy"] for e in ev][1:], marker=".", **kw)
        axes[0][j].set_title(f"{partition}, n = {n}")
        axes[0][j].set_xlabel("round")
        axes[1][j].set_xlabel("cumulative bytes per client (up + down)")
        axes[1][j].set_xscale("log")
        for i in range(2):
            axes[i][j].set_ylabel("test accuracy")
            axes[i][j].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(study_file: Path, out: Path, figures: Path, tuning_file: Path | None = None, command: str = "") -> str:
    """Generate tables and plots for a study; write them into ``out``; return the generated text."""
    import tomllib

    study = tomllib.loads(study_file.read_text())
    records = load_cells(study_file)
    _, cells = load_study(study_file)
    rounds = {
        s: sorted({c.run_config.get("num-server-rounds", 200) for c in cells if c.label == s})
        for s in study["study"]["strategies"]
    }
    parts = [
        BEGIN,
        f"Generated by `{command or 'python -m flower_dlion.study.report ' + str(study_file)}` from "
        f"{len(records)} of {len(cells)} cells of `{study_file}` (budget: "
        + ", ".join(f"{s} {'/'.join(map(str, r))} rounds" for s, r in rounds.items())
        + f"; seeds {study['study']['seeds']}"
        + "".join(f", n = {n}: seeds {v}" for n, v in study["study"].get("seeds-by-clients", {}).items())
        + "; Fashion-MNIST test set).\n",
        results_tables(records, study["study"]),
    ]
    for part in _order((r["partition"] for r in records), study["study"]["partitions"]):
        path = figures / f"{study_file.stem}-{part}.png"
        plot_partition(records, study["study"], part, path)
        rel = Path("figures") / path.name if figures.parent == out.parent else path
        parts.append(f"![{part}]({rel.as_posix()})\n")
    if tuning_file is not None:
        parts.append(f"### Tuning (`{tuning_file}`)\n")
        parts.append(tuning_table(load_cells(tuning_file)))
    parts.append(END)
    generated = "\n".join(parts)
    text = out.read_text() if out.is_file() else "# Results\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + generated + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + generated + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return generated


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("--tuning", type=Path, help="tuning study file, reported as one table")
    parser.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"))
    parser.add_argument("--figures", type=Path, default=Path("docs/figures"))
    args = parser.parse_args(argv)
    command = "python -m flower_dlion.study.report " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(args.study, args.out, args.figures, args.tuning, command)
    print(f"[report] wrote {args.out} and figures in {args.figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
