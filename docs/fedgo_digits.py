"""FedGO and its baselines on scikit-learn's digits with a Dirichlet(0.1) split (an offline,
image-like stand-in for the paper's CIFAR setting): half of every class is the server's
unlabeled set U, the other half goes to K = 20 clients by Dirichlet(0.1) label skew; 40%
participation (8 clients per round); MLP classifier; the distillation methods use E_s server
epochs of Adam on U and MLP discriminators trained against U as the fake set (p_g = p_s, as in
the paper's toy example).

    python docs/fedgo_digits.py [--seeds 3] [--rounds 20] [--out docs/fedgo_digits.json]

Reports the server model's test accuracy (pooled over the clients' test splits) at the last
round and the best round, and the ensemble accuracy of the last round's teachers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict

METHODS = ["fedavg", "feddf", "fedet", "entropy-kd", "dafkd", "fedgo"]


def experiment(method: str, seed: int, rounds: int, server_epochs: int, alpha: float):
    cfg = from_dict(ExperimentConfig, {
        "rounds": rounds,
        "seed": seed,
        "data": {"name": "digits", "server_fraction": 0.5},
        "partition": {"kind": "dirichlet", "num_clients": 20, "alpha": alpha},
        "participation": {"kind": "uniform", "fraction": 0.4},
        "model": {"name": "mlp", "hidden": [64]},
        "client": {"epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    })
    params = None if method == "fedavg" else {"server_epochs": server_epochs, "disc_epochs": 20}
    start = time.time()
    result = Simulation(cfg, build_strategy(method, params)).run()
    accs = [r["test_accuracy"] for r in result.rounds]
    return {
        "final": accs[-1],
        "best": max(accs),
        "ensemble": result.rounds[-1].get("ensemble_accuracy"),
        "curve": accs,
        "seconds": time.time() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--server-epochs", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--out", default="docs/fedgo_digits.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {"settings": vars(args), "methods": {}}
    for method in METHODS:
        runs = [experiment(method, s, args.rounds, args.server_epochs, args.alpha)
                for s in range(args.seeds)]
        summary = {}
        for key in ("final", "best", "ensemble"):
            vals = [r[key] for r in runs if r[key] is not None]
            if vals:
                summary[key] = [statistics.mean(vals), statistics.pstdev(vals)]
        out["methods"][method] = {"summary": summary, "runs": runs}
        line = "  ".join(f"{k} {100*v[0]:5.1f}±{100*v[1]:4.1f}" for k, v in summary.items())
        print(f"{method:11s} {line}  ({sum(r['seconds'] for r in runs):.0f} s)", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
