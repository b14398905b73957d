"""Runs this Flower App on a real deployment on this machine: one SuperLink and N SuperNodes
(separate processes on 127.0.0.1, without TLS: --insecure), then ``flwr run`` against them,
then stops them all.

    python run_deployment.py                      # 2 SuperNodes, 3 rounds
    python run_deployment.py --nodes 3 --run-config "num-server-rounds=10"

On real machines the same commands run on separate hosts: ``flower-superlink`` on the server,
one ``flower-supernode --superlink <server>:<port>`` per site, with TLS certificates instead of
--insecure. The Flower state (the SuperLink connection, installed apps) lives in a temporary
FLWR_HOME, so your own ~/.flwr is not touched; it is removed after a completed run, and kept
with the processes' logs (printed) otherwise. Exits with 0 when the run completed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APP = Path(__file__).resolve().parent
# the Flower executables next to this interpreter (a virtualenv need not be activated)
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not found:
        sys.exit(f"{name} not found: pip install 'flwr>=1.42'")
    return str(found)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    """Ends a started process and the children in its process group (ClientApps, ServerApp)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="SuperNodes to start (default 2)")
    parser.add_argument("--run-config", default="",
                        help='overrides of [tool.flwr.app.config], e.g. "num-server-rounds=5"')
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the run before giving up (default 600)")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="flwr-home-"))
    link_port, *node_ports = free_ports(1 + args.nodes)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local-deployment"\n\n'
        f'[superlink.local-deployment]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    # The SuperLink and SuperNodes start flwr-serverapp and flwr-clientapp by name.
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1",
               PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    processes: list[subprocess.Popen] = []
    code = 1

    def start(name: str, command: list[str]) -> subprocess.Popen:
        log = open(home / f"{name}.log", "w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        processes.append(process)
        return process

    try:
        # The app's dependencies are already installed here: no `uv sync` per run.
        superlink = start("superlink", [
            tool("flower-superlink"), "--insecure", "--host", "127.0.0.1",
            "--port", str(link_port), "--disable-runtime-dependency-installation"])
        deadline = time.monotonic() + 60
        while not listening(link_port):
            if superlink.poll() is not None or time.monotonic() > deadline:
                return 1
            time.sleep(0.25)
        for p, port in enumerate(node_ports):
            start(f"supernode{p}", [
                tool("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                "--host", "127.0.0.1", "--port", str(port),
                "--node-config", f"partition-id={p} num-partitions={args.nodes}"])
        print(f"SuperLink on 127.0.0.1:{link_port}, {args.nodes} SuperNodes", flush=True)
        run_config = f"min-nodes={args.nodes} {args.run_config}".strip()
        # --stream: flwr run prints the ServerApp's log and returns when the run has ended
        code = subprocess.run([tool("flwr"), "run", str(APP), "local-deployment", "--stream",
                               "--run-config", run_config], env=env, timeout=args.timeout,
                              check=False).returncode
        if code == 0:
            listed = subprocess.run([tool("flwr"), "list", "local-deployment", "--format", "json"],
                                    env=env, capture_output=True, text=True, timeout=60)
            runs = json.loads(listed.stdout).get("runs", [])
            if not runs or not all(r.get("status", "").endswith("completed") for r in runs):
                print(f"the run did not complete: {listed.stdout}", file=sys.stderr)
                code = 1
        return code
    finally:
        for process in reversed(processes):
            stop(process)
        if code == 0:
            shutil.rmtree(home, ignore_errors=True)
        else:  # keep the logs
            for log in sorted(home.glob("*.log")):
                print(f"--- {log}\n{log.read_text()[-2000:]}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
