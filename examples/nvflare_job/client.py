"""A site's training script, on NVFlare's Client API: receive the global model, evaluate it,
train it on this site's shard of the digits, send it back with the number of examples as its
weight. Plain NVFlare: nothing here changes when the server aggregates with fedkernels."""

from __future__ import annotations

import argparse

import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

from task import MLP, evaluate, load_partition, load_test, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-partitions", type=int, required=True)
    args = parser.parse_args()

    flare.init()
    site = flare.get_site_name()  # "site-1", "site-2", ...
    partition = int(site.rsplit("-", 1)[1]) - 1
    x, y = load_partition(partition, args.num_partitions)
    x_test, y_test = load_test()
    model = MLP()
    while flare.is_running():
        received = flare.receive()
        model.load_state_dict(received.params)
        # the global model's accuracy: the server's model selector reads "accuracy"
        _, accuracy = evaluate(model, x_test, y_test)
        # NVFlare counts rounds from 0, the other examples from 1: the same seeds as theirs
        loss = train(model, x, y, seed=1000 * (received.current_round + 1) + partition)
        # FedAvg's weight: NVFlare weighs each reply by its NUM_STEPS_CURRENT_ROUND
        flare.send(FLModel(params=model.state_dict(),
                           metrics={"accuracy": accuracy, "train_loss": loss},
                           meta={"NUM_STEPS_CURRENT_ROUND": len(y)}))


if __name__ == "__main__":
    main()
