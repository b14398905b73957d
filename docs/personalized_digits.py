"""SuPerFed-MM/LM against the personalized baselines on digits; docs/superfed.md reports it.

Takes the arguments of ``fedkernels compare`` (``--algorithms``, ``--seeds``, ``--set``,
``--config``, ``--threads``) and runs the same simulations, but tabulates what a personalized
method is judged by: the accuracy of each client's own (personalized) model on the client's own
test split, averaged over all clients (``personalized_accuracy`` of the strategy's
evaluation; for SuPerFed both its oracle choice of lambda and the choice made on the client's
training split). Writes ``--out`` (JSON) and prints a markdown table::

    OMP_NUM_THREADS=1 python docs/personalized_digits.py --algorithms local,fedavg,... \\
        --seeds 0,1,2 --set partition.kind=pathological ... --out docs/personalized_digits.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedkernels.algorithms import build_strategy
from fedkernels.cli.compare import base_tree, parse_algorithm, split_algorithms
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict

KEYS = [
    ("personalized_accuracy", "personalized (mean over clients)"),
    ("personalized_accuracy_train_selected", "SuPerFed, λ chosen on train"),
    ("personalized_accuracy_worst10", "personalized worst-10%"),
    ("client_accuracy_mean", "global model (mean over clients)"),
]


def run(tree: dict, name: str, params: dict, seed: int) -> dict:
    run_tree = json.loads(json.dumps(tree))
    run_tree.update(seed=seed, algorithm=name)
    config = from_dict(ExperimentConfig, run_tree)
    start = time.perf_counter()
    result = Simulation(config, build_strategy(name, params)).run()
    summary = result.summary
    out = {k: summary[k] for k, _ in KEYS if k in summary}
    if name == "fedavg":  # no personal model: each client uses the global one
        out["personalized_accuracy"] = summary["client_accuracy_mean"]
        out["personalized_accuracy_worst10"] = summary["client_accuracy_worst10"]
    out["seconds"] = time.perf_counter() - start
    return out


def cell(values: list[float]) -> str:
    if not values:
        return "–"
    a = 100 * np.array(values)
    seeds = ", ".join(f"{v:.1f}" for v in a)
    return f"{a.mean():.1f} ± {a.std():.1f} [{seeds}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/personalized_digits.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    tree = base_tree(args.config, args.set)
    entries = []
    for text in split_algorithms(args.algorithms):
        name, params, label = parse_algorithm(text)
        runs = []
        for seed in seeds:
            runs.append(run(tree, name, params, seed))
            r = runs[-1]
            print(f"{label:>14s} seed {seed}: personalized {r['personalized_accuracy']:.3f} "
                  f"({r['seconds']:.1f}s)", file=sys.stderr, flush=True)
        entries.append({"label": label, "algorithm": name, "params": params, "runs": runs})
    meta = {"command": " ".join(sys.argv), "seeds": seeds, "config": tree, "entries": entries,
            "torch": torch.__version__, "threads": args.threads}
    Path(args.out).write_text(json.dumps(meta, indent=1) + "\n")
    print("| method | " + " | ".join(label for _, label in KEYS) + " | seconds per run |")
    print("|" + "---|" * (len(KEYS) + 2))
    for e in entries:
        cells = [cell([r[k] for r in e["runs"] if k in r]) for k, _ in KEYS]
        seconds = np.mean([r["seconds"] for r in e["runs"]])
        print(f"| {e['label']} | " + " | ".join(cells) + f" | {seconds:.0f} |")


if __name__ == "__main__":
    main()
