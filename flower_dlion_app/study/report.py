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
method's mean final (or best) accuracy over its seeds that trained, and fixed targets (several
references, comma-separated: the higher one on each partition). The tables themselves are built in
`flower_dlion_app.study.tables`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flower_dlion_app.study.sweep import load_study
from flower_dlion_app.study.tables import (
    bytes_to_target,
    convergence_table,
    local_steps,
    mean_std,
    ordered,
    results_tables,
    target_table,
    trained,
    tuning_table,
)

__all__ = [
    "bytes_to_target",
    "convergence_table",
    "load_cells",
    "local_steps",
    "main",
    "mean_std",
    "results_tables",
    "target_table",
    "trained",
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


def plot_partition(records: list[dict[str, Any]], study: dict[str, Any], partition: str, path: Path) -> None:
    """Accuracy vs round (top) and vs cumulative bytes per client (bottom, log x), one column per n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = ordered((r["num_clients"] for r in records), study["num-clients"])
    strategies = ordered((r["label"] for r in records), study["strategies"])
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
    reference: str | Sequence[str] | None = None,
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
        grid["strategies"] = ordered({r["label"] for r in extra}, wanted) + own
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
            f"[reached/run, × fewer bytes than {' or '.join([reference] if isinstance(reference, str) else reference)}"
            + (", the higher on each partition" if not isinstance(reference, str) and len(reference) > 1 else "")
            + "])\n"
        )
        parts.append(target_table(extra + records, study["study"], reference, targets, reference_metric))
    for part in ordered((r["partition"] for r in records), study["study"]["partitions"]):
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
    parser.add_argument(
        "--reference",
        help="label(s), comma-separated, whose accuracy is the bytes-to-target table's target (several: the "
        "highest on each partition)",
    )
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
        reference=args.reference.split(",") if args.reference and "," in args.reference else args.reference,
        reference_metric=f"{args.reference_metric}_accuracy",
        targets=[float(t) for t in args.targets.split(",") if t],
        convergence=args.convergence,
        section=args.section,
    )
    print(f"[report] wrote {args.out} and figures in {args.figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
