"""Run the app on Flower's Deployment Engine on this machine: a SuperLink, n SuperNodes, TLS, node auth.

Usage::

    python -m flower_dlion_app.deploy --nodes 3 --run-config "num-server-rounds=5" [--work DIR]
    python -m flower_dlion_app.deploy certs --out DIR --host superlink.example.org [--nodes N] [--days D]

The second makes the credentials of a real deployment (examples/edge/README.md).

What it does, in order (every process it starts is stopped by its PID at the end, also when a
step fails):

1. makes a throwaway CA, a server certificate for 127.0.0.1/localhost signed by it, and one
   ECDSA (P-384) key pair per SuperNode (``cryptography``, which Flower already depends on);
2. writes a Flower config (``$FLWR_HOME/config.toml``, in the work folder) with a connection
   ``local-tls`` to the SuperLink that trusts the CA;
3. starts ``flower-superlink`` with TLS and ``--enable-supernode-auth``, registers each node's
   public key (``flwr supernode register``), and starts ``flower-supernode`` i with its private
   key, the CA and ``--node-config "partition-id=i num-partitions=n"``;
4. ``flwr run . local-tls`` and waits for the run to finish by polling ``flwr ls --run-id ID``
   (``flwr run --stream`` exits 0 even when a run fails), then reports the status and the
   SuperLink's own ``network-traffic`` counters.

Each SuperNode runs with ``--isolation subprocess`` (Flower's default: the SuperNode starts a
``flower-superexec`` that starts one ClientApp process per message) unless ``--isolation
process`` is given (the launcher then starts each node's ``flower-superexec`` itself; in
Flower 1.41 that still starts one ClientApp process per message).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Deployment", "free_port", "main", "make_certificates", "make_credentials", "make_node_key"]

APP_ROOT = Path(__file__).resolve().parent.parent  # the folder with pyproject.toml


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_certificates(
    folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: float = 2
) -> tuple[Path, Path, Path]:
    """A CA and a SuperLink certificate for ``hosts`` (names or IPs): (ca.crt, server.pem, server.key).

    Valid for ``days``; the default is a throwaway pair for 127.0.0.1 / localhost.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flower-dlion CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    san = x509.SubjectAlternativeName(names)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.crt", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in OpenSSH format (what Flower's SuperNode auth reads): (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return private, public


@dataclass
class Deployment:
    """A SuperLink and n SuperNodes on 127.0.0.1 with TLS and SuperNode authentication."""

    work: Path
    nodes: int
    isolation: str = "subprocess"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work = self.work.resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.work / "flwr-home"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }
        bin_dir = str(Path(sys.executable).parent)
        self.env["PATH"] = bin_dir + os.pathsep + self.env.get("PATH", "")
        self.ca, self.cert, self.key = make_certificates(self.work / "certs")
        self.keys = [make_node_key(self.work / "keys", f"node{i}") for i in range(self.nodes)]
        home = Path(self.env["FLWR_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "local-tls"\n\n[superlink.local-tls]\n'
            f'address = "127.0.0.1:{self.port}"\nroot-certificates = "{self.ca}"\ninsecure = false\n'
        )

    # ------------------------------------------------------------------ processes
    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = (self.work / f"{name}.log").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI against this deployment."""
        return subprocess.run(
            ["flwr", *args], env=self.env, cwd=APP_ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )

    def start_superlink(self) -> None:
        """Start the SuperLink (TLS, SuperNode auth) and wait until its Control API answers."""
        self._start(
            "superlink",
            [
                "flower-superlink",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--ssl-certfile", str(self.cert), "--ssl-keyfile", str(self.key), "--ssl-ca-certfile", str(self.ca),
                "--enable-supernode-auth",
                "--database", str(self.work / "state.db"),
            ],
        )  # fmt: skip
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.ls() is not None:  # the Control API answers over TLS
                return
            if self.procs["superlink"].poll() is not None:
                break
            time.sleep(1)
        raise RuntimeError(f"the SuperLink did not come up; see {self.work / 'superlink.log'}")

    def ls(self, *args: str) -> dict[str, Any] | None:
        """``flwr ls --format json`` (``args`` e.g. ``--run-id ID``); None unless it succeeded.

        ``flwr`` exits 0 even when it cannot reach the SuperLink: its JSON says ``success``.
        """
        done = self.flwr("ls", *args, "--format", "json", timeout=60)
        try:
            out = json.loads(done.stdout)
        except ValueError:
            return None
        return out if done.returncode == 0 and out.get("success", True) and "runs" in out else None

    def register(self, i: int, timeout: float = 60) -> None:
        """Register node i's public key with the SuperLink (retried while the SuperLink is unavailable)."""
        deadline = time.time() + timeout
        while True:
            done = self.flwr("supernode", "register", str(self.keys[i][1]), "local-tls")
            text = done.stdout + done.stderr
            if done.returncode == 0 and "unavailable" not in text and "Error" not in text:
                return
            if time.time() > deadline:
                raise RuntimeError(f"flwr supernode register failed: {text}")
            time.sleep(2)

    def start_supernode(self, i: int, name: str | None = None) -> subprocess.Popen:
        """Start SuperNode i (partition i of n) with its private key and the CA.

        With ``isolation="process"`` the SuperNode does not start the process that launches
        ClientApps; this starts it (``flower-superexec``, pointed at the SuperNode's Runtime
        API) as its own process ``<name>-superexec``, as one would in a separate container.
        """
        name = name or f"supernode{i}"
        port = free_port()
        proc = self._start(
            name,
            [
                "flower-supernode",
                "--superlink", f"127.0.0.1:{self.port}",
                "--root-certificates", str(self.ca),
                "--auth-supernode-private-key", str(self.keys[i][0]),
                "--node-config", f"partition-id={i} num-partitions={self.nodes}",
                "--port", str(port),
                "--isolation", self.isolation,
            ],
        )  # fmt: skip
        if self.isolation == "process":
            self._start(
                f"{name}-superexec",
                ["flower-superexec", "--runtime-api-address", f"127.0.0.1:{port}", "--insecure"],
            )
        return proc

    def kill(self, name: str) -> None:
        """Kill one started process (and its children, and its SuperExec if any) by PID."""
        for key in (name, f"{name}-superexec"):
            proc = self.procs.pop(key, None)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop every process this deployment started (SIGTERM, then SIGKILL)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()

    # ------------------------------------------------------------------ runs
    def run(self, run_config: str, timeout: float = 1800) -> dict[str, Any]:
        """``flwr run`` the app, wait for it by polling ``flwr ls``; return the run's ``flwr ls`` record."""
        args = ["run", ".", "local-tls"] + (["--run-config", run_config] if run_config else [])
        started = self.flwr(*args, timeout=300)
        match = re.search(r"run (\d+)", started.stdout + started.stderr)
        if started.returncode != 0 or match is None:
            raise RuntimeError(f"flwr run failed: {started.stdout}{started.stderr}")
        run_id = match.group(1)
        deadline = time.time() + timeout
        while time.time() < deadline:
            listed = self.ls("--run-id", run_id)
            if listed is not None and listed["runs"]:
                record = listed["runs"][0]
                if str(record["status"]).startswith("finished"):
                    return record
            time.sleep(2)
        raise TimeoutError(f"run {run_id} did not finish within {timeout} s")


def make_credentials(out: Path, hosts: tuple[str, ...], nodes: int, days: float) -> None:
    """What a real deployment needs: a CA, the SuperLink's certificate for ``hosts``, one key pair per node.

    ``out/certs``: ca.crt (give it to every SuperNode), server.pem and server.key (the SuperLink's);
    ``out/keys``: node<i> (node i's private key: give it to that device only) and node<i>.pub
    (register it with ``flwr supernode register``).
    """
    make_certificates(out / "certs", hosts, days)
    for i in range(nodes):
        make_node_key(out / "keys", f"node{i}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:
        parser = argparse.ArgumentParser(
            prog="python -m flower_dlion_app.deploy certs",
            description="Make the TLS certificates and SuperNode keys of a deployment (see make_credentials).",
        )
        parser.add_argument("--out", type=Path, required=True, help="folder for certs/ and keys/")
        parser.add_argument("--host", action="append", required=True, help="the SuperLink's name or IP (repeatable)")
        parser.add_argument("--nodes", type=int, default=2, help="SuperNode key pairs to make")
        parser.add_argument("--days", type=float, default=365, help="validity of the certificates")
        args = parser.parse_args(argv[1:])
        make_credentials(args.out, tuple(args.host), args.nodes, args.days)
        print(f"wrote {args.out / 'certs'} and {args.out / 'keys'}")
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--run-config", default="num-server-rounds=5")
    parser.add_argument("--work", type=Path, default=Path("deploy-work"))
    parser.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    dep = Deployment(args.work, args.nodes, args.isolation)
    try:
        dep.start_superlink()
        for i in range(args.nodes):
            dep.register(i)
            dep.start_supernode(i)
        record = dep.run(args.run_config, timeout=args.timeout)
    finally:
        dep.stop()
    print(json.dumps(record, indent=2))
    return 0 if record["status"] == "finished:completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
