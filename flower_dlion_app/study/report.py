"""Turn a sweep's cell files into tables (Markdown) and plots (PNG).

Usage::

    python -m flower_dlion_app.study.report my-study.toml        # -> <out>/report.md and <out>/figures/
    python -m flower_dlion_app.study.report examples/studies/study.toml --tuning examples/studies/tune.toml \
        --out docs/RESULTS.md --figures docs/figures
    python -m flower_dlion_app.study.report examples/studies/beyond.toml --baselines examples/studies/study.toml \
        --reference fedavg-lr0.03 --section beyond --out docs/RESULTS.md --figures docs/figures

By default everything goes into the study's own output folder (its ``out``): ``<out>/report.md``
and ``<out>/figures/``; the repository's documents are written only when named (``--out``,
``--figures``). Writes the generated part of ``--out`` between ``<!-- BEGIN GENERATED -->`` and
``<!-- END GENERATED -->`` (``<!-- BEGIN GENERATED name -->`` … with ``--section name``;
text outside the markers is kept, so the written analysis survives a regeneration), and one
PNG per partition into ``--figures`` (`flower_dlion_app.study.plots`: each method's mean over
its seeds with a min–max band, against the round and against the cumulative MB per client, up +
down, log x; one column per number of clients), linked from the Markdown by a path relative to it.

``--baselines`` adds the cells of another study that match this one's clients, partitions
and seeds; ``--reference`` adds a table of the bytes each method needs to reach that
method's mean final (or best) accuracy over its seeds that trained, and fixed targets (several
references, comma-separated: the higher one on each partition). The tables themselves are built in
`flower_dlion_app.study.tables`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flower_dlion_app.study.coverage import describe
from flower_dlion_app.study.plots import plot_partition
from flower_dlion_app.study.studyfile import StudyError, cell_matches, load_study
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
    "build_parser",
    "bytes_to_target",
    "convergence_table",
    "default_outputs",
    "load_cells",
    "local_steps",
    "main",
    "mean_std",
    "plot_partition",
    "results_tables",
    "setup_notes",
    "target_table",
    "trained",
    "tuning_table",
    "write_report",
    "write_section",
]

BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def load_cells(study_file: Path) -> list[dict[str, Any]]:
    """The finished cells of a study (cells not run yet are left out).

    A cell file counts if the sweep would skip it (`flower_dlion_app.study.studyfile.cell_matches`: the same
    run config and thread count). Each record gets ``label``: the strategy or variant name the tables and
    plots show.
    """
    out, cells = load_study(study_file)
    records = []
    for cell in cells:
        path = out / "cells" / f"{cell.name}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            if cell_matches(record, cell):
                record["label"] = cell.label
                records.append(record)
    return records


def default_outputs(study_file: Path) -> tuple[Path, Path]:
    """Where a report goes unless told: ``<out>/report.md`` and ``<out>/figures``, ``out`` the study's own folder."""
    out, _ = load_study(study_file)
    return out / "report.md", out / "figures"


def _link(target: Path, markdown: Path) -> str:
    """``target``'s path relative to the folder of the Markdown file that links it, with forward slashes."""
    return Path(os.path.relpath(target.resolve(), markdown.resolve().parent)).as_posix()


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
        *([notes] if (notes := setup_notes(extra + records)) else []),  # none for cells from before they existed
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
        parts.append(f"![{part}]({_link(path, out)})\n")
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


def setup_notes(records: Sequence[dict[str, Any]]) -> str:
    """What the cells recorded about how they were set up: torch threads, and partitions that left data out.

    Cells written before these were recorded (no ``threads``, no ``partition_check``) are counted as such;
    when no cell recorded either, the result is empty.
    """
    threads: dict[int, int] = {}
    for r in records:
        if "threads" in r:
            threads[r["threads"]] = threads.get(r["threads"], 0) + 1
    checked = [r for r in records if r.get("partition_check")]
    if not threads and not checked:
        return ""
    lines = []
    if threads:
        counts = "; ".join(f"{t} in {k} cells" for t, k in sorted(threads.items()))
        unrecorded = len(records) - sum(threads.values())
        lines.append(
            f"torch CPU threads per cell: {counts}" + (f"; not recorded in {unrecorded}" if unrecorded else "") + "."
        )
    if checked:
        if lines:
            lines.append("")  # a paragraph of its own
        short = {}
        for r in checked:
            what = describe(r["partition_check"])
            if what:
                short.setdefault((r["partition"], r["num_clients"], r["seed"], what), []).append(r["name"])
        unchecked = len(records) - len(checked)
        tail = f" ({unchecked} cells ran before partitions were checked)" if unchecked else ""
        if not short:
            lines.append(f"Every checked cell's partitions gave each client data and each class a client{tail}.")
        else:
            lines.append(f"Partitions that left data out, as recorded when each cell was set up{tail}:")
            for (part, n, seed, what), names in sorted(short.items()):
                cells = ", ".join(f"`{name}`" for name in sorted(names))
                lines.append(f"- {part}, n = {n}, seed {seed}: {what} ({len(names)} cells: {cells})")
    return "\n".join(lines) + "\n"


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


def _accuracies(text: str) -> list[float]:
    """``--targets``: comma-separated accuracies in [0, 1]."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = [-1.0]
    if not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated accuracies in [0, 1], e.g. 0.75,0.8")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every option with its help text)."""
    parser = argparse.ArgumentParser(
        prog="python -m flower_dlion_app.study.report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("study", type=Path, help="the study file (TOML) whose cells are reported")
    parser.add_argument(
        "--tuning", type=Path, help="a tuning study file, reported as one more table (its best value in bold)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FILE.md",
        help="the Markdown file to write the generated section into (created if missing; the text outside the "
        "section's markers is kept); default: report.md in the study's own output folder (its [study] out). The "
        "repository's results go into docs/RESULTS.md only when named here",
    )
    parser.add_argument(
        "--figures",
        type=Path,
        metavar="FOLDER",
        help="the folder for the PNG figures (one per partition, named <study>-<partition>.png; the Markdown links "
        "them relative to --out's folder); default: figures/ in the study's own output folder",
    )
    parser.add_argument(
        "--baselines",
        type=Path,
        help="another study file whose cells at this study's clients, partitions and seeds are shown too",
    )
    parser.add_argument(
        "--baseline-labels", default="", help="comma-separated labels of --baselines to show (default: all)"
    )
    parser.add_argument(
        "--reference",
        help="label(s), comma-separated, whose accuracy is the bytes-to-target table's target (several: the "
        "highest on each partition); without it, no such table",
    )
    parser.add_argument(
        "--reference-metric",
        choices=("final", "best"),
        default="final",
        help="the reference's accuracy that is the target: its mean final (default) or mean best accuracy",
    )
    parser.add_argument(
        "--targets",
        type=_accuracies,
        default="0.75,0.8",
        help="fixed target accuracies of the bytes-to-target table, comma-separated (default: 0.75,0.8)",
    )
    parser.add_argument(
        "--convergence", action="store_true", help="add the table of best accuracy, round of best and late gain"
    )
    parser.add_argument(
        "--section",
        default="",
        help="name of the generated section: its own markers <!-- BEGIN GENERATED name --> … in --out, so several "
        "reports share one file (default: the unnamed section)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = "python -m flower_dlion_app.study.report " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        out, figures = default_outputs(args.study)
        out, figures = args.out or out, args.figures or figures
        write_report(
            args.study,
            out,
            figures,
            args.tuning,
            command,
            baselines=args.baselines,
            baseline_labels=[label for label in args.baseline_labels.split(",") if label],
            reference=args.reference.split(",") if args.reference and "," in args.reference else args.reference,
            reference_metric=f"{args.reference_metric}_accuracy",
            targets=args.targets,
            convergence=args.convergence,
            section=args.section,
        )
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[report] wrote {out} and figures in {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
