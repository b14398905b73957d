"""fedkernels.integrations.distributed on real process groups: 2 and 4 processes on the gloo
backend over loopback (torch.multiprocessing spawn). Every result is compared with
single-process :func:`fedkernels.aggregate` on the union of all ranks' clients, and every way
in which ranks can disagree (key order, missing or extra key, shape, transposed shape, dtype,
flags, int_policy, a NaN weight, no client anywhere, a rank that never calls, a rank that dies
mid-call) must make every rank raise the same clear error within a bound, never crash a
process nor hang. The NCCL variant runs the same checks on CUDA tensors (marked cuda: skipped
without a GPU).

Every scenario runs inside one spawn per world size, to pay the process start-up once. The
parent hosts the rendezvous store, so the ranks can build a fresh process group after a
scenario that leaves one unusable (an absent or dead rank).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fedkernels
from fedkernels.integrations.distributed import WeightedPartial, all_reduce_aggregate

# Bounds on how long a rank may take to raise: they catch hangs (the default process-group
# timeout is 30 minutes), they are not performance figures.
HANG_BOUND_S = 20.0
SHORT_TIMEOUT_S = 3.0
SPAWN_BOUND_S = 300.0
STORE_TIMEOUT = timedelta(seconds=60)


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


# ---------------------------------------------------------------- results


def _check_results(rank: int, world: int, device: str) -> None:
    for dtype, atol in ((torch.float32, 2e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
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
        expected = fedkernels.aggregate(clients, weights, base=base, scale=0.7, normalize=True)
        target = {n: t.clone() for n, t in base.items()}
        got = all_reduce_aggregate(local, local_w, base=target, scale=0.7, normalize=True,
                                   out=target)
        assert got is target
        _close(target, expected, atol * 4, 1e-5)

        # int_policy="first" (client 0, which rank 0 holds) and "skip" (the base's)
        got = all_reduce_aggregate(local, local_w, normalize=True, like=like, int_policy="first")
        assert torch.equal(got["bn.num_batches_tracked"], clients[0]["bn.num_batches_tracked"])
        got = all_reduce_aggregate(local, local_w, base=base, int_policy="skip")
        assert torch.equal(got["bn.num_batches_tracked"], base["bn.num_batches_tracked"])

    # The total weight W travels in float64 whatever the model's dtype: a float32 W would
    # round 2**24 + world (rank 0's client has weight 2**24 + 1, the others 1).
    clients = [{"x": torch.full((3,), float(k > 0), device=device)} for k in range(world)]
    weights = [2.0**24 + 1] + [1.0] * (world - 1)
    got = all_reduce_aggregate([clients[rank]], [weights[rank]], normalize=True)
    assert torch.equal(got["x"], fedkernels.aggregate(clients, weights, normalize=True)["x"])
    partial = WeightedPartial.from_clients([clients[rank]], [weights[rank]]).all_reduce()
    assert partial.total_weight.dtype == torch.float64
    assert float(partial.total_weight) == 2.0**24 + world

    # normalize=True divides the weights by the global total before the sum, as aggregate
    # does: raw weights beyond float32's range, or so small that 1 / W is, gave an error, inf,
    # NaN or "value cannot be converted to type float without overflow".
    clients = [{"x": torch.full((3,), rank * 2.0 + 1.0, device=device)} for rank in range(world)]
    for unit in (1e39, 3e38, 1e300, 1e-40, 1e-46):
        weights = [unit * (r + 1) for r in range(world)]
        for base in (None, {"x": torch.ones(3, device=device)}):
            got = all_reduce_aggregate([clients[rank]], [weights[rank]], normalize=True,
                                       base=base)
            expected = fedkernels.aggregate(clients, weights, normalize=True, base=base)
            assert torch.allclose(got["x"], expected["x"], rtol=1e-6), (unit, got, expected)

    # Integer entries of every dtype follow int_policy as in aggregate. The backends reduce
    # and broadcast few integer dtypes (gloo: no int16, uint16, uint32, uint64, "Invalid
    # scalar type"; torch has no CPU max for the unsigned ones): these raised RuntimeError.
    for int_dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.bool):
        clients = [{"x": torch.full((2,), float(k), device=device),
                    "n": (torch.tensor([k % 2 == 1, k == 0]) if int_dtype == torch.bool else
                          torch.tensor([k, 2**15 - 1 - k]).to(int_dtype)).to(device)}
                   for k in range(world)]
        for policy in ("max", "first"):
            counter = clients[rank]["n"].clone()
            got = all_reduce_aggregate([clients[rank]], [1.0], normalize=True,
                                       int_policy=policy, timeout=HANG_BOUND_S)
            expected = fedkernels.aggregate(clients, [1.0] * world, normalize=True,
                                            int_policy=policy)
            assert got["n"].dtype == int_dtype, (int_dtype, policy)
            assert torch.equal(got["n"], expected["n"]), (int_dtype, policy, got["n"])
            assert torch.equal(clients[rank]["n"], counter)  # the input is not written

    # A Module.state_dict()'s _metadata (module versions) is carried over, as aggregate does;
    # the result was a plain dict without it. A rank without clients takes like='s.
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).to(device)
    state = module.state_dict()
    empty = world > 2 and rank == world - 1
    got = all_reduce_aggregate([] if empty else [state], [] if empty else [1.0],
                               normalize=True, like=state if empty else None)
    expected = fedkernels.aggregate([state], [1.0], normalize=True)
    assert got._metadata == expected._metadata == state._metadata
    assert got._metadata is not state._metadata  # a copy
    module.load_state_dict(got)

    if world == 4:
        # Hierarchy: two "nodes" {0, 1} and {2, 3}; sum inside each node onto its leader,
        # sum across the leaders {0, 2}, broadcast back inside each node.
        nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        leaders = dist.new_group([0, 2])
        node, leader = nodes[rank // 2], (rank // 2) * 2
        # A rank outside the group it passes is told so (it got "Invalid process group
        # specified" from the backend lookup); it takes no part in any collective.
        with pytest.raises(ValueError, match="is not a member of the group"):
            all_reduce_aggregate([_xy(rank, device)], [1.0], group=nodes[1 - rank // 2])
        clients, weights = _clients(11, 9, torch.float32, device)
        # Leader 0 has no client of its own; rank 1 holds client 0 (int_policy="first").
        mine = [k for k in range(len(clients)) if 1 + k % 3 == rank]
        for policy in ("max", "first"):
            partial = WeightedPartial.from_clients([clients[k] for k in mine],
                                                   [weights[k] for k in mine],
                                                   like=clients[0], int_policy=policy)
            partial.reduce(dst=leader, group=node)
            if rank == leader:
                partial.all_reduce(group=leaders)
            partial.broadcast(src=leader, group=node)
            got = partial.result(normalize=True)
            _close(got, fedkernels.aggregate(clients, weights, normalize=True,
                                             int_policy=policy), 2e-5, 1e-5)


# ---------------------------------------------------------------- disagreements


def _xy(rank: int, device: str, order=("x", "y", "n"), **changes) -> dict:
    """Rank r's one client: x = r + 1, y = r + 10 (so a mix-up of x and y shows), a counter."""
    values = {"x": torch.full((2, 3), rank + 1.0), "y": torch.full((2, 3), rank + 10.0),
              "n": torch.tensor(rank)}
    values.update(changes)
    return {k: values[k].to(device) for k in order if values.get(k) is not None}


def _expect_failure(outcomes: list, name: str, call, error: type, *fragments: str) -> None:
    """Runs ``call``, which must raise ``error`` with every fragment in its message within
    HANG_BOUND_S; records the message so the caller can check all ranks saw the same one."""
    start = time.monotonic()
    try:
        call()
    except error as err:
        elapsed = time.monotonic() - start
        message = str(err)
    else:
        raise AssertionError(f"{name}: no {error.__name__} raised")
    assert elapsed < HANG_BOUND_S, f"{name}: took {elapsed:.1f} s to raise"
    for fragment in fragments:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    outcomes.append((name, error.__name__, message))


def _check_disagreements(rank: int, world: int, device: str) -> None:
    odd = 1 if world > 1 else -1  # the rank that differs
    one = torch.ones(1, dtype=torch.float64)
    mine = _xy(rank, device)
    like = _xy(0, device)
    outcomes: list = []

    # The same keys in another order are matched by name: x = mean(r + 1), y = mean(r + 10).
    order = ("y", "n", "x") if rank == odd else ("x", "y", "n")
    got = all_reduce_aggregate([_xy(rank, device, order)], one, normalize=True)
    assert list(got) == list(order)
    expected_x = sum(r + 1.0 for r in range(world)) / world
    assert torch.equal(got["x"], torch.full((2, 3), expected_x, device=device)), got["x"]
    assert torch.equal(got["y"], torch.full((2, 3), expected_x + 9.0, device=device)), got["y"]
    assert int(got["n"]) == world - 1

    def each(name, error, fragments, **per_rank):
        """Every rank calls; on rank ``odd`` with the arguments in per_rank."""
        kwargs = {"updates": [mine], "weights": one, "normalize": True}
        if rank == odd:
            kwargs.update(per_rank)
        _expect_failure(outcomes, name, lambda: all_reduce_aggregate(
            kwargs.pop("updates"), kwargs.pop("weights"), **kwargs), error, *fragments)

    if world > 1:
        each("missing key", ValueError, ["tensor 'y' is missing on rank 1"],
             updates=[_xy(rank, device, ("x", "n"))])
        each("extra key", ValueError, ["rank 1 has tensor 'z'"],
             updates=[_xy(rank, device, ("x", "y", "z", "n"), z=torch.zeros(3))])
        each("shape", ValueError, ["tensor 'x' has shape (2, 4) on rank 1, (2, 3) on rank 0"],
             updates=[_xy(rank, device, x=torch.zeros(2, 4))])
        each("transposed shape", ValueError,
             ["tensor 'x' has shape (3, 2) on rank 1, (2, 3) on rank 0"],
             updates=[_xy(rank, device, x=torch.zeros(3, 2))])
        each("dtype", ValueError, ["tensor 'y' has dtype torch.float64 on rank 1"],
             updates=[_xy(rank, device, y=torch.zeros(2, 3, dtype=torch.float64))])
        each("int dtype", ValueError, ["tensor 'n' has dtype torch.int32 on rank 1"],
             updates=[_xy(rank, device, n=torch.tensor(1, dtype=torch.int32))])
        each("int_policy", ValueError, ["int_policy is 'first' on rank 1, 'max' on rank 0"],
             int_policy="first")
        each("normalize", ValueError, ["normalize is False on rank 1, True on rank 0"],
             normalize=False)
        each("scale", ValueError, ["scale is 0.5 on rank 1, 1.0 on rank 0"], scale=0.5)
        each("base on one rank", ValueError, ["rank 1 passes base= (delta mode)"], base=like)
        # Every rank passes a base, but rank 1's has drifted: caught, not summed into a
        # different model on each rank.
        drifted = _xy(0, device, y=torch.full((2, 3), 10.5)) if rank == odd else like
        _expect_failure(outcomes, "base values", lambda: all_reduce_aggregate(
            [mine], one, base=drifted), ValueError,
            "the base's tensor 'y' holds other values on rank 1 than on rank 0")
        signed_zero = _xy(0, device, x=torch.full((2, 3), -0.0)) if rank == odd else \
            _xy(0, device, x=torch.zeros(2, 3))
        _expect_failure(outcomes, "base bits", lambda: all_reduce_aggregate(
            [mine], one, base=signed_zero), ValueError, "the base's tensor 'x' holds other")
        each("list against dict", ValueError, ["rank 1 passes a sequence of tensors"],
             updates=[list(mine.values())])
        each("NaN weight", ValueError, ["rank 1 failed", "weight of client 0 is nan"],
             weights=torch.tensor([float("nan")]))
        each("bad int_policy", ValueError, ["rank 1 failed", "int_policy must be one of"],
             int_policy="mean")
        each("inconsistent clients", ValueError,
             ["rank 1 failed", "client 1, tensor 'x' is torch.float32 (3, 2)"],
             updates=[mine, _xy(rank, device, x=torch.zeros(3, 2))], weights=[1.0, 1.0])
        each("bad out", ValueError, ["rank 1 failed", "out tensor 'x'"],
             out=_xy(rank, device, x=torch.zeros(3, 2)))
        each("bad timeout", ValueError, ["rank 1 failed", "timeout must be a positive"],
             timeout=-1.0)
        each("sparse tensor", TypeError, ["rank 1 failed", "tensor 'x' has layout torch.sparse"],
             updates=[_xy(rank, device, x=torch.ones(2, 3).to_sparse())])
        # 0.0 == -0.0, but the digests differ (and so would the signs of zero results): this
        # raised "digests differ although their descriptions agree".
        _expect_failure(outcomes, "signed zero scale", lambda: all_reduce_aggregate(
            [mine], one, scale=-0.0 if rank == odd else 0.0), ValueError,
            "scale is -0.0 on rank 1, 0.0 on rank 0")
        # Rank totals whose float64 sum overflows: OverflowError from fsum after the model's
        # all-reduce; now a ValueError on every rank before it.
        wide = {k: v.double() if v.is_floating_point() else v for k, v in mine.items()}
        _expect_failure(outcomes, "weights beyond float64", lambda: all_reduce_aggregate(
            [wide], [1e308], normalize=True), ValueError, "weights sum to more than float64")
        # The step-by-step API agrees on the layout too.
        changes = {"x": torch.zeros(3, 2)} if rank == odd else {}
        partial = WeightedPartial.from_clients([_xy(rank, device, **changes)], one)
        _expect_failure(outcomes, "WeightedPartial.all_reduce", lambda: partial.all_reduce(),
                        ValueError, "tensor 'x' has shape (3, 2) on rank 1, (2, 3) on rank 0")
        # Ranks that name another root, or call another collective: each waited in its own
        # collective until the timeout (and a rank whose reduce completed returned).
        _expect_failure(outcomes, "reduce dst", lambda: WeightedPartial.from_clients(
            [mine], one).reduce(dst=odd if rank == odd else 0, timeout=SHORT_TIMEOUT_S),
            ValueError, "dst is 1 on rank 1, 0 on rank 0")
        _expect_failure(outcomes, "broadcast src", lambda: WeightedPartial.from_clients(
            [mine], one).broadcast(src=odd if rank == odd else 0, timeout=SHORT_TIMEOUT_S),
            ValueError, "src is 1 on rank 1, 0 on rank 0")
        partial = WeightedPartial.from_clients([mine], one)
        _expect_failure(outcomes, "reduce against all_reduce", lambda: (
            partial.reduce(dst=0, timeout=SHORT_TIMEOUT_S) if rank == odd
            else partial.all_reduce(timeout=SHORT_TIMEOUT_S)), ValueError,
            "collective is 'reduce' on rank 1, 'all_reduce' on rank 0")
        if world > 2:
            # a rank without clients whose like= lacks a key
            last = world - 1
            kwargs = {} if rank != last else {"updates": [], "weights": [],
                                              "like": _xy(0, device, ("x", "n"))}
            updates = kwargs.pop("updates", [mine])
            weights = kwargs.pop("weights", one)
            _expect_failure(outcomes, "empty rank's like", lambda: all_reduce_aggregate(
                updates, weights, normalize=True, **kwargs), ValueError,
                f"tensor 'y' is missing on rank {last}")
    # Failures that every rank shares
    _expect_failure(outcomes, "no client anywhere", lambda: all_reduce_aggregate(
        [], [], like=like, normalize=True), ValueError, "no client updates on any")
    _expect_failure(outcomes, "int_policy error", lambda: all_reduce_aggregate(
        [mine], one, int_policy="error"), TypeError, "tensor 'n'", "int_policy='error'")
    _expect_failure(outcomes, "weights sum to 0", lambda: all_reduce_aggregate(
        [mine], torch.zeros(1), normalize=True), ValueError, "weights sum to 0")

    # Clients and weights that require grad (a module's parameters) are read as values; the
    # in-place op had refused them with a message about out=.
    grads = {k: v.clone().requires_grad_() if v.is_floating_point() else v
             for k, v in mine.items()}
    got = all_reduce_aggregate([grads], one.clone().requires_grad_(), normalize=True)
    assert torch.equal(got["x"], torch.full((2, 3), expected_x, device=device))

    # Every rank raised the same message; and the group still works afterwards.
    gathered = [None] * world
    dist.all_gather_object(gathered, outcomes)
    assert all(g == outcomes for g in gathered), gathered
    got = all_reduce_aggregate([mine], one, normalize=True)
    assert torch.equal(got["x"], torch.full((2, 3), expected_x, device=device))


# ---------------------------------------------------------------- no client counted twice


def _check_sums_once(rank: int, world: int, device: str) -> None:
    """A partial knows which ranks' clients it holds: a collective that would add some twice,
    or read a partial that reduce() sent away, raises the same error on every rank."""
    one = torch.ones(1, dtype=torch.float64)
    expected_x = sum(r + 1.0 for r in range(world)) / world
    outcomes: list = []

    def fresh():
        return WeightedPartial.from_clients([_xy(rank, device)], one)

    # all_reduce twice over the same ranks (it summed world copies of every client)
    partial = fresh().all_reduce()
    _expect_failure(outcomes, "all_reduce twice", partial.all_reduce, ValueError,
                    "would count them twice", "clients of rank 0")
    assert torch.equal(partial.result(normalize=True)["x"],  # the refused call changed nothing
                       torch.full((2, 3), expected_x, device=device))
    # adding clients after a collective, then summing again, is refused the same way
    partial.add_clients([_xy(rank, device)], one)
    _expect_failure(outcomes, "add, then all_reduce again", partial.all_reduce, ValueError,
                    "would count them twice")

    # after reduce, the other ranks' partials are no sums: refused until a broadcast fills them
    partial = fresh().reduce(dst=0)
    if rank != 0:
        with pytest.raises(ValueError, match="summed onto another rank"):
            partial.result()
        with pytest.raises(ValueError, match="summed onto another rank"):
            partial.add_clients([_xy(rank, device)], one)
    _expect_failure(outcomes, "all_reduce after reduce", partial.all_reduce, ValueError,
                    "rank 1's partial was summed onto another rank")
    _expect_failure(outcomes, "broadcast from a reduced rank", lambda: partial.broadcast(src=1),
                    ValueError, "broadcast from rank 1")
    partial.broadcast(src=0)
    assert torch.equal(partial.result(normalize=True)["x"],
                       torch.full((2, 3), expected_x, device=device))
    # everyone now holds every rank's clients, so another sum is refused
    _expect_failure(outcomes, "all_reduce after broadcast", partial.all_reduce, ValueError,
                    "would count them twice")

    if world == 4:
        # Orthogonal groups are fine: inside {0, 1} and {2, 3}, then across {0, 2} and {1, 3}.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        partial = fresh().all_reduce(group=pairs[rank // 2])
        partial.all_reduce(group=across[rank % 2])
        assert torch.equal(partial.result(normalize=True)["x"],
                           torch.full((2, 3), expected_x, device=device))
        assert float(partial.total_weight) == world and partial.count == world
        # The same pairs twice is not: {0, 1} then {0, 1} (and {2, 3} then {2, 3}).
        partial = fresh().all_reduce(group=pairs[rank // 2])
        _expect_failure(outcomes, "same pair twice",
                        lambda: partial.all_reduce(group=pairs[rank // 2]), ValueError,
                        f"clients of rank {2 * (rank // 2)}")

    # Every rank saw the same messages, and the default group is still usable.
    gathered = [None] * world
    dist.all_gather_object(gathered, [o for o in outcomes if o[0] != "same pair twice"])
    assert all(g == gathered[0] for g in gathered), gathered
    got = fresh().all_reduce().result(normalize=True)
    assert torch.equal(got["x"], torch.full((2, 3), expected_x, device=device))


def _check_weight_ranges(rank: int, world: int, device: str) -> None:
    """Weights the float32 accumulator cannot take make every rank raise the same error, also
    where only some ranks hold them (one rank raising in the op would leave the others waiting
    in the all-reduce)."""
    mine = _xy(rank, device)
    outcomes: list = []
    # normalize=False: rank 1's raw weight is beyond float32 (checked before the agreement)
    weight = torch.tensor([1e39 if rank == 1 else 1.0], dtype=torch.float64)
    _expect_failure(outcomes, "raw weight beyond float32",
                    lambda: all_reduce_aggregate([mine], weight, timeout=HANG_BOUND_S),
                    ValueError, "rank 1 failed before the all-reduce", "1e+39")
    if world > 2:
        # normalize=True: weights that cancel to a sum 1e310 times smaller than themselves;
        # only ranks 0 and 1 would overflow in w / W (checked after the agreement, on every
        # rank)
        weights = {0: [1e300], 1: [-1e300], 2: [1e-10]}.get(rank, [0.0])
        _expect_failure(outcomes, "mixed signs that cancel",
                        lambda: all_reduce_aggregate([mine], weights, normalize=True,
                                                     timeout=HANG_BOUND_S),
                        ValueError, "mixed signs that almost cancel")
    # WeightedPartial holds its sums relative to a power of two near its largest weight, and
    # the collectives bring every rank to the group's largest: weights far apart on different
    # ranks, past float32's limits, sum and normalise as aggregate's (they gave inf or NaN).
    clients = [_xy(r, device) for r in range(world)]
    for weights in ([1e39] + [1.0] * (world - 1), [3e38] * world, [1e-46 * (r + 1) for r in
                    range(world)], [1e-40] + [1e30] * (world - 1)):
        expected = fedkernels.aggregate(clients, weights, normalize=True)
        partial = WeightedPartial.from_clients([mine], [weights[rank]]).all_reduce()
        got = partial.result(normalize=True)
        assert torch.allclose(got["x"], expected["x"], rtol=1e-6), (weights, got["x"])
        reduced = WeightedPartial.from_clients([mine], [weights[rank]]).reduce(dst=0)
        reduced.broadcast(src=0)
        assert torch.equal(reduced.result(normalize=True)["x"], got["x"])
    # without normalize, a weight past float32 is refused as aggregate refuses it
    partial = WeightedPartial.from_clients([mine], [1e39 if rank == 0 else 1.0]).all_reduce()
    _expect_failure(outcomes, "partial result of a raw weight beyond float32",
                    partial.result, ValueError, "beyond the float32 range")
    gathered = [None] * world
    dist.all_gather_object(gathered, outcomes)
    assert all(g == outcomes for g in gathered), gathered
    # the group is still usable
    got = all_reduce_aggregate([mine], [1.0], normalize=True)
    expected_x = sum(r + 1.0 for r in range(world)) / world
    assert torch.equal(got["x"], torch.full((2, 3), expected_x, device=device))


# ---------------------------------------------------------------- absent and dead ranks
# Each of these leaves its process group unusable, so each runs on a spare group of all ranks
# made for it beforehand; the default group stays healthy.


def _check_absent_rank(rank: int, world: int, device: str, group, store) -> None:
    """The last rank never calls: the others raise after the short timeout."""
    last = world - 1
    if rank == last:
        # Stay alive (and connected) until every other rank has raised.
        store.wait([f"absent/raised/{r}" for r in range(last)], STORE_TIMEOUT)
        return
    mine = _xy(rank, device)
    outcomes: list = []
    _expect_failure(outcomes, "absent rank", lambda: all_reduce_aggregate(
        [mine], torch.ones(1), normalize=True, group=group, timeout=SHORT_TIMEOUT_S),
        RuntimeError, f"did not join it within {SHORT_TIMEOUT_S:g} s", "destroy it")
    store.set(f"absent/raised/{rank}", "1")


def _check_dead_rank(rank: int, world: int, device: str, group) -> None:
    """The last rank dies inside the call, after the agreement, at the model all-reduce."""
    mine = _xy(rank, device)
    if rank == world - 1:
        def die(*args, **kwargs):
            os._exit(0)
        dist.all_reduce = die
    outcomes: list = []
    _expect_failure(outcomes, "dead rank", lambda: all_reduce_aggregate(
        [mine], torch.ones(1), normalize=True, group=group, timeout=SHORT_TIMEOUT_S),
        RuntimeError, "all-reduce of the model", "a rank died")


# ---------------------------------------------------------------- the ranks


def _worker(rank: int, world: int, port: int, backend: str) -> None:
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group(backend, store=dist.PrefixStore("ranks", store), rank=rank,
                            world_size=world, timeout=STORE_TIMEOUT)
    spares = [dist.new_group(list(range(world))) for _ in range(2)] if world > 1 else []
    _check_disagreements(rank, world, device)
    _check_results(rank, world, device)
    if world > 1:
        _check_sums_once(rank, world, device)
        _check_weight_ranges(rank, world, device)
    if spares:
        _check_absent_rank(rank, world, device, spares[0], store)
        _check_dead_rank(rank, world, device, spares[1])
    # No destroy_process_group(): it would wait for the absent-rank scenario's abandoned
    # collective until the group's timeout. The rank's process ends here (os._exit under
    # the fork server), which releases everything.


def _run_ranks(world: int, backend: str, monkeypatch) -> None:
    """Spawns the ranks; fails at once with a rank's traceback when one fails, and after
    SPAWN_BOUND_S when they hang."""
    # The ranks run sys.executable; its folder on PATH serves tools looked up by name.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}"
                               f"{os.environ.get('PATH', '')}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=STORE_TIMEOUT)
    # A fork server that has imported torch and fedkernels once forks the ranks, so each
    # rank only imports this module. (The server does not get the parent's sys.path on
    # Python 3.11, so it preloads installed packages, not this file.)
    mp.get_context("forkserver").set_forkserver_preload(
        ["pytest", "torch", "torch.distributed", "fedkernels",
         "fedkernels.integrations.distributed"])
    context = mp.start_processes(_worker, args=(world, store.port, backend), nprocs=world,
                                 join=False, start_method="forkserver")
    deadline = time.monotonic() + SPAWN_BOUND_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish within {SPAWN_BOUND_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo(world, monkeypatch):
    _run_ranks(world, "gloo", monkeypatch)


@pytest.mark.slow
@pytest.mark.cuda
def test_nccl(monkeypatch):
    # NCCL needs one GPU per rank; with a single GPU only the one-rank checks run.
    _run_ranks(max(1, min(2, torch.cuda.device_count())), "nccl", monkeypatch)


def test_add_clients_matches_state_dicts_by_name():
    clients, weights = _clients(3, 3)
    partial = WeightedPartial.from_clients(clients[:1], weights[:1])
    reordered = [dict(reversed(list(c.items()))) for c in clients[1:]]
    partial.add_clients(reordered, weights[1:])
    got = partial.result(normalize=True)
    assert list(got) == list(clients[0])  # the first client's key order
    _close(got, fedkernels.aggregate(clients, weights, normalize=True), 2e-5, 1e-5)
    with pytest.raises(TypeError, match="state_dict"):
        partial.add_clients([list(clients[1].values())], [1.0])
    bad = dict(clients[1], **{"fc.weight": torch.zeros(7, 5)})
    with pytest.raises(ValueError, match="client 0, tensor 'fc.weight' is torch.float32 \\(7, 5\\)"):
        partial.add_clients([bad], [1.0])


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_clients_under_float32_base(half):
    # The server keeps a float32 model, the clients send half precision (as aggregate allows).
    clients, weights = _clients(5, 3, half)
    base = {n: t.float() if t.is_floating_point() else t
            for n, t in _clients(6, 1)[0][0].items()}
    got = WeightedPartial.from_clients(clients, weights, base=base).result(scale=0.5,
                                                                            normalize=True)
    _close(got, fedkernels.aggregate(clients, weights, base=base, scale=0.5, normalize=True),
           1e-5, 1e-5)


def test_flat_and_list_clients():
    flat = torch.randn(3, 5)
    weights = [1.0, 2.0, 3.0]
    got = WeightedPartial.from_clients(flat, weights).result(normalize=True)
    torch.testing.assert_close(got, fedkernels.aggregate(flat, weights, normalize=True))
    lists = [[torch.randn(2), torch.randn(3, 1)] for _ in range(3)]
    got = WeightedPartial.from_clients(lists, weights).result()
    for a, b in zip(got, fedkernels.aggregate(lists, weights)):
        torch.testing.assert_close(a, b)


def test_extreme_weights_of_one_partial():
    """Clients added in several calls whose weights grow past the first call's unit by more
    than 2^32, or lie past float32's limits: result(normalize=True) as aggregate's."""
    clients, weights = _clients(5, 4)
    for scaled in ([1e-46, 1e-40, 1e30, 1e39], [1.0, 3e38, 3e38, 2.0], [1e300, 1e-300, 1.0, 1e200]):
        partial = WeightedPartial.from_clients(clients[:1], scaled[:1])
        partial.add_clients(clients[1:3], scaled[1:3])
        partial.add_clients(clients[3:], scaled[3:])
        expected = fedkernels.aggregate(clients, scaled, normalize=True)
        _close(partial.result(normalize=True), expected, 1e-6, 1e-5)
        base = {n: t + 1 for n, t in clients[0].items()}
        partial = WeightedPartial.from_clients(clients[:2], scaled[:2], base=base)
        partial.add_clients(clients[2:], scaled[2:])
        expected = fedkernels.aggregate(clients, scaled, normalize=True, base=base, scale=0.5)
        _close(partial.result(normalize=True, scale=0.5), expected, 1e-5, 1e-5)
    partial = WeightedPartial.from_clients(clients, weights)
    with pytest.raises(ValueError, match="scale 1e\\+39 is beyond the float32 range"):
        partial.result(scale=1e39)
    with pytest.raises(TypeError, match="scale"):
        partial.result(scale="2")


def test_rank_without_clients_needs_structure():
    with pytest.raises(ValueError, match="like= or base="):
        WeightedPartial.from_clients([], [])


def test_one_rank_in_this_process():
    """The one-rank checks (those a single-GPU NCCL run makes) over gloo in this process: the
    collectives' fast-tier run; test_gloo spawns two and four ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=STORE_TIMEOUT)
    try:
        _check_disagreements(0, 1, "cpu")
        _check_results(0, 1, "cpu")
    finally:
        dist.destroy_process_group()
