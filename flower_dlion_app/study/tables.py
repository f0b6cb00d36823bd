"""The study report's tables (Markdown) from a sweep's cell records: accuracy, bytes, convergence, targets.

Each function takes the cell records (`flower_dlion_app.study.report.load_cells`) and the study's grid
(its ``[study]`` table) and returns Markdown; `flower_dlion_app.study.report` puts them into a document.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from flower_dlion_app.config.checks import TRAIN_IMAGES
from flower_dlion_app.config.keys import DEFAULTS, FEDAVG_FAMILY

__all__ = [
    "bytes_to_target",
    "convergence_table",
    "local_steps",
    "mean_std",
    "ordered",
    "results_tables",
    "target_table",
    "trained",
    "tuning_table",
]


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


def ordered(values: Iterable[Any], reference: Sequence[Any]) -> list[Any]:
    """The distinct ``values`` in the order of ``reference`` (those not in it left out)."""
    values = set(values)
    return [v for v in reference if v in values]


def results_tables(records: list[dict[str, Any]], study: dict[str, Any]) -> str:
    """Accuracy tables per partition and a bytes table, as Markdown."""
    strategies = ordered((r["label"] for r in records), study["strategies"])
    clients = ordered((r["num_clients"] for r in records), study["num-clients"])
    partitions = ordered((r["partition"] for r in records), study["partitions"])
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
    lines.append(
        "### Bytes per client over the whole run (MB per client, 1 MB = 10⁶ bytes, measured on the messages; "
        "mean over cells)\n"
    )
    header = " | ".join(f"n = {n}: MB per client, up / down" for n in clients)
    lines.append(
        f"| strategy | rounds | {header} | up bits / param / round (per client) | local steps / round | "
        "up bits / param / local step |"
    )
    lines.append("|---|---|" + "---|" * (len(clients) + 3))
    for s in strategies:
        row, bits, steps = [], [], []
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
            steps += [local_steps(g) for g in group]
        k = statistics.mean(steps)
        lines.append(
            f"| {s} | {', '.join(map(str, rounds))} | " + " | ".join(row) + f" | {statistics.mean(bits):.3f} | "
            f"{k:.4g} | {statistics.mean(bits) / k:.4f} |"
        )
    lines.append("")
    return "\n".join(lines)


def local_steps(record: dict[str, Any]) -> float:
    """Local optimizer steps a client takes per round (K): the unit of "bits per parameter per local step".

    ``local-steps`` for the D-Lion family; for the FedAvg family ``local-batches`` × ``local-epochs`` when
    it caps the epochs, else ``local-epochs`` × the mean partition's batches, (60,000 − holdout) / (n × batch
    size) (partitions differ in size, so this is the clients' mean, not each client's count).
    """
    cfg = {**DEFAULTS, **record["run_config"]}
    if cfg["strategy"] not in FEDAVG_FAMILY:
        return float(cfg["local-steps"])
    if cfg["local-batches"]:
        return float(cfg["local-batches"] * cfg["local-epochs"])
    return cfg["local-epochs"] * (TRAIN_IMAGES - cfg["holdout"]) / (record["num_clients"] * cfg["batch-size"])


def trained(record: dict[str, Any]) -> bool:
    """Whether a cell trained: it was not stopped (diverged) and its best accuracy is over twice its round-0 one.

    Round 0 is the untrained model (about chance); a run that ends at chance without a non-finite value (an
    older cell, or one whose model collapsed) does not train either.
    """
    accuracies = [e["accuracy"] for e in record["evals"] if e["accuracy"] is not None]
    if record["summary"].get("status") == "stopped" or len(accuracies) < 2:
        return False
    return max(accuracies[1:]) > 2 * accuracies[0]


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
    for part in ordered((r["partition"] for r in records), study["partitions"]):
        lines.append(f"**{part}**\n")
        lines.append(f"| method | rounds | best accuracy | round of best (per seed) | gain in the last {last} rounds |")
        lines.append("|---|---|---|---|---|")
        for s in ordered((r["label"] for r in records), study["strategies"]):
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
    reference: str | Sequence[str],
    fixed: Sequence[float] = (0.75, 0.8),
    metric: str = "final_accuracy",
) -> str:
    """Per partition: MB per client to reach the reference's mean ``metric`` (final or best accuracy) and fixed targets.

    The reference's mean is over its seeds that trained (`trained`); with several, its mean minus one
    standard deviation (the low end of its seed spread) is a target too. With several reference labels
    (e.g. FedAvg at two learning rates), each partition's reference is the one with the highest such mean:
    the baseline at its best.

    A method's entry is the mean over the seeds that reached the target, with how many did,
    and the reference's bytes divided by it (× fewer bytes than the reference).
    """
    strategies = ordered((r["label"] for r in records), study["strategies"])
    lines = []
    for part in ordered((r["partition"] for r in records), study["partitions"]):
        found = _best_reference(records, part, [reference] if isinstance(reference, str) else reference, metric)
        if found is None:
            continue
        label, ran, ref = found
        ref_values = [r["summary"][metric] for r in ref]
        ref_acc = statistics.mean(ref_values)
        sd = statistics.stdev(ref_values) if len(ref_values) > 1 else 0.0
        spread = [ref_acc - sd] if sd > 0.0005 else []  # the low end of its seed spread
        targets = [ref_acc, *spread, *[t for t in fixed if abs(t - ref_acc) > 0.005]]
        ref_final = mean_std([r["summary"][metric] for r in ref])
        what = metric.replace("_", " ")
        seeds = f", the {len(ref)} of {len(ran)} seeds that trained" if len(ref) < len(ran) else ""
        lines.append(f"**{part}** ({label} {what} {ref_final}{seeds})\n")
        names = [f" ({label})", " (its mean − 1 std)" if spread else ""]
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
                ratio = f", {ref_mb[t] / mb:.1f}×" if ref_mb[t] and s != label else ""
                row.append(f"{mb:.2f} [{len(hits)}/{len(group)}{ratio}]")
            lines.append(f"| {s} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def _best_reference(
    records: list[dict[str, Any]], part: str, labels: Sequence[str], metric: str
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(label, its cells, its cells that trained) of the label with the highest mean ``metric`` on ``part``."""
    found = []
    for label in labels:
        ran = [r for r in records if r["label"] == label and r["partition"] == part]
        ref = [r for r in ran if trained(r)]
        if ref:
            found.append((statistics.mean(r["summary"][metric] for r in ref), label, ran, ref))
    if not found:
        return None
    _, label, ran, ref = max(found, key=lambda f: f[0])
    return label, ran, ref
