"""FedEvg against its federated generative baseline (FedCVAE) on scikit-learn's digits
(8x8, pixels in [0, 1]), in the thesis' four columns (docs/results/fedevg.md):

    K = 10 clients, full participation, Dirichlet alpha = 0.01 and 1;
    K = 100 clients, 10% participation, alpha = 0.01 and 1.

The metric is the thesis': a classifier trained only on the server's M = 10 * spc synthetic
samples, tested on every client's held-out real digits (the simulation's pooled test accuracy),
every ``--eval-every`` rounds. Two references per setting and seed use the same classifier
recipe: the initial noise set of FedEvg (chance level) and ``spc`` real training digits per class
(what M real samples can teach).

    python experiments/fedevg_digits.py                   # K = 100, alpha = 1; 3 seeds; a few minutes
    python experiments/fedevg_digits.py --sweep           # the four columns (times: docs/results/fedevg.md)
    python experiments/fedevg_digits.py --sweep --seeds 5 # five seeds, as in docs/results/fedevg.md
    python experiments/fedevg_digits.py --settings K100-a1 --seeds 5 --local-epochs 5 \
        --out experiments/fedevg_digits_k100_e5.json --plot experiments/fedevg_digits_k100_e5.png

``--resume`` keeps the runs already in ``--out`` that were made with the same rounds, evaluation
interval and common settings, and runs only the missing seeds (runs are deterministic per seed).

Writes ``--out`` (default experiments/fedevg_digits.json) and the accuracy curves ``--plot`` (default
experiments/fedevg_digits_curves.png). Every hyperparameter is fixed before any run, the same way for
both methods: the thesis' or official scripts' values where they exist, the shared scale-downs
(MLP models, batch 32, 100 rounds) identical for both; nothing is tuned on test data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedkernels.algorithms import build_strategy
from fedkernels.algorithms.fedevg import train_on_synthetic
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict

HERE = Path(__file__).parent

# The thesis' columns. The Dirichlet draw at alpha = 0.01 cannot give 100 clients two digits each
# (1797 samples, one class mostly lands on one client), so that column uses two classes per
# client, the minimum the authors' splitter enforces.
SETTINGS = {
    "K10-a0.01": ({"kind": "dirichlet", "num_clients": 10, "alpha": 0.01}, {"kind": "full"}),
    "K10-a1": ({"kind": "dirichlet", "num_clients": 10, "alpha": 1.0}, {"kind": "full"}),
    "K100-a0.01": ({"kind": "pathological", "num_clients": 100, "classes_per_client": 2},
                   {"kind": "uniform", "fraction": 0.1}),
    "K100-a1": ({"kind": "dirichlet", "num_clients": 100, "alpha": 1.0},
                {"kind": "uniform", "fraction": 0.1}),
}
# Thesis Table 4.2, MNIST (ResNet-10, 500 rounds for FedEvg, 100 for the baselines).
PAPER = {"fedevg": {"K10-a0.01": 62.95, "K10-a1": 70.94, "K100-a0.01": 72.25, "K100-a1": 86.49},
         "fedcvae": {"K10-a0.01": 66.93, "K10-a1": 64.73, "K100-a0.01": 63.13, "K100-a1": 63.80}}
COMMON = {"hidden": [128, 128], "batch_size": 32, "server_epochs": 100, "spc": 10}


def experiment_config(setting: str, seed: int, rounds: int, eval_every: int) -> ExperimentConfig:
    partition, participation = SETTINGS[setting]
    return from_dict(ExperimentConfig, {
        "rounds": rounds, "seed": seed, "data": {"name": "digits"},
        "partition": partition, "participation": participation,
        "model": {"name": "mlp", "hidden": [64]}, "eval_every": eval_every,
    })


def references(sim: Simulation, strategy, spc: int, seed: int) -> dict[str, float]:
    """The classifier recipe on the initial noise set and on spc real digits per class."""
    cfg = strategy.config
    out = {}
    fed = sim.federation
    x = torch.cat([c.train_x for c in fed.clients])
    y = torch.cat([c.train_y for c in fed.clients])
    g = torch.Generator().manual_seed(1000 + seed)
    rows = torch.cat([torch.nonzero(y == c).flatten()[torch.randperm(int((y == c).sum()),
                      generator=g)[:spc]] for c in range(fed.num_classes)])
    noise = torch.randn(len(strategy.synth_y), x.shape[1],
                        generator=torch.Generator().manual_seed(2000 + seed))
    for name, (xs, ys) in {"noise": (noise, strategy.synth_y), "real": (x[rows], y[rows])}.items():
        train_on_synthetic(strategy.classifier, strategy.info.model, xs, ys,
                           epochs=cfg.server_epochs, lr=cfg.server_lr,
                           batch_size=cfg.server_batch_size, seed=seed, round_index=10**6)
        sim.server.state.update({k: v.clone() for k, v in strategy.classifier.state_dict().items()})
        out[name] = sim.evaluate().pooled_accuracy()
    return out


def run(method: str, setting: str, seed: int, rounds: int, eval_every: int,
        images: bool = False, common: dict = COMMON) -> dict:
    params = {**common, "classify_every": eval_every}
    if images and seed == 0:
        params["image_path"] = str(HERE / f"fedevg_digits_{setting}_{method}.png")
    strategy = build_strategy(method, params)
    sim = Simulation(experiment_config(setting, seed, rounds, eval_every), strategy)
    start = time.time()
    result = sim.run()
    seconds = time.time() - start
    curve = [(r["round"], r["test_accuracy"]) for r in result.rounds if "test_accuracy" in r]
    out = {"seed": seed, "final": curve[-1][1], "curve": curve, "seconds": seconds}
    if method == "fedevg":
        out["references"] = references(sim, strategy, COMMON["spc"], seed)
    return out


def mean_std(values: list[float]) -> list[float]:
    return [statistics.mean(values), statistics.pstdev(values) if len(values) > 1 else 0.0]


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(out["results"])
    fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for method, style in (("fedevg", "-"), ("fedcvae", "--")):
            runs = out["results"][setting].get(method, {}).get("runs", [])
            if not runs:
                continue
            rounds = [r for r, _ in runs[0]["curve"]]
            accs = torch.tensor([[a for _, a in r["curve"]] for r in runs]) * 100
            m, s = accs.mean(0), accs.std(0, unbiased=False)
            ax.plot(rounds, m, style, label=method)
            ax.fill_between(rounds, m - s, m + s, alpha=0.2)
        ref = out["results"][setting].get("references")
        if ref:
            ax.axhline(100 * ref["real"][0], color="gray", ls=":",
                       label=f"{COMMON['spc']} real digits/class")
        ax.set_title(setting)
        ax.set_xlabel("round")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy of the synthetic-set classifier (%)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_previous(args, common: dict) -> dict:
    """The results in ``args.out`` if they were made with the same rounds, interval and common."""
    path = Path(args.out)
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    same = (old["common"] == common and old["settings"]["rounds"] == args.rounds
            and old["settings"]["eval_every"] == args.eval_every)
    return old["results"] if same else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="all four columns of the thesis")
    parser.add_argument("--settings", default="", help="comma-separated, e.g. K10-a1,K100-a1")
    parser.add_argument("--methods", default="fedevg,fedcvae")
    parser.add_argument("--images", action="store_true",
                        help="write seed 0's final synthetic sets as PNG grids into experiments/")
    parser.add_argument("--local-epochs", type=int, default=None,
                        help="local epochs of both methods (default: theirs, 1); use with --out")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the matching runs already in --out, run only what is missing")
    parser.add_argument("--out", default=str(HERE / "fedevg_digits.json"))
    parser.add_argument("--plot", default=str(HERE / "fedevg_digits_curves.png"))
    args = parser.parse_args()
    settings = (args.settings.split(",") if args.settings
                else list(SETTINGS) if args.sweep else ["K100-a1"])
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]} (choose from {', '.join(SETTINGS)})")
    methods = args.methods.split(",")
    torch.set_num_threads(1)
    common = COMMON if args.local_epochs is None else {**COMMON, "local_epochs": args.local_epochs}
    previous = load_previous(args, common) if args.resume else {}
    out = {"settings": {**vars(args), "settings": settings}, "common": common, "paper": PAPER,
           "results": {}}
    for setting in settings:
        res = out["results"].setdefault(setting, {})
        refs = []
        for method in methods:
            done = {r["seed"]: r for r in previous.get(setting, {}).get(method, {}).get("runs", [])}
            runs = [done.get(s) or run(method, setting, s, args.rounds, args.eval_every,
                                       args.images, common)
                    for s in range(args.seeds)]
            res[method] = {"final": mean_std([r["final"] for r in runs]), "runs": runs}
            refs += [r["references"] for r in runs if "references" in r]
            print(f"{setting:11s} {method:8s} final {100 * res[method]['final'][0]:5.1f} "
                  f"± {100 * res[method]['final'][1]:4.1f}  "
                  f"({sum(r['seconds'] for r in runs):.0f} s)", flush=True)
        if refs:
            res["references"] = {k: mean_std([r[k] for r in refs]) for k in refs[0]}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    plot(out, Path(args.plot))


if __name__ == "__main__":
    main()
