"""The CPU output pool of the allocating weighted_sum, quantized sum and sparse sum
(fedkernels.ops.output_pool): the same values as PyTorch's allocator, no memory shared by two
live results, the limit, release, and results that outlive the pool's settings or the
interpreter."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from safetensors.torch import load, save

import fedkernels
from fedkernels.ops import summation
from fedkernels.ops.output_pool import (
    output_pool_stats,
    release_output_pool,
    set_output_pool_limit,
)

BIG = (300, 1000)  # 1.2 MB of float32: pooled
SMALL = (7, 33)  # far below the pool's 256 KiB: PyTorch's allocator
BLOCK = 300 * 1000 * 4


@pytest.fixture(autouse=True)
def fresh_pool():
    """Each test starts from an empty pool with the default limit, and leaves it so."""
    limit = output_pool_stats()["limit"]
    release_output_pool()
    yield
    set_output_pool_limit(limit)
    release_output_pool()


def clients(num=3, shapes=(BIG, SMALL), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(num)]


def run(cs, weights=(0.2, 0.3, 0.5), base=(), delta=False):
    flat = [t for c in cs for t in c]
    return summation.weighted_sum(flat, torch.tensor(weights, dtype=torch.float64), list(base),
                                  0.9, delta)


def span(t: torch.Tensor) -> range:
    start = t.untyped_storage().data_ptr()
    return range(start, start + t.untyped_storage().nbytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("delta", [False, True])
def test_pooled_results_are_the_same_bits(dtype, delta):
    cs = clients(dtype=dtype)
    base = clients(1, dtype=dtype, seed=1)[0] if delta else ()
    set_output_pool_limit(0)
    expected = run(cs, base=base, delta=delta)
    set_output_pool_limit(64 << 20)
    hits = output_pool_stats()["hits"]
    for _ in range(3):  # fresh, then reused blocks
        got = run(cs, base=base, delta=delta)
        assert all(torch.equal(g, e) and g.dtype == e.dtype for g, e in zip(got, expected))
        del got
    assert output_pool_stats()["hits"] - hits == 2


def test_a_dropped_result_is_reused_and_live_ones_never_share():
    cs = clients()
    before = output_pool_stats()
    first = run(cs)[0]
    second = run(cs)[0]  # `first` is alive: a fresh block
    assert not set(span(first)) & set(span(second))
    address = first.data_ptr()
    del first
    third = run(cs)[0]
    assert third.data_ptr() == address
    assert not set(span(second)) & set(span(third))
    after = output_pool_stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 2)


def test_a_view_keeps_the_block_in_use():
    cs = clients()
    result = run(cs)[0]
    view = result[10:20]
    address = result.data_ptr()
    del result
    again = run(cs)[0]
    assert again.data_ptr() != address
    assert not set(span(view)) & set(span(again))
    expected = (run(cs)[0])[10:20]
    assert torch.equal(view, expected)


def test_small_results_bypass_the_pool():
    before = output_pool_stats()
    for _ in range(3):
        run(clients(shapes=(SMALL, (5,))))
    assert output_pool_stats() == before


def test_the_limit_bounds_the_idle_bytes_oldest_freed_first():
    set_output_pool_limit(2 * BLOCK + 10)
    cs = clients(shapes=(BIG,))
    results = [run(cs)[0] for _ in range(4)]
    addresses = [r.data_ptr() for r in results]
    while results:  # four blocks come back in order, two fit: the last two stay
        results.pop(0)
    stats = output_pool_stats()
    assert stats["idle_blocks"] == 2 and stats["idle_bytes"] == 2 * BLOCK
    assert run(cs)[0].data_ptr() in addresses[2:]
    set_output_pool_limit(BLOCK - 1)  # lowering the limit frees what no longer fits
    assert output_pool_stats()["idle_blocks"] == 0
    kept = run(cs)[0]
    del kept  # larger than the limit: freed, not kept
    assert output_pool_stats()["idle_bytes"] == 0


def test_limit_zero_is_no_pool():
    set_output_pool_limit(0)
    before = output_pool_stats()
    for _ in range(3):
        run(clients())
    assert output_pool_stats() == before


def test_release_frees_idle_blocks_and_leaves_live_results_alone():
    cs = clients()
    live = run(cs)
    dropped = run(cs)
    del dropped
    assert output_pool_stats()["idle_bytes"] == BLOCK
    assert release_output_pool() == BLOCK
    assert output_pool_stats()["idle_bytes"] == 0
    set_output_pool_limit(0)
    expected = run(cs)
    assert torch.equal(live[0], expected[0])
    del live  # the limit is 0 now: its block is freed
    assert output_pool_stats()["idle_bytes"] == 0


def test_a_result_resized_below_the_pools_size_is_freed_not_kept():
    t = run(clients())[0]
    storage = t.untyped_storage()
    storage.resize_(40)  # a 40-byte block from the pool's allocator; the old one goes idle
    assert output_pool_stats()["idle_bytes"] == BLOCK
    del t, storage
    assert output_pool_stats()["idle_blocks"] == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError, match="whole number of bytes"):
        set_output_pool_limit(bad)


def test_public_names():
    assert fedkernels.release_output_pool is release_output_pool
    assert fedkernels.set_output_pool_limit is set_output_pool_limit
    assert fedkernels.output_pool_stats is output_pool_stats


def test_a_pooled_result_is_an_ordinary_tensor():
    t = run(clients())[0]
    expected = t.clone()
    assert t.is_contiguous() and t.untyped_storage().nbytes() == BLOCK
    assert torch.equal(copy.deepcopy(t), expected)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), expected)
    assert torch.equal(load(save({"t": t}))["t"], expected)
    t.resize_(2 * BLOCK // 4)  # grows through the pool's allocator
    assert torch.equal(t[:expected.numel()].view(BIG), expected)
    t = t[:expected.numel()].view(BIG)
    assert torch.equal(torch.from_numpy(t.numpy().copy()), expected)
    t.share_memory_()  # moves to shared memory; the old block goes back to the pool
    assert t.is_shared()


def test_autograd_through_pooled_results():
    cs = clients(2, shapes=(BIG,))
    w = torch.tensor([0.25, 0.75], dtype=torch.float64, requires_grad=True)
    cs[0][0].requires_grad_(True)
    out = summation.weighted_sum([cs[0][0], cs[1][0]], w)[0]
    assert out.grad_fn is not None
    out.sum().backward()
    assert torch.allclose(cs[0][0].grad, torch.full(BIG, 0.25))
    expected = torch.stack([cs[0][0].detach().sum(), cs[1][0].sum()]).double()
    assert torch.allclose(w.grad, expected, rtol=1e-5)


def test_opcheck_on_pooled_sizes():
    cs = clients(2, shapes=(BIG,))
    args = ([cs[0][0], cs[1][0]], torch.tensor([0.5, 0.25], dtype=torch.float64), [], 1.0, False)
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, args)


def test_aggregate_uses_the_pool():
    sds = [{"w": c[0], "b": c[1], "steps": torch.tensor(k)} for k, c in enumerate(clients())]
    first = fedkernels.aggregate(sds, [1, 2, 3], normalize=True)
    address = first["w"].data_ptr()
    del first
    again = fedkernels.aggregate(sds, [1, 2, 3], normalize=True)
    assert again["w"].data_ptr() == address


def test_the_quantized_sum_uses_the_pool():
    """aggregate_quantized's fresh sums come from the same pool: the next round's sum is written
    into the block the dropped one gave back, with the same bits."""
    qs = [fedkernels.quantize_int8([c[0]]) for c in clients()]
    first = fedkernels.aggregate_quantized(qs, [1, 2, 3], normalize=True)
    address, expected = first[0].data_ptr(), first[0].clone()
    del first
    hits = output_pool_stats()["hits"]
    again = fedkernels.aggregate_quantized(qs, [1, 2, 3], normalize=True)
    assert again[0].data_ptr() == address and output_pool_stats()["hits"] == hits + 1
    assert torch.equal(again[0], expected)


def test_the_sparse_sum_uses_the_pool():
    """aggregate_sparse's fresh sums (with a base) come from the same pool, with the same bits."""
    cs = clients()
    ss = [fedkernels.sparsify_topk([c[0]], fraction=0.1) for c in cs]
    base = [cs[0][0]]
    first = fedkernels.aggregate_sparse(ss, [1, 2, 3], base, normalize=True)
    address, expected = first[0].data_ptr(), first[0].clone()
    del first
    hits = output_pool_stats()["hits"]
    again = fedkernels.aggregate_sparse(ss, [1, 2, 3], base, normalize=True)
    assert again[0].data_ptr() == address and output_pool_stats()["hits"] == hits + 1
    assert torch.equal(again[0], expected)


def test_threads_never_get_a_live_block():
    cs = clients(2, shapes=(BIG,))
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    set_output_pool_limit(0)
    expected = summation.weighted_sum([cs[0][0], cs[1][0]], w)[0]
    set_output_pool_limit(64 << 20)
    hits = output_pool_stats()["hits"]
    errors = []

    def worker():
        try:
            held = []
            for _ in range(30):
                held.append(summation.weighted_sum([cs[0][0], cs[1][0]], w)[0])
                if len(held) > 2:
                    held.pop(0)
                assert all(torch.equal(h, expected) for h in held)
                assert len({h.data_ptr() for h in held}) == len(held)
        except BaseException as e:  # reported below: a thread's failure is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert output_pool_stats()["hits"] > hits


def _python(code: str, **env) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": root, **env})


@pytest.mark.slow
def test_results_outlive_the_interpreter():
    """Results held by module globals, by a reference cycle and by an atexit handler are freed
    during or after the interpreter's shutdown, some after the library's static destructors."""
    done = _python("""
        import atexit, gc, torch, fedkernels
        gc.disable()
        x = [torch.randn(300, 1000) for _ in range(2)]
        w = torch.tensor([0.5, 0.5], dtype=torch.float64)
        kept = fedkernels.ops.weighted_sum(x, w)
        cycle = [fedkernels.ops.weighted_sum(x, w)]
        cycle.append(cycle)
        late = fedkernels.ops.weighted_sum(x, w)
        atexit.register(lambda: late.clear())
        del x
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("value, limit", [("0", 0), ("1048576", 1 << 20)])
def test_the_environment_sets_the_limit(value, limit):
    done = _python("import fedkernels; print(fedkernels.output_pool_stats()['limit'])",
                   FEDKERNELS_OUTPUT_POOL_BYTES=value)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == limit


@pytest.mark.slow
def test_a_bad_environment_value_is_an_import_error():
    done = _python("import fedkernels; fedkernels.output_pool_stats()",
                   FEDKERNELS_OUTPUT_POOL_BYTES="lots")
    assert done.returncode != 0
    assert "FEDKERNELS_OUTPUT_POOL_BYTES must be a whole number of bytes" in done.stderr
