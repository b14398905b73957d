"""Personalized evaluation of many clients: batched (torch.func.vmap) against one at a time.

    python bench/bench_personalized_eval.py                # 1,000 clients, MLP and CNN
    python bench/bench_personalized_eval.py --clients 200 --threads 1
    python bench/bench_personalized_eval.py --out /tmp/pe.json   # write there, not bench/results/runs/
    python bench/bench_personalized_eval.py --save               # also update bench/results/<device>.json

Every client has its own personal model (Ditto's: personal parameters, random perturbations of
the initial model) and its own test split of 1 to 40 random digits-shaped rows (8x8, 10
classes); the strategy's ``personalized_logits`` runs both ways:

  sequential   load_state_dict + forward per client (batched_eval = False)
  batched      chunks of up to 64 clients of similar test sizes, personal states stacked,
               one vmap(functional_call) forward per chunk (the default)

Reported: medians of interleaved repeats of one full evaluation, the speed-up (sequential /
batched) and the largest difference between the two paths' logits. The personal states are
built by the strategy on both paths (``personal_state``), so their cost is in both times.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim.config import ClientConfig, ModelConfig
from fedkernels.sim.models import build_model
from fedkernels.sim.strategy import SetupInfo

from harness.cli import add_output_arguments, at_least, check_output_arguments
from harness.machine import environment
from harness.results import write_results
from harness.timing import interleaved_medians

MODELS = {
    "MLP 64-64-10": ModelConfig(name="mlp", hidden=[64]),
    "CNN 16-32 (8x8)": ModelConfig(name="cnn", channels=[16, 32]),
}


def setup(config: ModelConfig, num_clients: int, max_rows: int):
    model = build_model(config, 64, 10, (1, 8, 8), seed=0)
    strategy = build_strategy("ditto", {})
    names = [n for n, _ in model.named_parameters()]
    strategy.setup(SetupInfo(
        num_clients=num_clients, train_sizes=torch.ones(num_clients, dtype=torch.float64),
        num_classes=10, participation_probabilities=None, parameter_names=names, model=model,
        client_config=ClientConfig(), seed=0,
    ))
    g = torch.Generator().manual_seed(0)
    for k in range(num_clients):
        strategy.personal[k] = {
            n: strategy.initial[n] + 0.1 * torch.randn(strategy.initial[n].shape, generator=g)
            for n in names
        }
    sizes = torch.randint(1, max_rows + 1, (num_clients,), generator=g).tolist()
    clients = [  # evaluation reads only the test split
        SimpleNamespace(test_x=torch.randn(n, 64, generator=g),
                        test_y=torch.randint(0, 10, (n,), generator=g))
        for n in sizes
    ]
    return strategy, model.state_dict(), clients


def measure(config: ModelConfig, num_clients: int, max_rows: int, repeats: int) -> dict:
    strategy, state, clients = setup(config, num_clients, max_rows)

    def batched():
        strategy.batched_eval = True
        return strategy.personalized_logits(state, clients)

    def sequential():
        strategy.batched_eval = False
        return strategy.personalized_logits(state, clients)

    diff = max(float((a - b).abs().max()) for a, b in zip(batched(), sequential()))
    times = interleaved_medians({"sequential": sequential, "batched": batched},
                                torch.device("cpu"), repeats=repeats, warmup=1)
    return {
        "clients": num_clients,
        "test_rows": sum(len(c.test_y) for c in clients),
        "parameters": sum(t.numel() for t in state.values()),
        "sequential_s": times["sequential"],
        "batched_s": times["batched"],
        "speedup": times["sequential"] / times["batched"],
        "max_abs_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=at_least(1), default=1000)
    parser.add_argument("--max-rows", type=at_least(1), default=40,
                        help="test rows per client: uniform in 1..max-rows")
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--threads", type=at_least(1), help="torch.set_num_threads")
    parser.add_argument("--tiny", action="store_true", help="10 clients, 1 repeat: checks the script runs")
    add_output_arguments(parser)
    args = parser.parse_args()
    check_output_arguments(args)
    if args.tiny:
        args.clients, args.repeats = 10, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.clients} clients, 1..{args.max_rows} test rows each, {torch.get_num_threads()} threads")
    header = ("model", "rows", "sequential", "batched", "speedup", "max diff")
    print("{:18s} {:>6s} {:>11s} {:>10s} {:>8s} {:>9s}".format(*header))
    rows = {}
    for name, config in MODELS.items():
        row = measure(config, args.clients, args.max_rows, args.repeats)
        rows[name] = row
        print(
            f"{name:18s} {row['test_rows']:6d} {row['sequential_s'] * 1e3:9.1f}ms "
            f"{row['batched_s'] * 1e3:8.1f}ms {row['speedup']:7.2f}x {row['max_abs_diff']:9.1e}"
        )
    payload = {"environment": environment(torch.device("cpu")), "rows": rows}
    path = write_results("personalized_eval", torch.device("cpu"), payload, save=args.save, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
