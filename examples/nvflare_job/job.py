"""Runs FedAvg on the digits in NVFlare's simulator, with fedkernels' aggregator in NVFlare's
FedAvg controller, on NVFlare's public job API (FedAvgRecipe, SimEnv).

    python job.py                          # 2 sites, 3 rounds
    python job.py --sites 4 --rounds 10
"""

from __future__ import annotations

import argparse
import os

import torch
from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.recipe import SimEnv

import fedkernels
from fedkernels.integrations.nvflare import WeightedModelAggregator

from task import MLP, evaluate, load_test

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workspace", default=None,
                        help="where the simulator writes the sites' folders and logs "
                             "(default: NVFlare's, /tmp/nvflare/simulation)")
    args = parser.parse_args()

    recipe = FedAvgRecipe(
        name="digits_fedavg", model=MLP(), min_clients=args.sites, num_rounds=args.rounds,
        train_script=os.path.join(HERE, "client.py"), train_args=f"--num-partitions {args.sites}",
        # the only line that differs from NVFlare's own FedAvg: the weighted mean is fused
        aggregator=WeightedModelAggregator())
    where = {"workspace_root": args.workspace} if args.workspace else {}
    # NVFlare copies the aggregator's source files into the job's custom/ folder when they lie
    # outside site-packages (an editable install). An editable install is found after the path,
    # so the copies, which lack the compiled kernels, would win: put the real package on the path.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fedkernels.__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    run = recipe.execute(SimEnv(num_clients=args.sites, **where))

    # the server's persistor saved the last global model in the job's workspace
    path = os.path.join(run.get_result(), "server", "simulate_job", "app_server",
                        "FL_global_model.pt")
    model = MLP()
    model.load_state_dict(torch.load(path)["model"])
    loss, accuracy = evaluate(model, *load_test())
    print(f"final global model: test accuracy {accuracy:.3f}, loss {loss:.3f}")


if __name__ == "__main__":
    main()
