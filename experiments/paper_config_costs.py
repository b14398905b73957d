"""What the configurations in configs/ cost on this CPU, one thread each.

Three measurements, written to ``--out`` (default experiments/paper_config_costs.json):

1. ``stand_ins``: every MNIST-1D stand-in (configs/mnist1d/) run for a few rounds at its full
   size (``fedkernels run --config ... --rounds N``); the median training time of a round
   (clients and aggregation, rounds 2..N: the first carries one-off costs), the evaluation's
   time, and the whole command's wall time (start-up, data generation, the algorithm's setup).
2. ``tables_measured``: the tables' configurations whose rounds are cheap (SuPerFed-MM on MNIST,
   FedAU on CIFAR-10, AAggFF-S on the heart data), run a few rounds on random files of the
   publisher's format *and full size* (fedkernels.sim.datasets.tiny_files): a round costs the
   same whatever the pixels hold.
3. ``model_steps``: one SGD step (forward, backward, update) and one forward of each table's
   model at the table's batch size, for the estimates of the tables whose rounds take minutes
   to hours here (docs/guide/reproducing_papers.md multiplies them out).

    OMP_NUM_THREADS=1 python experiments/paper_config_costs.py                 # about 5 minutes
    OMP_NUM_THREADS=1 python experiments/paper_config_costs.py --only stand_ins

Times depend on the machine and on what else runs on it; the JSON records the CPU and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedkernels.sim.config import ModelConfig
from fedkernels.sim.datasets import tiny_files
from fedkernels.sim.models import build_model

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"
# stand-in -> rounds to run (FedGO's rounds take seconds, its setup more)
STAND_IN_ROUNDS = {"superfed_mm": 6, "aaggff_s": 5, "aaggff_d": 5, "fedau": 10, "fedgo": 2,
                   "fedevg": 4, "vred": 4, "semi_vred": 4}
# table config -> (rounds, writer of full-size random files into a folder)
TABLES = {
    "superfed_mm_mnist": (3, lambda root: tiny_files.write_mnist(
        root, num_train=60000, num_test=10000, gz=False)),
    "fedau_cifar10": (5, lambda root: tiny_files.write_cifar10(
        root, per_batch=10000, num_test=10000)),
    "aaggff_s_heart": (5, lambda root: tiny_files.write_heart(root, per_site=230)),
}
# table config -> model, row shape, classes, batch size
MODELS = {
    "superfed_mm_mnist": ("superfed_twonn", (1, 28, 28), 10, 10, {}),
    "fedau_cifar10": ("fedau_cnn_cifar10", (3, 32, 32), 10, 16, {}),
    "aaggff_d_tiny_imagenet": ("superfed_mobilenet", (3, 64, 64), 200, 20, {}),
    "fedgo_cifar10": ("vgg11", (3, 32, 32), 10, 64, {"norm": "batch"}),
    "fedevg_mnist": ("fedevg_resnet10", (1, 28, 28), 10, 64, {}),
    "vred_cifar10": ("resnet18", (3, 32, 32), 10, 64, {"norm": "group", "groups": 2}),
}


def run(config: Path, rounds: int, out: Path, *extra: str) -> dict:
    """``fedkernels run`` in a child process (one thread); its per-round times."""
    command = [sys.executable, "-m", "fedkernels.cli", "run", "--config", str(config),
               "--rounds", str(rounds), "--threads", "1", "--no-progress", "--no-plots",
               "--out", str(out), "--overwrite", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    rounds_ = json.loads((out / "results.json").read_text())["rounds"]
    train = [r["time_client"] + r["time_aggregate"] for r in rounds_]
    return {
        "rounds": len(rounds_),
        "train_s_per_round_median": statistics.median(train[1:] or train),
        "train_s_first_round": train[0],
        "eval_s_max": max(r.get("time_eval", 0.0) for r in rounds_),
        "participants": [r["participants"] for r in rounds_],
        "command_wall_s": wall,
        "outside_rounds_s": wall - sum(r["wall_time_s"] for r in rounds_),
    }


def time_model(name: str, shape: tuple[int, ...], classes: int, batch: int, options: dict,
               repeats: int = 3) -> dict:
    model = build_model(ModelConfig(name=name, **options), int(np.prod(shape)), classes, shape, 0)
    x = torch.rand(batch, int(np.prod(shape)))
    y = torch.randint(0, classes, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def forward() -> None:
        with torch.no_grad():
            model(x)

    out = {"model": name, "batch": batch, "parameters": sum(p.numel() for p in model.parameters())}
    for key, fn in (("step_s", step), ("forward_s", forward)):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[key] = statistics.median(times)
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "paper_config_costs.json")
    parser.add_argument("--only", choices=["stand_ins", "tables_measured", "model_steps"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result["environment"] = {
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "threads": 1,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.only in (None, "stand_ins"):
            result["stand_ins"] = {}
            for name, rounds in STAND_IN_ROUNDS.items():
                result["stand_ins"][name] = run(CONFIGS / "mnist1d" / f"{name}.yaml", rounds,
                                                tmp / name)
                print(name, result["stand_ins"][name], flush=True)
        if args.only in (None, "tables_measured"):
            result["tables_measured"] = {}
            for name, (rounds, write) in TABLES.items():
                root = tmp / f"{name}-data"
                write(root)
                result["tables_measured"][name] = run(CONFIGS / f"{name}.yaml", rounds,
                                                      tmp / name, "--data.root", str(root))
                print(name, result["tables_measured"][name], flush=True)
        if args.only in (None, "model_steps"):
            result["model_steps"] = {}
            for name, (model, shape, classes, batch, options) in MODELS.items():
                result["model_steps"][name] = time_model(model, shape, classes, batch, options)
                print(name, result["model_steps"][name], flush=True)
    result["environment"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
