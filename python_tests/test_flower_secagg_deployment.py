"""SecAgg+ with the fused ring arithmetic on a real Flower deployment: one SuperLink and three
SuperNodes on loopback (separate processes), a legacy App whose ServerApp runs
``DefaultWorkflow(fit_workflow=FusedSecAggPlusWorkflow(...))`` and whose ClientApp carries
``fused_secaggplus_mod``. The protocol's state lives in each SuperNode's context between the
four stages, each stage a fresh ClientApp process.

In the masked-vector stage one SuperNode is killed while its client trains, after it has
shared its keys: the server must rebuild its pairwise masks from the survivors' shares. The
aggregate equals the survivors' weighted mean of the updates they reported (each client
saves what it sent) to the fixed-point precision."""

from __future__ import annotations

import shutil
import textwrap

import numpy as np
import pytest
import straggler_grid

pytest.importorskip("flwr")
pytest.importorskip("cryptography")

from test_integrations_flower_deployment import (  # noqa: E402
    Deployment,
    _wait_for_result,
    app_pyproject,
)

from fedkernels.integrations.flower.secagg import fixed_point_scale  # noqa: E402

pytestmark = pytest.mark.slow

PYPROJECT = app_pyproject("fksecagg", """
    round-timeout = 180.0
    straggler-patience = 10.0
    clipping-range = 4.0
    quantization-range = 4194304
    max-weight = 100.0
    result-path = ""
    updates-dir = ""
    victim-partition = -1
    marker-path = ""
""")

CLIENT_APP = '''
import time
from pathlib import Path

import numpy as np
from flwr.client import ClientApp, NumPyClient

from fedkernels.integrations.flower.secagg import fused_secaggplus_mod

SHAPES = [(6, 4), (4,), (300,)]


class Client(NumPyClient):
    def __init__(self, partition, config):
        self.partition, self.config = partition, config

    def fit(self, parameters, config):
        p = self.partition
        if p == self.config["victim-partition"]:
            Path(self.config["marker-path"]).write_text("training")  # killed now
            time.sleep(300)
        rng = np.random.default_rng(100 + p)
        update = [rng.normal(0.0, 0.5, s).astype(np.float32) for s in SHAPES]
        np.savez(Path(self.config["updates-dir"]) / f"client-{p}.npz", *update)
        return update, 10 + 7 * p, {}


def client_fn(context):
    return Client(int(context.node_config["partition-id"]), context.run_config).to_client()


app = ClientApp(client_fn=client_fn, mods=[fused_secaggplus_mod])
'''

SERVER_APP = '''
import json
import os

import numpy as np
from flwr.common import ndarrays_to_parameters
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

from fedkernels.integrations.flower.secagg import FusedSecAggPlusWorkflow
from fksecagg.client_app import SHAPES
from fksecagg.straggler_grid import StragglerTimeout

app = ServerApp()


@app.main()
def main(grid, context):
    config = context.run_config
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=3,
                      min_available_clients=3, initial_parameters=ndarrays_to_parameters(
                          [np.zeros(s, np.float32) for s in SHAPES]))
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1),
                           strategy=strategy)
    workflow = FusedSecAggPlusWorkflow(
        num_shares=3, reconstruction_threshold=2, clipping_range=config["clipping-range"],
        quantization_range=config["quantization-range"], max_weight=config["max-weight"],
        timeout=config["round-timeout"])
    DefaultWorkflow(fit_workflow=workflow)(
        StragglerTimeout(grid, config["straggler-patience"]), legacy)
    arrays = [a.numpy().tolist() for a in legacy.state.array_records[MAIN_PARAMS_RECORD].values()]
    with open(config["result-path"] + ".tmp", "w") as f:
        json.dump({"arrays": arrays}, f)
    os.replace(config["result-path"] + ".tmp", config["result-path"])
'''

CLIP, QRANGE, MAX_WEIGHT = 4.0, 4194304, 100.0


class SecAggDeployment(Deployment):
    """The harness, running the SecAgg+ App above."""

    def __init__(self, tmp_path, nodes, deadline_s):
        super().__init__(tmp_path, nodes, deadline_s)
        shutil.rmtree(self.app)
        package = self.app / "fksecagg"
        package.mkdir(parents=True)
        (self.app / "pyproject.toml").write_text(PYPROJECT)
        (package / "__init__.py").write_text("")
        (package / "client_app.py").write_text(textwrap.dedent(CLIENT_APP))
        (package / "server_app.py").write_text(textwrap.dedent(SERVER_APP))
        shutil.copy(straggler_grid.__file__, package / "straggler_grid.py")


def test_a_supernode_killed_after_sharing_its_keys(tmp_path):
    result_path, marker = tmp_path / "result.json", tmp_path / "victim-is-training"
    updates = tmp_path / "updates"
    updates.mkdir()
    deployment = SecAggDeployment(tmp_path, nodes=3, deadline_s=420)
    try:
        deployment.start_superlink_and_nodes()
        deployment.run_app(f'result-path="{result_path}" updates-dir="{updates}" '
                           f'victim-partition=2 marker-path="{marker}"')
        deployment.kill_node_when(marker, "supernode2", "the victim's client to start training")
        result = _wait_for_result(deployment, result_path)
    finally:
        deployment.stop()

    survivors = [0, 1]
    assert sorted(f.name for f in updates.iterdir()) == ["client-0.npz", "client-1.npz"]
    sent = {p: list(np.load(updates / f"client-{p}.npz").values()) for p in survivors}
    weights = {p: 10 + 7 * p for p in survivors}
    total = sum(weights.values())
    want = [sum(weights[p] * sent[p][t].astype(np.float64) for p in survivors) / total
            for t in range(len(sent[0]))]
    # Each survivor's w x and w are off by at most half a fixed-point step (w in max-weight
    # units); the float32 result adds its own rounding.
    step = 1.0 / fixed_point_scale(CLIP, QRANGE)
    big = max(float(np.abs(a).max()) for p in survivors for a in sent[p])
    atol = len(survivors) * step / 2 * (1 + big) / (total / MAX_WEIGHT) + 2**-24 * big
    got = [np.asarray(a) for a in result["arrays"]]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)
