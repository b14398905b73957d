"""The Flower apps of fedkernels' seed methods on Flower's own machinery, in processes started
and stopped by the tests (the harness of test_integrations_flower_deployment.py: free loopback
ports, every wait bounded, a process that dies fails the wait with its log). Each run's
results.json equals that of the ``fedkernels run`` command with the same configuration and
seed, bit for bit (``assert_same_metrics``: every metric of every round, the summary and the
per-client table compare with ``==``; only the times differ):

- ``TestLocalDeployment``: SuPerFed-MM and AAggFF-D, each a ``flwr run`` against ONE
  deployment started for both (a SuperLink and two SuperNodes, ``--insecure`` on 127.0.0.1);
  the runs are submitted together, so that one run's ClientApp start-ups overlap the other's
  waits;
- ``TestSimulationEngine``: SuPerFed-MM, AAggFF-D, FedAU and FedGO, one after the other,
  against ONE SuperLink
  in simulation mode (Flower's simulation engine, Ray: two simulated SuperNodes); skipped
  where Ray is not installed (``pip install "flwr[simulation]"``);
- ``test_a_supernode_killed_mid_round``: FedAU on three SuperNodes, one killed while its
  ClientApp trains in round 2: that round and the next aggregate the two others, record the
  lost client, and end as fedkernels run's rounds without it (``Simulation`` in this
  process, which can drop a client's reply where the command cannot).

The Apps: SuPerFed-MM and AAggFF-S run examples/flower_seed_method as it is; the others a
copy whose pyproject.toml also lists their keys (``flwr run --run-config`` overrides only
listed keys). Every run has two rounds on two clients. The reference is ``fedkernels run``
(its ``main``, in this process) with the App's whole run config as flags: the run config's
translation is checked against the command line's. Ray starts each ClientApp's worker with
one torch thread; the deployment's processes and the reference get one thread too, so that
their sums round alike (on two threads a personalized ECE came out 3e-11 apart).

Every ClientApp of a deployment is a process of its own (per message, one message at a time
per SuperNode) that imports torch and loads the data: on two busy cores the two deployment
runs take about a minute together, the four simulation-engine runs about 12-15 s
each, the killed SuperNode about a minute and a half.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from local_ports import free_ports, listening

pytest.importorskip("flwr")

import tomli  # noqa: E402  (Flower's dependencies, as Flower reads and writes the App's TOML)
import tomli_w  # noqa: E402
from app_parity_helpers import assert_same_metrics, simulate  # noqa: E402
from test_integrations_flower_deployment import (  # noqa: E402
    Deployment,
    _tool,
    _wait_for_result,
    app_pyproject,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(_tool(t) for t in ("flower-superlink", "flower-supernode", "flwr")),
    reason="Flower's command-line tools are not installed",
)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flower_seed_method"
NODES = 2

# Every run: two rounds on two clients (one SuperNode each), a 16-unit MLP, the personalized
# evaluation (SuPerFed's evaluate messages) after round 2 only; the example's other settings.
COMMON = {"rounds": 2, "eval_every": 2, "partition.num_clients": NODES, "model.hidden": "16"}
# What each method changes besides (FedGO needs server data; the participation patterns that
# AAggFF-D and FedAU are about).
METHODS: dict[str, dict[str, Any]] = {
    "superfed-mm": {},
    "superfed-lm": {"superfed-lm.start_fraction": 0.5, "superfed-lm.local_init": "copy_global"},
    "aaggff-s": {},
    "aaggff-d": {"participation.kind": "uniform", "participation.fraction": 0.67},
    "fedau": {"participation.kind": "bernoulli", "participation.fraction": 0.5},
    "fedgo": {"data.server_fraction": 0.3, "fedgo.disc_epochs": 1, "fedgo.server_epochs": 1},
    "fedevg": {"fedevg.spc": 3},
}
# Keys the example's pyproject.toml does not list, with fedkernels' defaults: the copy lists them
# so that --run-config may set them.
ADDED_KEYS = {"participation.kind": "full", "participation.fraction": 0.1,
              "data.server_fraction": 0.0, "superfed-lm.start_fraction": 0.4,
              "superfed-lm.local_init": "independent", "fedgo.disc_epochs": 10,
              "fedgo.server_epochs": 2, "fedevg.spc": 10}
DEADLINE_S = 900
# A deployment starts a process per ClientApp message (a torch import each), so it runs the
# methods whose deployment path differs from the simulation engine's: client state kept in
# the SuperNode's context between rounds (SuPerFed-MM; LM keeps it the same way) and nodes
# left out of a round (AAggFF-D); FedAU runs on a deployment in
# test_a_supernode_killed_mid_round.
DEPLOYMENT_METHODS = ("superfed-mm", "aaggff-d")
# Flower's simulation engine (Ray, a run about half a minute on two busy cores) runs the methods
# whose path through it differs: node state between rounds (SuPerFed-MM), nodes left out of a
# round (AAggFF-D), random participation (FedAU) and server-side data (FedGO). SuPerFed-LM,
# AAggFF-S and FedEvg take those paths too; all seven run through Flower in test_apps_flower.py.
SIMULATION_ENGINE_METHODS = ("superfed-mm", "aaggff-d", "fedau", "fedgo")


def _run_config(values: dict) -> str:
    """``--run-config`` text (TOML values)."""
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


def _overrides(name: str) -> dict[str, Any]:
    return {"algorithm": name, **COMMON, **METHODS[name]}


def _app_config(app: Path) -> dict[str, Any]:
    """The App's run config as Flower flattens it (``section.field`` keys)."""
    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    project = tomli.loads((app / "pyproject.toml").read_text())
    return flat(project["tool"]["flwr"]["app"]["config"])


def _apps(folder: Path) -> dict[str, Path]:
    """Each method's App: the example itself where its pyproject.toml lists every key the
    method's run sets, else a copy that lists the added keys too."""
    copy = folder / "seed-method-app-all-keys"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    project = tomli.loads((EXAMPLE / "pyproject.toml").read_text())
    config = project["tool"]["flwr"]["app"]["config"]
    for key, value in ADDED_KEYS.items():
        head, field = key.split(".")
        assert field not in config.get(head, {}), f"the example lists {key} now"
        config.setdefault(head, {})[field] = value
    (copy / "pyproject.toml").write_text(tomli_w.dumps(project))
    listed = set(_app_config(EXAMPLE))
    return {name: EXAMPLE if set(_overrides(name)) <= listed else copy for name in METHODS}


def _fedkernels_run(app: Path, overrides: dict[str, Any], out: Path) -> dict[str, Any]:
    """``fedkernels run`` (its command line, in this process, one thread) of the App's run
    config with the overrides: every experiment key as a flag, the app's own keys and other
    algorithms' parameters left out (the ServerApp ignores those)."""
    from fedkernels.algorithms import available
    from fedkernels.apps.flower import APP_KEYS
    from fedkernels.cli import main

    config = {**_app_config(app), **overrides}
    others = set(available()) - {config["algorithm"]}
    flags = [f for k, v in config.items() if k not in APP_KEYS and k.split(".")[0] not in others
             for f in (f"--{k}", str(v))]
    threads = torch.get_num_threads()
    try:
        code = main(["run", *flags, "--threads", "1", "--out", str(out), "--no-progress",
                     "--no-plots"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, f"fedkernels run {' '.join(flags)} exited with {code}"
    return json.loads((out / "results.json").read_text())


class AppDeployment(Deployment):
    """The harness, running a given App folder."""

    def __init__(self, tmp_path: Path, nodes: int, deadline_s: float, app: Path) -> None:
        super().__init__(tmp_path, nodes, deadline_s)
        self.app = app
        # the ClientApps and ServerApp import fedkernels as this process does
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(EXAMPLE.parent.parent), self.env.get("PYTHONPATH", "")])
        self.env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"

    def submit(self, name: str, app: Path, overrides: dict[str, Any], *extra: str) -> Path:
        """``flwr run`` of ``app`` (process ``run-NAME``); returns its result path."""
        result = self.tmp_path / f"{name}-results.json"
        self.start(f"run-{name}", [
            _tool("flwr"), "run", str(app), "loopback", "--stream",
            "--run-config", _run_config({**overrides, "result-path": str(result)}), *extra])
        self.expected_exits.add(f"run-{name}")
        return result

    def result(self, name: str, path: Path) -> dict[str, Any]:
        """The run's results.json, once written; fails at once where its ``flwr run`` did."""
        run = self.processes[f"run-{name}"]

        def done() -> bool:
            if run.poll() not in (None, 0):
                pytest.fail(f"flwr run of {name} exited with status {run.returncode}:\n"
                            + self.log_tail(f"run-{name}") + "\n" + self.all_logs())
            return path.exists() and path.stat().st_size > 0

        self.wait_for(done, f"the result of {name}")
        return json.loads(path.read_text())  # written whole: a temporary renamed into place


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each method's App and run config."""
    apps = _apps(tmp_path_factory.mktemp("apps"))
    return {name: (apps[name], _overrides(name)) for name in METHODS}


@pytest.fixture(scope="module")
def reference(cases, tmp_path_factory):
    """``fedkernels run``'s results.json of a method, computed once for both engines."""
    results: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in results:
            app, overrides = cases[name]
            results[name] = _fedkernels_run(app, overrides, tmp_path_factory.mktemp(name))
        return results[name]

    return get


class TestLocalDeployment:
    """``flwr run`` of each of DEPLOYMENT_METHODS against one SuperLink and two SuperNodes."""

    @pytest.fixture(scope="class")
    @classmethod
    def deployment(cls, cases, tmp_path_factory):
        tmp_path = tmp_path_factory.mktemp("deployment")
        deployment = AppDeployment(tmp_path, nodes=NODES, deadline_s=DEADLINE_S, app=EXAMPLE)
        deployment.env["OMP_NUM_THREADS"] = "1"  # the nodes' ClientApps and the ServerApps
        try:
            deployment.start_superlink_and_nodes()
            paths = {name: deployment.submit(name, *cases[name]) for name in DEPLOYMENT_METHODS}
            yield deployment, paths
        finally:
            deployment.stop()

    @pytest.mark.parametrize("name", DEPLOYMENT_METHODS)
    def test_matches_fedkernels_run(self, deployment, reference, name):
        runs, paths = deployment
        result = runs.result(name, paths[name])
        assert result["summary"]["rounds_completed"] == COMMON["rounds"]
        if name.startswith("superfed"):
            assert "personalized_accuracy" in result["rounds"][-1]
        assert_same_metrics(result, reference(name))


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Flower's simulation engine needs Ray: pip install 'flwr[simulation]'")
class TestSimulationEngine:
    """``flwr run`` of each of SIMULATION_ENGINE_METHODS against one SuperLink in simulation
    mode: two simulated SuperNodes
    (Ray actors), the ClientApps' kept state (SuPerFed's local models) in the nodes' contexts
    between rounds."""

    @pytest.fixture(scope="class")
    @classmethod
    def superlink(cls, tmp_path_factory):
        tmp_path = tmp_path_factory.mktemp("simulation")
        deployment = AppDeployment(tmp_path, nodes=0, deadline_s=DEADLINE_S, app=EXAMPLE)
        deployment.env["OMP_NUM_THREADS"] = "1"  # the ServerApps; Ray sets it for the workers
        link_port, control_port = free_ports(2)
        (Path(deployment.env["FLWR_HOME"]) / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
        try:
            deployment.start("superlink", [
                _tool("flower-superlink"), "--insecure", "--simulation", "--isolation",
                "subprocess", "--host", "127.0.0.1", "--port", str(link_port),
                "--control-api-address", f"127.0.0.1:{control_port}",
                "--disable-runtime-dependency-installation"])
            deployment.wait_for(lambda: listening(link_port), "the SuperLink's port")
            yield deployment
        finally:
            deployment.stop()

    @pytest.mark.parametrize("name", SIMULATION_ENGINE_METHODS)
    def test_matches_fedkernels_run(self, superlink, cases, reference, name):
        app, overrides = cases[name]
        superlink.deadline = time.monotonic() + 300
        path = superlink.submit(name, app, overrides, "--federation-config",
                                f"num-supernodes={NODES} client-resources-num-cpus=1")
        result = superlink.result(name, path)
        assert result["summary"]["rounds_completed"] == COMMON["rounds"]
        assert_same_metrics(result, reference(name))


KILL_APP_PYPROJECT = app_pyproject("fkkill", """
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
""")

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
        deployment.kill_node_when(marker, "supernode2", "the victim's ClientApp to start round 2")
        result = _wait_for_result(deployment, result_path)
    finally:
        deployment.stop()
    assert [r.get("lost_participants") for r in result["rounds"]] == [None, [2], [2]]
    assert [r["participants"] for r in result["rounds"]] == [3, 2, 2]
    config = {"algorithm": "fedau", "rounds": 3, "partition.num_clients": 3,
              "participation.kind": "full", "model.hidden": "16"}
    assert_same_metrics(result, simulate(config, lost={1: {2}, 2: {2}}))
