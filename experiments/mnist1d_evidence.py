"""Every method family's comparison re-run on MNIST-1D with the 1-D CNN of MNIST-1D, 5 seeds,
each method's learning rate chosen on a validation split (docs/results/*.md report it).

MNIST-1D (Greydanus and Kobak 2020) is generated offline and is hard for small models (the
published CNN reaches 94 %, an MLP 68 %), so unlike the 8x8 digits it leaves room between the
methods. Every client holds at least 50 test samples (``--test-sizes`` counts them, seed by
seed, without training). The tables, in order of importance:

- ``superfed-clean``: SuPerFed's pathological split (2 classes per client, 50 clients, 5 per
  round) against training alone, FedAvg, FedAvg + fine-tuning, Ditto and APFL;
  ``superfed-noise``: the same with symmetric label noise 0.2 on the training labels;
  ``superfed-long``: SuPerFed-MM, FedAvg-FT and local with 150 rounds instead of 60;
- ``fairness``: AAggFF-D, VRed and Semi-VRed against FedAvg and q-FFL, 100 clients
  (Dirichlet 0.5), 10 sampled per round, with the worst-10 % of clients (``fairness-short``:
  the first, shorter run with momentum SGD, whose rates all hit the top of the grid);
- ``fedau-bernoulli``, ``fedau-markov``, ``fedau-cyclic``: FedAU against averaging the
  participants, averaging all and the known-p oracle, 100 clients whose participation
  probabilities depend on their labels (FedAU's experiment);
- ``fedgo``: FedGO against FedAvg, FedDF, Fed-ET and DaFKD's weighting, 20 clients,
  Dirichlet 0.1, an unlabeled server set;
- ``fedevg-a0.01``, ``fedevg-a1``: FedEvg against FedCVAE, 10 clients, two classes each
  (the thesis' Dirichlet 0.01, which leaves clients empty here) and Dirichlet 1.

Protocol, the same for every method of a table: the learning rate (client SGD's; FedEvg's and
FedCVAE's own Adam rate) is chosen from a grid of three values (``LR_GRID``; ``PLAIN_GRID`` for
the plain SGD of the fairness and FedAU tables; ``ADAM_GRID``) by one run per value on seed 0
with 20 % of every client's training rows held out as validation (test rows not loaded), by the
table's criterion; then seeds 0-4 run at the chosen rate and are scored on the test rows. For CPU time,
``superfed-noise`` reuses the rates ``superfed-clean`` chose and the Markov and cyclic FedAU
tables those of the Bernoulli one. Method parameters other than the rate are the papers'
defaults or earlier tables' validation choices, fixed before any run.

Every finished cell (table, method, phase, seed, lr) is written to ``--out`` at once (atomic
replace), and a rerun skips the cells already there, so an interrupted run resumes where it
stopped::

    OMP_NUM_THREADS=1 nice -n 5 python experiments/mnist1d_evidence.py            # everything
    python experiments/mnist1d_evidence.py --tables superfed-clean,superfed-noise # some tables
    python experiments/mnist1d_evidence.py --report superfed-clean                # print a table
    python experiments/mnist1d_evidence.py --plot                                 # the figures
    python experiments/mnist1d_evidence.py --test-sizes    # test samples per client, no training

Writes ``experiments/mnist1d_evidence.json`` and ``experiments/mnist1d_evidence_<family>.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.atomic_files import replacing
from fedkernels.sim.config import ConfigError, from_dict
from fedkernels.sim.data import load_dataset, stratified_split
from fedkernels.sim.dataset import Dataset
from fedkernels.sim.federation import build_federation
from fedkernels.sim.paired_stats import paired_difference
from fedkernels.sim.run import prepare_data
from fedkernels.sim.tabular import DataWarning

HERE = Path(__file__).resolve().parent
OUT = HERE / "mnist1d_evidence.json"
SEEDS = [0, 1, 2, 3, 4]
TUNE_SEED = 0
LR_GRID = [0.01, 0.03, 0.1]  # client SGD with momentum 0.9
PLAIN_GRID = [0.1, 0.3, 1.0]  # client SGD without momentum
ADAM_GRID = [3e-4, 1e-3, 3e-3]  # FedEvg's and FedCVAE's client Adam
VALIDATION_FRACTION = 0.2

SGD = {"momentum": 0.9, "weight_decay": 1e-4}
CNN = {"name": "mnist1d_cnn"}

# ----------------------------------------------------------------------------- the tables

SUPERFED_TREE = {
    "rounds": 60,
    "data": {"name": "mnist1d", "num_samples": 12500, "test_fraction": 0.2},
    "partition": {"kind": "pathological", "num_clients": 50, "classes_per_client": 2},
    "participation": {"kind": "uniform", "fraction": 0.1},
    "model": CNN,
    "client": {"epochs": 2, "batch_size": 50, **SGD},
}
SUPERFED_METHODS = [  # (label, algorithm, parameters): the papers' defaults
    ("local", "local", {}),
    ("FedAvg", "fedavg", {}),
    ("FedAvg-FT", "fedavg-ft", {}),
    ("Ditto", "ditto", {}),
    ("APFL", "apfl", {}),
    ("SuPerFed-MM", "superfed-mm", {}),
    ("SuPerFed-LM", "superfed-lm", {}),
]
NOISE_METHODS = [m for m in SUPERFED_METHODS if m[0] != "FedAvg-FT"]
PA, PW, ECE = "personalized_accuracy", "personalized_accuracy_worst10", "personalized_ece"
SUPERFED_PAIRS = [  # the paper's claims (SuPerFed first) and the baselines among themselves
    *[(sf, base, m) for sf in ("SuPerFed-MM", "SuPerFed-LM")
      for base in ("FedAvg-FT", "Ditto", "local", "APFL") for m in (PA, PW)],
    ("SuPerFed-MM", "SuPerFed-LM", PA), ("FedAvg-FT", "local", PA), ("Ditto", "local", PA),
    ("Ditto", "FedAvg-FT", PA), ("FedAvg-FT", "local", PW), ("Ditto", "local", PW),
]
NOISE_PAIRS = [  # under noise the paper also claims the best calibration (lowest ECE)
    *[(sf, base, m) for sf in ("SuPerFed-MM", "SuPerFed-LM")
      for base in ("Ditto", "local", "FedAvg") for m in (PA, PW, ECE)],
    ("Ditto", "local", PA), ("Ditto", "local", ECE),
]

# 100 clients of a Dirichlet(0.5) split; half of every client's samples are its test rows, and
# every client has at least 100 samples, hence at least 50 test samples
MANY_CLIENTS = {
    "data": {"name": "mnist1d", "num_samples": 30000, "test_fraction": 0.5},
    "partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 100, "min_samples": 100},
    "model": CNN,
}
FAIR_TREE = {
    **MANY_CLIENTS,
    "rounds": 200,
    "participation": {"kind": "uniform", "fraction": 0.1},
    "client": {"steps": 5, "batch_size": 32},  # plain SGD: momentum restarts every round
}
# the first, shorter run (every method chose the top of LR_GRID and stayed near 54 %)
FAIR_SHORT_TREE = {**FAIR_TREE, "rounds": 100, "client": {"steps": 5, "batch_size": 32, **SGD}}
FAIR_METHODS = [  # method parameters: the values the digits tables chose on validation
    ("FedAvg", "fedavg", {}),
    ("q-FFL", "qffl", {"q": 1.0}),
    ("AAggFF-D", "aaggff-d", {"cdf": "logistic"}),
    ("VRed", "vred", {"beta": 1.0}),
    ("Semi-VRed", "semi-vred", {"beta": 1.0}),
]
FEDAU_TREE = {
    **MANY_CLIENTS,
    "rounds": 200,
    "participation": {"fraction": 0.1, "probability_model": "label_correlated",
                      "min_probability": 0.02, "label_concentration": 0.1},
    "client": {"steps": 5, "batch_size": 16},  # plain SGD, as FedAU's code
}
FEDAU_METHODS = [
    ("avg participants", "avg-participating", {}),
    ("avg all", "avg-all", {}),
    ("FedAU (K=50)", "fedau", {"cutoff": 50}),
    ("known p_n", "known-p", {}),  # the oracle FedAU estimates: separates weights from estimate
]

FEDAU_PAIRS = [(a, b, m) for a, b in (("FedAU (K=50)", "avg participants"),
                                       ("FedAU (K=50)", "avg all"),
                                       ("FedAU (K=50)", "known p_n"),
                                       ("known p_n", "avg participants"),
                                       ("avg all", "avg participants"))
               for m in ("test_accuracy", "client_accuracy_worst10")]

FEDGO_TREE = {
    "rounds": 50,
    "data": {"name": "mnist1d", "num_samples": 30000, "test_fraction": 0.5,
             "server_fraction": 0.1},
    "partition": {"kind": "dirichlet", "alpha": 0.1, "num_clients": 20, "min_samples": 100},
    "participation": {"kind": "uniform", "fraction": 0.4},
    "model": CNN,
    "client": {"steps": 20, "batch_size": 32, **SGD},
}
DISTILL = {"server_epochs": 2}
DISCRIMINATORS = {"disc_arch": "mlp", "disc_epochs": 5}  # fake data: U itself (no generator)
FEDGO_METHODS = [
    ("FedAvg", "fedavg", {}),
    ("FedDF", "feddf", DISTILL),
    ("Fed-ET", "fedet", DISTILL),
    ("DaFKD weights", "dafkd", {**DISTILL, **DISCRIMINATORS}),
    ("FedGO", "fedgo", {**DISTILL, **DISCRIMINATORS}),
]

FEDEVG_COMMON = {"hidden": [128, 128], "batch_size": 32, "server_epochs": 100, "spc": 10}
FEDEVG_METHODS = [
    ("FedEvg", "fedevg", {**FEDEVG_COMMON, "clamp": False}),
    ("FedCVAE", "fedcvae", {**FEDEVG_COMMON, "output": "linear"}),
]


def _fedevg_tree(alpha: float) -> dict[str, Any]:
    # at alpha = 0.01 a Dirichlet draw leaves clients empty, so that table gives every client
    # two classes (the minimum the authors' splitter enforces), as the digits tables did
    partition = ({"kind": "dirichlet", "alpha": alpha, "num_clients": 10, "min_samples": 250}
                 if alpha >= 0.1 else
                 {"kind": "pathological", "num_clients": 10, "classes_per_client": 2})
    return {
        "rounds": 50,
        "data": {"name": "mnist1d", "num_samples": 5000, "test_fraction": 0.2},
        "partition": partition,
        "participation": {"kind": "full"},
        "model": CNN,
    }


def _fedau(kind: str, **extra: Any) -> dict[str, Any]:
    tree = copy.deepcopy(FEDAU_TREE)
    tree["participation"].update(kind=kind, **extra)
    return tree


PERSONAL = ["personalized_accuracy", "personalized_accuracy_worst10", "personalized_ece",
            "client_accuracy_mean"]
FAIR = ["client_accuracy_mean", "client_accuracy_worst10", "client_accuracy_min",
        "test_accuracy"]
POOLED = ["test_accuracy", "client_accuracy_mean", "client_accuracy_worst10"]

TABLES: dict[str, dict[str, Any]] = {
    "superfed-clean": {
        "family": "superfed", "tree": SUPERFED_TREE, "methods": SUPERFED_METHODS,
        "criterion": "personal", "metrics": [*PERSONAL, "personalized_accuracy_oracle"],
        "baselines": ["FedAvg-FT", "local"], "pairs": SUPERFED_PAIRS,
        "title": "MNIST-1D, pathological (2 classes per client), 50 clients, 5 per round, "
                 "60 rounds x 2 local epochs (batch 50), 1-D CNN",
    },
    "superfed-noise": {
        "family": "superfed", "tree": {**SUPERFED_TREE,
                                       "data": {**SUPERFED_TREE["data"],
                                                "label_noise": "symmetric", "noise_rate": 0.2}},
        "methods": NOISE_METHODS, "criterion": "personal",
        "metrics": [*PERSONAL, "personalized_accuracy_oracle"],
        "baselines": ["FedAvg", "local"], "lrs_from": "superfed-clean",
        "pairs": NOISE_PAIRS,
        "title": "as superfed-clean, symmetric label noise 0.2 on the training labels",
    },
    "fairness": {
        "family": "fairness", "tree": FAIR_TREE, "methods": FAIR_METHODS, "criterion": "fair",
        "metrics": FAIR, "baselines": ["FedAvg", "q-FFL"], "lr_grid": PLAIN_GRID,
        "title": "MNIST-1D, Dirichlet(0.5), 100 clients, 10 sampled per round, 200 rounds x 5 "
                 "steps (batch 32, plain SGD), 1-D CNN",
    },
    "fairness-short": {
        "family": "fairness", "tree": FAIR_SHORT_TREE, "methods": FAIR_METHODS,
        "criterion": "fair", "metrics": FAIR, "baselines": ["FedAvg", "q-FFL"],
        "title": "as fairness with 100 rounds and SGD momentum 0.9 (grid 0.01-0.1)",
    },
    "fedau-bernoulli": {
        "family": "fedau", "tree": _fedau("bernoulli"), "methods": FEDAU_METHODS,
        "criterion": "pooled", "metrics": POOLED, "baselines": ["avg participants", "avg all"],
        "pairs": FEDAU_PAIRS, "lr_grid": PLAIN_GRID,
        "title": "MNIST-1D, Dirichlet(0.5), 100 clients, Bernoulli participation with "
                 "label-correlated p_n (mean 0.1, min 0.02), 200 rounds x 5 steps, 1-D CNN",
    },
    "fedau-markov": {
        "family": "fedau", "tree": _fedau("markov", markov_delta=0.05),
        "methods": FEDAU_METHODS, "criterion": "pooled", "metrics": POOLED,
        "baselines": ["avg participants", "avg all"], "pairs": FEDAU_PAIRS, "lrs_from": "fedau-bernoulli",
        "title": "as fedau-bernoulli, Markov participation (delta 0.05)",
    },
    "fedau-cyclic": {
        "family": "fedau", "tree": _fedau("cyclic", cycle_length=50),
        "methods": FEDAU_METHODS, "criterion": "pooled", "metrics": POOLED,
        "baselines": ["avg participants", "avg all"], "pairs": FEDAU_PAIRS, "lrs_from": "fedau-bernoulli",
        "title": "as fedau-bernoulli, cyclic participation (cycles of 50 rounds)",
    },
    "fedgo": {
        "family": "fedgo", "tree": FEDGO_TREE, "methods": FEDGO_METHODS, "criterion": "pooled",
        "metrics": POOLED, "baselines": ["FedAvg", "FedDF"],
        "title": "MNIST-1D, Dirichlet(0.1), 20 clients, 8 per round, 10 % of every class as "
                 "the server's unlabeled set, 50 rounds x 20 steps (batch 32), 1-D CNN",
    },
    "fedevg-a0.01": {
        "family": "fedevg", "tree": _fedevg_tree(0.01), "methods": FEDEVG_METHODS,
        "criterion": "pooled", "metrics": ["test_accuracy"], "baselines": ["FedCVAE"],
        "lr_param": "lr", "lr_grid": ADAM_GRID,
        "title": "MNIST-1D, 2 classes per client (for Dirichlet 0.01), 10 clients, full "
                 "participation, 50 rounds; a 1-D "
                 "CNN trained on the 100 synthetic samples, tested on the clients' real data",
    },
    "fedevg-a1": {
        "family": "fedevg", "tree": _fedevg_tree(1.0), "methods": FEDEVG_METHODS,
        "criterion": "pooled", "metrics": ["test_accuracy"], "baselines": ["FedCVAE"],
        "lr_param": "lr", "lr_grid": ADAM_GRID,
        "title": "as fedevg-a0.01, Dirichlet(1)",
    },
}
# A check of the clean table's budget: 2.5 times the rounds, the methods that matter for the
# paper's claim, the rates chosen for superfed-clean
TABLES["superfed-long"] = {
    **TABLES["superfed-clean"], "tree": {**SUPERFED_TREE, "rounds": 150},
    "methods": [m for m in SUPERFED_METHODS if m[0] in ("local", "FedAvg-FT", "SuPerFed-MM")],
    "lrs_from": "superfed-clean",
    "pairs": [(a, b, m) for a, b, m in SUPERFED_PAIRS
              if a in ("SuPerFed-MM", "FedAvg-FT") and b in ("FedAvg-FT", "local")],
    "title": "as superfed-clean with 150 rounds instead of 60 (rates of superfed-clean)",
}
FAMILIES = ["superfed", "fairness", "fedau", "fedgo", "fedevg"]

# ----------------------------------------------------------------------------- data

_DATASETS: dict[int, Dataset] = {}
_VALIDATION: dict[tuple[str, int], Dataset] = {}


def config_of(tree: dict[str, Any]) -> ExperimentConfig:
    return from_dict(ExperimentConfig, tree)


def dataset_for(tree: dict[str, Any]) -> Dataset:
    """The generated MNIST-1D pool (the generator is seeded by the package, not by our seed)."""
    n = tree["data"]["num_samples"]
    if n not in _DATASETS:
        cfg = config_of({**tree, "seed": 0})
        _DATASETS[n] = load_dataset(cfg.data, cfg.partition.num_clients, 0)
    return _DATASETS[n]


def validation_dataset(name: str, tree: dict[str, Any], seed: int) -> Dataset:
    """The clients' training rows only (test rows never loaded), each tagged with its client,
    labels as the clients hold them (noisy where the table adds noise): a run on it with the
    natural partition holds out ``VALIDATION_FRACTION`` of every client's rows as validation."""
    key = (name, seed)
    if key not in _VALIDATION:
        cfg = config_of({**tree, "seed": seed})
        fed = build_federation(dataset_for(tree), cfg.partition, cfg.data.test_fraction, seed,
                               0.0, label_noise=cfg.data.label_noise,
                               noise_rate=cfg.data.noise_rate,
                               stratify=stratified_split(cfg.data))
        kept = [c for c in fed.clients if c.num_train >= 2]
        groups = np.repeat(np.arange(len(kept)), [c.num_train for c in kept])
        _VALIDATION[key] = Dataset.from_tensors(
            torch.cat([c.train_x for c in kept]), torch.cat([c.train_y for c in kept]), groups,
            num_classes=fed.num_classes, image_shape=fed.image_shape)
    return _VALIDATION[key]


# ----------------------------------------------------------------------------- one cell

KEEP = ("test_accuracy", "client_accuracy_", "personalized_accuracy", "personalized_ece",
        "personalized_mce", "client_ece_mean")


def run_cell(name: str, spec: dict[str, Any], algorithm: str, params: dict[str, Any],
             lr: float, seed: int, phase: str) -> dict[str, Any]:
    tree = copy.deepcopy(spec["tree"])
    tree.update(seed=seed, algorithm=algorithm, vmap=True)
    tree.update(eval_every=tree["rounds"], checkpoint_every=tree["rounds"])
    lr_param = spec.get("lr_param")
    params = dict(params)
    if lr_param:
        params[lr_param] = lr
    else:
        tree["client"]["lr"] = lr
    if algorithm in ("fedevg", "fedcvae"):
        params["classify_every"] = tree["rounds"]
    if phase == "val":
        dataset = validation_dataset(name, spec["tree"], seed)
        tree["partition"] = {"kind": "natural", "num_clients": int(dataset.groups.max()) + 1}
        tree["data"] = {k: v for k, v in tree["data"].items()
                        if k not in ("label_noise", "noise_rate")}
        tree["data"]["test_fraction"] = VALIDATION_FRACTION
    else:
        dataset = dataset_for(spec["tree"])
    start = time.perf_counter()
    sim = Simulation(config_of(tree), build_strategy(algorithm, params), dataset=dataset)
    try:
        result = sim.run()
    except ConfigError as err:  # a loss-weighted rule refuses a NaN loss: the run diverged
        return {"summary": {}, "diverged": True, "error": str(err),
                "seconds": time.perf_counter() - start}
    summary = {k: v for k, v in result.summary.items()
               if k.startswith(KEEP) and (v is None or isinstance(v, (int, float)))}
    if "personalized_accuracy" not in summary:  # no personal models: the global model's
        summary["personalized_accuracy"] = summary.get("client_accuracy_mean")
        summary["personalized_accuracy_worst10"] = summary.get("client_accuracy_worst10")
        summary["personalized_ece"] = summary.get("client_ece_mean")
    return {"summary": summary, "diverged": bool(result.summary.get("diverged", False)),
            "seconds": time.perf_counter() - start}


def score(cell: dict[str, Any], criterion: str) -> float:
    s = cell["summary"]
    if cell["diverged"]:
        return -math.inf
    if criterion == "personal":
        value = s.get("personalized_accuracy")
    elif criterion == "fair":
        value = (s["client_accuracy_mean"] + s["client_accuracy_worst10"]) / 2
    else:
        value = s.get("test_accuracy")
    return -math.inf if value is None or not math.isfinite(value) else float(value)


# ----------------------------------------------------------------------------- bookkeeping


def cell_key(table: str, label: str, phase: str, seed: int, lr: float) -> str:
    return f"{table}|{label}|{phase}|{seed}|{lr:g}"


def load(path: Path) -> dict[str, Any]:
    results = json.loads(path.read_text()) if path.is_file() else {"tables": {}, "cells": {}}
    # the protocol as this version of the script states it (kept in the file for the record)
    results.update(protocol=" ".join(__doc__.split("\n\n")[3].split()), lr_grid=LR_GRID,
                   plain_grid=PLAIN_GRID, adam_grid=ADAM_GRID, seeds=SEEDS, tune_seed=TUNE_SEED,
                   validation_fraction=VALIDATION_FRACTION)
    return {k: results.pop(k) for k in [k for k in results if k not in ("tables", "cells")]} | {
        "tables": results["tables"], "cells": results["cells"]}


def save(results: dict[str, Any], path: Path) -> None:
    with replacing(path) as partial:
        Path(partial).write_text(json.dumps(results, indent=1) + "\n")


def chosen_lr(results: dict[str, Any], table: str, label: str) -> float | None:
    return results["tables"].get(table, {}).get("lr", {}).get(label)


def grid_of(name: str) -> list[float]:
    """The grid a table's rates were chosen from: its own, or that of the table it reuses."""
    spec = TABLES[name]
    return grid_of(spec["lrs_from"]) if spec.get("lrs_from") else spec.get("lr_grid", LR_GRID)


def grid_edges(results: dict[str, Any], table: str) -> dict[str, str]:
    """The methods whose chosen rate is the smallest or largest of its grid ("bottom"/"top"):
    there the best rate may lie outside what was tried."""
    grid = grid_of(table)
    edges = {}
    for label, lr in results["tables"].get(table, {}).get("lr", {}).items():
        if math.isclose(lr, max(grid)):
            edges[label] = "top"
        elif math.isclose(lr, min(grid)):
            edges[label] = "bottom"
    return edges


def client_test_sizes(name: str, seeds: list[int] = SEEDS) -> list[dict[str, Any]]:
    """Test samples per client of a table's federation, seed by seed, built as the test phase
    builds it (the same data set and :func:`prepare_data` call as the simulation) without
    training anything."""
    tree = TABLES[name]["tree"]
    rows = []
    for seed in seeds:
        cfg = config_of({**tree, "seed": seed})
        with warnings.catch_warnings():  # a single-class test split's AUROC: not asked here
            warnings.simplefilter("ignore", DataWarning)
            fed = prepare_data(cfg, torch.device("cpu"), dataset_for(tree)).federation
        sizes = np.array([c.num_test for c in fed.clients])
        rows.append({"seed": seed, "clients": len(sizes), "min": int(sizes.min()),
                     "median": float(np.median(sizes)), "max": int(sizes.max()),
                     "under_50": int((sizes < 50).sum())})
    return rows


def client_test_sizes_report(names: list[str], seeds: list[int] = SEEDS) -> str:
    """One row per table: test samples per client, min / median / max, seed by seed."""
    lines = ["Test samples per client, min / median / max, by seed:", "",
             "| table | clients | " + " | ".join(f"seed {s}" for s in seeds)
             + " | clients under 50 (all seeds) |", "|---|---|" + "---|" * (len(seeds) + 1)]
    for name in names:
        rows = client_test_sizes(name, seeds)
        lines.append(f"| {name} | {rows[0]['clients']} | " + " | ".join(
            f"{r['min']} / {r['median']:g} / {r['max']}" for r in rows)
            + f" | {sum(r['under_50'] for r in rows)} |")
    return "\n".join(lines) + "\n"


def run_table(name: str, results: dict[str, Any], path: Path) -> None:
    spec = TABLES[name]
    grid = grid_of(name)
    entry = results["tables"].setdefault(name, {"title": spec["title"], "lr": {},
                                                "validation": {}})
    entry.update(title=spec["title"], tree=spec["tree"], criterion=spec["criterion"],
                 grid=grid, methods={label: [algo, params]
                                     for label, algo, params in spec["methods"]})
    if spec.get("lrs_from"):
        entry["lrs_from"] = spec["lrs_from"]
    cells = results["cells"]

    def cell(label, algo, params, phase, seed, lr):
        key = cell_key(name, label, phase, seed, lr)
        if key not in cells:
            cells[key] = run_cell(name, spec, algo, params, lr, seed, phase)
            save(results, path)
            print(f"  {key}: score {score(cells[key], spec['criterion']):.4f} "
                  f"({cells[key]['seconds']:.0f} s)", flush=True)
        return cells[key]

    for label, algo, params in spec["methods"]:
        if spec.get("lrs_from"):
            lr = chosen_lr(results, spec["lrs_from"], label)
            if lr is None:
                raise SystemExit(f"{name} reuses the rates of {spec['lrs_from']}: run it first")
        else:
            scores = {lr: score(cell(label, algo, params, "val", TUNE_SEED, lr),
                                spec["criterion"]) for lr in grid}
            entry["validation"][label] = {f"{lr:g}": v for lr, v in scores.items()}
            lr = max(grid, key=lambda v: scores[v])  # ties: the first (smallest) rate
        entry["lr"][label] = lr
        save(results, path)
        for seed in SEEDS:
            cell(label, algo, params, "test", seed, lr)


# ----------------------------------------------------------------------------- report


def test_values(results: dict[str, Any], table: str, label: str, metric: str) -> list[float]:
    lr = chosen_lr(results, table, label)
    if lr is None:
        return []
    out = []
    for seed in SEEDS:
        c = results["cells"].get(cell_key(table, label, "test", seed, lr))
        if c is None:
            return []
        v = c["summary"].get(metric)
        out.append(math.nan if v is None else float(v))
    return out


NAMES = {"personalized_accuracy": "personalized acc", "personalized_accuracy_worst10":
         "personalized worst-10%", "personalized_ece": "ECE", "client_accuracy_mean":
         "global model, avg client", "client_accuracy_worst10": "worst-10%",
         "client_accuracy_min": "worst client", "test_accuracy": "pooled acc",
         "personalized_accuracy_oracle": "SuPerFed: λ on test (oracle)"}


LOWER_IS_BETTER = {"personalized_ece"}


def report(results: dict[str, Any], table: str) -> str:
    spec, entry = TABLES[table], results["tables"].get(table)
    if entry is None:
        return f"{table}: not run\n"
    metrics = spec["metrics"]
    lines = [f"{spec['title']}. Cells: mean ± std over seeds 0-4 (sample std), %; "
             "per-seed values of the first metric in brackets.", "",
             "| method | lr | " + " | ".join(NAMES.get(m, m) for m in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for label, _, _ in spec["methods"]:
        cells = []
        for i, m in enumerate(metrics):
            v = np.array(test_values(results, table, label, m))
            if v.size == 0 or np.isnan(v).all():
                cells.append("–")
                continue
            text = f"{100 * np.nanmean(v):.1f} ± {100 * np.nanstd(v, ddof=1):.1f}"
            if i == 0:
                text += " [" + ", ".join(f"{100 * x:.1f}" for x in v) + "]"
            cells.append(text)
        lr = entry["lr"].get(label)
        lines.append(f"| {label} | {'–' if lr is None else f'{lr:g}'} | " + " | ".join(cells)
                     + " |")
    lines += ["", "Paired differences, seed by seed (method minus baseline, points): mean ± "
              "std [95 % t-interval]; ahead/behind on seeds; verdict.", "",
              "| method − baseline | metric | difference [95 % CI] | ahead/behind | verdict |",
              "|---|---|---|---|---|"]
    pairs = spec.get("pairs") or [(label, base, m) for base in spec["baselines"]
                                  for label, _, _ in spec["methods"] if label != base
                                  for m in metrics[:2]]
    for label, base, m in pairs:
        a, b = test_values(results, table, label, m), test_values(results, table, base, m)
        if not a or not b or any(map(math.isnan, a + b)):
            continue
        d = paired_difference(a, b)
        # for ECE lower is better: the one "ahead" is the one with the lower value
        verdict = (d.verdict(label, base) if m not in LOWER_IS_BETTER
                   else d.verdict(base, label).replace("ahead", "ahead (lower)"))
        lines.append(f"| {label} − {base} | {NAMES.get(m, m)} | {d.text()} | "
                     f"{d.ahead}/{d.behind} | {verdict} |")
    val = entry.get("validation", {})
    if val:
        lines += ["", "Validation scores (seed 0, criterion " + spec["criterion"] + ") by "
                  "learning rate: " + "; ".join(
                      f"{label}: " + ", ".join(f"{lr} → {100 * s:.1f}" for lr, s in v.items())
                      for label, v in val.items())]
    elif spec.get("lrs_from"):
        lines += ["", f"Learning rates: those chosen for {spec['lrs_from']}."]
    edges = grid_edges(results, table)
    if edges:
        lines += ["", "Chosen at an end of the grid " + ", ".join(f"{v:g}" for v in grid_of(table))
                  + " (a rate outside it might do better; not tried): " + "; ".join(
                      f"{label} ({where})" for label, where in edges.items())]
    seconds = sum(c["seconds"] for k, c in results["cells"].items() if k.startswith(table + "|"))
    lines += ["", f"Run time of the table's cells: {seconds / 60:.1f} min (one thread)."]
    return "\n".join(lines) + "\n"


def paired_from_compare(path: Path, base: str, metrics: list[str]) -> str:
    """Every method minus ``base`` in a ``fedkernels compare`` JSON (older tables), seed by seed,
    with the 95 % t-interval: the paired evidence behind those pages' "A beats B"."""
    data = json.loads(path.read_text())
    entries = data["entries"] if isinstance(data, dict) else data
    by_label = {e["label"]: {r["seed"]: r["summary"] for r in e["runs"]} for e in entries}
    if base not in by_label:
        raise SystemExit(f"{path}: no method {base!r} (methods: {', '.join(by_label)})")
    lines = [f"{path.name}: method − {base}, points, mean ± std [95 % t-interval], "
             "ahead/behind", "", "| method | metric | difference | ahead/behind | verdict |",
             "|---|---|---|---|---|"]
    for label, runs in by_label.items():
        if label == base:
            continue
        for m in metrics:
            seeds = [s for s in runs if s in by_label[base] and runs[s].get(m) is not None
                     and by_label[base][s].get(m) is not None]
            if not seeds:
                continue
            d = paired_difference([runs[s][m] for s in seeds], [by_label[base][s][m] for s in seeds])
            lines.append(f"| {label} | {m} | {d.text()} | {d.ahead}/{d.behind} | "
                         f"{d.verdict(label, base)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], family: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [t for t in TABLES if TABLES[t]["family"] == family and t in results["tables"]]
    if not tables:
        return None
    fig, axes = plt.subplots(1, len(tables), figsize=(4.2 * len(tables), 3.6), squeeze=False)
    for ax, table in zip(axes[0], tables):
        spec = TABLES[table]
        metric = spec["metrics"][0]
        labels = [label for label, _, _ in spec["methods"]]
        for i, label in enumerate(labels):
            v = 100 * np.array(test_values(results, table, label, metric))
            if v.size:
                ax.bar(i, np.nanmean(v), color="C0", alpha=0.35)
                ax.plot(np.full(v.size, i) + np.linspace(-0.2, 0.2, v.size), v, "o", ms=3,
                        color="C0")
        ax.set_xticks(range(len(labels)), labels, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(f"{NAMES.get(metric, metric)} (%)")
        ax.set_title(table, fontsize=9)
    fig.tight_layout()
    out = HERE / f"mnist1d_evidence_{family}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", default=",".join(TABLES),
                        help=f"comma-separated, in order (default all: {','.join(TABLES)})")
    parser.add_argument("--report", metavar="TABLE", nargs="*",
                        help="print the markdown of these tables (all when none named); no runs")
    parser.add_argument("--plot", action="store_true", help="write the figures; no runs")
    parser.add_argument("--compare-json", metavar="FILE",
                        help="print paired differences from a fedkernels compare JSON; no runs")
    parser.add_argument("--base", help="--compare-json: the baseline's label")
    parser.add_argument("--metrics", default="client_accuracy_mean,client_accuracy_worst10",
                        help="--compare-json: comma-separated summary keys")
    parser.add_argument("--test-sizes", metavar="TABLE", nargs="*",
                        help="print the test samples per client of these tables' federations "
                             "(all when none named), seeds 0-4; builds the clients, no training")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if args.compare_json:
        print(paired_from_compare(Path(args.compare_json), args.base, args.metrics.split(",")))
        return 0
    torch.set_num_threads(1)
    if args.test_sizes is not None:
        unknown = [t for t in args.test_sizes if t not in TABLES]
        if unknown:
            parser.error(f"unknown tables {unknown}; choose from {list(TABLES)}")
        print(client_test_sizes_report(args.test_sizes or list(TABLES)))
        return 0
    path = Path(args.out)
    results = load(path)
    if args.report is not None:
        for table in args.report or list(TABLES):
            print(f"## {table}\n\n{report(results, table)}")
        return 0
    if args.plot:
        for family in FAMILIES:
            out = plot(results, family)
            if out:
                print(out)
        return 0
    names = [t for t in args.tables.split(",") if t]
    unknown = [t for t in names if t not in TABLES]
    if unknown:
        parser.error(f"unknown tables {unknown}; choose from {list(TABLES)}")
    for name in names:
        print(f"## {name} (pid {os.getpid()})", flush=True)
        start = time.perf_counter()
        run_table(name, results, path)
        print(report(results, name), flush=True)
        print(f"{name}: {(time.perf_counter() - start) / 60:.1f} min of wall time", flush=True)
        plot(results, TABLES[name]["family"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
