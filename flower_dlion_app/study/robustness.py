r"""Tables for the fault studies: final accuracy per method against one swept run-config key.

Usage::

    python -m flower_dlion_app.study.robustness examples/studies/byzantine.toml --key byzantine-fraction \
        --section byzantine --out docs/RESULTS.md
    python -m flower_dlion_app.study.robustness examples/studies/faults.toml --key fail-fraction --section faults \
        --target 0.8 --out docs/RESULTS.md

One row per method (strategy or variant), one column per value of ``--key``; each entry is
the final test accuracy, mean ± standard deviation over the seeds run, with ``--bytes`` the
MB per client (up + down) of the whole run, and with
``--target`` the first evaluated round at or above it (mean over the seeds that reached
it, reached/run) and the MB per client (up + down) spent by then. The table goes into
``--out`` between ``<!-- BEGIN GENERATED <section> -->`` and ``<!-- END GENERATED <section> -->``;
without ``--out``, into ``<out>/report.md`` of the study's own output folder (the repository's
docs/RESULTS.md only when named: ``--out docs/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from flower_dlion_app.study.report import load_cells, publish

__all__ = ["build_parser", "main", "robustness_table"]


def _mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def robustness_table(
    records: list[dict[str, Any]], key: str, labels: list[str], target: float | None, *, with_bytes: bool = False
) -> str:
    """The markdown table (see the module docstring); ``with_bytes``: each entry's MB per client, up + down."""
    values = sorted({r["run_config"].get(key, 0.0) for r in records})
    header = "| method | " + " | ".join(f"{key} = {v:g}" if isinstance(v, float) else f"{key} = {v}" for v in values)
    header += " |"
    lines = [header, "|---|" + "---|" * len(values)]
    for label in labels:
        entries = []
        for v in values:
            cells = [r for r in records if r["label"] == label and r["run_config"].get(key, 0.0) == v]
            text = _mean_std([r["summary"]["final_accuracy"] for r in cells])
            if with_bytes and cells:
                mb = statistics.mean(
                    (r["summary"]["total_mb_up"] + r["summary"]["total_mb_down"]) / r["num_clients"] for r in cells
                )
                text += f" ({mb:.1f} MB)"
            if target is not None and cells:
                hits = [next((e for e in r["evals"] if e["accuracy"] >= target), None) for r in cells]
                reached = [(h, r) for h, r in zip(hits, cells, strict=True) if h is not None]
                if reached:
                    rnd = statistics.mean(h["round"] for h, _ in reached)
                    mb = statistics.mean(
                        (h["cum_bytes_up"] + h["cum_bytes_down"]) / r["num_clients"] for h, r in reached
                    )
                    text += f"; ≥ {target:g} at round {rnd:.0f}, {mb / 1e6:.1f} MB/client [{len(reached)}/{len(cells)}]"
                else:
                    text += f"; never ≥ {target:g} [0/{len(cells)}]"
            entries.append(text)
        lines.append(f"| {label} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every option with its help text)."""
    parser = argparse.ArgumentParser(
        prog="python -m flower_dlion_app.study.robustness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("study", type=Path, help="the study file (TOML) whose cells are tabulated")
    parser.add_argument("--key", required=True, help="the swept run-config key (the table's columns)")
    parser.add_argument("--section", required=True, help="name of the generated section in --out")
    parser.add_argument("--target", type=float, default=None, help="also report the first round at this accuracy")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FILE.md",
        help="the Markdown file to write the section into (created if missing; the text outside the section's "
        "markers is kept); default: report.md in the study's own output folder (its [study] out). The repository's "
        "results go into docs/RESULTS.md only when named here",
    )
    parser.add_argument(
        "--bytes", action="store_true", help="also each entry's MB per client, up + down (1 MB = 10⁶ bytes)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import tomllib

    from flower_dlion_app.study.studyfile import StudyError, load_study

    try:
        out = args.out or load_study(args.study)[0] / "report.md"
        records = load_cells(args.study)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    labels = list(tomllib.loads(args.study.read_text())["study"]["strategies"])
    command = "python -m flower_dlion_app.study.robustness " + " ".join(argv if argv is not None else sys.argv[1:])
    seeds = sorted({r["seed"] for r in records})
    header = (
        f"Generated by `{command}` from {len(records)} cells of `{args.study}` "
        f"(seeds {seeds}; final Fashion-MNIST test accuracy"
        + ("; in brackets: MB per client over the whole run, up + down" if args.bytes else "")
        + ").\n"
    )
    table = robustness_table(records, args.key, labels, args.target, with_bytes=args.bytes)
    publish(out, args.section, [header, table])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
