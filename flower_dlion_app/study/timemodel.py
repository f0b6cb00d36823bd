r"""Time to accuracy under a bandwidth model, from a study's measured bytes and compute (issue 4, item 5).

Usage::

    python -m flower_dlion_app.study.timemodel examples/studies/study.toml examples/studies/beyond.toml \
        --labels dlion-vote,global-adamw,fedavg-lr0.03,ef-sign-k40 --clients 8 --partition dirichlet-0.5 \
        --target 0.8 --section time-model --out docs/PERFORMANCE.md --figure docs/figures/time-model.png

Without ``--out`` and ``--figure`` the section and the plot go into the first study's own output
folder (``<out>/report.md``, ``<out>/figures/time-model.png``), never into the repository's docs.

The model: the clients of a round work in parallel, each on its own link, and a round ends
when the average client has downloaded what the server sent it, computed, and uploaded its
reply. After round r, with the cell's measured totals over all n clients::

    T(r) = C(r) / n  +  8 · down(r) / (n · B_down)  +  8 · up(r) / (n · B_up)  +  r · RTT

where down(r), up(r) are the cumulative bytes measured on the messages (``results.jsonl``),
C(r) the cumulative wall time of the in-process run without its evaluations (its clients ran
one after another on this 2-core machine, so C(r)/n is the compute of one client plus 1/n of
the server's), B the link speeds in bit/s and RTT one round trip per round. Profiles:
``edge`` (10 Mbit/s down, 10 Mbit/s up, 50 ms) and ``datacenter`` (1 Gbit/s, 1 Gbit/s, 0.5 ms);
both are assumptions, only bytes and compute are measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from flower_dlion_app.study.report import load_cells, publish

__all__ = ["PROFILES", "build_parser", "main", "modelled_times"]

PROFILES = {"edge": (10e6, 10e6, 0.05), "datacenter": (1e9, 1e9, 0.0005)}  # down, up bit/s; RTT s


def modelled_times(record: dict[str, Any], down_bps: float, up_bps: float, rtt: float) -> list[tuple[float, float]]:
    """(modelled seconds, accuracy) at each evaluated round of one cell."""
    n = record["num_clients"]
    evals = record["evals"]
    per_eval = record["summary"]["eval_time_s"] / max(len(evals), 1)
    out = []
    for i, e in enumerate(evals):
        compute = max(e["wall_time_s"] - per_eval * (i + 1), 0.0)  # minus the evaluations so far
        comm = 8 * e["cum_bytes_down"] / (n * down_bps) + 8 * e["cum_bytes_up"] / (n * up_bps)
        out.append((compute / n + comm + e["round"] * rtt, e["accuracy"]))
    return out


def _mb_per_client(record: dict[str, Any]) -> float:
    last = record["evals"][-1]
    return (last["cum_bytes_up"] + last["cum_bytes_down"]) / record["num_clients"] / 1e6


def _time_to(points: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in points if acc >= target), None)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every option with its help text)."""
    parser = argparse.ArgumentParser(
        prog="python -m flower_dlion_app.study.timemodel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("studies", type=Path, nargs="+", help="the study files (TOML) whose cells are modelled")
    parser.add_argument("--labels", required=True, help="comma-separated methods (strategies or variants)")
    parser.add_argument("--clients", type=int, required=True, help="the cells' number of clients")
    parser.add_argument("--partition", required=True, help="the cells' partition, e.g. dirichlet-0.5")
    parser.add_argument(
        "--target", type=float, default=0.8, help="the accuracy whose modelled time is tabulated (default: 0.8)"
    )
    parser.add_argument(
        "--section", default="time-model", help="name of the generated section in --out (default: time-model)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FILE.md",
        help="the Markdown file to write the section into (the text outside the section's markers is kept); "
        "default: report.md in the first study's own output folder (its [study] out)",
    )
    parser.add_argument(
        "--figure",
        type=Path,
        help="the PNG file of the plot (linked from --out by a path relative to it); default: "
        "figures/time-model.png in the first study's own output folder",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from flower_dlion_app.study.studyfile import StudyError, load_study

    try:
        study_out = load_study(args.studies[0])[0]
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or study_out / "report.md"
    figure_path = args.figure or study_out / "figures" / "time-model.png"
    labels = args.labels.split(",")
    records = [
        r
        for study in args.studies
        for r in load_cells(study)
        if r["label"] in labels and r["num_clients"] == args.clients and r["partition"] == args.partition
    ]
    lines = [
        "| method | seeds | final accuracy | MB per client (up + down) | "
        + " | ".join(f"{p}: time to {args.target:g}" for p in PROFILES)
        + " |",
        "|---|---|---|---|" + "---|" * len(PROFILES),
    ]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PROFILES), figsize=(6 * len(PROFILES), 4.2), sharey=True)
    for label in labels:
        cells = [r for r in records if r["label"] == label]
        if not cells:
            continue
        final = [r["summary"]["final_accuracy"] for r in cells]
        mb = [_mb_per_client(r) for r in cells]
        row = f"| {label} | {len(cells)} | {statistics.mean(final):.3f} | {statistics.mean(mb):.2f} |"
        for ax, (profile, (down, up, rtt)) in zip(axes, PROFILES.items(), strict=True):
            curves = [modelled_times(r, down, up, rtt) for r in cells]
            hits = [t for t in (_time_to(c, args.target) for c in curves) if t is not None]
            reached = f"[{len(hits)}/{len(cells)}]"
            row += f" {statistics.mean(hits):.1f} s {reached} |" if hits else f" never {reached} |"
            first = curves[0][1:]  # the first seed's curve, from round 1 on (round 0 is at T = 0)
            ax.plot([t for t, _ in first], [a for _, a in first], marker=".", label=label)
            ax.set_title(f"{profile}: {down / 1e6:g} Mbit/s down, {up / 1e6:g} Mbit/s up, RTT {rtt * 1e3:g} ms")
            ax.set_xscale("log")
            ax.set_xlabel("modelled wall time (s)")
        lines.append(row)
    axes[0].set_ylabel(f"test accuracy ({args.partition}, n = {args.clients}, first seed)")
    axes[-1].legend(fontsize=8)
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(figure_path, dpi=110)
    command = "python -m flower_dlion_app.study.timemodel " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"Generated by `{command}` ({len(records)} cells; time to target = mean over the seeds "
        "that reached it, [reached/run]).\n"
    )
    link = Path(os.path.relpath(figure_path.resolve(), out.resolve().parent)).as_posix()
    publish(out, args.section, [header, "\n".join(lines) + "\n", f"![time model]({link})\n"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
