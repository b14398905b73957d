"""Runs one NVFlare job in NVFlare's simulator (loopback, in this machine only) and writes the
final global model to a ``.npz`` file. Used by ``test_nvflare_simulator.py`` as a child process:

    python nvflare_sim_job.py {sag,sagdrop,fedavg} {nvflare,fedkernels} WORKSPACE OUT.npz [N_CLIENTS]

``sag``: the ScatterAndGather workflow with ``InTimeAccumulateWeightedAggregator`` (NVFlare's or
ours, the only difference between the two jobs is the component's module path), WEIGHT_DIFF
contributions, per-site aggregation weights. ``fedavg``: NVFlare's FedAvg controller with its
built-in aggregation (``nvflare``) or with ``WeightedModelAggregator`` (``fedkernels``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nvflare.apis.dxo import DataKind
from nvflare.app_common.shareablegenerators.full_model_shareable_generator import (
    FullModelShareableGenerator,
)
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather
from nvflare.job_config.api import FedJob
from nvflare_sim_components import (
    DiffTrainer,
    DroppingDiffTrainer,
    ModelTrainer,
    SavingFedAvg,
    SavingPersistor,
)

ROUNDS = 3


def aggregation_weights(n_clients: int) -> dict:
    return {f"site-{i}": 0.5 + 0.25 * i for i in range(1, n_clients + 1)}


def sag_job(which: str, out_path: str, n_clients: int) -> FedJob:
    if which == "nvflare":
        from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import (
            InTimeAccumulateWeightedAggregator,
        )
    else:
        from fedkernels.integrations.nvflare import InTimeAccumulateWeightedAggregator
    job = FedJob(name=f"sag_{which}", min_clients=n_clients)
    job.to_server(SavingPersistor(out_path=out_path), id="persistor")
    job.to_server(FullModelShareableGenerator(), id="shareable_generator")
    job.to_server(InTimeAccumulateWeightedAggregator(
        expected_data_kind=DataKind.WEIGHT_DIFF,
        aggregation_weights=aggregation_weights(n_clients),
    ), id="aggregator")
    job.to_server(ScatterAndGather(
        min_clients=n_clients, num_rounds=ROUNDS, wait_time_after_min_received=0,
        persistor_id="persistor",
        train_timeout=0, task_check_period=0.05,
    ))
    job.to_clients(DiffTrainer(), tasks=["train"])
    return job


# "sagdrop": the last site goes silent in round DROP_ROUND for longer than the server waits
# after the first n - 1 replies (WAIT_S); the round ends with the others, the late reply is
# refused, and the site is back for the next round.
DROP_ROUND = 1
WAIT_S = 8  # seconds (NVFlare takes an int)


def sag_drop_job(which: str, out_path: str, n_clients: int) -> FedJob:
    from fedkernels.integrations.nvflare import InTimeAccumulateWeightedAggregator

    job = FedJob(name="sagdrop_fedkernels", min_clients=n_clients)
    job.to_server(SavingPersistor(out_path=out_path), id="persistor")
    job.to_server(FullModelShareableGenerator(), id="shareable_generator")
    job.to_server(InTimeAccumulateWeightedAggregator(
        expected_data_kind=DataKind.WEIGHT_DIFF,
        aggregation_weights=aggregation_weights(n_clients),
    ), id="aggregator")
    job.to_server(ScatterAndGather(
        min_clients=n_clients - 1, num_rounds=ROUNDS, wait_time_after_min_received=WAIT_S,
        persistor_id="persistor", train_timeout=0, task_check_period=0.05,
    ))
    job.to_clients(DroppingDiffTrainer(drop_site=n_clients, drop_round=DROP_ROUND,
                                       silent_s=WAIT_S + 4.0), tasks=["train"])
    return job


def fedavg_job(which: str, out_path: str, n_clients: int) -> FedJob:
    kwargs = dict(num_clients=n_clients, num_rounds=ROUNDS, out_path=out_path, persistor_id="",
                  save_filename=None)
    if which == "nvflare":
        controller = SavingFedAvg(aggregation_weights=aggregation_weights(n_clients), **kwargs)
    else:
        from fedkernels.integrations.nvflare import WeightedModelAggregator

        controller = SavingFedAvg(
            aggregator=WeightedModelAggregator(aggregation_weights=aggregation_weights(n_clients)),
            **kwargs)
    job = FedJob(name=f"fedavg_{which}", min_clients=n_clients)
    job.to_server(controller)
    job.to_clients(ModelTrainer(), tasks=["train"])
    return job


def main() -> None:
    kind, which, workspace, out_path = sys.argv[1:5]
    n_clients = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    build = {"sag": sag_job, "sagdrop": sag_drop_job, "fedavg": fedavg_job}[kind]
    job = build(which, os.path.abspath(out_path), n_clients)
    # fedkernels is installed: keep FedJob from copying its sources into the job's custom/ folder
    job.set_app_packages(["fedkernels"])
    job.simulator_run(workspace, n_clients=n_clients, threads=n_clients)
    if not os.path.exists(out_path):
        sys.exit(f"the job ended without saving a global model to {out_path}")


if __name__ == "__main__":
    main()
