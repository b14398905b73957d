"""Final accuracy of FedAvg, the robust rules and FedAvg with central DP under Byzantine attacks,
on scikit-learn's digits. Writes experiments/robust_attacks.json and experiments/robust_dp_epsilon.png;
docs/results/robust.md reports them.

    OMP_NUM_THREADS=1 nice -n 5 python experiments/robust_attacks.py

Setup of every cell: 20 clients (IID split), all of them in every round, 20 rounds, an MLP with
one hidden layer of 32 units trained for 2 local epochs (batch 16, lr 0.3), 20 % of the clients
Byzantine (a seeded choice per seed), 5 seeds. Metric: the final global model's accuracy on the
pooled test splits of all clients (``summary.test_accuracy``; test labels are never flipped).
The rules that take f are told f = 4, the true number of Byzantine clients. Each cell is one
``fedkernels run``; ``--commands`` prints them instead of running.

A second part sweeps the noise multiplier of FedAvg + DP without attack and plots accuracy
against the epsilon the accountant reports after the last round, next to FedAvg and to clipping
without noise. Cells already in the JSON are reused (``--fresh`` recomputes them).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path

import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "robust_attacks.json"
FIGURE = HERE / "robust_dp_epsilon.png"

F = 4  # Byzantine clients among 20
DP = {"clip": 0.5, "noise_multiplier": 1.0}
RULES = {
    "fedavg": ("fedavg", {}, {}),
    "fedmedian": ("fedmedian", {}, {}),
    "trimmed-mean": ("trimmed-mean", {"beta": 0.2}, {}),
    "krum": ("krum", {"num_malicious": F}, {}),
    "multikrum": ("multikrum", {"num_malicious": F}, {}),
    "bulyan": ("bulyan", {"num_malicious": F}, {}),
    "fedavg+DP": ("fedavg", {}, DP),
}
ATTACKS = ["none", "signflip", "gaussian", "labelflip", "scale"]
SIGMAS = [0.5, 1.0, 2.0, 4.0, 8.0]


def experiment(seed: int, attack: str, dp: dict, rounds: int) -> dict:
    return {
        "rounds": rounds,
        "seed": seed,
        "eval_every": rounds,
        "checkpoint_every": rounds,
        "vmap": True,
        "data": {"name": "digits"},
        "partition": {"kind": "iid", "num_clients": 20},
        "participation": {"kind": "full"},
        "model": {"name": "mlp", "hidden": [32]},
        "client": {"epochs": 2, "batch_size": 16, "lr": 0.3},
        "attack": {"kind": attack, "fraction": 0.2, "scale": 10.0, "std": 1.0},
        "dp": dp,
    }


def command(algorithm: str, params: dict, tree: dict) -> str:
    """The ``fedkernels run`` line of one cell."""
    words = ["fedkernels", "run", "--algorithm", algorithm]
    for key in ("rounds", "seed", "vmap"):
        words += [f"--{key}", str(tree[key]).lower()]
    for section in ("partition", "participation", "model", "client", "attack", "dp"):
        for field, value in tree[section].items():
            if section == "attack" and tree["attack"]["kind"] == "none" and field != "kind":
                continue
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value).lower()
            words += [f"--{section}.{field}", text]
    for field, value in params.items():
        words += [f"--{algorithm}.{field}", str(value)]
    return shlex.join(words)


def run_cell(algorithm: str, params: dict, tree: dict) -> dict:
    config = from_dict(ExperimentConfig, tree)
    start = time.perf_counter()
    result = Simulation(config, build_strategy(algorithm, params)).run()
    return {
        "accuracy": result.summary["test_accuracy"],
        "epsilon": result.summary.get("dp_epsilon"),
        "seconds": time.perf_counter() - start,
    }


def mean_std(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.1f} ± {100 * sd:.1f}"


def table(cells: dict, seeds: list[int]) -> str:
    lines = ["| rule | " + " | ".join(ATTACKS) + " |", "|---" * (len(ATTACKS) + 1) + "|"]
    for rule in RULES:
        row = [mean_std([cells[f"{rule}/{a}/{s}"]["accuracy"] for s in seeds]) for a in ATTACKS]
        lines.append(f"| {rule} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(cells: dict, seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps, acc, err = [], [], []
    for sigma in SIGMAS:
        runs = [cells[f"dp-sigma{sigma}/{s}"] for s in seeds]
        eps.append(runs[0]["epsilon"])
        values = [r["accuracy"] for r in runs]
        acc.append(100 * statistics.fmean(values))
        err.append(100 * statistics.stdev(values) if len(values) > 1 else 0.0)
    plain = [cells[f"fedavg/none/{s}"]["accuracy"] for s in seeds]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.errorbar(eps, acc, yerr=err, marker="o", capsize=3, label="FedAvg + DP (C = 0.5)")
    for x, y, sigma in zip(eps, acc, SIGMAS):
        ax.annotate(f"σ={sigma:g}", (x, y), textcoords="offset points", xytext=(4, -12),
                    fontsize=8)
    ax.axhline(100 * statistics.fmean(plain), color="grey", linestyle="--", label="FedAvg, no DP")
    clip_only = [cells[f"dp-clip-only/{s}"]["accuracy"] for s in seeds]
    ax.axhline(100 * statistics.fmean(clip_only), color="tab:orange", linestyle=":",
               label="clipping only (σ = 0, no ε)")
    ax.set_xscale("log")
    ax.set_xlabel("ε after 20 rounds (δ = 1/20, RDP accountant)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits, 20 clients, all per round; mean ± std of 5 seeds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--commands", action="store_true", help="print the runs' command lines")
    parser.add_argument("--fresh", action="store_true", help="ignore cells already in the JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)

    jobs = []
    for rule, (algorithm, params, dp) in RULES.items():
        for attack in ATTACKS:
            for seed in args.seeds:
                jobs.append((f"{rule}/{attack}/{seed}", algorithm, params,
                             experiment(seed, attack, dp, args.rounds)))
    for sigma in SIGMAS:
        for seed in args.seeds:
            dp = {"clip": DP["clip"], "noise_multiplier": sigma}
            jobs.append((f"dp-sigma{sigma}/{seed}", "fedavg", {},
                         experiment(seed, "none", dp, args.rounds)))
    for seed in args.seeds:  # clipping without noise: what the clip alone costs
        jobs.append((f"dp-clip-only/{seed}", "fedavg", {},
                     experiment(seed, "none", {"clip": DP["clip"]}, args.rounds)))
    if args.commands:
        for key, algorithm, params, tree in jobs:
            print(f"# {key}\n{command(algorithm, params, tree)}")
        return

    saved = {} if args.fresh or not RESULTS.exists() else json.loads(RESULTS.read_text())
    cells = saved.get("cells", {}) if saved.get("rounds") == args.rounds else {}
    for i, (key, algorithm, params, tree) in enumerate(jobs):
        if key not in cells:
            cells[key] = run_cell(algorithm, params, tree)
            print(f"[{i + 1}/{len(jobs)}] {key}: {100 * cells[key]['accuracy']:.1f}% "
                  f"({cells[key]['seconds']:.1f} s)", flush=True)
            RESULTS.write_text(json.dumps({
                "rounds": args.rounds,
                "setup": experiment(0, "signflip", DP, args.rounds),
                "rules": {r: {"algorithm": a, "params": p, "dp": d}
                          for r, (a, p, d) in RULES.items()},
                "torch": torch.__version__,
                "cells": cells,
            }, indent=1) + "\n")
    print(table(cells, args.seeds))
    print("\nFedAvg + DP without attack:")
    for sigma in SIGMAS:
        runs = [cells[f"dp-sigma{sigma}/{s}"] for s in args.seeds]
        print(f"sigma {sigma:g}: epsilon {runs[0]['epsilon']:.2f}, accuracy "
              f"{mean_std([r['accuracy'] for r in runs])}")
    clip_only = [cells[f"dp-clip-only/{s}"]["accuracy"] for s in args.seeds]
    print(f"clipping only (sigma 0, no guarantee): accuracy {mean_std(clip_only)}")
    total = sum(c["seconds"] for c in cells.values())
    print(f"\n{len(cells)} runs, {total / 60:.1f} min of run time")
    plot(cells, args.seeds)


if __name__ == "__main__":
    main()
