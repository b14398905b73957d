"""Why FedEvg's accuracy stops rising after about 20 rounds (docs/results/fedevg.md): FedEvg on digits,
K = 10 clients, Dirichlet alpha = 1, full participation, 100 rounds, with the per-round
diagnostics the strategy logs (energy gap between the clients' real data and the synthetic set
under the freshly trained client models, mean server step |beta_t a_j| against the noise delta,
how much of the set moves, the share of pixels at a bound, the within-class spread, the client
learning rate), and three yardsticks measured with the same classifier recipe: the spread of
its accuracy over 10 initialisations on the final synthetic set (evaluation noise), and its
accuracy on 10 real digits per class and on every client's training data.

    python experiments/fedevg_flat.py                   # 3 seeds, diagnostics (about 8 minutes)
    python experiments/fedevg_flat.py --interventions   # also beta_0 = 1, spc 50, 5 local epochs
    python experiments/fedevg_flat.py --interventions --intervention-seeds 1   # cheaper

Writes ``--out`` (default experiments/fedevg_flat.json) and ``--plot`` (experiments/fedevg_flat.png).
``--resume`` keeps the runs already in ``--out`` made with the same rounds, interval and common
settings, and runs only the missing ones (runs are deterministic per seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from fedevg_digits import COMMON, experiment_config  # experiments/, the script's own folder

from fedkernels.algorithms import build_strategy
from fedkernels.algorithms.fedevg import train_on_synthetic
from fedkernels.sim import Simulation

HERE = Path(__file__).parent
SETTING = "K10-a1"
DIAGNOSTICS = ["energy_gap", "step_abs", "noise_std", "moved_abs", "changed_fraction",
               "saturated_fraction", "within_class_distance", "client_lr", "beta"]
# Cheapest first, so an interrupted run keeps the most (the JSON is written after each).
INTERVENTIONS = {
    "default": {},
    "beta_0 = 1": {"server_beta": 1.0},
    "spc 50 (M = 500)": {"spc": 50},
    "5 local epochs": {"local_epochs": 5},
}
PLATEAU = 20  # the plateau's level: mean accuracy over the evaluations from this round on


def classifier_accuracy(sim, strategy, x, y, seed) -> float:
    cfg = strategy.config
    train_on_synthetic(strategy.classifier, strategy.info.model, x, y, epochs=cfg.server_epochs,
                       lr=cfg.server_lr, batch_size=cfg.server_batch_size, seed=seed,
                       round_index=10**6)
    sim.server.state.update({k: v.clone() for k, v in strategy.classifier.state_dict().items()})
    return sim.evaluate().pooled_accuracy()


def within_class_distance(x, y) -> float:
    spreads = []
    for c in y.unique():
        rows = x[y == c].double()
        if len(rows) > 1:
            spreads.append(torch.cdist(rows, rows).sum() / (len(rows) * (len(rows) - 1)))
    return float(torch.stack(spreads).mean())


def run(seed: int, rounds: int, eval_every: int, extra: dict, yardsticks: bool) -> dict:
    strategy = build_strategy("fedevg", {**COMMON, "classify_every": eval_every, **extra})
    sim = Simulation(experiment_config(SETTING, seed, rounds, eval_every), strategy)
    start = time.time()
    result = sim.run()
    out = {
        "seed": seed,
        "seconds": time.time() - start,
        "accuracy": [(r["round"], r["test_accuracy"]) for r in result.rounds
                     if "test_accuracy" in r],
        "diagnostics": {k: [r[f"strategy_{k}"] for r in result.rounds] for k in DIAGNOSTICS},
    }
    if yardsticks:
        final_x, final_y = strategy.synth_x.clone(), strategy.synth_y
        out["final_set_accuracy_over_inits"] = [
            classifier_accuracy(sim, strategy, final_x, final_y, 100 + s) for s in range(10)]
        fed = sim.federation
        x = torch.cat([c.train_x for c in fed.clients])
        y = torch.cat([c.train_y for c in fed.clients])
        spc = strategy.config.spc
        real = []
        for draw in range(5):
            g = torch.Generator().manual_seed(1000 * seed + draw)
            rows = torch.cat([torch.nonzero(y == c).flatten()[
                torch.randperm(int((y == c).sum()), generator=g)[:spc]] for c in range(10)])
            real.append((classifier_accuracy(sim, strategy, x[rows], y[rows], 200 + draw),
                         within_class_distance(x[rows], y[rows]),
                         float(((x[rows] <= 0) | (x[rows] >= 1)).double().mean())))
        out["real_spc_accuracy"] = [r[0] for r in real]
        out["real_spc_within_class_distance"] = [r[1] for r in real]
        out["real_saturated_fraction"] = [r[2] for r in real]
        # The same classifier trained on every client's training data (50 epochs): what the
        # recipe reaches when data is no limit.
        cfg = strategy.config
        train_on_synthetic(strategy.classifier, strategy.info.model, x, y, epochs=50,
                           lr=cfg.server_lr, batch_size=cfg.server_batch_size, seed=300,
                           round_index=10**6)
        sim.server.state.update({k: v.clone() for k, v in strategy.classifier.state_dict().items()})
        out["all_real_accuracy"] = sim.evaluate().pooled_accuracy()
    return out


def plateau(run_: dict) -> float:
    """Mean accuracy over the evaluations at or after round PLATEAU."""
    return statistics.mean(a for r, a in run_["accuracy"] if r >= PLATEAU)


def yardsticks(base: list[dict]) -> dict:
    return {
        "final_set_accuracy_std_over_inits": mean_std(
            [statistics.pstdev(r["final_set_accuracy_over_inits"]) for r in base]),
        "real_spc_accuracy": mean_std([a for r in base for a in r["real_spc_accuracy"]]),
        "real_spc_within_class_distance": mean_std(
            [a for r in base for a in r["real_spc_within_class_distance"]]),
        "real_saturated_fraction": mean_std([a for r in base for a in r["real_saturated_fraction"]]),
        "all_real_accuracy": mean_std([r["all_real_accuracy"] for r in base]),
    }


def mean_std(values):
    return [statistics.mean(values), statistics.pstdev(values) if len(values) > 1 else 0.0]


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = out["runs"]["default"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    ax = axes[0][0]
    for name, runs in out["runs"].items():
        rounds = [r for r, _ in runs[0]["accuracy"]]
        acc = torch.tensor([[a for _, a in r["accuracy"]] for r in runs]) * 100
        ax.plot(rounds, acc.mean(0), label=name)
        ax.fill_between(rounds, acc.mean(0) - acc.std(0, unbiased=False),
                        acc.mean(0) + acc.std(0, unbiased=False), alpha=0.15)
    y = out["yardsticks"]
    ax.axhline(100 * y["real_spc_accuracy"][0], ls=":", color="gray", label="10 real digits/class")
    ax.axhline(100 * y["all_real_accuracy"][0], ls="--", color="gray", label="all real training data")
    ax.set_title("test accuracy of the synthetic-set classifier (%)")
    ax.legend(fontsize=7)
    panels = [
        (axes[0][1], "energy_gap", "energy gap E(synthetic) - E(real)", None),
        (axes[0][2], "within_class_distance", "within-class distance",
         y["real_spc_within_class_distance"][0]),
        (axes[1][0], "saturated_fraction", "pixels at 0 or 1", y["real_saturated_fraction"][0]),
        (axes[1][2], "changed_fraction", "share of values moved > 1e-3 per round", None),
    ]
    for ax, key, title, ref in panels:
        vals = torch.tensor([r["diagnostics"][key] for r in base])
        ax.plot(range(1, vals.shape[1] + 1), vals.mean(0))
        if ref is not None:
            ax.axhline(ref, ls=":", color="gray", label="10 real digits/class")
            ax.legend(fontsize=7)
        ax.set_title(title)
    ax = axes[1][1]
    for key, label in (("step_abs", "mean |beta_t a_j| (server step)"),
                       ("moved_abs", "mean |change| after the clamp"),
                       ("noise_std", "noise delta")):
        vals = torch.tensor([r["diagnostics"][key] for r in base])
        ax.semilogy(range(1, vals.shape[1] + 1), vals.mean(0), label=label)
    ax.set_title("server step per pixel and round")
    ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--interventions", action="store_true")
    parser.add_argument("--intervention-seeds", type=int, default=None,
                        help="seeds per intervention (default: --seeds)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the matching runs already in --out, run only what is missing")
    parser.add_argument("--out", default=str(HERE / "fedevg_flat.json"))
    parser.add_argument("--plot", default=str(HERE / "fedevg_flat.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = INTERVENTIONS if args.interventions else {"default": {}}
    previous = {}
    if args.resume and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        if (old["common"] == COMMON and old["settings"]["rounds"] == args.rounds
                and old["settings"]["eval_every"] == args.eval_every):
            previous = old["runs"]
    out = {"settings": vars(args), "setting": SETTING, "common": COMMON, "runs": {}}
    for name, extra in chosen.items():
        seeds = args.seeds if name == "default" or args.intervention_seeds is None \
            else args.intervention_seeds
        done = {r["seed"]: r for r in previous.get(name, [])}
        runs = [done.get(s) or run(s, args.rounds, args.eval_every, extra, name == "default")
                for s in range(seeds)]
        out["runs"][name] = runs
        finals = [r["accuracy"][-1][1] for r in runs]
        at20 = [dict(r["accuracy"]).get(20, r["accuracy"][0][1]) for r in runs]
        print(f"{name:18s} round 20 {100 * statistics.mean(at20):5.1f}  plateau "
              f"{100 * statistics.mean(plateau(r) for r in runs):5.1f}  final "
              f"{100 * statistics.mean(finals):5.1f} ± {100 * statistics.pstdev(finals):4.1f}  "
              f"({sum(r['seconds'] for r in runs):.0f} s)", flush=True)
        if name == "default":
            out["yardsticks"] = yardsticks(runs)
            print(json.dumps(out["yardsticks"], indent=1))
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    plot(out, Path(args.plot))


if __name__ == "__main__":
    main()
