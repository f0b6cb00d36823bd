"""The default app on a two-node Ray cluster: where D-Lion's client state lives when a client moves (issue 60, item 3).

Flower's Simulation Engine hands each message of a virtual SuperNode to whichever Ray actor is
free, so on a cluster a virtual client served by one Ray node in a round may be served by
another in the next. A D-Lion client that keeps its state in files (run config
``state-in-context=false``) writes them under the run config's ``client-state-dir``, else under
``$FLOWER_DLION_STATE_DIR`` (as set in the environment of ``ray start`` on that node: Ray's
workers inherit it): a client that moved finds its files only where that folder is shared.

This script starts, on this one machine, a Ray cluster of two nodes (``ray start --head`` and
``ray start --address=…``, one CPU each, their own ``--temp-dir`` and free ports), then runs
``flwr run .`` of the default app on it (``RAY_ADDRESS`` points the Simulation Engine's
``ray.init()`` at the head; ``client-resources-num-cpus=1`` gives one actor per node).
Setups:

* ``separate``: each Ray node has its own ``FLOWER_DLION_STATE_DIR``: no shared storage;
* ``shared``: both Ray nodes have the same ``FLOWER_DLION_STATE_DIR`` (shared storage);
* ``context``: ``state-in-context=true`` (the state travels in Flower's context, which the
  Simulation Engine keeps in its ``flwr-simulation`` process), Ray nodes with separate folders;
* ``local``: the reference, one machine, no cluster (Flower starts its own Ray with
  ``init-args-num-cpus=2``: two actors, as on the cluster).

Per setup: the rounds completed, the final accuracy (``summary.json``), the replies the server
rejected (from its log and from ``results.jsonl``) and why, the client's warnings, how many of
the rejected nodes were accepted in a later round (resynced), the bytes down per round, and the
wall time. Every Ray process started here is stopped at the end, also on failure, by the process
groups of its ``ray start`` commands and by its ``--temp-dir`` (never a plain ``ray stop``,
which stops every Ray on the machine); each run's SuperLink is stopped by its process group.

Usage::

    .venv/bin/python benchmarks/ray_cluster.py [--supernodes 10] [--rounds 20] \\
        [--setups separate,shared,context,local] [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: flwr, ray
SETUPS = ("separate", "shared", "context", "local")
LEVEL = re.compile(r"(?:\x1b\[[0-9;]*m)?(?:INFO|WARNING|ERROR|DEBUG)\s*(?:\x1b\[[0-9;]*m)?\s*:")
REJECTED = re.compile(r"round (\d+): rejected reply from node (\d+) \(partition (\d+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    """This environment: the venv first on PATH, no telemetry, no cluster address, no state folder of its own."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "FLOWER_DLION_STATE_DIR", "FLWR_HOME"):
        env.pop(key, None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",  # else flwr installs the app's dependencies anew
        RAY_USAGE_STATS_ENABLED="0",
        RAY_DEDUP_LOGS="0",  # every client warning reaches the log, none folded into "[repeated 3x]"
    )
    return env


# --------------------------------------------------------------------------- the cluster
@dataclass
class RayCluster:
    """A Ray cluster of one head and ``len(state_dirs) - 1`` workers on this machine, each with its own state folder.

    ``state_dirs[i]`` is ``FLOWER_DLION_STATE_DIR`` of node i (the head first; None: unset).
    Use as a context manager: the cluster is stopped on exit, whatever happened.
    """

    root: Path
    state_dirs: Sequence[Path | None]
    cpus_per_node: int = 1
    object_store_mb: int = 300
    port: int = 0
    temp_dir: Path = Path()  # Ray's --temp-dir: a short path of its own (Ray's socket paths are limited to 107 bytes)
    pgids: list[int] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ray_start(self, head: bool, state_dir: Path | None) -> None:
        env = base_env()
        if state_dir is not None:
            env["FLOWER_DLION_STATE_DIR"] = str(state_dir)
        cmd = [str(BIN / "ray"), "start", "--node-ip-address", "127.0.0.1", "--temp-dir", str(self.temp_dir)]
        if head:
            cmd += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
            cmd += ["--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port())]
        else:
            cmd += ["--address", self.address]
        cmd += ["--num-cpus", str(self.cpus_per_node), "--object-store-memory", str(self.object_store_mb << 20)]
        cmd += ["--disable-usage-stats"]
        for flag in (
            "--node-manager-port",
            "--object-manager-port",
            "--metrics-export-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--runtime-env-agent-port",
        ):
            cmd += [flag, str(free_port())]
        # its own session: every process it starts (they outlive it) stays in its process group
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.pgids.append(proc.pid)
        out, _ = proc.communicate(timeout=180)
        self.log.append(f"$ {' '.join(cmd)}\n{out}")
        if proc.returncode != 0:
            raise RuntimeError(f"ray start failed (rc {proc.returncode}):\n{out[-3000:]}")

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="dlr-", dir="/tmp"))
        (self.root / "ray-temp-dir").write_text(f"{self.temp_dir}\n")
        self.port = free_port()
        for i, state_dir in enumerate(self.state_dirs):
            if state_dir is not None:
                state_dir.mkdir(parents=True, exist_ok=True)
            self._ray_start(head=i == 0, state_dir=state_dir)
        self.wait_for_nodes(len(self.state_dirs))

    def wait_for_nodes(self, n: int, timeout: float = 60.0) -> None:
        """Until ``ray status`` lists n alive nodes."""
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            res = subprocess.run(
                [str(BIN / "ray"), "status", "--address", self.address],
                env=base_env(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            out = res.stdout
            active = out.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in out else ""
            if len(re.findall(r"\bnode_[0-9a-f]+", active)) >= n:
                return
            time.sleep(1.0)
        raise RuntimeError(f"the cluster at {self.address} did not reach {n} nodes:\n{out[-2000:]}")

    def processes(self) -> list[int]:
        """This cluster's processes: in the process groups of its ``ray start`` commands, or naming its temp dir."""
        tag = f"{self.temp_dir}/" if self.temp_dir != Path() else None
        return [
            pid
            for pid, cmd in _processes()
            if pid != os.getpid() and (_pgid(pid) in self.pgids or (tag is not None and tag in cmd))
        ]

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to this cluster's processes, SIGKILL to those left after ``grace`` seconds (as ``ray stop`` does)."""
        for pid in self.processes():
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self.processes():
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.temp_dir != Path():  # its logs stay with the run's files, the sockets go
            try:
                shutil.copytree(
                    self.temp_dir,
                    self.root / "ray-logs",
                    symlinks=True,
                    ignore=shutil.ignore_patterns("sockets"),
                    dirs_exist_ok=True,
                )
            except (shutil.Error, OSError):
                pass
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _processes() -> list[tuple[int, str]]:
    """(pid, command line) of the live processes on this machine (Linux: /proc), zombies left out."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        out.append((int(entry.name), cmd))
    return out


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


# --------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    setup: str
    rc: int
    status: str
    rounds: int
    rounds_completed: int
    rounds_applied: int
    final_accuracy: float | None
    wall_s: float
    server_wall_s: float | None
    bytes_down_per_round: float
    bytes_down_total: int
    bytes_up_total: int
    rejected: int  # results.jsonl: sum of num_rejected
    failed: int  # results.jsonl: sum of num_failed (sampled, no reply)
    catch_ups: int
    full_syncs: int
    state_resets: int
    rejected_in_log: int  # the server's "round r: rejected reply from node n" lines
    rejected_why: dict[str, int]
    rejected_nodes: list[tuple[int, int]]  # (round, partition)
    resynced: int  # rejected (round, node)s whose node was accepted in a later round
    rejected_in_last_round: int
    client_no_replica: int  # client messages "has no replica" (distinct texts)
    client_starts_anew: int  # client warnings "… is refused …; the node starts anew" (distinct texts)
    nodes_moved: int  # partitions with state files in more than one node's folder (separate folders only)
    cluster_start_s: float = 0.0  # the two `ray start`s until `ray status` lists both nodes
    cluster_stop_s: float = 0.0
    rows: list[dict[str, Any]] = field(repr=False, default_factory=list)
    log: str = ""
    command: str = ""


def _why(block: str) -> str:
    for key, what in (
        ("has no replica", "no replica"),
        ("replica at version", "stale replica"),
        ("starts anew", "state refused"),
        ("refused", "refused"),
        ("checksum", "checksum"),
    ):
        if key in block:
            return what
    return "other"


def parse_log(text: str) -> dict[str, Any]:
    """The server's rejected replies (round, partition, why) and the client's messages about missing state."""
    rejected: list[tuple[int, int, int, str]] = []
    for m in REJECTED.finditer(text):
        nxt = LEVEL.search(text, m.end())
        block = text[m.end() : nxt.start() if nxt else len(text)]
        rejected.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), _why(block)))
    rejected = sorted(set(rejected))
    no_replica = {line.strip() for line in text.splitlines() if "has no replica" in line and "Message:" in line}
    anew = {line.strip() for line in text.splitlines() if "starts anew" in line and "flower-dlion: node" in line}
    return {"rejected": rejected, "no_replica": len(no_replica), "starts_anew": len(anew)}


def moved_nodes(state_dirs: Sequence[Path]) -> int:
    """Partitions whose state files are in more than one of these folders (a client that moved between Ray nodes)."""
    seen: dict[str, int] = {}
    for d in {p.resolve() for p in state_dirs}:
        for part in {p.parent.name for p in d.glob("*/partition-*/*.state*")}:
            seen[part] = seen.get(part, 0) + 1
    return sum(1 for n in seen.values() if n > 1)


def stop_superlink(port: int) -> None:
    """Stop the local SuperLink this run started (the one on ``port``), by its process group."""
    for pid, cmd in _processes():
        if "flower-superlink" in cmd and re.search(rf"--port {port}( |$)", cmd):
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                _signal(pid, signal.SIGTERM)


def run_flwr(
    setup: str,
    out: Path,
    *,
    num_supernodes: int,
    rounds: int,
    ray_address: str | None,
    run_config: dict[str, Any] | None = None,
    state_env: Path | None = None,
    eval_every: int = 0,
    timeout: float = 1800.0,
) -> RunResult:
    """``flwr run .`` of the default app, on the cluster at ``ray_address`` (None: Flower's own local Ray).

    The run gets its own Flower home and free ports, its SuperLink is stopped at the end.
    """
    work = out / setup
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results"
    env = base_env()
    http_port, control_port = free_port(), free_port()
    env.update(
        FLWR_HOME=str(work / "flwr-home"),
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port),
        FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
    )
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    if state_env is not None:  # the local reference's state folder (on a cluster each Ray node has its own)
        env["FLOWER_DLION_STATE_DIR"] = str(state_env)
    fed = f"num-supernodes={num_supernodes} client-resources-num-cpus=1"
    if ray_address is None:
        fed += " init-args-num-cpus=2"  # connecting to a cluster, Ray refuses num_cpus
    config = {
        "num-server-rounds": rounds,
        "eval-every": eval_every or rounds,
        "state-in-context": "false",
        "results-dir": f"'{results}'",
        **(run_config or {}),
    }
    cmd = [str(BIN / "flwr"), "run", ".", "--stream", "--federation-config", fed]
    cmd += ["--run-config", " ".join(f"{k}={v}" for k, v in config.items())]
    shown = (f"RAY_ADDRESS={ray_address} " if ray_address else "") + " ".join(
        a if " " not in a else f'"{a}"' for a in ["flwr", *cmd[1:]]
    )
    log_path = work / "flwr-run.log"
    t0 = time.perf_counter()
    try:
        with log_path.open("w") as log:
            try:
                rc = subprocess.run(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        wall = time.perf_counter() - t0
        text = log_path.read_text(errors="replace")
        status = _run_status(text, env)
    finally:
        stop_superlink(http_port)
    return _result(setup, rc, status, rounds, wall, text, results, shown, num_supernodes)


def _run_status(text: str, env: dict[str, str]) -> str:
    found = re.findall(r"Successfully started run (\d+)", text)
    if not found:
        return "not started"
    res = subprocess.run(
        [str(BIN / "flwr"), "ls", "--run-id", found[-1], "--format", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        return json.loads(res.stdout)["runs"][0]["status"]
    except (ValueError, KeyError, IndexError):
        return f"unknown ({res.stdout.strip()[-200:]})"


def _result(
    setup: str, rc: int, status: str, rounds: int, wall: float, text: str, results: Path, cmd: str, n: int
) -> RunResult:
    rows_path, summary_path = results / "results.jsonl", results / "summary.json"
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    train = [r for r in rows if r["round"] >= 1]
    log = parse_log(text)
    rejected = log["rejected"]
    # every node is sampled every round (fraction-train = 1): a node is accepted in a round unless rejected there
    rejected_by_round: dict[int, set[int]] = {}
    for r, node, _, _ in rejected:
        rejected_by_round.setdefault(r, set()).add(node)
    completed = max((r["round"] for r in train), default=0)
    resynced = sum(
        1
        for r, node, _, _ in rejected
        if any(node not in rejected_by_round.get(later, set()) for later in range(r + 1, completed + 1))
    )
    why: dict[str, int] = {}
    for *_, w in rejected:
        why[w] = why.get(w, 0) + 1
    total = lambda key: int(sum(r.get(key) or 0 for r in train))  # noqa: E731
    return RunResult(
        setup=setup,
        rc=rc,
        status=status,
        rounds=rounds,
        rounds_completed=completed,
        rounds_applied=total("applied"),
        final_accuracy=summary.get("final_accuracy"),
        wall_s=round(wall, 1),
        server_wall_s=summary.get("wall_time_s"),
        bytes_down_per_round=total("bytes_down") / max(len(train), 1),
        bytes_down_total=total("bytes_down"),
        bytes_up_total=total("bytes_up"),
        rejected=total("num_rejected"),
        failed=total("num_failed"),
        catch_ups=total("catch_ups"),
        full_syncs=total("full_syncs"),
        state_resets=total("state_resets"),
        rejected_in_log=len(rejected),
        rejected_why=why,
        rejected_nodes=[(r, p) for r, _, p, _ in rejected],
        resynced=resynced,
        rejected_in_last_round=len(rejected_by_round.get(completed, set())),
        client_no_replica=log["no_replica"],
        client_starts_anew=log["starts_anew"],
        nodes_moved=0,
        rows=rows,
        log=str(results.parent / "flwr-run.log"),
        command=cmd,
    )


# --------------------------------------------------------------------------- setups
def run_setup(
    setup: str, out: Path, *, num_supernodes: int, rounds: int, eval_every: int = 0, timeout: float = 1800.0
) -> RunResult:
    """One setup (see the module doc) from start to end: its cluster (if any) is started and stopped here."""
    kw = {"num_supernodes": num_supernodes, "rounds": rounds, "eval_every": eval_every, "timeout": timeout}
    base = out / setup
    if setup == "local":
        return run_flwr(setup, out, ray_address=None, state_env=base / "state", **kw)
    if setup == "shared":
        dirs = [base / "state-shared"] * 2
    else:
        dirs = [base / "state-node0", base / "state-node1"]
    run_config = {"state-in-context": "true"} if setup == "context" else None
    t0 = time.perf_counter()
    with RayCluster(base / "cluster", dirs) as cluster:
        started = time.perf_counter() - t0
        result = run_flwr(setup, out, ray_address=cluster.address, run_config=run_config, **kw)
        t1 = time.perf_counter()
    result.cluster_start_s, result.cluster_stop_s = round(started, 1), round(time.perf_counter() - t1, 1)
    result.nodes_moved = moved_nodes(dirs) if setup == "separate" else 0
    return result


def table(results: Sequence[RunResult]) -> str:
    head = (
        "| setup | status | rounds done | final acc. | rejected replies (why) | resynced later | client: no replica / "
        "starts anew | catch-ups + full syncs | bytes down / round | wall s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        why = ", ".join(f"{k} {v}" for k, v in sorted(r.rejected_why.items())) or "-"
        acc = "-" if r.final_accuracy is None else f"{r.final_accuracy:.4f}"
        lines.append(
            f"| {r.setup} | {r.status} | {r.rounds_completed}/{r.rounds} | {acc} | {r.rejected} ({why}) | "
            f"{r.resynced} | {r.client_no_replica} / {r.client_starts_anew} | {r.catch_ups} + {r.full_syncs} | "
            f"{r.bytes_down_per_round:,.0f} | {r.wall_s:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--supernodes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=0, help="0: only after the last round")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the logs, state folders and results")
    args = ap.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        ap.error(f"unknown setups {sorted(unknown)}; choose from {SETUPS}")
    out = Path(tempfile.mkdtemp(prefix="dlion-ray-", dir="/tmp"))  # short: Ray's socket paths are limited
    print(f"[ray_cluster] working in {out}; load average {os.getloadavg()[0]:.1f} (1 min)", flush=True)
    results = []
    for setup in setups:
        r = run_setup(setup, out, num_supernodes=args.supernodes, rounds=args.rounds, eval_every=args.eval_every)
        results.append(r)
        print(
            f"[ray_cluster] {setup}: {r.status}, {r.rounds_completed}/{r.rounds} rounds, acc {r.final_accuracy}, "
            f"rejected {r.rejected} {r.rejected_why}, resynced {r.resynced}, moved {r.nodes_moved}, "
            f"{r.bytes_down_per_round:,.0f} B down/round, {r.wall_s} s (cluster start {r.cluster_start_s} s, "
            f"stop {r.cluster_stop_s} s)\n  $ {r.command}",
            flush=True,
        )
    print(table(results))
    print(f"[ray_cluster] {os.cpu_count()} CPUs, load average now {os.getloadavg()[0]:.1f} (1 min)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if all(r.status == "finished:completed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
