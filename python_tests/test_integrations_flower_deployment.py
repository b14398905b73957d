"""A real Flower deployment on loopback: one SuperLink and two or three SuperNodes (separate
processes, started and stopped by the test), a Flower App submitted with ``flwr run``, and a
ServerApp that runs fedkernels' FedAvg strategy. In every round the ServerApp also hands the
same replies to Flower's own FedAvg and records the largest difference.

- ``test_supernode_killed_mid_round_and_restarted``: three SuperNodes; round 1 aggregates
  all three; in round 2 one of them is killed while its ClientApp trains, and the round ends
  with the two surviving replies (the ServerApp waits a bounded time for stragglers after the
  first reply); then a new SuperNode with the killed one's partition joins, a later round
  includes it again, and the final model is FedAvg over each round's replies.

Works without an activated virtualenv: the SuperLink starts ``flower-superexec`` and the
SuperNodes start ``flwr-clientapp`` from PATH, so the interpreter's ``bin/`` goes first on the
children's PATH. Bounded in time: every wait has a deadline, polls the started processes and
fails at once with the log of one that exited; the processes are killed (their process groups)
whatever happens. Each test takes about a minute on two idle cores, most of it process start-up
(each round starts one ClientApp process per node, which imports torch); the deadlines leave
room for a loaded machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import straggler_grid
from local_ports import free_ports, listening
from process_tree import with_descendants

pytest.importorskip("flwr")

BIN = Path(sys.executable).parent


def _tool(name: str) -> str | None:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name)


pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(_tool(t) for t in ("flower-superlink", "flower-supernode", "flwr")),
    reason="Flower's command-line tools are not installed",
)]

def app_pyproject(package: str, config: str) -> str:
    """A Flower App's pyproject.toml: ``package``'s server_app and client_app modules, and
    ``config`` (TOML lines of ``[tool.flwr.app.config]`` and its tables)."""
    return f"""
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{package}"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["{package}"]

[tool.flwr.app]
publisher = "fedkernels"

[tool.flwr.app.components]
serverapp = "{package}.server_app:app"
clientapp = "{package}.client_app:app"

[tool.flwr.app.config]
{textwrap.dedent(config).strip()}
"""


PYPROJECT = app_pyproject("fkdeploy", """
    num-server-rounds = 3
    round-timeout = 60.0
    straggler-patience = 0.0
    result-path = ""
    victim-partition = -1
    victim-round = 0
    marker-path = ""
""")

CLIENT_APP = '''
import time

import torch  # noqa: F401  (ArrayRecord.to_torch_state_dict needs it imported)
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    # Deterministic "training": client p moves every array by 0.1 (p + 1) and reports
    # 10 (p + 1) examples, so FedAvg over clients P moves the model by
    # sum_p (p + 1)^2 / (10 sum_p (p + 1)).
    p = int(context.node_config["partition-id"])
    server_round = int(msg.content["config"]["server-round"])
    if p == context.run_config["victim-partition"] and \\
            server_round == context.run_config["victim-round"]:
        with open(context.run_config["marker-path"], "w") as f:
            f.write("training")  # the test kills this SuperNode now
        time.sleep(300)
    state = msg.content["arrays"].to_torch_state_dict()
    new = {k: v + 0.1 * (p + 1) for k, v in state.items()}
    metrics = MetricRecord({"num-examples": 10 * (p + 1), "partition": float(p)})
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
from fkdeploy.straggler_grid import StragglerTimeout

app = ServerApp()


class CheckedFedAvg(FedAvg):
    """fedkernels' FedAvg, and Flower's on the same replies for comparison."""

    differences = []
    partitions = []

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        ours, metrics = super().aggregate_train(server_round, replies)
        if ours is None:
            raise RuntimeError("no valid replies in round %d" % server_round)
        theirs, _ = FlowerFedAvg().aggregate_train(server_round, replies)
        self.differences.append(max(
            float(np.abs(ours[k].numpy() - theirs[k].numpy()).max()) for k in ours))
        self.partitions.append(sorted(int(m.content["metrics"]["partition"])
                                      for m in replies if not m.has_error()))
        return ours, metrics


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    if float(config["straggler-patience"]) > 0:
        grid = StragglerTimeout(grid, float(config["straggler-patience"]))
    strategy = CheckedFedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    initial = {"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial),
                            num_rounds=int(config["num-server-rounds"]),
                            timeout=float(config["round-timeout"]))
    arrays = {k: v.tolist() for k, v in result.arrays.to_torch_state_dict().items()}
    with open(config["result-path"], "w") as f:
        json.dump({"arrays": arrays, "rounds": sorted(result.train_metrics_clientapp),
                   "differences": strategy.differences,
                   "partitions": strategy.partitions}, f)
'''




def _stop(process: subprocess.Popen) -> None:
    """Ends a process the test started: SIGTERM to its process group, then SIGKILL to all it
    started, found through /proc (a child in a session of its own is not in the group)."""
    if process.poll() is not None:
        return
    tree = with_descendants([process.pid])
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in reversed(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait(timeout=10)


class Deployment:
    """The processes of one test: started with their output in a log file each, watched by
    every wait, stopped at the end."""

    def __init__(self, tmp_path: Path, nodes: int, deadline_s: float):
        self.tmp_path = tmp_path
        self.app = tmp_path / "app"
        (self.app / "fkdeploy").mkdir(parents=True)
        (self.app / "pyproject.toml").write_text(PYPROJECT)
        (self.app / "fkdeploy" / "__init__.py").write_text("")
        (self.app / "fkdeploy" / "client_app.py").write_text(textwrap.dedent(CLIENT_APP))
        (self.app / "fkdeploy" / "server_app.py").write_text(textwrap.dedent(SERVER_APP))
        shutil.copy(straggler_grid.__file__, self.app / "fkdeploy" / "straggler_grid.py")
        home = tmp_path / "flwr-home"
        home.mkdir()
        self.link_port, *self.node_ports = free_ports(1 + nodes)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{self.link_port}"\ninsecure = true\n')
        # The children start further Flower executables by name (flower-superexec,
        # flwr-serverapp, flwr-clientapp): this interpreter's bin/ goes first on PATH.
        path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
        self.env = dict(os.environ, PATH=path, FLWR_HOME=str(home),
                        FLWR_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1")
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.expected_exits: set[str] = set()
        self.deadline = time.monotonic() + deadline_s

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp_path / f"{name}.log", "w")
        self.logs[name] = log
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                   cwd=self.tmp_path, start_new_session=True)
        self.processes[name] = process
        return process

    def log_tail(self, name: str, chars: int = 4000) -> str:
        self.logs[name].flush()
        return (self.tmp_path / f"{name}.log").read_text()[-chars:]

    def all_logs(self) -> str:
        return "\n".join(f"--- {name}.log\n{self.log_tail(name, 2500)}" for name in self.logs)

    def check_children(self) -> None:
        """Fails at once, with its log, if a started process has exited unexpectedly."""
        for name, process in self.processes.items():
            if name not in self.expected_exits and process.poll() is not None:
                pytest.fail(f"{name} exited with status {process.returncode} "
                            f"({' '.join(process.args[:2])}):\n{self.log_tail(name)}\n"
                            + self.all_logs())

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        while time.monotonic() < self.deadline:
            if condition():
                return
            self.check_children()
            time.sleep(0.25)
        pytest.fail(f"timed out waiting for {what}\n" + self.all_logs())

    def start_superlink_and_nodes(self) -> None:
        self.start("superlink", [_tool("flower-superlink"), "--insecure", "--host",
                                 "127.0.0.1", "--port", str(self.link_port),
                                 "--disable-runtime-dependency-installation"])
        self.wait_for(lambda: listening(self.link_port), "the SuperLink's port")
        for p, port in enumerate(self.node_ports):
            self.start(f"supernode{p}", [
                _tool("flower-supernode"), "--insecure", "--superlink",
                f"127.0.0.1:{self.link_port}", "--host", "127.0.0.1", "--port", str(port),
                "--node-config", f"partition-id={p} num-partitions={len(self.node_ports)}"])

    def run_app(self, run_config: str) -> None:
        """``flwr run`` (it exits when the run has finished)."""
        self.start("flwr-run", [_tool("flwr"), "run", str(self.app), "loopback", "--stream",
                                "--run-config", run_config])
        self.expected_exits.add("flwr-run")

    def flwr_run_failed(self) -> bool:
        code = self.processes["flwr-run"].poll()
        if code not in (None, 0):
            pytest.fail(f"flwr run exited with status {code}:\n" + self.all_logs())
        return False

    def kill_node_when(self, marker: Path, node: str, what: str) -> None:
        """SIGKILL to ``node``'s process group once ``marker`` exists (its ClientApp writes it
        where it stalls), as a machine that dies would go."""
        self.wait_for(lambda: marker.exists() or self.flwr_run_failed(), what)
        self.expected_exits.add(node)
        os.killpg(self.processes[node].pid, signal.SIGKILL)
        self.processes[node].wait(timeout=10)

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            _stop(process)
        for log in self.logs.values():
            log.close()


def _wait_for_result(deployment: Deployment, result_path: Path) -> dict:
    deployment.wait_for(lambda: result_path.exists() or deployment.flwr_run_failed(),
                        "the ServerApp's result file")
    deployment.wait_for(lambda: result_path.stat().st_size > 0, "the result file's content")
    time.sleep(0.2)  # written in one json.dump; let it finish
    return json.loads(result_path.read_text())


def _flat(values) -> list[float]:
    return [v for row in values for v in row] if isinstance(values[0], list) else values


def _move(partitions) -> float:
    """FedAvg's move of every array in one round, given the partitions that replied."""
    return sum((p + 1) ** 2 for p in partitions) / (10 * sum(p + 1 for p in partitions))


def test_a_child_that_exits_fails_the_wait_at_once(tmp_path):
    """The harness itself: children find Flower's executables without an activated
    virtualenv, and a child that dies fails the wait with its log instead of running into
    the deadline."""
    deployment = Deployment(tmp_path, nodes=0, deadline_s=120)
    assert deployment.env["PATH"].split(os.pathsep)[0] == str(BIN)
    try:
        deployment.start("superlink", [_tool("flower-superlink"), "--no-such-option"])
        with pytest.raises(pytest.fail.Exception) as failure:
            deployment.wait_for(lambda: False, "something that never happens")
    finally:
        deployment.stop()
    message = str(failure.value)
    assert "superlink exited with status" in message and "--no-such-option" in message
    assert "timed out" not in message


def test_supernode_killed_mid_round_and_restarted(tmp_path):
    """Kill a SuperNode mid-round, then a new SuperNode process with the killed one's partition joins: the
    rounds after it include that partition again, and the final model is FedAvg's over each
    round's replies (whichever rounds the new node made it into; the killed node may still be
    sampled until the SuperLink forgets it, costing that round the straggler patience)."""
    deployment = Deployment(tmp_path, nodes=3, deadline_s=420)
    result_path = tmp_path / "result.json"
    marker = tmp_path / "victim-is-training"
    try:
        deployment.start_superlink_and_nodes()
        deployment.run_app(f'result-path="{result_path}" num-server-rounds=4 '
                           f'round-timeout=180.0 straggler-patience=10.0 victim-partition=2 '
                           f'victim-round=2 marker-path="{marker}"')
        deployment.kill_node_when(marker, "supernode2", "the victim's ClientApp to start round 2")
        port = free_ports(1)[0]
        deployment.start("supernode2-restarted", [
            _tool("flower-supernode"), "--insecure", "--superlink",
            f"127.0.0.1:{deployment.link_port}", "--host", "127.0.0.1", "--port", str(port),
            "--node-config", "partition-id=2 num-partitions=3"])
        result = _wait_for_result(deployment, result_path)
    finally:
        deployment.stop()
    assert result["rounds"] == [1, 2, 3, 4]
    partitions = result["partitions"]
    assert partitions[:2] == [[0, 1, 2], [0, 1]]  # round 2: the survivors only
    assert 2 in partitions[3], partitions  # the restarted node is back by round 4
    assert max(result["differences"]) < 1e-6  # fedkernels FedAvg == Flower FedAvg
    expected = sum(_move(p) for p in partitions)
    for values in result["arrays"].values():
        assert _flat(values) == pytest.approx([expected] * len(_flat(values)), rel=1e-6)
