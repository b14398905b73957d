"""SuPerFed-MM/LM vs FedAvg vs FedProx on scikit-learn's digits with a pathological split
(every client holds 2 classes). Writes experiments/superfed_digits.json; docs/results/superfed.md reports it.

    OMP_NUM_THREADS=1 python experiments/superfed_digits.py --seeds 0 1 2

Metric for every method: the mean over ALL clients of the accuracy on the client's own test
split (20% of its data). FedAvg/FedProx: the final global model. SuPerFed: the mixed model
theta(lambda) on the grid 0, 0.1, ..., 1, with lambda picked per client (a) on its test split
(the paper's figure, an oracle choice), (b) on its training split; plus both endpoints.
local-only: every client trains alone on its training split (no federation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict

METHODS = {
    "fedavg": {},
    "fedprox": {"mu": 0.01},
    # these tables predate the validation split: lambda picked on train (nothing held out)
    "superfed-mm": {"nu": 1.0, "mu": 0.01, "start_fraction": 0.4, "lambda_selection": "train"},
    "superfed-lm": {"nu": 2.0, "mu": 0.01, "start_fraction": 0.4, "lambda_selection": "train"},
    "local-only": {},
}


def experiment(seed: int, rounds: int, clients: int, fraction: float, epochs: int = 5) -> dict:
    return {
        "rounds": rounds,
        "seed": seed,
        "eval_every": rounds,
        "checkpoint_every": rounds,
        "data": {"name": "digits", "test_fraction": 0.2},
        "partition": {"kind": "pathological", "num_clients": clients, "classes_per_client": 2},
        "participation": {"kind": "uniform", "fraction": fraction},
        "model": {"name": "mlp", "hidden": [200, 200]},
        "client": {
            "epochs": epochs,
            "batch_size": 10,
            "lr": 0.05,
            "lr_decay": 0.999,
            "momentum": 0.9,
            "weight_decay": 1e-4,
        },
    }


def local_only(cfg: ExperimentConfig, fraction: float) -> dict:
    """Baseline without federation: every client trains its own model (the same initial model,
    optimizer and batch size) on its training split alone, for its expected share of the
    run's local epochs (rounds x participation fraction x epochs), and is tested on its own
    test split."""
    from fedkernels.sim.client import batch_plan
    from fedkernels.sim.data import load_dataset
    from fedkernels.sim.federation import build_federation
    from fedkernels.sim.models import build_model
    from fedkernels.sim.seeding import numpy_rng

    dataset = load_dataset(cfg.data, cfg.partition.num_clients, cfg.seed)
    fed = build_federation(dataset, cfg.partition, cfg.data.test_fraction, cfg.seed)
    c = cfg.client
    epochs = max(1, round(cfg.rounds * fraction * c.epochs))
    accuracies = []
    for k, data in enumerate(fed.clients):
        model = build_model(cfg.model, fed.num_features, fed.num_classes, fed.image_shape, cfg.seed)
        opt = torch.optim.SGD(
            model.parameters(), lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay
        )
        rng = numpy_rng(cfg.seed, 999, k)
        plan_cfg = dataclasses.replace(c, epochs=epochs)
        for rows in batch_plan(data.num_train, plan_cfg, rng):
            index = torch.from_numpy(rows)
            loss = torch.nn.functional.cross_entropy(
                model(data.train_x[index]), data.train_y[index]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            model.eval()
            accuracies.append(float((model(data.test_x).argmax(1) == data.test_y).double().mean()))
    acc = torch.tensor(accuracies, dtype=torch.float64)
    return {
        "client_accuracy_mean": float(acc.mean()),
        "client_accuracy_std": float(acc.std(correction=0)),
        "local_epochs": epochs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", default=str(Path(__file__).with_name("superfed_digits.json")))
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        for method in args.methods:
            cfg = from_dict(
                ExperimentConfig,
                experiment(seed, args.rounds, args.clients, args.fraction, args.epochs),
                "experiment",
            )
            start = time.perf_counter()
            if method == "local-only":
                summary = local_only(cfg, args.fraction)
            else:
                summary = Simulation(cfg, build_strategy(method, METHODS[method])).run().summary
            row = {
                "method": method,
                "seed": seed,
                "seconds": time.perf_counter() - start,
                **{k: v for k, v in summary.items() if isinstance(v, (int, float))},
            }
            results.append(row)
            keys = [
                "client_accuracy_mean",
                "personalized_accuracy_oracle",
                "personalized_accuracy_train_selected",
                "local_endpoint_accuracy",
            ]
            print(method, seed, {k: round(row[k], 4) for k in keys if k in row}, flush=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "settings": experiment(0, args.rounds, args.clients, args.fraction, args.epochs)
                | {"seeds": args.seeds},
                "methods": METHODS,
                "runs": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
