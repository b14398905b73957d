"""Fairness and participation comparisons in the shape of the papers' tables (offline, 2 CPU cores).

Each experiment is one ``fedkernels compare`` run (every method on the same clients, seeds
0,1,2,3,4 by default) whose table, JSON and plot are described in docs/results/participation.md and
docs/results/fairness.md:

- ``fedau-bernoulli``, ``fedau-markov``, ``fedau-cyclic``: FedAU against averaging the
  participants, the known-p oracle, MIFA and FedVARP, 100 clients of digits (Dirichlet 0.3)
  whose participation probabilities depend on their labels (FedAU's experiment);
- ``aaggff-device``: AAggFF-D against FedAvg, q-FedAvg, TERM, AFL, PropFair and Δ-FL,
  100 synthetic(1,1) users, 10% of them sampled per round;
- ``aaggff-device-digits``: the same line-up on digits split among 100 clients by
  Dirichlet(0.3), 10% sampled per round;
- ``aaggff-silo-heart``: AAggFF-S against the same baselines and FedMGDA+ on four sites of a
  heart-disease-like table (AUROC, as the paper's Heart experiment);
- ``aaggff-silo-uci-heart``: the same line-up on the UCI Heart Disease data itself, one client
  per hospital (``--heart-root DIR``: the folder with the repository's four
  ``processed.*.data`` files or the merged ``heart_disease_uci.csv``);
- ``aaggff-silo-digits``: the same on digits split among 7 clients;
- ``semivred``: VRed and Semi-VRed against FedAvg, 30 synthetic(1,1) users, full
  participation, with the paper's count of improved / degraded clients against FedAvg;
- ``semivred-digits``: the paper's whole Table 6 line-up (FedAvg, q-FFL, AFL, GiFair, TERM,
  PropFair, Δ-FL, VRed, Semi-VRed) on digits split among 30 clients by Dirichlet(0.1).

Hyperparameters are never chosen on test data. ``--tune`` selects them on a validation split
carved out of each client's training rows (20% of them; the test rows are not loaded into the
tuning runs) for seed 0, the same way for every method: first the client learning rate, from
``lr_grid``, with the experiment's first method (the baseline), the grid extended a step at a
time (up to three) while the best value is at its edge; then each method's own
parameters from its grid (the papers' grids) at that learning rate. The criterion is the
experiment's ``criterion``: validation pooled accuracy for the participation tables (the
FedAU paper's metric), the mean of average and worst-10% client accuracy for the fairness
tables, the mean of average and worst client AUROC for the heart table. The values the tuning
chose are written into ``experiments/tuning/tuning_<name>.json`` (every validation score is kept
there), and every later run of that experiment uses them; without that file a run uses the
values written below (the papers' choices, and a learning rate that trains FedAvg).

    python experiments/fairness_papers.py fedau-bernoulli             # one table, seeds 0-4
    python experiments/fairness_papers.py all --seeds 0,1,2           # every table, 3 seeds (faster)
    python experiments/fairness_papers.py semivred --tune             # the validation sweep first
    python experiments/fairness_papers.py all --save                  # into bench/results/

Without ``--save`` the results go to ``runs/fairness_papers/compare_<name>/``; with it to
``bench/results/compare_<name>/`` (table, JSON and plot).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedkernels.algorithms.registry import build_strategy
from fedkernels.cli.compare import compare, markdown_table
from fedkernels.sim.config import ExperimentConfig, from_dict
from fedkernels.sim.data import load_dataset, stratified_split
from fedkernels.sim.dataset import Dataset
from fedkernels.sim.federation import build_federation
from fedkernels.sim.paired_stats import paired_difference
from fedkernels.sim.run import Simulation

ROOT = Path(__file__).resolve().parent.parent
HEART_CSV = Path("runs") / "fairness_papers" / "heart_like.csv"  # relative to ROOT
TUNING_DIR = ROOT / "experiments" / "tuning"
LR_EXTENSIONS = 3

# --------------------------------------------------------------------------- the experiments

FEDAU_TREE = {
    "rounds": 300,
    "eval_every": 25,
    "vmap": True,
    "data": {"name": "digits"},
    "partition": {"kind": "dirichlet", "alpha": 0.3, "num_clients": 100},
    "model": {"name": "logreg"},
    "client": {"steps": 5, "batch_size": 16, "lr": 0.1},
    "participation": {"fraction": 0.1, "probability_model": "label_correlated",
                      "min_probability": 0.02, "label_concentration": 0.1},
}
FEDAU_METHODS = [
    # (label, algorithm, fixed parameters, grid of parameters chosen on validation)
    ("average participants", "avg-participating", {}, {}),
    ("FedAU (K=50)", "fedau", {"cutoff": 50}, {}),
    ("known p_n", "known-p", {}, {}),
    ("MIFA", "mifa", {}, {}),
    ("FedVARP", "fedvarp", {}, {}),
]
FEDAU_LONG = [("FedAU (K=∞)", "fedau", {"cutoff": 0}, {}), ("average all", "avg-all", {}, {})]

DEVICE_TREE = {
    "rounds": 300,
    "eval_every": 25,
    "vmap": True,
    "data": {"name": "synthetic", "alpha": 1.0, "beta": 1.0, "max_samples": 200},
    "partition": {"kind": "natural", "num_clients": 100},
    "participation": {"kind": "uniform", "fraction": 0.1},
    "model": {"name": "logreg"},
    "client": {"epochs": 1, "batch_size": 20, "lr": 0.05},
}
DEVICE_DIGITS_TREE = {
    "rounds": 300,
    "eval_every": 25,
    "vmap": True,
    "data": {"name": "digits"},
    "partition": {"kind": "dirichlet", "alpha": 0.3, "num_clients": 100},
    "participation": {"kind": "uniform", "fraction": 0.1},
    "model": {"name": "logreg"},
    "client": {"steps": 5, "batch_size": 16, "lr": 0.1},
}
FAIR_BASELINES = [
    ("FedAvg", "fedavg", {}, {}),
    ("q-FedAvg", "qfedavg", {"q": 0.1}, {"q": [0.1, 1.0, 5.0]}),
    ("TERM", "term", {"tilt": 0.1}, {"tilt": [0.1, 1.0, 10.0]}),
    ("AFL", "afl", {"step": 0.01}, {"step": [0.01, 0.1, 1.0]}),
    ("PropFair", "propfair", {"utility_bound": 3.0}, {"utility_bound": [2.0, 3.0, 5.0]}),
]
CDFS = ["weibull", "exponential", "frechet", "normal", "gumbel", "logistic"]
DEVICE_METHODS = [
    *FAIR_BASELINES,
    ("Δ-FL", "delta-fl", {"alpha": 0.5}, {"alpha": [0.2, 0.5, 0.8]}),
    ("AAggFF-D", "aaggff-d", {"cdf": "weibull"}, {"cdf": CDFS}),
]
SILO_METHODS = [
    *FAIR_BASELINES,
    ("FedMGDA+", "fedmgda", {"epsilon": 0.5}, {"epsilon": [0.1, 0.5, 1.0]}),
    ("AAggFF-S", "aaggff-s", {"cdf": "weibull"}, {"cdf": CDFS}),
]
HEART_TREE = {
    "rounds": 200,
    "eval_every": 20,
    "vmap": True,
    "data": {"name": "csv", "path": str(HEART_CSV), "label_column": "num",
             "positive_labels": ["1", "2", "3", "4"], "client_column": "site"},
    "partition": {"kind": "natural"},
    "participation": {"kind": "full"},
    "model": {"name": "logreg"},
    "client": {"epochs": 1, "batch_size": 20, "lr": 0.01},
}
# The UCI Heart Disease data itself (four hospitals, 920 patients), read from the folder that
# --heart-root names: the repository's four processed.*.data files or the merged
# heart_disease_uci.csv. Each hospital is a client; each client's test split is stratified.
UCI_HEART_TREE = {
    **HEART_TREE,
    "data": {"name": "heart", "root": None},
}
SILO_DIGITS_TREE = {
    "rounds": 100,
    "eval_every": 10,
    "vmap": True,
    "data": {"name": "digits"},
    "partition": {"kind": "dirichlet", "alpha": 0.3, "num_clients": 7},
    "participation": {"kind": "full"},
    "model": {"name": "mlp", "hidden": [32]},
    "client": {"epochs": 1, "batch_size": 20, "lr": 0.05},
}
SEMIVRED_TREE = {
    "rounds": 200,
    "eval_every": 20,
    "vmap": True,
    "data": {"name": "synthetic", "alpha": 1.0, "beta": 1.0, "max_samples": 400},
    "partition": {"kind": "natural", "num_clients": 30},
    "participation": {"kind": "full"},
    "model": {"name": "logreg"},
    "client": {"epochs": 1, "batch_size": 20, "lr": 0.05},
}
SEMIVRED_DIGITS_TREE = {
    "rounds": 100,
    "eval_every": 10,
    "vmap": True,
    "data": {"name": "digits", "test_fraction": 0.5},  # the paper's 50/50 split per client
    "partition": {"kind": "dirichlet", "alpha": 0.1, "num_clients": 30},
    "participation": {"kind": "full"},
    "model": {"name": "mlp", "hidden": [32]},
    "client": {"epochs": 1, "batch_size": 20, "lr": 0.05},
}
BETAS = [0.01, 0.05, 0.1, 0.2, 0.5, 1.0]
SEMIVRED_METHODS = [
    ("FedAvg", "fedavg", {}, {}),
    ("VRed", "vred", {"beta": 0.5}, {"beta": BETAS}),
    ("Semi-VRed", "semi-vred", {"beta": 0.5}, {"beta": BETAS}),
]

SEMIVRED_DIGITS_METHODS = [  # the methods and grids of the paper's Table 6
    ("FedAvg", "fedavg", {}, {}),
    ("q-FFL", "qffl", {"q": 0.1}, {"q": [0.01, 0.1, 1.0]}),
    ("AFL", "afl", {"step": 0.1}, {}),
    ("GiFair", "gifair", {"coefficient": 1.0}, {}),
    ("TERM", "term", {"tilt": 0.5}, {"tilt": [0.01, 0.1, 0.5, 1.0]}),
    ("PropFair", "propfair", {"utility_bound": 3.0}, {"utility_bound": [2.0, 3.0, 4.0, 5.0]}),
    ("Δ-FL", "delta-fl", {"alpha": 0.5}, {"alpha": [0.2, 0.5, 0.8]}),
    ("VRed", "vred", {"beta": 0.5}, {"beta": BETAS}),
    ("Semi-VRed", "semi-vred", {"beta": 0.5}, {"beta": BETAS}),
]


def _participation(kind: str, **extra: Any) -> dict[str, Any]:
    tree = copy.deepcopy(FEDAU_TREE)
    tree["participation"].update(kind=kind, **extra)
    return tree


EXPERIMENTS: dict[str, dict[str, Any]] = {
    "fedau-bernoulli": {
        "title": "digits, Dirichlet(0.3) over 100 clients, Bernoulli participation with "
        "label-correlated p_n (mean 0.1, min 0.02), logistic regression, 300 rounds x 5 steps",
        "tree": _participation("bernoulli"),
        "methods": FEDAU_METHODS, "long": FEDAU_LONG, "paired_with": ["known p_n"],
        "criterion": "pooled", "lr_grid": [0.03, 0.1, 0.3],
    },
    "fedau-markov": {
        "title": "digits, Dirichlet(0.3) over 100 clients, Markov participation (delta 0.05) "
        "with label-correlated p_n, logistic regression, 300 rounds x 5 steps",
        "tree": _participation("markov", markov_delta=0.05),
        "methods": FEDAU_METHODS, "long": FEDAU_LONG, "paired_with": ["known p_n"],
        "criterion": "pooled", "lr_grid": [0.03, 0.1, 0.3],
    },
    "fedau-cyclic": {
        "title": "digits, Dirichlet(0.3) over 100 clients, cyclic participation (cycles of 50 "
        "rounds) with label-correlated p_n, logistic regression, 300 rounds x 5 steps",
        "tree": _participation("cyclic", cycle_length=50),
        "methods": FEDAU_METHODS, "long": FEDAU_LONG, "paired_with": ["known p_n"],
        "criterion": "pooled", "lr_grid": [0.03, 0.1, 0.3],
    },
    "aaggff-device": {
        "title": "synthetic(1,1), 100 users, 10 sampled per round, logistic regression, "
        "300 rounds x 1 local epoch (batch 20)",
        "tree": DEVICE_TREE, "methods": DEVICE_METHODS, "long": [],
        "criterion": "fair", "lr_grid": [0.02, 0.05, 0.1],
    },
    "aaggff-device-digits": {
        "title": "digits, Dirichlet(0.3) over 100 clients, 10 sampled per round, logistic "
        "regression, 300 rounds x 5 steps (batch 16)",
        "tree": DEVICE_DIGITS_TREE, "methods": DEVICE_METHODS, "long": [],
        "criterion": "fair", "lr_grid": [0.03, 0.1, 0.3],
    },
    "aaggff-silo-heart": {
        "title": "heart-disease-like table, 4 sites (natural split), full participation, "
        "logistic regression, 200 rounds x 1 local epoch (batch 20)",
        "tree": HEART_TREE, "methods": SILO_METHODS, "long": [],
        "criterion": "auroc", "lr_grid": [0.01, 0.03, 0.1],
    },
    "aaggff-silo-uci-heart": {
        "title": "UCI Heart Disease, 4 hospitals (natural split), full participation, "
        "logistic regression, 200 rounds x 1 local epoch (batch 20)",
        "tree": UCI_HEART_TREE, "methods": SILO_METHODS,
        # the authors' code's update (docs/algorithms/aaggff.md, section 7) at the tuned CDF
        "long": [("AAggFF-S (code)", "aaggff-s", {"cdf": "logistic", "variant": "official"},
                  {})],
        "criterion": "auroc", "lr_grid": [0.01, 0.03, 0.1, 0.3, 1.0],
    },
    "aaggff-silo-digits": {
        "title": "digits, Dirichlet(0.3) over 7 clients, full participation, MLP 64-32-10, "
        "100 rounds x 1 local epoch (batch 20)",
        "tree": SILO_DIGITS_TREE, "methods": SILO_METHODS, "long": [],
        "criterion": "fair", "lr_grid": [0.02, 0.05, 0.1],
    },
    "semivred": {
        "title": "synthetic(1,1), 30 users, full participation, logistic regression, "
        "200 rounds x 1 local epoch (batch 20)",
        "tree": SEMIVRED_TREE, "methods": SEMIVRED_METHODS, "long": [],
        "criterion": "fair", "lr_grid": [0.02, 0.05, 0.1], "reference": "FedAvg",
    },
    "semivred-digits": {
        "title": "digits, Dirichlet(0.1) over 30 clients (half of each client's samples for "
        "test), full participation, MLP 64-32-10, 100 rounds x 1 local epoch (batch 20)",
        "tree": SEMIVRED_DIGITS_TREE, "methods": SEMIVRED_DIGITS_METHODS, "long": [],
        "criterion": "fair", "lr_grid": [0.02, 0.05, 0.1], "reference": "FedAvg",
    },
}

# --------------------------------------------------------------------------- helpers


def spec_text(label: str, name: str, params: dict[str, Any]) -> str:
    """``name:key=value;key=value@label``, the form ``fedkernels compare`` reads."""
    values = ";".join(f"{k}={v}" for k, v in params.items())
    return f"{name}{':' + values if values else ''}@{label}"


def ensure_heart_csv() -> None:
    """Writes the heart-disease-like table (experiments/make_heart_like_csv.py, seed 0) if missing."""
    if not HEART_CSV.is_file():
        HEART_CSV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "experiments" / "make_heart_like_csv.py"),
                        "--out", str(HEART_CSV)], check=True)


def tuned_values(name: str) -> dict[str, Any] | None:
    path = TUNING_DIR / f"tuning_{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def apply_tuning(spec: dict[str, Any], tuning: dict[str, Any] | None):
    """The experiment's tree and methods with the tuned learning rate and parameters."""
    tree = copy.deepcopy(spec["tree"])
    methods = list(spec["methods"])
    if tuning is None:
        return tree, methods
    tree["client"]["lr"] = tuning["lr"]
    chosen = tuning["params"]
    methods = [(label, name, {**fixed, **chosen.get(label, {})}, grid)
               for label, name, fixed, grid in methods]
    return tree, methods


# --------------------------------------------------------------------------- tuning


def validation_dataset(tree: dict[str, Any], seed: int) -> Dataset:
    """The clients' training rows only, each row tagged with its client: a tuning run on it
    (natural partition) splits every client's training rows into train and validation. A
    client with a single training row cannot be split and is left out of the tuning runs."""
    config = from_dict(ExperimentConfig, {**tree, "seed": seed})
    data = load_dataset(config.data, config.partition.num_clients, seed)
    # the same split as the real run's (run.py): the tuning never sees a row it tests on
    federation = build_federation(data, config.partition, config.data.test_fraction, seed,
                                  config.data.server_fraction,
                                  label_noise=config.data.label_noise,
                                  noise_rate=config.data.noise_rate,
                                  use_official_split=config.data.official_split,
                                  stratify=stratified_split(config.data))
    kept = [c for c in federation.clients if c.num_train >= 2]
    groups = np.repeat(np.arange(len(kept)), [c.num_train for c in kept])
    dataset = Dataset.from_tensors(torch.cat([c.train_x for c in kept]),
                                   torch.cat([c.train_y for c in kept]), groups,
                                   num_classes=federation.num_classes,
                                   image_shape=federation.image_shape)
    dataset.name = f"{data.name} (training rows)"
    return dataset


def validation_score(tree: dict[str, Any], dataset: Dataset, name: str,
                     params: dict[str, Any], criterion: str, seed: int) -> float:
    """One run on the validation split; the criterion (higher is better; -inf when undefined)."""
    run_tree = copy.deepcopy(tree)
    run_tree.update(seed=seed, algorithm=name)
    run_tree["partition"] = {"kind": "natural", "num_clients": int(dataset.groups.max()) + 1}
    config = from_dict(ExperimentConfig, run_tree)
    summary = Simulation(config, build_strategy(name, {k: str(v) for k, v in params.items()}),
                         dataset=dataset).run().summary
    if criterion == "pooled":
        value = summary["test_accuracy"]
    elif criterion == "fair":
        value = (summary["client_accuracy_mean"] + summary["client_accuracy_worst10"]) / 2
    else:
        mean, worst = summary.get("client_auroc_mean"), summary.get("client_auroc_min")
        value = None if mean is None else (mean + worst) / 2
    return float("-inf") if value is None or not np.isfinite(value) else float(value)


def tune(name: str, spec: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """The learning rate (first method), then each method's grid; writes the choices."""
    tree = copy.deepcopy(spec["tree"])
    dataset = validation_dataset(tree, seed)
    criterion, methods = spec["criterion"], spec["methods"] + spec.get("long", [])
    log: list[dict[str, Any]] = []

    def score(label, algo, params, lr):
        t = copy.deepcopy(tree)
        t["client"]["lr"] = lr
        start = time.perf_counter()
        value = validation_score(t, dataset, algo, params, criterion, seed)
        log.append({"method": label, "lr": lr, "params": params,
                    "score": value if np.isfinite(value) else None})
        print(f"  {label:>22s} lr={lr} {params}: {value:.4f} ({time.perf_counter() - start:.0f}s)",
              file=sys.stderr, flush=True)
        return value

    base_label, base_algo, base_fixed, _ = methods[0]
    lr_values = sorted(spec["lr_grid"])
    scores = {v: score(base_label, base_algo, base_fixed, v) for v in lr_values}
    # a choice at the grid's edge says the best value may lie beyond it: extend the grid by
    # the factor of its last step until the best value is inside it (at most LR_EXTENSIONS)
    for _ in range(LR_EXTENSIONS):
        best = max(scores, key=scores.get)
        if best == lr_values[-1]:
            new = lr_values[-1] * lr_values[-1] / lr_values[-2]
        elif best == lr_values[0]:
            new = lr_values[0] * lr_values[0] / lr_values[1]
        else:
            break
        new = float(f"{new:.3g}")
        lr_values = sorted([*lr_values, new])
        scores[new] = score(base_label, base_algo, base_fixed, new)
    lr = max(scores, key=scores.get)
    chosen: dict[str, dict[str, Any]] = {}
    for label, algo, fixed, grid in methods:
        if not grid:
            continue
        (key, values), = grid.items()
        best = max(values, key=lambda v: score(label, algo, {**fixed, key: v}, lr))
        chosen[label] = {key: best}
    result = {"experiment": name, "seed": seed, "criterion": criterion,
              "validation": "20% of each client's training rows", "lr_grid": lr_values, "lr": lr,
              "params": chosen, "runs": log}
    TUNING_DIR.mkdir(parents=True, exist_ok=True)
    (TUNING_DIR / f"tuning_{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# --------------------------------------------------------------------------- main


def late_accuracy(entries: list[dict[str, Any]], rounds: int) -> str:
    """Mean pooled test accuracy over the evaluations of the last third of the rounds (mean ±
    std over seeds): less sensitive than the last round to where an oscillating run stops."""
    lines = [f"Pooled test accuracy averaged over rounds {rounds - rounds // 3 + 1}-{rounds} (%):",
             ""]
    for e in entries:
        late = [np.mean([a for r, a in run["curve"] if r > rounds - rounds // 3])
                for run in e["runs"]]
        lines.append(f"- {e['label']}: {100 * np.mean(late):.1f} ± {100 * np.std(late):.1f}")
    return "\n".join(lines) + "\n"


PAIRED_KEYS = {  # the statistics the paired table compares, by the experiment's criterion
    "pooled": [("test_accuracy", "pooled acc"), ("client_accuracy_mean", "avg"),
               ("client_accuracy_worst10", "worst-10%")],
    "fair": [("client_accuracy_mean", "avg"), ("client_accuracy_worst10", "worst-10%"),
             ("client_accuracy_min", "worst")],
    "auroc": [("client_auroc_mean", "AUROC avg"), ("client_auroc_min", "AUROC worst"),
              ("client_accuracy_mean", "acc avg"), ("client_accuracy_min", "acc worst")],
}


def paired_differences(entries: list[dict[str, Any]], criterion: str, base: int = 0) -> str:
    """Every other method minus ``entries[base]`` (by default the first, the baseline), seed by
    seed: the differences' mean ± sample std in points, the 95 % t-interval of the mean (bold
    when it excludes 0) and on how many seeds the method is ahead/behind. The methods share the
    clients of a seed, so this separates a real gain from the seed-to-seed spread that the
    mean ± std columns mix in."""
    keys = PAIRED_KEYS[criterion]
    base_entry = entries[base]
    by_seed = {run["seed"]: run["summary"] for run in base_entry["runs"]}
    header = " | ".join(name for _, name in keys)
    label = base_entry["label"]
    lines = [f"Paired against {label}, seed by seed (method minus {label}, points: mean ± std "
             "[95 % t-interval] (seeds ahead/behind); **bold**: the interval excludes 0):", "",
             f"| method | {header} |", "|---|" + "---|" * len(keys)]
    for entry in entries:
        if entry is base_entry:
            continue
        cells = []
        for key, _ in keys:
            pairs = [(100 * run["summary"][key], 100 * by_seed[run["seed"]][key])
                     for run in entry["runs"]
                     if run["summary"].get(key) is not None
                     and by_seed[run["seed"]].get(key) is not None]
            if not pairs:
                cells.append("—")
                continue
            d = paired_difference([a for a, _ in pairs], [b for _, b in pairs])
            if d.low is None:
                cells.append(f"{d.mean:+.1f} (one seed) ({d.ahead}/{d.behind})")
                continue
            text = f"{d.mean:+.1f} ± {d.std:.1f} [{d.low:+.1f}, {d.high:+.1f}]"
            if d.low > 0 or d.high < 0:
                text = f"**{text}**"
            cells.append(f"{text} ({d.ahead}/{d.behind})")
        lines.append(f"| {entry['label']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="+", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--seeds", default="0,1,2,3,4",
                        help="comma-separated seeds (default 0,1,2,3,4)")
    parser.add_argument("--tune", action="store_true",
                        help="choose the learning rate and the methods' parameters on a "
                        "validation split first (long: a run per grid value)")
    parser.add_argument("--long", action="store_true",
                        help="add the extra methods (FedAU without cutoff, average all)")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--save", action="store_true",
                        help="write into bench/results/compare_<name>/")
    parser.add_argument("--out", metavar="DIR", help="folder for compare_<name>/ "
                        "(default runs/fairness_papers/)")
    parser.add_argument("--reference-split", choices=["median", "mean"], default="median",
                        help="semivred: count improved/degraded clients below/above FedAvg's "
                        "median (default) or mean accuracy (the paper's split)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heart-root", metavar="DIR",
                        help="aaggff-silo-uci-heart: the folder with the UCI Heart Disease data "
                        "(processed.{cleveland,hungarian,switzerland,va}.data, or "
                        "heart_disease_uci.csv); from the UCI Machine Learning Repository, "
                        "'Heart Disease', CC BY 4.0")
    args = parser.parse_args(argv)
    if args.out and args.save:
        parser.error("--out and --save name two different folders; give one")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    torch.set_num_threads(args.threads)
    os.chdir(ROOT)  # the configurations name the heart table relative to the repository
    names = list(EXPERIMENTS) if "all" in args.which else list(dict.fromkeys(args.which))
    if not args.heart_root and "aaggff-silo-uci-heart" in names:
        if "all" not in args.which:
            parser.error("aaggff-silo-uci-heart reads the UCI Heart Disease data: give the "
                         "folder that holds it with --heart-root DIR")
        print("skipping aaggff-silo-uci-heart: no --heart-root", file=sys.stderr)
        names.remove("aaggff-silo-uci-heart")
    if args.heart_root and not Path(args.heart_root).is_dir():
        parser.error(f"--heart-root: {args.heart_root} is not a folder")
    heart_root = str(Path(args.heart_root).resolve()) if args.heart_root else None
    root = Path(args.out) if args.out else (
        ROOT / "bench" / "results" if args.save else ROOT / "runs" / "fairness_papers")
    for name in names:
        spec = copy.deepcopy(EXPERIMENTS[name])
        if args.rounds:
            spec["tree"]["rounds"] = args.rounds
        if spec["tree"]["data"]["name"] == "heart":
            spec["tree"]["data"]["root"] = heart_root
        if spec["tree"]["data"]["name"] == "csv":
            ensure_heart_csv()
        if args.tune:
            print(f"tuning {name} on validation data", file=sys.stderr)
            tune(name, spec)
        tree, methods = apply_tuning(spec, tuned_values(name))
        if args.long:
            tuning = tuned_values(name) or {"params": {}}
            methods += [(label, algo, {**fixed, **tuning["params"].get(label, {})}, grid)
                        for label, algo, fixed, grid in spec.get("long", [])]
        algorithms = [spec_text(label, algo, params) for label, algo, params, _ in methods]
        out = root / f"compare_{name}"
        start = time.perf_counter()
        entries = compare(algorithms, seeds, tree, out, spec["title"],
                          reference=spec.get("reference"), reference_split=args.reference_split)
        elapsed = time.perf_counter() - start
        late = late_accuracy(entries, tree["rounds"])
        (out / "late_accuracy.md").write_text(late)
        timing = (f"Wall time of the runs: {elapsed / 60:.1f} min for {len(seeds)} seeds x "
                  f"{len(methods)} methods ({os.cpu_count()} CPUs, torch threads {args.threads}).\n")
        (out / "timing.md").write_text(timing)
        labels = [e["label"] for e in entries]
        paired = "\n".join(paired_differences(entries, spec["criterion"], labels.index(label))
                           for label in [labels[0], *spec.get("paired_with", [])])
        (out / "paired.md").write_text(paired)
        print(f"## {name}\n\n{spec['title']}; lr {tree['client']['lr']}\n\n"
              f"{markdown_table(entries)}\n{paired}\n{late}\n{timing}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
