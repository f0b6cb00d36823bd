"""Turn a sweep's cell files into tables (Markdown) and plots (PNG).

Usage::

    python -m flower_dlion_app.study.report examples/studies/study.toml [--tuning examples/studies/tune.toml]
        [--out docs/RESULTS.md] [--figures docs/figures]
    python -m flower_dlion_app.study.report examples/studies/beyond.toml --baselines examples/studies/study.toml \
        --reference fedavg-lr0.03 --section beyond

Writes the generated part of ``--out`` between ``<!-- BEGIN GENERATED -->`` and
``<!-- END GENERATED -->`` (``<!-- BEGIN GENERATED name -->`` … with ``--section name``;
text outside the markers is kept, so the written analysis survives a regeneration), and one
PNG per partition into ``--figures``: accuracy vs round and accuracy vs cumulative bytes per
client (log x), one column per number of clients.

``--baselines`` adds the cells of another study that match this one's clients, partitions
and seeds; ``--reference`` adds a table of the bytes each method needs to reach that
method's mean final accuracy (and fixed targets).
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

from flower_dlion_app.study.sweep import load_study

__all__ = [
    "bytes_to_target",
    "convergence_table",
    "load_cells",
    "main",
    "mean_std",
    "results_tables",
    "target_table",
    "tuning_table",
    "write_report",
    "write_section",
]

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
    """One row per strategy: the validation accuracy at each value of its swept key; the best in bold.

    The swept key is the one whose value differs between a strategy's cells (``swept`` if none does).
    """
    lines = ["| strategy | swept key: validation accuracy (best in bold) |", "|---|---|"]
    for s, group in _group(records, "label").items():
        varying = sorted(k for k in group[0]["run_config"] if len({repr(g["run_config"].get(k)) for g in group}) > 1)
        key = varying[0] if varying else swept
        group = sorted(group, key=lambda g: g["run_config"][key])
        best = max(g["summary"]["final_accuracy"] for g in group)
        cells = []
        for g in group:
            text = f"{g['run_config'][key]:g}: {g['summary']['final_accuracy']:.4f}"
            cells.append(f"**{text}**" if g["summary"]["final_accuracy"] == best else text)
        lines.append(f"| {s[0]} | {key} " + ", ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def convergence_table(records: list[dict[str, Any]], study: dict[str, Any], last: int = 10) -> str:
    """Per partition and method: best accuracy, the round it came in, and what the last rounds added.

    "gain in the last ``last`` rounds" is the best accuracy minus the best before those rounds
    (mean over seeds): close to 0 means the run had stopped improving.
    """
    lines = []
    for part in _order((r["partition"] for r in records), study["partitions"]):
        lines.append(f"**{part}**\n")
        lines.append(f"| method | rounds | best accuracy | round of best (per seed) | gain in the last {last} rounds |")
        lines.append("|---|---|---|---|---|")
        for s in _order((r["label"] for r in records), study["strategies"]):
            group = sorted((r for r in records if r["label"] == s and r["partition"] == part), key=lambda r: r["seed"])
            if not group:
                continue
            best, at, gain = [], [], []
            for r in group:
                ev = [e for e in r["evals"] if e["accuracy"] is not None and e["round"] > 0]
                top = max(ev, key=lambda e: e["accuracy"])
                cut = r["summary"]["rounds"] - last
                before = [e["accuracy"] for e in ev if e["round"] <= cut]
                best.append(top["accuracy"])
                at.append(str(top["round"]))
                if before:
                    gain.append(top["accuracy"] - max(before))
            rounds = r["summary"]["rounds"]
            lines.append(f"| {s} | {rounds} | {mean_std(best)} | {', '.join(at)} | {mean_std(gain) if gain else '–'} |")
        lines.append("")
    return "\n".join(lines)


def bytes_to_target(record: dict[str, Any], target: float) -> float | None:
    """Bytes per client (up + down, measured) when the run first evaluated at ≥ ``target``."""
    for e in record["evals"]:
        if e["accuracy"] is not None and e["accuracy"] >= target:
            return (e["cum_bytes_up"] + e["cum_bytes_down"]) / record["num_clients"]
    return None


def target_table(
    records: list[dict[str, Any]],
    study: dict[str, Any],
    reference: str,
    fixed: Sequence[float] = (0.75, 0.8),
    metric: str = "final_accuracy",
) -> str:
    """Per partition: MB per client to reach the reference's mean ``metric`` (final or best accuracy) and fixed targets.

    With several reference seeds, its mean minus one standard deviation (the low end of its
    seed spread) is a target too.

    A method's entry is the mean over the seeds that reached the target, with how many did,
    and the reference's bytes divided by it (× fewer bytes than the reference).
    """
    strategies = _order((r["label"] for r in records), study["strategies"])
    lines = []
    for part in _order((r["partition"] for r in records), study["partitions"]):
        ref = [r for r in records if r["label"] == reference and r["partition"] == part]
        if not ref:
            continue
        ref_values = [r["summary"][metric] for r in ref]
        ref_acc = statistics.mean(ref_values)
        sd = statistics.stdev(ref_values) if len(ref_values) > 1 else 0.0
        spread = [ref_acc - sd] if sd > 0.0005 else []  # the low end of its seed spread
        targets = [ref_acc, *spread, *[t for t in fixed if abs(t - ref_acc) > 0.005]]
        ref_final = mean_std([r["summary"][metric] for r in ref])
        what = metric.replace("_", " ")
        lines.append(f"**{part}** ({reference} {what} {ref_final})\n")
        names = [f" ({reference})", " (its mean − 1 std)" if spread else ""]
        heads = [f"to {t:.3f}" + (names[i] if i < 2 else "") for i, t in enumerate(targets)]
        lines.append("| method | " + " | ".join(f"MB / client {h}" for h in heads) + " |")
        lines.append("|---|" + "---|" * len(targets))
        ref_mb = {}
        for t in targets:
            hits = [b for b in (bytes_to_target(r, t) for r in ref) if b is not None]
            ref_mb[t] = statistics.mean(hits) / 1e6 if hits else None
        for s in strategies:
            group = [r for r in records if r["label"] == s and r["partition"] == part]
            if not group:
                continue
            row = []
            for t in targets:
                hits = [b for b in (bytes_to_target(r, t) for r in group) if b is not None]
                if not hits:
                    row.append(f"– [0/{len(group)}]")
                    continue
                mb = statistics.mean(hits) / 1e6
                ratio = f", {ref_mb[t] / mb:.1f}×" if ref_mb[t] and s != reference else ""
                row.append(f"{mb:.2f} [{len(hits)}/{len(group)}{ratio}]")
            lines.append(f"| {s} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_partition(records: list[dict[str, Any]], study: dict[str, Any], partition: str, path: Path) -> None:
    """Accuracy vs round (top) and vs cumulative bytes per client (bottom, log x), one column per n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = _order((r["num_clients"] for r in records), study["num-clients"])
    strategies = _order((r["label"] for r in records), study["strategies"])
    fig, axes = plt.subplots(2, len(clients), figsize=(max(4 * len(clients), 8), 7), squeeze=False)
    palette = plt.get_cmap("tab20").colors if len(study["strategies"]) > 10 else [f"C{i}" for i in range(10)]
    colors = {s: palette[i % len(palette)] for i, s in enumerate(study["strategies"])}
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


def write_report(
    study_file: Path,
    out: Path,
    figures: Path,
    tuning_file: Path | None = None,
    command: str = "",
    *,
    baselines: Path | None = None,
    baseline_labels: Sequence[str] = (),
    reference: str | None = None,
    reference_metric: str = "final_accuracy",
    targets: Sequence[float] = (0.75, 0.8),
    convergence: bool = False,
    section: str = "",
) -> str:
    """Generate tables and plots for a study; write them into ``out``; return the generated text."""
    import tomllib

    study = tomllib.loads(study_file.read_text())
    records = load_cells(study_file)
    _, cells = load_study(study_file)
    own = list(study["study"]["strategies"])
    rounds = {s: sorted({c.run_config.get("num-server-rounds", 200) for c in cells if c.label == s}) for s in own}
    extra: list[dict[str, Any]] = []
    if baselines is not None:  # the other study's cells at this study's clients, partitions and seeds
        grid = study["study"]
        wanted = baseline_labels or tomllib.loads(baselines.read_text())["study"]["strategies"]
        extra = [
            r
            for r in load_cells(baselines)
            if r["label"] in wanted
            and r["num_clients"] in grid["num-clients"]
            and r["partition"] in grid["partitions"]
            and r["seed"] in grid["seeds"]
        ]
        grid["strategies"] = _order({r["label"] for r in extra}, wanted) + own
    begin, end = (BEGIN, END)
    if section:
        begin, end = markers(section)
    parts = [
        begin,
        f"Generated by `{command or 'python -m flower_dlion_app.study.report ' + str(study_file)}` from "
        f"{len(records)} of {len(cells)} cells of `{study_file}` (budget: "
        + ", ".join(f"{s} {'/'.join(map(str, r))} rounds" for s, r in rounds.items())
        + f"; seeds {study['study']['seeds']}"
        + "".join(f", n = {n}: seeds {v}" for n, v in study["study"].get("seeds-by-clients", {}).items())
        + "; Fashion-MNIST test set"
        + (f"; with the {len(extra)} matching cells of `{baselines}`" if baselines is not None else "")
        + ").\n",
        where_ran(extra + records),
        results_tables(extra + records, study["study"]),
    ]
    if convergence:
        parts.append("### Convergence: the best accuracy, when it came, and what the last 10 rounds added\n")
        parts.append(convergence_table(extra + records, study["study"]))
    if reference is not None:
        parts.append(
            "### Bytes per client to reach a target accuracy (mean over the seeds that reached it "
            f"[reached/run, × fewer bytes than {reference}])\n"
        )
        parts.append(target_table(extra + records, study["study"], reference, targets, reference_metric))
    for part in _order((r["partition"] for r in records), study["study"]["partitions"]):
        path = figures / f"{study_file.stem}-{part}.png"
        plot_partition(extra + records, study["study"], part, path)
        rel = Path("figures") / path.name if figures.parent == out.parent else path
        parts.append(f"![{part}]({rel.as_posix()})\n")
    if tuning_file is not None:
        parts.append(f"### Tuning (`{tuning_file}`)\n")
        parts.append(tuning_table(load_cells(tuning_file)))
    parts.append(end)
    generated = "\n".join(parts)
    write_section(out, begin, end, generated)
    return generated


def where_ran(records: Sequence[dict[str, Any]]) -> str:
    """One line saying where the cells' clients trained, naming every cell that did not train on the CPU.

    Cells written before the sweep recorded it (no ``ran_on``) trained on the CPU: no GPU was used before.
    """
    places: dict[str, list[str]] = {}
    for r in records:
        places.setdefault(r.get("ran_on", "cpu").split(",")[0], []).append(r["name"])
    cpu = len(places.pop("cpu", []))
    text = f"Clients trained on the CPU in {cpu} of {len(records)} cells"
    for where, names in sorted(places.items()):
        text += f"; on {where} in {len(names)}: " + ", ".join(f"`{n}`" for n in sorted(names))
    return text + ".\n"


def markers(section: str) -> tuple[str, str]:
    """The begin and end markers of the generated section ``section``."""
    return f"<!-- BEGIN GENERATED {section} -->", f"<!-- END GENERATED {section} -->"


def publish(out: Path, section: str, parts: Sequence[str]) -> str:
    """Write ``parts`` as the generated section ``section`` of ``out``, print and return it."""
    begin, end = markers(section)
    text = "\n".join([begin, *parts, end])
    write_section(out, begin, end, text)
    print(text)
    return text


def write_section(out: Path, begin: str, end: str, generated: str) -> None:
    """Put ``generated`` (which starts with ``begin`` and ends with ``end``) into ``out``, replacing the old one."""
    text = out.read_text() if out.is_file() else "# Results\n\n" + begin + "\n" + end + "\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + generated + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + generated + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("--tuning", type=Path, help="tuning study file, reported as one table")
    parser.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"))
    parser.add_argument("--figures", type=Path, default=Path("docs/figures"))
    parser.add_argument("--baselines", type=Path, help="another study whose matching cells are shown too")
    parser.add_argument(
        "--baseline-labels", default="", help="comma-separated labels of --baselines to show (default: all)"
    )
    parser.add_argument("--reference", help="label whose final accuracy is the bytes-to-target table's target")
    parser.add_argument(
        "--reference-metric",
        choices=("final", "best"),
        default="final",
        help="the reference's accuracy that is the target: its mean final (default) or mean best accuracy",
    )
    parser.add_argument("--targets", default="0.75,0.8", help="fixed target accuracies (comma-separated)")
    parser.add_argument("--convergence", action="store_true", help="add the best-accuracy / round-of-best table")
    parser.add_argument("--section", default="", help="name of the generated section (its own markers)")
    args = parser.parse_args(argv)
    command = "python -m flower_dlion_app.study.report " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(
        args.study,
        args.out,
        args.figures,
        args.tuning,
        command,
        baselines=args.baselines,
        baseline_labels=[label for label in args.baseline_labels.split(",") if label],
        reference=args.reference,
        reference_metric=f"{args.reference_metric}_accuracy",
        targets=[float(t) for t in args.targets.split(",") if t],
        convergence=args.convergence,
        section=args.section,
    )
    print(f"[report] wrote {args.out} and figures in {args.figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
