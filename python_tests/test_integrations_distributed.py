"""fedkernels.integrations.distributed on real process groups: 2 and 4 processes on the gloo backend over
loopback (torch.multiprocessing spawn), every result compared with single-process
:func:`fedkernels.aggregate` on the union of all ranks' clients. The NCCL variant runs the same
checks on CUDA tensors (marked cuda: skipped without a GPU).

Every scenario runs inside one spawn per world size, to pay the process start-up once.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fedkernels
from fedkernels.integrations.distributed import WeightedPartial, all_reduce_aggregate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clients(seed: int, count: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def model(k):
        return {
            "conv.weight": torch.randn(4, 3, 3, generator=g),
            "conv.bias": torch.randn(4, generator=g),
            "bn.num_batches_tracked": torch.tensor(10 * k + 3),
            "fc.weight": torch.randn(5, 7, generator=g),
            "scalar": torch.randn((), generator=g),
        }

    out = []
    for k in range(count):
        m = model(k)
        out.append({n: (t.to(dtype) if t.is_floating_point() else t).to(device)
                    for n, t in m.items()})
    weights = (torch.rand(count, generator=g, dtype=torch.float64) * 5 + 0.5).tolist()
    return out, weights


def _split(world: int, rank: int, total: int) -> list[int]:
    """Uneven shares; the last rank gets no client when there are more than two ranks."""
    if world > 2 and rank == world - 1:
        return []
    owners = [k % (world - 1 if world > 2 else world) for k in range(total)]
    return [k for k, r in enumerate(owners) if r == rank]


def _close(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype, n
        if a[n].is_floating_point():
            torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=n)
        else:
            assert torch.equal(a[n], b[n]), n


def _worker(rank: int, world: int, port: int, backend: str) -> None:
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for dtype, atol in ((torch.float32, 2e-5), (torch.float64, 1e-12),
                            (torch.bfloat16, 2e-2)):
            clients, weights = _clients(7, 7, dtype, device)
            mine = _split(world, rank, len(clients))
            local = [clients[k] for k in mine]
            local_w = [weights[k] for k in mine]
            like = clients[0]

            # plain, normalized (FedAvg)
            got = all_reduce_aggregate(local, local_w, normalize=True, like=like)
            _close(got, fedkernels.aggregate(clients, weights, normalize=True), atol, 1e-5)

            # plain, raw weights and a scale
            got = all_reduce_aggregate(local, local_w, scale=0.3, like=like)
            _close(got, fedkernels.aggregate(clients, weights, scale=0.3), atol, 1e-5)

            # delta mode with base and server learning rate, into the base in place
            base = {n: t.clone() for n, t in _clients(99, 1, dtype, device)[0][0].items()}
            expected = fedkernels.aggregate(clients, weights, base=base, scale=0.7,
                                            normalize=True)
            target = {n: t.clone() for n, t in base.items()}
            got = all_reduce_aggregate(local, local_w, base=target, scale=0.7,
                                       normalize=True, out=target)
            assert got is target
            _close(target, expected, atol * 4, 1e-5)

            # int_policy="first" (client 0, which rank 0 holds) and "skip" (the base's)
            got = all_reduce_aggregate(local, local_w, normalize=True, like=like,
                                       int_policy="first")
            assert torch.equal(got["bn.num_batches_tracked"],
                               clients[0]["bn.num_batches_tracked"])
            got = all_reduce_aggregate(local, local_w, base=base, int_policy="skip")
            assert torch.equal(got["bn.num_batches_tracked"], base["bn.num_batches_tracked"])

        if world == 4:
            # Hierarchy: two "nodes" {0, 1} and {2, 3}; sum inside each node onto its
            # leader, sum across the leaders {0, 2}, broadcast back inside each node.
            nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            leaders = dist.new_group([0, 2])
            node, leader = nodes[rank // 2], (rank // 2) * 2
            clients, weights = _clients(11, 9, torch.float32, device)
            mine = [k for k in range(len(clients)) if k % 4 == rank]
            partial = WeightedPartial.from_clients([clients[k] for k in mine],
                                                   [weights[k] for k in mine], like=clients[0])
            partial.reduce(dst=leader, group=node)
            if rank == leader:
                partial.all_reduce(group=leaders)
            partial.broadcast(src=leader, group=node)
            got = partial.result(normalize=True)
            _close(got, fedkernels.aggregate(clients, weights, normalize=True), 2e-5, 1e-5)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_equals_single_process(world):
    mp.spawn(_worker, args=(world, _free_port(), "gloo"), nprocs=world, join=True)


@pytest.mark.cuda
def test_nccl_equals_single_process():
    world = max(1, min(2, torch.cuda.device_count()))
    mp.spawn(_worker, args=(world, _free_port(), "nccl"), nprocs=world, join=True)


def test_rank_without_clients_needs_structure():
    with pytest.raises(ValueError, match="like= or base="):
        WeightedPartial.from_clients([], [])
