"""Evidence for FedEvg's composition (docs/results/fedevg.md): a 2-D Gaussian mixture of 6
classes split so that each of 3 clients sees only 2 classes; after T rounds, do the server's
composed samples cover every client's modes? Compared for the signed and exact weightings.

    OMP_NUM_THREADS=1 python experiments/fedevg_toy.py   # writes experiments/fedevg_toy.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict


def run(mode: str, rounds: int, seed: int = 0) -> dict:
    cfg = from_dict(ExperimentConfig, {
        "rounds": rounds, "seed": seed,
        "data": {"name": "gaussian_mixture", "num_samples": 1800, "num_features": 2,
                 "num_classes": 6, "separation": 4.0},
        "partition": {"kind": "pathological", "num_clients": 3, "classes_per_client": 2},
        "participation": {"kind": "full"},
        "model": {"name": "mlp", "hidden": [32]},
        "eval_every": rounds,
    })
    strategy = build_strategy("fedevg", {
        "mode": mode, "clamp": False, "server_beta": 0.5, "server_beta_last": 0.05,
        "server_sigma": 0.01, "client_step": 0.1, "hidden": [64, 64], "batch_size": 64,
        "local_epochs": 2, "server_epochs": 20, "spc": 20,
    })
    sim = Simulation(cfg, strategy)
    result = sim.run()
    fed = sim.federation
    xs = torch.cat([c.train_x for c in fed.clients])
    ys = torch.cat([c.train_y for c in fed.clients])
    means = torch.stack([xs[ys == c].mean(0) for c in range(6)])
    x, y = strategy.synth_x, strategy.synth_y
    d = torch.cdist(x, means)  # [M, 6]
    near_own = (d.gather(1, y[:, None])[:, 0] < 2.0).double()  # within 2 sd of its class mean
    per_class = [float(near_own[y == c].mean()) for c in range(6)]
    client_classes = [sorted(set(c.train_y.tolist())) for c in fed.clients]
    covered = [all(per_class[c] > 0 for c in cls) for cls in client_classes]
    init = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    init_near = float((torch.cdist(init, means).gather(1, y[:, None])[:, 0] < 2.0).double().mean())
    return {
        "mode": mode, "rounds": rounds, "client_classes": client_classes,
        "fraction_near_own_class_mean": per_class, "every_client_mode_covered": covered,
        "overall_near_fraction": float(near_own.mean()), "noise_init_near_fraction": init_near,
        "synthetic_classifier_test_accuracy": result.summary["test_accuracy"],
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    torch.set_num_threads(1)
    out = {mode: run(mode, rounds) for mode in ("signed", "exact")}
    print(json.dumps(out, indent=1))
    Path(__file__).with_name("fedevg_toy.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
