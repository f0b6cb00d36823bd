"""Memory and time of Flower Simulation Engine runs of the app at scale: D-Lion against FedAvg (issue 60).

For each (nodes, strategy) it starts, as ``scripts/run.sh`` does::

    flwr run . --stream --federation-config "num-supernodes=N" --run-config "<scale overrides> <--run-config>"

under a Flower home of its own (``FLWR_HOME``), free ports, its own Ray temp folder
(``RAY_TMPDIR``), its own D-Lion state folder (``FLOWER_DLION_STATE_DIR``) and results folder
(run-config ``results-dir``), all in one temp folder. Every 0.25 s it sums the RSS of the whole
process tree the run spawns: the ``flwr run`` CLI, the local SuperLink it launches, the
simulation process (ServerApp, SuperNodes' contexts) and Ray's own processes and workers.
A process belongs to the run when it descends from the ``flwr run`` process or from that
SuperLink, or when its environment holds this run's ``FLWR_HOME`` (Ray's processes are
re-parented; they inherit the environment). When the run ends (also on errors, Ctrl-C or
SIGTERM) the SuperLink's process group, the ``flwr run`` process group and then every process
left with this run's ``FLWR_HOME`` are stopped (SIGTERM, then SIGKILL): never anyone else's,
and no ``ray stop``.

Measured: peak total RSS (and PSS, which splits shared pages such as Ray's object store), the
RSS right before round 1 (the ``[ROUND 1/`` log line) and after it, the peak by role
(simulation / Ray workers / Ray core / SuperLink / CLI), the wall time, the seconds per round
(the ``[ROUND k/`` lines' arrival times; also ``results.jsonl``'s ``wall_time_s``), the state
folder's disk use and its per-node folders (``<state>/<run key>/partition-<i>``; a node that
only answered the hello has an empty one, so clients touched = folders holding a file), and
the expected number of distinct clients touched, N·(1 − (1 − m/N)^R) with m the nodes sampled
a round, where no folder counts them (FedAvg, or D-Lion with its state in ``context.state``).

Scale overrides (change with ``--run-config``, which comes after them): fraction-train,
num-server-rounds, strategy, model, results-dir, ``partitioner='iid'`` (Dirichlet refuses
partitions under 10 images: 60,000 / 10,000 nodes is 6 each), ``min-train-nodes=1``,
``min-available-nodes=1``, ``eval-every`` = rounds + 1 (the server evaluates at round 0 and
the last one only).

Example::

    .venv/bin/python benchmarks/sim_scale.py --nodes 1000 --fraction 0.05 --rounds 20 \\
        --out /tmp/sim_scale.json      # also writes /tmp/sim_scale.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
PAGE = os.sysconf("SC_PAGE_SIZE")
GB = 1e9
MB = 1e6

ROLES = ("simulation", "ray-worker", "ray-core", "superlink", "superexec", "cli", "other")


# ----------------------------------------------------------------------------- processes
def _read(path: str, mode: str = "r") -> Any:
    try:
        with open(path, mode) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, starttime) of ``pid``, or None if it is gone."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    rest = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "
    return int(rest[1]), int(rest[2]), int(rest[19])


def _rss(pid: int) -> int:
    text = _read(f"/proc/{pid}/statm")
    return int(text.split()[1]) * PAGE if text else 0


def _pss(pid: int) -> int:
    text = _read(f"/proc/{pid}/smaps_rollup")
    if not text:
        return 0
    m = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def _cmdline(pid: int) -> str:
    raw = _read(f"/proc/{pid}/cmdline", "rb")
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() if raw else ""


def role_of(cmd: str) -> str:
    """What a process of the run is, from its command line."""
    if "flower-superlink" in cmd:
        return "superlink"
    if "flower-superexec" in cmd:
        return "superexec"
    if "flwr-simulation" in cmd or "flwr-serverapp" in cmd:
        return "simulation"
    if cmd.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE_")) or "ray/dashboard" in cmd:
        return "ray-core"  # the raylet's agents (an idle worker too), not a ClientApp actor
    if cmd.startswith("ray::") or "default_worker.py" in cmd:
        return "ray-worker"  # ray::ClientAppActor (setproctitle), or a worker before it took its actor
    if any(s in cmd for s in ("raylet", "gcs_server", "log_monitor", "autoscaler", "ray/_private", "ray.util")):
        return "ray-core"
    if " run " in f" {cmd} " and "flwr" in cmd:
        return "cli"
    return "other"


class Tree:
    """The processes of one run: descendants of its roots, and any process with its FLWR_HOME in the environment."""

    def __init__(self, flwr_home: str, root_pid: int) -> None:
        self.marker = f"FLWR_HOME={flwr_home}".encode()
        self.roots = {root_pid}
        self._ours: dict[tuple[int, int], bool] = {}  # (pid, starttime) → has our FLWR_HOME
        self._cmd: dict[tuple[int, int], str] = {}

    def _has_marker(self, key: tuple[int, int]) -> bool:
        if key not in self._ours:
            env = _read(f"/proc/{key[0]}/environ", "rb")
            self._ours[key] = bool(env) and any(v == self.marker for v in env.split(b"\0"))
        return self._ours[key]

    def scan(self) -> dict[int, tuple[str, str, int]]:
        """pid → (role, command line, pgid) of every live process of the run."""
        stats: dict[int, tuple[int, int, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and (st := _stat(int(name))) is not None:
                stats[int(name)] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        ours = {pid for pid, st in stats.items() if self._has_marker((pid, st[2]))}
        for pid in stats:  # the SuperLink `flwr run` launches becomes a root of its own
            if pid in ours and "flower-superlink" in self.cmd(pid, stats[pid][2]):
                self.roots.add(pid)
        stack = [r for r in self.roots if r in stats]
        while stack:
            pid = stack.pop()
            ours.add(pid)
            stack.extend(c for c in children.get(pid, ()) if c not in ours)
        me = os.getpid()
        return {
            pid: (role_of(self.cmd(pid, stats[pid][2])), self.cmd(pid, stats[pid][2]), stats[pid][1])
            for pid in ours
            if pid != me and pid in stats
        }

    def cmd(self, pid: int, start: int) -> str:
        key = (pid, start)
        if key not in self._cmd:
            self._cmd[key] = _cmdline(pid)
        return self._cmd[key]


def stop_tree(tree: Tree, flwr_proc: subprocess.Popen, grace: float = 15.0) -> list[str]:
    """Stop the run's processes: the SuperLink's and `flwr run`'s groups, then anything with our FLWR_HOME."""
    notes = []
    procs = tree.scan()
    own_pgid = os.getpgid(0)
    groups = {pgid for pid, (_, _, pgid) in procs.items() if pgid == pid}  # the SuperLink's, SuperExec's
    with contextlib.suppress(ProcessLookupError, PermissionError):
        groups.add(os.getpgid(flwr_proc.pid))
    groups.discard(own_pgid)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    for pid in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and tree.scan():
        time.sleep(0.25)
    left = tree.scan()
    for pid, (role, cmd, _) in left.items():
        notes.append(f"SIGKILL {pid} ({role}): {cmd[:80]}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        flwr_proc.wait(timeout=5)
    return notes


# ----------------------------------------------------------------------------- one run
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disk_usage(folder: Path) -> tuple[int, int]:
    """(bytes allocated on disk, apparent bytes) of the files under ``folder``."""
    used = apparent = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                used += st.st_blocks * 512
                apparent += st.st_size
    return used, apparent


def node_folders(state: Path) -> tuple[int, int, int]:
    """(per-node folders, those holding a file, bytes on disk in those) under ``state``.

    Node folders are ``<state>/<run key>/partition-<i>`` (or ``node-<id>``); a node that only
    answered the hello has an empty one. Other folders (``anchors``) are left out.
    """
    folders = with_files = used = 0
    if not state.is_dir():
        return 0, 0, 0
    for run in state.iterdir():
        if not run.is_dir():
            continue
        for node in run.iterdir():
            if node.is_dir() and node.name.startswith(("partition-", "node-")):
                folders += 1
                node_used, _ = disk_usage(node)
                if any(f.is_file() for f in node.rglob("*")):
                    with_files += 1
                    used += node_used
    return folders, with_files, used


def scale_config(args: argparse.Namespace, strategy: str, results: Path) -> str:
    cfg = {
        "strategy": f"'{strategy}'",
        "model": f"'{args.model}'",
        "fraction-train": repr(float(args.fraction)),
        "num-server-rounds": str(args.rounds),
        "min-train-nodes": "1",
        "min-available-nodes": "1",
        "eval-every": str(args.rounds + 1),
        "partitioner": "'iid'",
        "results-dir": f"'{results}'",
    }
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def run_one(args: argparse.Namespace, nodes: int, strategy: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="simscale-", dir=args.tmp))
    home, state, results, raytmp = tmp / "home", tmp / "state", tmp / "results", tmp / "ray"
    for d in (home, state, results, raytmp):
        d.mkdir()
    port, control_port = free_port(), free_port()
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(port),
        FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
        FLOWER_DLION_STATE_DIR=str(state),
        RAY_TMPDIR=str(raytmp),
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        str(VENV_BIN / "flwr"), "run", str(REPO), "--stream",
        "--federation-config", f"num-supernodes={nodes}",
        "--run-config", scale_config(args, strategy, results),
    ]  # fmt: skip
    if args.run_config:
        cmd += ["--run-config", args.run_config]
    print(f"[sim_scale] {nodes} nodes, {strategy}: {shlex.join(cmd)}", flush=True)
    print(f"[sim_scale]   temp folder {tmp}", flush=True)
    log_path = tmp / "flwr-run.log"
    events: dict[str, Any] = {"round_start": {}, "round_end": {}, "sampled": [], "run_id": None}
    latest = {"rss": 0}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    tree = Tree(str(home), proc.pid)

    def reader() -> None:
        assert proc.stdout is not None
        with log_path.open("w") as log:
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                now = time.monotonic() - t0
                log.write(f"{now:9.2f} {line}")
                log.flush()
                if args.verbose:
                    sys.stdout.write(line)
                if m := re.search(r"\[ROUND (\d+)/", line):
                    events["round_start"][int(m.group(1))] = (now, latest["rss"])
                elif m := re.search(r"\[flower-dlion\] round (\d+)/\d+:", line):
                    events["round_end"][int(m.group(1))] = (now, latest["rss"])
                elif m := re.search(r"sampled (\d+) nodes \(out of (\d+)\)", line, re.I):
                    events["sampled"].append(int(m.group(1)))
                    events.setdefault("first_sample", now)
                elif m := re.search(r"Successfully started run (\d+)", line):
                    events["run_id"] = m.group(1)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    peak: dict[str, Any] = {"rss": 0, "t": 0.0, "roles": {}, "procs": 0, "top": []}
    role_peak = dict.fromkeys(ROLES, 0)
    peak_pss, samples, timed_out = 0, 0, False
    series: list[list[float]] = []
    peak_training = 0  # the peak until the last round's line (not the shutdown)
    notes: list[str] = []
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > args.timeout:
                timed_out = True
                break
            procs = tree.scan()
            by_role = dict.fromkeys(ROLES, 0)
            sizes = {pid: _rss(pid) for pid in procs}
            for pid, (role, _, _) in procs.items():
                by_role[role] += sizes[pid]
            total = sum(by_role.values())
            latest["rss"] = total
            for r in ROLES:
                role_peak[r] = max(role_peak[r], by_role[r])
            if total > peak["rss"]:
                top = sorted(procs, key=lambda q: -sizes[q])[:12]
                peak = {
                    "rss": total, "t": time.monotonic() - t0, "roles": by_role, "procs": len(procs),
                    "top": [f"{sizes[q] / GB:.3f} GB {procs[q][0]}: {procs[q][1][:90]}" for q in top],
                }  # fmt: skip
            if args.rounds not in events["round_end"]:
                peak_training = max(peak_training, total)
            if samples % args.series_every == 0:  # the RSS over time: growth, and where it sits
                series.append([round(time.monotonic() - t0, 1), *(round(by_role[r] / GB, 3) for r in ROLES)])
            if args.pss_every and samples % args.pss_every == 0:
                peak_pss = max(peak_pss, sum(_pss(pid) for pid in procs))
            samples += 1
            time.sleep(args.interval)
        wall = time.monotonic() - t0
        thread.join(timeout=10)
        status = None
        if events["run_id"] and not timed_out:
            with contextlib.suppress(Exception):
                out = subprocess.run(
                    [str(VENV_BIN / "flwr"), "ls", "--run-id", events["run_id"], "--format", "json"],
                    cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                ).stdout  # fmt: skip
                status = json.loads(out)["runs"][0]["status"]
    finally:
        notes += stop_tree(tree, proc)
    summary_file = next(results.rglob("summary.json"), None)
    summary = json.loads(summary_file.read_text()) if summary_file else {}
    rows_file = next(results.rglob("results.jsonl"), None)
    rows = [json.loads(r) for r in rows_file.read_text().splitlines() if r.strip()] if rows_file else []
    disk_used, disk_apparent = disk_usage(state)
    folders, touched_files, node_used = node_folders(state)
    starts = events["round_start"]
    log_rounds = [starts[k + 1][0] - starts[k][0] for k in sorted(starts) if k + 1 in starts]
    if args.rounds in starts and args.rounds in events["round_end"]:
        log_rounds.append(events["round_end"][args.rounds][0] - starts[args.rounds][0])
    walls = {r["round"]: r["wall_time_s"] for r in rows if r.get("wall_time_s") is not None}
    jsonl_rounds = [walls[k] - walls[k - 1] for k in sorted(walls) if k >= 1 and k - 1 in walls]
    m = statistics.median(events["sampled"]) if events["sampled"] else None
    expected = nodes * (1 - (1 - m / nodes) ** len(events["sampled"])) if m else None
    baseline = starts.get(1, (None, None))[1]
    after1 = events["round_end"].get(1, (None, None))[1]
    tail = log_path.read_text().splitlines()[-25:] if log_path.exists() else []
    result = {
        "nodes": nodes,
        "strategy": strategy,
        "status": status or ("timeout" if timed_out else summary.get("status")),
        "returncode": proc.returncode,
        "peak_rss_gb": peak["rss"] / GB,
        "peak_at_s": round(peak["t"], 1),
        "peak_rss_until_last_round_gb": peak_training / GB,
        "peak_rss_by_role_gb": {r: v / GB for r, v in peak["roles"].items() if v},
        "max_rss_by_role_gb": {r: v / GB for r, v in role_peak.items() if v},
        "processes_at_peak": peak["procs"],
        "largest_at_peak": peak["top"],
        "peak_pss_gb": peak_pss / GB if args.pss_every else None,
        "rss_before_round1_gb": baseline / GB if baseline else None,
        "rss_after_round1_gb": after1 / GB if after1 else None,
        "growth_gb": (peak["rss"] - baseline) / GB if baseline else None,
        "wall_s": round(wall, 1),
        "app_wall_s": summary.get("wall_time_s"),
        "to_round1_s": round(starts[1][0], 1) if 1 in starts else None,
        "round1_to_first_sample_s": (  # D-Lion: the hellos to every node (and Ray's start); FedAvg: ~0
            round(events["first_sample"] - starts[1][0], 1) if 1 in starts and "first_sample" in events else None
        ),
        "s_per_round_median": statistics.median(log_rounds) if log_rounds else None,
        "s_per_round_median_jsonl": statistics.median(jsonl_rounds) if jsonl_rounds else None,
        "s_per_round_log": [round(x, 2) for x in log_rounds],
        "rounds_done": len(events["round_end"]),
        "sampled_per_round": m,
        "state_disk_mb": disk_used / MB,
        "state_apparent_mb": disk_apparent / MB,
        "state_node_folders": folders,
        "state_node_folders_with_files": touched_files,
        "disk_per_touched_client_mb": node_used / MB / touched_files if touched_files else None,
        "clients_touched": touched_files or None,
        "clients_touched_expected": round(expected) if expected else None,
        "final_accuracy": summary.get("final_accuracy"),
        "rss_series_columns": ["t_s", *ROLES],
        "rss_series_gb": series,
        "round_end_s": {k: round(v[0], 1) for k, v in sorted(events["round_end"].items())},
        "samples": samples,
        "cleanup": notes,
        "command": shlex.join(cmd),
        "temp_folder": str(tmp) if args.keep else None,
    }
    if result["status"] != "finished:completed":
        result["log_tail"] = tail
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return result


# ----------------------------------------------------------------------------- report
def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| nodes | strategy | peak RSS GB | D-Lion/FedAvg peak ratio | s per round (median) | ratio | state disk MB "
        "| disk per touched client MB | clients touched |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results:
        ref = next((x for x in results if x["nodes"] == r["nodes"] and x["strategy"] == "fedavg"), None)
        ratio = r["peak_rss_gb"] / ref["peak_rss_gb"] if ref and ref["peak_rss_gb"] else None
        t, t_ref = r["s_per_round_median"], ref and ref["s_per_round_median"]
        tratio = t / t_ref if t and t_ref else None
        touched = (
            str(r["clients_touched"])
            if r["clients_touched"]
            else (f"~{r['clients_touched_expected']} (expected)" if r["clients_touched_expected"] else "—")
        )
        lines.append(
            f"| {r['nodes']} | {r['strategy']} | {_f(r['peak_rss_gb'])} | {_f(ratio)} | {_f(t)} | {_f(tratio)} "
            f"| {_f(r['state_disk_mb'], '{:.1f}')} | {_f(r['disk_per_touched_client_mb'])} | {touched} |"
        )
    detail = (
        "\n\n| nodes | strategy | status | RSS before round 1 GB | after round 1 GB | growth GB | peak PSS GB "
        "| peak by role GB | wall s | to round 1 s | round 1 start to first sample s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in results:
        roles = ", ".join(f"{k} {v:.2f}" for k, v in r["peak_rss_by_role_gb"].items())
        detail += (
            f"| {r['nodes']} | {r['strategy']} | {r['status']} | {_f(r['rss_before_round1_gb'])} "
            f"| {_f(r['rss_after_round1_gb'])} | {_f(r['growth_gb'])} | {_f(r['peak_pss_gb'])} | {roles} "
            f"| {_f(r['wall_s'], '{:.0f}')} | {_f(r['to_round1_s'], '{:.0f}')} "
            f"| {_f(r.get('round1_to_first_sample_s'), '{:.0f}')} |\n"
        )
    return head + "\n".join(lines) + detail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000], help="num-supernodes of each federation")
    p.add_argument("--fraction", type=float, default=0.05, help="run-config fraction-train")
    p.add_argument("--rounds", type=int, default=20, help="run-config num-server-rounds")
    p.add_argument("--strategies", nargs="+", default=["dlion-vote", "fedavg"], help="run-config strategy values")
    p.add_argument("--model", default="cnn", help="run-config model")
    p.add_argument("--run-config", default="", help="more run-config overrides, after the scale ones (win over them)")
    p.add_argument("--out", type=Path, default=None, help="JSON output (a .md with the tables beside it)")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between RSS samples")
    p.add_argument("--series-every", type=int, default=8, help="keep every k-th sample's RSS by role in the JSON")
    p.add_argument("--pss-every", type=int, default=4, help="also sum PSS every k samples (0: never)")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before a run is stopped")
    p.add_argument("--tmp", default=None, help="where the per-run temp folders go (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep each run's temp folder (log, state, results)")
    p.add_argument("--verbose", action="store_true", help="echo the runs' logs")
    args = p.parse_args()

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through run_one's finally: the run's processes are stopped

    signal.signal(signal.SIGTERM, on_term)
    results = []
    for nodes in args.nodes:
        for strategy in args.strategies:
            r = run_one(args, nodes, strategy)
            results.append(r)
            print(
                f"[sim_scale] {nodes} {strategy}: {r['status']}, peak {r['peak_rss_gb']:.2f} GB, "
                f"{_f(r['s_per_round_median'])} s/round, wall {r['wall_s']:.0f} s",
                flush=True,
            )
            if r.get("log_tail"):
                print("\n".join(r["log_tail"]), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
                args.out.write_text(json.dumps(payload, indent=1))
                args.out.with_suffix(".md").write_text(table(results) + "\n")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
