"""The study report's figures: each method's mean over seeds with its min–max band, in a colour of its own.

One PNG per partition (`plot_partition`): accuracy against round (top row) and against the
cumulative MB per client, up + down (bottom row, log x), one column per number of clients.
Each method is one line, the mean over its seeds at each evaluated round (over the seeds
evaluated at that round: a seed that stopped early leaves the later means), and a shaded band
from the lowest to the highest seed (min–max; no band for one seed). On the bottom row both
coordinates are means over the seeds: the cumulative bytes of a round differ slightly between
seeds (entropy-coded downlinks). Both rows have a legend with the number of seeds of each method.

A method's colour, marker and line style come from its name (`method_style`: SHA-256 of
``"702:<name>"``), so a method looks the same in every study's figures. Two methods of one figure
may share a colour (one of 15), and then most likely differ in marker (one of 10) or line style
(one of 3): two names share all three with probability 1/450. The salt 702 was picked once, among
the first 3,000, as one that gives the main study's 8 methods (``examples/studies/study.toml``) 8
colours and the shipped study files the fewest shared colours; changing it recolours every figure.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flower_dlion_app.study.tables import ordered

__all__ = ["LINESTYLES", "MARKERS", "PALETTE", "STYLE_SALT", "method_style", "plot_partition", "seed_band"]

PALETTE = (  # matplotlib's tab10, then 5 dark colours that stand apart from them and from each other
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#000000",
    "#000075",
    "#800000",
    "#469990",
    "#f032e6",
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
STYLE_SALT = "702"
LINESTYLES = ("-", "--", "-.")


def method_style(label: str) -> dict[str, str]:
    """The colour, marker and line style of a method, from its name alone (the same in every study).

    Parameters
    ----------
    label : str
        The method's name (strategy or variant).

    Returns
    -------
    dict
        ``{"color": <of PALETTE>, "marker": <of MARKERS>, "linestyle": <of LINESTYLES>}``, for matplotlib.

    """
    digest = hashlib.sha256(f"{STYLE_SALT}:{label}".encode()).digest()
    return {
        "color": PALETTE[int.from_bytes(digest[:8], "big") % len(PALETTE)],
        "marker": MARKERS[int.from_bytes(digest[8:16], "big") % len(MARKERS)],
        "linestyle": LINESTYLES[int.from_bytes(digest[16:24], "big") % len(LINESTYLES)],
    }


def seed_band(records: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per evaluated round: the mean, min and max accuracy over the seeds, and the mean MB per client.

    Parameters
    ----------
    records : sequence of dict
        The cell records of one method, partition and number of clients (one per seed).

    Returns
    -------
    list of dict
        One per round evaluated in any seed, ascending: ``round``, ``mean``, ``low``, ``high`` (accuracy
        over the seeds evaluated at that round), ``mb_per_client`` (mean over those seeds of the cumulative
        MB per client, up + down, 1 MB = 10⁶ bytes) and ``seeds`` (how many were evaluated).

    """
    by_round: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        for e in r["evals"]:
            if e["accuracy"] is not None:
                mb = (e["cum_bytes_up"] + e["cum_bytes_down"]) / r["num_clients"] / 1e6
                by_round.setdefault(e["round"], []).append((e["accuracy"], mb))
    band = []
    for rnd in sorted(by_round):
        accs = [a for a, _ in by_round[rnd]]
        band.append(
            {
                "round": rnd,
                "mean": statistics.fmean(accs),
                "low": min(accs),
                "high": max(accs),
                "mb_per_client": statistics.fmean(mb for _, mb in by_round[rnd]),
                "seeds": len(accs),
            }
        )
    return band


def plot_partition(records: list[dict[str, Any]], study: dict[str, Any], partition: str, path: Path) -> None:
    """Write one partition's figure (the module docstring says what it shows) to ``path`` (PNG).

    Parameters
    ----------
    records : list of dict
        Cell records (``label``, ``partition``, ``num_clients``, ``seed``, ``evals``, …).
    study : dict
        The study's ``[study]`` table: its ``num-clients`` and ``strategies`` order the columns and lines.
    partition : str
        The partition to plot.
    path : Path
        The PNG file.

    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in records if r["partition"] == partition]
    clients = ordered((r["num_clients"] for r in mine), study["num-clients"])
    methods = ordered((r["label"] for r in mine), study["strategies"])
    eval_sets = {r.get("summary", {}).get("eval_set", "test") for r in mine}
    what = f"{'/'.join(sorted(eval_sets))} accuracy"
    fig, axes = plt.subplots(2, len(clients), figsize=(max(4.5 * len(clients), 8), 7.5), squeeze=False)
    for j, n in enumerate(clients):
        top, bottom = axes[0][j], axes[1][j]
        for label in methods:
            group = [r for r in mine if r["num_clients"] == n and r["label"] == label]
            if not group:
                continue
            band = seed_band(group)
            style = method_style(label)
            seeds = len(group)
            name = f"{label} ({seeds} seed{'s' if seeds > 1 else ''})"
            line = {**style, "markersize": 3, "linewidth": 1.3}
            rounds = [b["round"] for b in band]
            top.plot(rounds, [b["mean"] for b in band], label=name, **line)
            later = [b for b in band if b["mb_per_client"] > 0]  # log x: round 0 (no bytes yet) left out
            bottom.plot([b["mb_per_client"] for b in later], [b["mean"] for b in later], label=name, **line)
            if seeds > 1:
                shade = {"color": style["color"], "alpha": 0.18, "linewidth": 0}
                top.fill_between(rounds, [b["low"] for b in band], [b["high"] for b in band], **shade)
                bottom.fill_between(
                    [b["mb_per_client"] for b in later], [b["low"] for b in later], [b["high"] for b in later], **shade
                )
        top.set_title(f"{partition}, n = {n}")
        top.set_xlabel("round")
        bottom.set_xlabel("cumulative MB per client, up + down (1 MB = 10⁶ bytes; log)")
        bottom.set_xscale("log")
        for ax in (top, bottom):
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{what}: mean over seeds (line), lowest to highest seed (band)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
