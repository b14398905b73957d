"""The simulator on a lent GPU, in one go and under 5 minutes on an H200. It builds nothing: run
it from the source folder once the CUDA kernels are built in place (``bench/gpu_validate.sh``
builds them):

    python experiments/gpu_sim_check.py [--out DIR] [--budget SECONDS]

1. The simulator's GPU tests: ``pytest -m cuda`` on test_sim_cuda.py (a GPU run agrees with the
   CPU run of its seed, repeats bitwise, resumes a checkpoint of the other device),
   and test_sim_placement.py (where every family of algorithms finds its tensors, and which
   fedkernels kernels run, counted by device).
2. Real configurations for a few rounds on the GPU, and the small ones on the CPU too (all its
   cores; the CPU's peak memory is the whole process's, since the start), every run in a time
   box that ends it after the round that crosses it: MNIST-1D with its CNN (``--data.name mnist1d --model.name
   mnist1d_cnn``, skipped without the mnist1d package), ResNet-18 on generated 3x32x32 images
   (Gaussian class patterns: the ``resnet18`` model needs an image shape, which the built-in
   ``gaussian_mixture`` rows lack), and 100 clients of an MLP trained at once with ``vmap``.

Writes ``gpu_sim_check.json`` (per run: rounds done, seconds per round, rounds per second
after the first round, peak device memory, test accuracy; the tests' counts) and the tests'
log into DIR: ``$OUT`` when set, else ``bench/results/runs/gpu-sim-check-<UTC time>``. Exit
status 2 (one line) without a GPU or without fedkernels' CUDA kernels, 1 when the tests fail,
0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the package as built in place

import torch  # noqa: E402

from fedkernels.algorithms import build_strategy  # noqa: E402
from fedkernels.ops import native  # noqa: E402
from fedkernels.sim import ConfigError, Dataset, ExperimentConfig, Simulation, from_dict  # noqa: E402
from fedkernels.sim.devices import device_name  # noqa: E402

TESTS = ["python_tests/test_sim_cuda.py", "python_tests/test_sim_placement.py"]


class OutOfTime(Exception):
    """A run's time box ended (after the round that crossed it)."""


def generated_images(num_samples: int = 2000, classes: int = 10, seed: int = 0) -> Dataset:
    """3x32x32 images: a random pattern per class plus noise, clipped to [0, 1]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    patterns = torch.rand(classes, 3, 32, 32, generator=g, device="cpu")
    y = torch.arange(num_samples, device="cpu") % classes
    noise = 0.3 * torch.randn(num_samples, 3, 32, 32, generator=g, device="cpu")
    return Dataset.from_tensors((patterns[y] + noise).clamp(0, 1), y)


def configurations() -> dict[str, tuple[dict[str, Any], Any, bool]]:
    """name -> (configuration tree, dataset factory or None, whether to run it on the CPU too:
    not ResNet-18, whose CPU round takes minutes)."""
    base = {"algorithm": "fedavg", "partition": {"num_clients": 10}, "seed": 0}
    return {
        "mnist1d_cnn": ({**base, "rounds": 6, "eval_every": 6,
                         "data": {"name": "mnist1d"}, "model": {"name": "mnist1d_cnn"},
                         "client": {"epochs": 1, "batch_size": 32}}, None, True),
        "resnet18_images_3x32x32": ({**base, "rounds": 4, "eval_every": 4,
                                     "model": {"name": "resnet18"},
                                     "client": {"steps": 5, "batch_size": 32, "lr": 0.05}},
                                    generated_images, False),
        "mlp_100_clients_vmap": ({**base, "rounds": 6, "eval_every": 6, "vmap": True,
                                  "data": {"name": "gaussian_mixture", "num_samples": 20000,
                                           "num_features": 32, "num_classes": 10},
                                  "partition": {"num_clients": 100},
                                  "model": {"name": "mlp", "hidden": [64]},
                                  "client": {"steps": 5, "batch_size": 32}}, None, True),
    }


def timed_run(tree: dict[str, Any], dataset, device: str, seconds: float) -> dict[str, Any]:
    """One run on ``device``, stopped after the round that ends past ``seconds``."""
    config = from_dict(ExperimentConfig, {**tree, "device": device})
    started = time.perf_counter()
    try:
        sim = Simulation(config, build_strategy(config.algorithm),
                         dataset=None if dataset is None else dataset())
    except ConfigError as err:
        return {"skipped": str(err)}
    setup_s = time.perf_counter() - started
    deadline = time.perf_counter() + seconds

    def stop_when_late(record: dict[str, Any]) -> None:
        if time.perf_counter() > deadline and record["round"] < config.rounds:
            raise OutOfTime

    try:
        sim.run(on_round=stop_when_late)
        complete = True
    except OutOfTime:
        complete = False
    walls = [r["wall_time_s"] for r in sim.records]
    summary = sim.result().summary
    later = walls[1:]
    return {
        "device": summary["device"], "device_name": summary["device_name"],
        "rounds_done": len(walls), "rounds_planned": config.rounds, "complete": complete,
        "setup_s": setup_s, "round_s": walls,
        "rounds_per_s_after_first": len(later) / sum(later) if later else None,
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "test_accuracy": summary["test_accuracy"],
        "clients": len(sim.federation.clients), "parameters": sum(
            v.numel() for k, v in sim.server.state.items() if k in sim.server.parameter_names),
    }


def run_tests(out: Path, seconds: float) -> dict[str, Any]:
    log = out / "pytest_sim_cuda.log"
    command = [sys.executable, "-m", "pytest", *TESTS, "-m", "cuda", "-q", "-rs",
               "-p", "no:cacheprovider"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=seconds)
        text, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        partial = err.stdout or ""
        if isinstance(partial, bytes):
            partial = partial.decode(errors="replace")
        text, status = f"{partial}\n(stopped after {seconds:.0f} s)", -1
    log.write_text(text)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text)}
    return {"command": " ".join(command[1:]), "exit_status": status, "counts": counts,
            "seconds": time.perf_counter() - started, "log": log.name,
            "tail": text.strip().splitlines()[-15:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder of the results (default: $OUT, else "
                        "bench/results/runs/gpu-sim-check-<time>)")
    parser.add_argument("--budget", type=float, default=280.0,
                        help="seconds for everything (default 280)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sim_check: error: no CUDA device is visible (torch.cuda.is_available() is "
              "False)", file=sys.stderr)
        return 2
    if not native.cuda_available:
        print("gpu_sim_check: error: fedkernels' CUDA kernels are not built (build them in "
              "place first: FEDKERNELS_CUDA=1 python setup.py build_ext --inplace)",
              file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.budget
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out or os.environ.get("OUT") or
               REPO / "bench" / "results" / "runs" / f"gpu-sim-check-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": stamp, "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": device_name(torch.device("cuda", torch.cuda.current_device())),
        "cpu": device_name(torch.device("cpu")), "cpu_threads": torch.get_num_threads(),
    }
    path = out / "gpu_sim_check.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=2) + "\n")

    report["tests"] = run_tests(out, min(170.0, deadline - time.perf_counter() - 60))
    save()
    report["runs"] = {}
    for name, (tree, dataset, on_cpu) in configurations().items():
        entry = report["runs"][name] = {}
        for device, share in (("cuda", 25.0), ("cpu", 12.0)):
            if device == "cpu" and not on_cpu:
                continue
            left = deadline - time.perf_counter()
            if left < 10:
                entry[device] = {"skipped": "out of the time budget"}
                continue
            entry[device] = timed_run(tree, dataset, device, min(share, left - 8))
            save()
        gpu, cpu = entry.get("cuda", {}), entry.get("cpu", {})
        if gpu.get("rounds_per_s_after_first") and cpu.get("rounds_per_s_after_first"):
            entry["gpu_speedup"] = gpu["rounds_per_s_after_first"] / cpu["rounds_per_s_after_first"]
        save()
        print(f"{name}: " + ", ".join(
            f"{d} {r['rounds_per_s_after_first']:.2f} rounds/s, peak "
            f"{r['peak_memory_bytes'] / 2**20:.0f} MiB" if r.get("rounds_per_s_after_first")
            else f"{d} {r.get('skipped', 'one round only')}"
            for d, r in entry.items() if isinstance(r, dict)))
    tests = report["tests"]
    print(f"tests: {tests['counts']} (exit status {tests['exit_status']}); results in {path}")
    return 0 if tests["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
