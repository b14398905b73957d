"""A real Flower deployment on loopback: one SuperLink and two SuperNodes (separate processes,
started and stopped by the test), a Flower App submitted with ``flwr run``, and a ServerApp
that runs fedkernels' FedAvg strategy for three rounds. In every round the ServerApp also
hands the same replies to Flower's own FedAvg and records the largest difference.

Bounded in time: every wait has a deadline, and the processes are killed (their process
groups) whatever happens. About 30-40 s on two cores, most of it process start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

BIN = Path(sys.executable).parent


def _tool(name: str) -> str | None:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name)


pytestmark = pytest.mark.skipif(
    not all(_tool(t) for t in ("flower-superlink", "flower-supernode", "flwr")),
    reason="Flower's command-line tools are not installed",
)

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fkdeploy"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedkernels"

[tool.flwr.app.components]
serverapp = "fkdeploy.server_app:app"
clientapp = "fkdeploy.client_app:app"

[tool.flwr.app.config]
num-server-rounds = 3
result-path = ""
"""

CLIENT_APP = '''
import torch  # noqa: F401  (ArrayRecord.to_torch_state_dict needs it imported)
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    # Deterministic "training": client p moves every array by 0.1 (p + 1) and reports
    # 10 (p + 1) examples, so FedAvg moves the model by (10*0.1 + 20*0.2) / 30 per round.
    p = int(context.node_config["partition-id"])
    state = msg.content["arrays"].to_torch_state_dict()
    new = {k: v + 0.1 * (p + 1) for k, v in state.items()}
    metrics = MetricRecord({"num-examples": 10 * (p + 1), "train_loss": 1.0 + p})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)
'''

SERVER_APP = '''
import json

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedkernels.integrations.flower import FedAvg

app = ServerApp()


class CheckedFedAvg(FedAvg):
    """fedkernels' FedAvg, and Flower's on the same replies for comparison."""

    differences = []

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        ours, metrics = super().aggregate_train(server_round, replies)
        if ours is None:
            raise RuntimeError("no valid replies in round %d" % server_round)
        theirs, _ = FlowerFedAvg().aggregate_train(server_round, replies)
        self.differences.append(max(
            float(np.abs(ours[k].numpy() - theirs[k].numpy()).max()) for k in ours))
        return ours, metrics


@app.main()
def main(grid: Grid, context: Context) -> None:
    rounds = int(context.run_config["num-server-rounds"])
    strategy = CheckedFedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    initial = {"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=rounds,
                            timeout=60)
    arrays = {k: v.tolist() for k, v in result.arrays.to_torch_state_dict().items()}
    with open(context.run_config["result-path"], "w") as f:
        json.dump({"arrays": arrays, "rounds": sorted(result.train_metrics_clientapp),
                   "differences": strategy.differences}, f)
'''


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait_for_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def _stop(process: subprocess.Popen) -> None:
    """Ends a process the test started, with the children in its process group."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def test_fedavg_on_superlink_and_supernodes(tmp_path):
    app = tmp_path / "app"
    (app / "fkdeploy").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "fkdeploy" / "__init__.py").write_text("")
    (app / "fkdeploy" / "client_app.py").write_text(textwrap.dedent(CLIENT_APP))
    (app / "fkdeploy" / "server_app.py").write_text(textwrap.dedent(SERVER_APP))
    home = tmp_path / "flwr-home"
    home.mkdir()
    link_port, *node_ports = _free_ports(3)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
    result_path = tmp_path / "result.json"
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1",
               PYTHONUNBUFFERED="1")

    processes: list[subprocess.Popen] = []
    logs = []

    def start(name: str, args: list[str]) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        logs.append((name, log))
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=tmp_path, start_new_session=True)
        processes.append(process)
        return process

    deadline = time.monotonic() + 150
    try:
        start("superlink", [_tool("flower-superlink"), "--insecure", "--host", "127.0.0.1",
                            "--port", str(link_port),
                            "--disable-runtime-dependency-installation"])
        _wait_for_port(link_port, deadline)
        for p, port in enumerate(node_ports):
            start(f"supernode{p}", [
                _tool("flower-supernode"), "--insecure", "--superlink",
                f"127.0.0.1:{link_port}", "--host", "127.0.0.1", "--port", str(port),
                "--node-config", f"partition-id={p} num-partitions=2"])
        run = subprocess.run(
            [_tool("flwr"), "run", str(app), "loopback", "--stream",
             "--run-config", f'result-path="{result_path}"'],
            env=env, cwd=tmp_path, capture_output=True, text=True,
            timeout=max(10.0, deadline - time.monotonic()))
        for _ in range(40):  # the ServerApp writes the file just before the run ends
            if result_path.exists():
                break
            time.sleep(0.25)
        if not result_path.exists():
            print(run.stdout, run.stderr)
            for name, _ in logs:
                print(f"--- {name}.log\n" + (tmp_path / f"{name}.log").read_text()[-3000:])
        assert result_path.exists(), "the Flower run wrote no result (logs above)"
    finally:
        for process in reversed(processes):
            _stop(process)
        for _, log in logs:
            log.close()

    result = json.loads(result_path.read_text())
    assert result["rounds"] == [1, 2, 3]
    assert max(result["differences"]) < 1e-6  # fedkernels FedAvg == Flower FedAvg
    per_round = (10 * 0.1 + 20 * 0.2) / 30
    for values in result["arrays"].values():
        flat = [v for row in values for v in row] if isinstance(values[0], list) else values
        assert flat == pytest.approx([3 * per_round] * len(flat), rel=1e-6)
