"""FedAvg in plain PyTorch: a server loop that trains K clients one after the other from the
global model and moves the global model to their example-weighted mean with one call of
``fedkernels.aggregate`` (one fused pass over the K state_dicts).

    python fedavg.py                          # 2 clients, 3 rounds
    python fedavg.py --clients 10 --rounds 20 --server-lr 1.0
"""

from __future__ import annotations

import argparse
import time

import fedkernels

from task import MLP, evaluate, load_partition, load_test, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-lr", type=float, default=1.0,
                        help="x <- x + lr * (mean - x); 1.0 is FedAvg")
    args = parser.parse_args()

    shards = [load_partition(c, args.clients) for c in range(args.clients)]
    x_test, y_test = load_test()
    global_model = MLP()
    sizes = [float(len(y)) for _, y in shards]

    for server_round in range(1, args.rounds + 1):
        start = time.perf_counter()
        states = []
        for client, (x, y) in enumerate(shards):
            local = MLP()
            local.load_state_dict(global_model.state_dict())
            train(local, x, y, seed=1000 * server_round + client)
            states.append(local.state_dict())
        # x <- x + lr * sum_k n_k (x_k - x) / sum_k n_k, in one fused pass over the K models,
        # written into the global model's own tensors (its state_dict shares their storage)
        global_state = global_model.state_dict()
        fedkernels.aggregate(states, sizes, base=global_state, scale=args.server_lr,
                             normalize=True, out=global_state)
        loss, accuracy = evaluate(global_model, x_test, y_test)
        print(f"round {server_round}: test accuracy {accuracy:.3f}, loss {loss:.3f}, "
              f"{time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
