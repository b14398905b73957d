"""Batched (torch.func.vmap) against sequential local training of one round's clients.

    python bench/bench_vmap.py                  # 100 clients, MLP 64-64-10 on digits
    python bench/bench_vmap.py --clients 50 --threads 1
    python bench/bench_vmap.py --out /tmp/vmap.json   # write there instead of bench/results/runs/
    python bench/bench_vmap.py --save                 # also update bench/results/<device>.json

Every client of the round (IID digits, about 14 training rows each) trains the same MLP from
the same global model with the same minibatch plans on both paths:

  sequential   fedkernels.sim.client.LocalTrainer, one client after another (torch.optim.SGD)
  vmap         fedkernels.sim.vmap.BatchedTrainer, all clients per step in one vmapped
               forward/backward on stacked [K, ...] parameters

Reported: the median wall time of one round's client training over repeats, the speedup
(sequential / vmap), and the largest difference between the two paths' trained parameters.
Results go under the key "vmap" of a new file in bench/results/runs/ (see harness/results.py); --save
also merges them into the committed bench/results/<device>.json.
"""

from __future__ import annotations

import argparse

import torch

from fedkernels.algorithms import FedAvg
from fedkernels.sim.client import LocalTrainer
from fedkernels.sim.config import ClientConfig, ModelConfig, PartitionConfig
from fedkernels.sim.data import load_digits
from fedkernels.sim.federation import build_federation
from fedkernels.sim.models import build_model
from fedkernels.sim.vmap import BatchedTrainer

from harness.cli import add_output_arguments, at_least, check_output_arguments
from harness.machine import environment
from harness.results import write_results
from harness.timing import median_time

SETTINGS = {
    "1 epoch, batch 10": ClientConfig(epochs=1, batch_size=10, lr=0.05),
    "5 epochs, batch 10": ClientConfig(epochs=5, batch_size=10, lr=0.05),
    "10 steps, batch 16, momentum 0.9": ClientConfig(
        steps=10, batch_size=16, lr=0.05, momentum=0.9
    ),
}


def measure(num_clients: int, hidden: list[int], client: ClientConfig, repeats: int) -> dict:
    fed = build_federation(
        load_digits(), PartitionConfig(kind="iid", num_clients=num_clients), 0.2, seed=0
    )
    model = build_model(
        ModelConfig(name="mlp", hidden=hidden), fed.num_features, fed.num_classes, None, seed=0
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = list(range(num_clients))
    strategy = FedAvg()
    sequential = LocalTrainer(model, client, strategy, seed=0)
    batched = BatchedTrainer(model, client, strategy, seed=0)

    def run_sequential():
        return [sequential.train(state, fed.clients[i], 0, i) for i in ids]

    def run_batched():
        return batched.train(state, fed.clients, 0, ids)

    diff = max(
        float((a.state[k] - b.state[k]).abs().max())
        for a, b in zip(run_sequential(), run_batched())
        for k in state
    )
    t_seq = median_time(run_sequential, torch.device("cpu"), repeats=repeats, warmup=1)
    t_vmap = median_time(run_batched, torch.device("cpu"), repeats=repeats, warmup=1)
    steps = sum(
        len(range(0, c.num_train, client.batch_size)) * client.epochs
        if client.steps is None
        else client.steps
        for c in fed.clients
    )
    return {
        "clients": num_clients,
        "parameters": sum(p.numel() for p in model.parameters()),
        "client_steps": steps,
        "sequential_s": t_seq,
        "vmap_s": t_vmap,
        "speedup": t_seq / t_vmap,
        "max_abs_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=at_least(1), default=100)
    parser.add_argument("--hidden", type=at_least(1), nargs="+", default=[64])
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--threads", type=at_least(1), help="torch.set_num_threads")
    parser.add_argument("--tiny", action="store_true",
                        help="4 clients, 1 repeat, 10 local steps only: checks the script runs")
    add_output_arguments(parser)
    args = parser.parse_args()
    check_output_arguments(args)
    settings = dict(SETTINGS)
    if args.tiny:
        args.clients, args.repeats = 4, 1
        settings = {k: v for k, v in SETTINGS.items() if v.steps is not None}
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {}
    print(
        f"{args.clients} clients, MLP 64-{'-'.join(map(str, args.hidden))}-10 on digits, "
        f"{torch.get_num_threads()} threads"
    )
    header = ("local training", "steps", "sequential", "vmap", "speedup", "max diff")
    print("{:36s} {:>6s} {:>11s} {:>9s} {:>8s} {:>9s}".format(*header))
    for name, client in settings.items():
        row = measure(args.clients, args.hidden, client, args.repeats)
        rows[name] = row
        print(
            f"{name:36s} {row['client_steps']:6d} {row['sequential_s'] * 1e3:9.1f}ms "
            f"{row['vmap_s'] * 1e3:7.1f}ms {row['speedup']:7.1f}x {row['max_abs_diff']:9.1e}"
        )
    payload = {"environment": environment(torch.device("cpu")), "rows": rows}
    path = write_results("vmap", torch.device("cpu"), payload, save=args.save, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
