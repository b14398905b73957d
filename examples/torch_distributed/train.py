"""FedAvg with the clients spread over the ranks of a torch.distributed job: every rank trains
its own clients from the global model, then one call of ``all_reduce_aggregate`` gives every
rank the example-weighted mean over all ranks' clients (a fused local sum, then one all-reduce
of one model-sized buffer). Rank 0 evaluates and logs.

    torchrun --standalone --nproc-per-node 2 train.py                 # 2 ranks on gloo (CPU), 2 clients
    torchrun --standalone --nproc-per-node 2 train.py --clients 10 --rounds 20

With NCCL on GPUs, pass --backend nccl: each rank then uses the GPU of its LOCAL_RANK.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fedkernels.integrations.distributed import all_reduce_aggregate

from task import MLP, evaluate, load_partition, load_test, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2, help="clients over all ranks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for the default env:// init
    dist.init_process_group(args.backend, timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # the ranks share the machine's cores

    mine = list(range(rank, args.clients, world))  # clients rank, rank + world, ...
    shards = [tuple(t.to(device) for t in load_partition(c, args.clients)) for c in mine]
    global_model = MLP().to(device)
    x_test, y_test = (t.to(device) for t in load_test())
    global_state = global_model.state_dict()  # the same tensors: updated in place below

    for server_round in range(1, args.rounds + 1):
        start = time.perf_counter()
        updates, sizes = [], []
        for client, (x, y) in zip(mine, shards):
            local = MLP().to(device)
            local.load_state_dict(global_state)
            train(local, x, y, seed=1000 * server_round + client)
            updates.append(local.state_dict())
            sizes.append(float(len(y)))
        # x <- x + sum_k n_k (x_k - x) / sum_k n_k over every rank's clients, written into
        # global_state on every rank; a rank without clients passes [] and like=global_state
        all_reduce_aggregate(updates, sizes, base=global_state, normalize=True,
                             out=global_state, like=global_state)
        if rank == 0:
            loss, accuracy = evaluate(global_model, x_test, y_test)
            print(f"round {server_round}: test accuracy {accuracy:.3f}, loss {loss:.3f}, "
                  f"{time.perf_counter() - start:.2f} s", flush=True)
    # Leave together: gloo's teardown can abort a rank whose peer is still evaluating
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
