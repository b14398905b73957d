"""FedAvg the FedLab way: models travel as one flat parameter vector (FedLab's
``SerializationTool``), and the server averages the clients' vectors with fedkernels'
``Aggregators``, a drop-in for ``fedlab.utils.aggregator.Aggregators`` (one fused pass where
FedLab stacks the K vectors into a [P, K] copy first).

    python fedavg.py                          # 2 clients, 3 rounds
    python fedavg.py --clients 10 --rounds 20
    python fedavg.py --fedasync 0.5           # FedAsync: clients merge one at a time
"""

from __future__ import annotations

import argparse
import time

from fedlab.utils.serialization import SerializationTool

from fedkernels.integrations.fedlab import Aggregators  # was: from fedlab.utils.aggregator ...

from task import MLP, evaluate, load_partition, load_test, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fedasync", type=float, default=None, metavar="ALPHA",
                        help="merge each client as it finishes, (1 - alpha) x + alpha x_k")
    args = parser.parse_args()

    shards = [load_partition(c, args.clients) for c in range(args.clients)]
    x_test, y_test = load_test()
    server_model, local = MLP(), MLP()

    for server_round in range(1, args.rounds + 1):
        start = time.perf_counter()
        vectors, sizes = [], []
        for client, (x, y) in enumerate(shards):
            # what FedLab's trainers do: load the server's vector, train, send a vector back
            SerializationTool.deserialize_model(local, SerializationTool.serialize_model(server_model))
            train(local, x, y, seed=1000 * server_round + client)
            vector = SerializationTool.serialize_model(local)
            if args.fedasync is None:
                vectors.append(vector)
                sizes.append(len(y))
            else:
                merged = Aggregators.fedasync_aggregate(
                    SerializationTool.serialize_model(server_model), vector, args.fedasync)
                SerializationTool.deserialize_model(server_model, merged)
        if args.fedasync is None:
            # sum_k n_k x_k / sum_j n_j over the K vectors
            mean = Aggregators.fedavg_aggregate(vectors, weights=sizes)
            SerializationTool.deserialize_model(server_model, mean)
        loss, accuracy = evaluate(server_model, x_test, y_test)
        print(f"round {server_round}: test accuracy {accuracy:.3f}, loss {loss:.3f}, "
              f"{time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
