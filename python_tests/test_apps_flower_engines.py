"""The Flower apps of fedkernels' algorithms on Flower's own machinery, in processes started
and stopped by the tests (the harness of test_integrations_flower_deployment.py: free
loopback ports, every wait bounded, a process that dies fails the wait with its log):

- ``test_example_app_on_a_local_deployment``: examples/flower_seed_method (SuPerFed-MM) with
  ``flwr run`` against a SuperLink and three SuperNodes (``--insecure`` on 127.0.0.1): the
  same metrics as ``fedkernels run``, bit for bit;
- ``test_a_supernode_killed_mid_round``: FedAU on three SuperNodes, one killed while its
  ClientApp trains in round 2: that round and the next aggregate the two others, record
  the lost client, and end as fedkernels run's rounds without it;
- ``test_flwr_run_on_the_simulation_engine``: the example on a SuperLink in simulation mode
  (Flower's simulation engine, Ray), skipped where Ray is not installed (it is not part of
  the test requirements: ``pip install "flwr[simulation]"``).

Every ClientApp is a process of its own in a deployment (per message), which imports torch
and loads the data: each test takes one to three minutes on two busy cores.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import textwrap
from pathlib import Path

import pytest
from local_ports import free_ports, listening

pytest.importorskip("flwr")

from app_parity_helpers import assert_same_metrics, simulate  # noqa: E402
from test_integrations_flower_deployment import (  # noqa: E402
    Deployment,
    _tool,
    _wait_for_result,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(_tool(t) for t in ("flower-superlink", "flower-supernode", "flwr")),
    reason="Flower's command-line tools are not installed",
)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flower_seed_method"

# The example's pyproject.toml, as the run config the ServerApp sees (with the overrides).
EXAMPLE_CONFIG = {
    "algorithm": "superfed-mm", "rounds": 10, "seed": 0, "device": "cpu", "eval_every": 1,
    "data.name": "digits", "partition.num_clients": 5, "partition.kind": "dirichlet",
    "partition.alpha": 0.5, "model.hidden": "64", "client.epochs": 1, "client.batch_size": 16,
    "client.lr": 0.1, "superfed-mm.start_fraction": 0.4, "superfed-mm.nu": 1.0,
    "superfed-mm.mu": 0.01,
}


def _run_config(values: dict) -> str:
    """``--run-config`` text (TOML values)."""
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


class AppDeployment(Deployment):
    """The harness, running a given App folder."""

    def __init__(self, tmp_path: Path, nodes: int, deadline_s: float, app: Path) -> None:
        super().__init__(tmp_path, nodes, deadline_s)
        self.app = app
        # the ClientApps and ServerApp import fedkernels as this process does
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(EXAMPLE.parent.parent), self.env.get("PYTHONPATH", "")])
        self.env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"


def test_example_app_on_a_local_deployment(tmp_path):
    result_path = tmp_path / "results.json"
    # the personalized evaluation (evaluate messages) after round 2 only: fewer processes
    overrides = {"rounds": 2, "eval_every": 2, "partition.num_clients": 3,
                 "model.hidden": "16", "result-path": str(result_path)}
    deployment = AppDeployment(tmp_path, nodes=3, deadline_s=600, app=EXAMPLE)
    try:
        deployment.start_superlink_and_nodes()
        deployment.run_app(_run_config(overrides))
        result = _wait_for_result(deployment, result_path)
    finally:
        deployment.stop()
    overrides.pop("result-path")
    assert result["summary"]["rounds_completed"] == 2
    assert "personalized_accuracy" in result["rounds"][-1]
    assert_same_metrics(result, simulate({**EXAMPLE_CONFIG, **overrides}))


KILL_APP_PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fkkill"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["fkkill"]

[tool.flwr.app]
publisher = "fedkernels"

[tool.flwr.app.components]
serverapp = "fkkill.server_app:app"
clientapp = "fkkill.client_app:app"

[tool.flwr.app.config]
algorithm = "fedau"
rounds = 3
result-path = ""
round-timeout = 240.0
straggler-patience = 10.0

[tool.flwr.app.config.partition]
num_clients = 3

[tool.flwr.app.config.participation]
kind = "full"

[tool.flwr.app.config.model]
hidden = "16"

[tool.flwr.app.config.app]
victim-partition = 2
victim-round = 1
marker-path = ""
"""

KILL_CLIENT = '''
import time

from fedkernels.apps.flower import client_app


def stall(message, context, call_next):
    """The victim's ClientApp says it trains, then waits to be killed with its SuperNode."""
    config = context.run_config
    if message.metadata.message_type == "train" \\
            and int(context.node_config["partition-id"]) == config["app.victim-partition"] \\
            and int(message.content["config"]["round"]) == config["app.victim-round"]:
        with open(config["app.marker-path"], "w") as f:
            f.write("training")
        time.sleep(300)
    return call_next(message, context)


app = client_app(mods=[stall])
'''


def test_a_supernode_killed_mid_round(tmp_path):
    app = tmp_path / "kill-app"
    (app / "fkkill").mkdir(parents=True)
    (app / "pyproject.toml").write_text(KILL_APP_PYPROJECT)
    (app / "fkkill" / "__init__.py").write_text("")
    (app / "fkkill" / "server_app.py").write_text(
        "from fedkernels.apps.flower import server_app\n\napp = server_app()\n")
    (app / "fkkill" / "client_app.py").write_text(textwrap.dedent(KILL_CLIENT))
    result_path, marker = tmp_path / "results.json", tmp_path / "victim-is-training"
    deployment = AppDeployment(tmp_path, nodes=3, deadline_s=600, app=app)
    try:
        deployment.start_superlink_and_nodes()
        deployment.run_app(_run_config({"result-path": str(result_path),
                                        "app.marker-path": str(marker)}))
        deployment.wait_for(lambda: marker.exists() or deployment.flwr_run_failed(),
                            "the victim's ClientApp to start round 2")
        deployment.expected_exits.add("supernode2")
        os.killpg(deployment.processes["supernode2"].pid, signal.SIGKILL)
        deployment.processes["supernode2"].wait(timeout=10)
        result = _wait_for_result(deployment, result_path)
    finally:
        deployment.stop()
    assert [r.get("lost_participants") for r in result["rounds"]] == [None, [2], [2]]
    assert [r["participants"] for r in result["rounds"]] == [3, 2, 2]
    config = {"algorithm": "fedau", "rounds": 3, "partition.num_clients": 3,
              "participation.kind": "full", "model.hidden": "16"}
    assert_same_metrics(result, simulate(config, lost={1: {2}, 2: {2}}))


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Flower's simulation engine needs Ray: pip install 'flwr[simulation]'")
# Ray starts each ClientApp's worker with OMP_NUM_THREADS=1: the reference runs on one thread
# too, so that its sums round as the workers' do (2 threads gave an ECE 3e-11 apart)
@pytest.mark.usefixtures("one_thread")
def test_flwr_run_on_the_simulation_engine(tmp_path):
    """``flwr run`` of the example against a SuperLink in simulation mode: five simulated
    SuperNodes (Ray actors), the ClientApps' kept state (SuPerFed's local models) in the
    nodes' contexts between rounds."""
    result_path = tmp_path / "results.json"
    deployment = AppDeployment(tmp_path, nodes=0, deadline_s=600, app=EXAMPLE)
    link_port, control_port = free_ports(2)
    (Path(deployment.env["FLWR_HOME"]) / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
    overrides = {"rounds": 2, "model.hidden": "16", "result-path": str(result_path)}
    try:
        deployment.start("superlink", [
            _tool("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
            "--host", "127.0.0.1", "--port", str(link_port),
            "--control-api-address", f"127.0.0.1:{control_port}",
            "--disable-runtime-dependency-installation"])
        deployment.wait_for(lambda: listening(link_port), "the SuperLink's port")
        deployment.start("flwr-run", [
            _tool("flwr"), "run", str(EXAMPLE), "loopback", "--stream",
            "--run-config", _run_config(overrides),
            "--federation-config", "num-supernodes=5 client-resources-num-cpus=1"])
        deployment.expected_exits.add("flwr-run")
        result = _wait_for_result(deployment, result_path)
    finally:
        deployment.stop()
    overrides.pop("result-path")
    assert_same_metrics(result, simulate({**EXAMPLE_CONFIG, **overrides}))
