"""The two comparisons of docs/fairness.md, on scikit-learn's digits (offline, 2 CPU cores).

1. ``fairness``: FedAvg against the fair-aggregation strategies, 20 clients with a
   Dirichlet(0.1) label split, full participation.
2. ``participation``: FedAU against averaging the participants (and the other
   participation-aware rules) under heterogeneous, label-correlated Bernoulli participation.

Each writes compare.{json,md,png} into a folder compare_<name>/ (see fedkernels.cli.compare):
under a new folder in bench/results/runs/ by default, into the committed bench/results/ with
--save, or under --out DIR.

    python bench/compare_strategies.py [fairness|participation|all] [--seeds 0,1,2,3,4] [--save]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fedkernels.cli.compare import compare, markdown_table

from harness.cli import at_least
from harness.results import RESULTS_DIR, new_run_path

COMMON = {
    "data": {"name": "digits"},
    "partition": {"kind": "dirichlet", "alpha": 0.1, "num_clients": 20},
    "model": {"name": "mlp", "hidden": [32]},
    "client": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "vmap": True,
}

EXPERIMENTS = {
    "fairness": {
        "title": "digits, Dirichlet(0.1) over 20 clients, full participation, MLP 64-32-10, "
        "100 rounds x 1 local epoch (lr 0.1, batch 32)",
        "tree": {**COMMON, "rounds": 100, "eval_every": 10, "participation": {"kind": "full"}},
        "algorithms": [
            "fedavg",
            "qffl:q=1@q-FFL (q=1)",
            "qfedavg:q=0.1@q-FedAvg (q=0.1)",
            "afl:step=0.1@AFL (γ=0.1)",
            "term:tilt=1@TERM (τ=1)",
            "propfair:utility_bound=3@PropFair (M=3)",
            "gifair@GiFair",
            "delta-fl:alpha=0.5@Δ-FL (α=0.5)",
            "fedmgda:epsilon=0.2@FedMGDA+ (ε=0.2)",
            "vred:beta=0.5@VRed (β=0.5)",
            "semi-vred:beta=0.5@Semi-VRed (β=0.5)",
            "aaggff-s:cdf=weibull@AAggFF-S (Weibull)",
        ],
    },
    "participation": {
        "title": "digits, Dirichlet(0.1) over 20 clients, Bernoulli participation with "
        "label-correlated p_n (mean 0.2, min 0.02), MLP, 300 rounds x 5 local steps (lr 0.1, batch 16)",
        "tree": {
            **COMMON,
            "rounds": 300,
            "eval_every": 20,
            "client": {"lr": 0.1, "batch_size": 16, "steps": 5},
            "participation": {
                "kind": "bernoulli",
                "fraction": 0.2,
                "probability_model": "label_correlated",
                "min_probability": 0.02,
            },
        },
        "algorithms": [
            "avg-participating@average participants",
            "avg-all@average all",
            "fedau:cutoff=50@FedAU (K=50)",
            "fedau:cutoff=0@FedAU (K=∞)",
            "known-p@known p_n",
            "mifa@MIFA",
            "fedvarp@FedVARP",
        ],
    },
}


def seed_list(text: str) -> list[int]:
    """--seeds: one line at the command line (exit status 2), not a traceback once parsed."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", default="all", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--seeds", type=seed_list, default="0,1,2,3,4",
                        help="comma-separated integer seeds")
    parser.add_argument("--out", metavar="DIR",
                        help="folder for compare_<name>/ (default: a new folder under "
                             "bench/results/runs/)")
    parser.add_argument("--save", action="store_true",
                        help="write into bench/results/compare_<name>/, the committed results")
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--tiny", action="store_true",
                        help="2 rounds, seed 0, the first two algorithms: checks the script runs")
    args = parser.parse_args(argv)
    if args.out and args.save:
        parser.error("--out and --save name two different folders; give one")
    torch.set_num_threads(args.threads)
    seeds = args.seeds
    names = list(EXPERIMENTS) if args.which == "all" else [args.which]
    root = Path(args.out or (RESULTS_DIR if args.save else new_run_path("compare", suffix="")))
    for name in names:
        spec = EXPERIMENTS[name]
        tree, algorithms = spec["tree"], spec["algorithms"]
        if args.tiny:
            tree, algorithms, seeds = {**tree, "rounds": 2, "eval_every": 1}, algorithms[:2], [0]
        out = root / f"compare_{name}"
        entries = compare(algorithms, seeds, tree, out, spec["title"])
        print(f"## {name}\n\n{spec['title']}\n\n{markdown_table(entries)}")
    print(f"wrote {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
