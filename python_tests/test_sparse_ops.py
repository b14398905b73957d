"""The sparse-update ops against their pure-PyTorch references: top-k selection per tensor and
per model (k and fraction; ties to the lower position; NaN; error feedback and its telescoping
identity), the server's weighted scatter-add in its three forms bit for bit over dtypes and index
types, thread-count independence, bad inputs as one-line errors raised before anything is
written, opcheck and torch.compile, the CPU builds, the CUDA kernels against the CPU ones where
a GPU is visible."""

from __future__ import annotations

import pytest
import torch
from conftest import FLOAT_DTYPES, cpu_builds, run_in_cpu_build

import fedkernels
from fedkernels.ops import reference as ref
from fedkernels.ops import sparse as sops

SHAPES = [(5, 7), (129,), (), (0,), (2, 3, 41), (300,)]
OPS = torch.ops.fedkernels


def tensors(dtype=torch.float32, seed=0, shapes=SHAPES, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype).to(device)
            for s in shapes]


def exact(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a.isnan(), b.isnan()), (a, b)
    assert torch.equal(a.nan_to_num(0.25), b.nan_to_num(0.25)), (a, b)


def counts(x, k=None, fraction=None):
    return [min(k, t.numel()) if k is not None else
            (min(t.numel(), max(1, round(fraction * t.numel()))) if t.numel() else 0) for t in x]


# ---------------------------------------------------------------- sparsify_topk


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("kk", [(3, None), (None, 0.1), (None, 1.0), (0, None)],
                         ids=["k3", "f0.1", "f1", "k0"])
def test_topk_per_tensor_equals_reference(dtype, feedback, kk):
    k, fraction = kk
    x = tensors(dtype, seed=1)
    res = tensors(dtype, seed=2, scale=0.1) if feedback else None
    got = fedkernels.sparsify_topk(x, k, fraction=fraction, residual=res)
    idx, vals, new_res = ref.sparsify_topk_reference(x, counts(x, k, fraction), res)
    for t in range(len(x)):
        assert got.indices[t].dtype == torch.int32
        assert torch.equal(got.indices[t].long(), idx[t])
        exact(got.values[t], vals[t])
        assert got.shapes[t] == x[t].shape
        if feedback:
            exact(got.residual[t], new_res[t])
    assert (got.residual is None) == (not feedback)


def test_topk_per_model_equals_reference_over_the_concatenation():
    x = tensors(torch.float32, seed=3, shapes=[(40, 3), (7,), (0,), (200,)])
    res = tensors(torch.float32, seed=4, shapes=[(40, 3), (7,), (0,), (200,)], scale=0.1)
    got = fedkernels.sparsify_topk(x, fraction=0.05, scope="model", residual=res,
                                   index_dtype=torch.int64)
    flat = torch.cat([(a + b).reshape(-1) for a, b in zip(x, res)])
    want = ref.topk_indices_reference(flat, round(0.05 * flat.numel()))
    starts = [0, 120, 127, 127, 327]
    back = torch.cat([i + starts[t] for t, i in enumerate(got.indices)])
    assert torch.equal(back, want)
    assert torch.equal(torch.cat(got.values), flat[want])
    kept = flat.clone()
    kept[want] = 0
    assert torch.equal(torch.cat([r.reshape(-1) for r in got.residual]), kept)


def test_ties_go_to_the_lower_position_and_nan_ranks_first():
    v = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, float("nan"), 0.0])
    got = fedkernels.sparsify_topk(v, 3)
    assert got.indices[0].tolist() == [1, 2, 6]  # NaN, then the first two of four |2|
    assert got.values[0][:2].tolist() == [-2.0, 2.0] and got.values[0][2].isnan()
    zeros = torch.zeros(10)
    zeros[7] = 1.0
    assert fedkernels.sparsify_topk(zeros, 4).indices[0].tolist() == [0, 1, 2, 7]


def test_error_feedback_telescopes():
    """sum of what was sent over rounds + the last residual = sum of the updates (float64)."""
    g = torch.Generator().manual_seed(9)
    res = [torch.zeros(500, dtype=torch.float64)]
    sent = torch.zeros(500, dtype=torch.float64)
    total = torch.zeros(500, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(500, generator=g, dtype=torch.float64)
        total += x
        s = fedkernels.sparsify_topk([x], fraction=0.02, residual=res)
        sent += s.to_dense()[0]
        res = s.residual
    torch.testing.assert_close(sent + res[0], total, rtol=0, atol=1e-12)


def test_client_results_do_not_change_the_inputs():
    x = tensors(seed=5, shapes=[(64,)])
    res = tensors(seed=6, shapes=[(64,)], scale=0.1)
    x0, r0 = x[0].clone(), res[0].clone()
    fedkernels.sparsify_topk(x, 5, residual=res)
    fedkernels.sparsify_topk(x, 5, residual=res, scope="model")
    assert torch.equal(x[0], x0) and torch.equal(res[0], r0)


# ---------------------------------------------------------------- the server's sum


def clients(K, dtype=torch.float32, shapes=SHAPES, fraction=0.2, index_dtype=torch.int32):
    return [fedkernels.sparsify_topk(tensors(dtype, seed=10 + k, shapes=shapes), fraction=fraction,
                                     index_dtype=index_dtype) for k in range(K)]


def flat_lists(cs):
    return [i for c in cs for i in c.indices], [v for c in cs for v in c.values]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("K", [1, 3, 12])
def test_sum_equals_reference_in_all_three_forms(dtype, index_dtype, K):
    cs = clients(K, dtype, index_dtype=index_dtype)
    base = tensors(dtype, seed=77)
    w = torch.linspace(-0.5, 1.5, K, dtype=torch.float64)
    idx, vals = flat_lists(cs)
    want = ref.sparse_weighted_sum_reference(base, idx, vals, w)
    fresh = fedkernels.aggregate_sparse(cs, w, base)
    out = [torch.full_like(b, 7.0) for b in base]
    fedkernels.aggregate_sparse(cs, w, base, out=out)
    inplace = [b.clone() for b in base]
    fedkernels.aggregate_sparse_(inplace, cs, w)
    for t in range(len(base)):
        exact(fresh[t], want[t])
        exact(out[t], want[t])
        exact(inplace[t], want[t])


def test_sum_without_base_strided_base_and_normalize():
    cs = clients(3)
    zeros = [torch.zeros(s) for s in SHAPES]
    idx, vals = flat_lists(cs)
    want = ref.sparse_weighted_sum_reference(zeros, idx, vals, [0.2, 0.3, 0.5])
    for got in (fedkernels.aggregate_sparse(cs, [2, 3, 5], normalize=True),
                fedkernels.aggregate_sparse(cs, [0.2, 0.3, 0.5], out=[torch.empty(s) for s in SHAPES])):
        for a, b in zip(got, want):
            exact(a, b)
    # a transposed base, in place and as input
    base = torch.randn(7, 5).t()
    c = [fedkernels.sparsify_topk([torch.randn(5, 7)], 6) for _ in range(2)]
    want = ref.sparse_weighted_sum_reference([base.contiguous()], *flat_lists(c), [1.0, -1.0])
    exact(fedkernels.aggregate_sparse(c, [1.0, -1.0], [base])[0], want[0])
    b2 = base.clone().t().contiguous().t()
    fedkernels.aggregate_sparse_([b2], c, [1.0, -1.0])
    exact(b2.contiguous(), want[0])


def test_dense_round_trip_and_nbytes():
    x = tensors(seed=8, shapes=[(30, 4)])
    s = fedkernels.sparsify_topk(x, 12)
    dense = s.to_dense()[0]
    assert (dense != 0).sum() == 12
    assert torch.equal(dense.reshape(-1)[s.indices[0].long()], x[0].reshape(-1)[s.indices[0].long()])
    assert s.nbytes == 12 * 4 + 12 * 4


def test_results_do_not_depend_on_threads():
    shapes = [(1 << 20,), (3001,)]
    cs = clients(6, shapes=shapes, fraction=0.3)
    base = tensors(seed=3, shapes=shapes)
    w = [0.1, 0.2, 0.3, -0.4, 0.5, 1e-3]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(fedkernels.aggregate_sparse(cs, w, base))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            exact(a, b)
    idx, vals = flat_lists(cs)
    for a, b in zip(outs[0], ref.sparse_weighted_sum_reference(base, idx, vals, w)):
        exact(a, b)


# ---------------------------------------------------------------- bad inputs: one-line errors


def _err(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg
    for w in words:
        assert w in msg, (w, msg)


def test_bad_index_lists_raise_before_anything_is_written():
    base = [torch.zeros(10), torch.zeros(3, 4)]
    ok = torch.tensor([1, 4], dtype=torch.int32)
    val = torch.ones(2)
    w = torch.ones(2, dtype=torch.float64)

    def lists(bad):
        return [ok, ok, ok, bad], [val, val, val, val]

    cases = [
        (torch.tensor([3, 3], dtype=torch.int32), "repeats index 3"),
        (torch.tensor([5, 2], dtype=torch.int32), "after 5"),
        (torch.tensor([2, 12], dtype=torch.int32), "out of range [0, 12)"),
        (torch.tensor([-1, 2], dtype=torch.int32), "out of range"),
    ]
    for bad, words in cases:
        idx, vals = lists(bad)
        target = [b.clone() for b in base]
        with pytest.raises(ValueError, match=r"indices tensor 3 \(client 1, tensor 1\)") as info:
            sops.sparse_weighted_sum_(target, idx, vals, w)
        assert words in str(info.value) and "\n" not in str(info.value).strip()
        assert all(torch.equal(a, b) for a, b in zip(target, base))
        out = [torch.full((10,), 5.0), torch.full((3, 4), 5.0)]
        with pytest.raises(ValueError, match=r"\(client 1, tensor 1\)") as info:
            sops.sparse_weighted_sum(base, idx, vals, w, out=out)
        assert words in str(info.value)
        assert all(bool((o == 5).all()) for o in out)


def test_bad_inputs_are_one_line_errors():
    x = [torch.randn(10), torch.randn(3, 4)]
    s = fedkernels.sparsify_topk(x, 3)
    i, v = s.indices, s.values
    one = torch.ones(1, dtype=torch.float64)
    _err(ValueError, lambda: fedkernels.sparsify_topk(x), "exactly one of k and fraction")
    _err(ValueError, lambda: fedkernels.sparsify_topk(x, 2, fraction=0.5), "exactly one")
    _err(ValueError, lambda: fedkernels.sparsify_topk(x, -1), "k must be")
    _err(ValueError, lambda: fedkernels.sparsify_topk(x, fraction=1.5), "fraction")
    _err(ValueError, lambda: fedkernels.sparsify_topk(x, 2, scope="layer"), "scope")
    _err(TypeError, lambda: fedkernels.sparsify_topk([torch.arange(4)], 2), "x tensor 0", "dtype")
    _err(TypeError, lambda: fedkernels.sparsify_topk(x, 2, index_dtype=torch.int16), "index_dtype")
    _err(ValueError, lambda: fedkernels.sparsify_topk(x, 2, residual=[torch.zeros(10)]), "residual")
    _err(ValueError, lambda: fedkernels.sparsify_topk(x, 2, residual=[torch.zeros(10),
                                                                      torch.zeros(12)]),
         "residual tensor 1", "shape")
    _err(TypeError, lambda: fedkernels.sparsify_topk(
        [x[0], x[1].double()], 2, scope="model"), "x tensor 1", "one dtype")
    _err(TypeError, lambda: sops.sparse_weighted_sum(x, [i[0].short(), i[1]], v, one),
         "indices tensor 0", "int32 or int64")
    _err(TypeError, lambda: sops.sparse_weighted_sum(x, [i[0], i[1].long()], v, one),
         "indices tensor 1", "has dtype int64", "indices tensor 0 has int32")
    _err(TypeError, lambda: sops.sparse_weighted_sum(x, i, [v[0].double(), v[1]], one),
         "values tensor 0", "has dtype Double")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, [v[0][:2], v[1]], one),
         "values tensors 0", "one length")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i[:1], v[:1], one), "1 indices tensors")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v[:1], one), "1 values tensors")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v, torch.ones(2)), "K = 2")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v, torch.tensor([float("inf")])),
         "weight of client 0")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v, torch.ones(1, 1)), "weights")
    _err(TypeError, lambda: sops.sparse_weighted_sum([torch.zeros(10, dtype=torch.int32), x[1]],
                                                      i, v, one), "base tensor 0", "dtype")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v, one, out=[torch.empty(10)]),
         "out has 1 tensors")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v, one, out=[torch.empty(11),
                                                                        torch.empty(3, 4)]),
         "out tensor 0", "shape")
    _err(ValueError, lambda: sops.sparse_weighted_sum(x, i, v, one, out=[x[0], torch.empty(3, 4)]),
         "overlaps")
    _err(ValueError, lambda: sops.sparse_weighted_sum_(x, i, [x[0][:3], v[1]], one), "overlaps")
    other = fedkernels.sparsify_topk([torch.randn(10), torch.randn(12)], 3)
    _err(ValueError, lambda: fedkernels.aggregate_sparse([s, other], [1, 1]), "client 1", "shapes")
    _err(ValueError, lambda: fedkernels.aggregate_sparse([s, s], [1.0]), "2 clients")
    _err(ValueError, lambda: fedkernels.aggregate_sparse([s, s], [1.0, -1.0], normalize=True),
         "normalize")
    _err(TypeError, lambda: fedkernels.aggregate_sparse([s], [True]), "bool")
    _err(ValueError, lambda: fedkernels.aggregate_sparse([], []), "no clients")


# ---------------------------------------------------------------- opcheck, torch.compile


def test_opcheck():
    cs = clients(2, shapes=[(5, 7), (33,)])
    idx, vals = flat_lists(cs)
    base = tensors(seed=1, shapes=[(5, 7), (33,)])
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    torch.library.opcheck(OPS.sparse_weighted_sum.default, (base, idx, vals, w))
    torch.library.opcheck(OPS.sparse_weighted_sum.out, (base, idx, vals, w),
                          {"out": [torch.empty(5, 7), torch.empty(33)]})
    torch.library.opcheck(OPS.sparse_weighted_sum.out, ([], idx, vals, w),
                          {"out": [torch.empty(5, 7), torch.empty(33)]})
    torch.library.opcheck(OPS.sparse_weighted_sum_.default, ([b.clone() for b in base], idx, vals, w))


def test_compile_fullgraph():
    cs = clients(2, shapes=[(6, 9), (31,)])
    idx, vals = flat_lists(cs)
    base = tensors(seed=4, shapes=[(6, 9), (31,)])
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def server(base, idx, vals):
        fresh = sops.sparse_weighted_sum(base, idx, vals, w)
        return [f * 2 for f in fresh]

    got = server(base, idx, vals)
    for g, e in zip(got, ref.sparse_weighted_sum_reference(base, idx, vals, w)):
        exact(g, e * 2)


# ---------------------------------------------------------------- every CPU build

_BUILD_SCRIPT = """
import torch
import fedkernels
from fedkernels.ops import native
from fedkernels.ops import reference as ref
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    shapes = [(70000,), (77, 5), (33,)]
    base = [torch.randn(s, generator=torch.Generator().manual_seed(9)).to(dt) for s in shapes]
    cs = [fedkernels.sparsify_topk([torch.randn(s, generator=torch.Generator().manual_seed(k)).to(dt)
                                    for s in shapes], fraction=0.1) for k in range(4)]
    w = [0.1, -0.2, 0.7, 0.4]
    got = fedkernels.aggregate_sparse(cs, w, base)
    want = ref.sparse_weighted_sum_reference(base, [i for c in cs for i in c.indices],
                                             [v for c in cs for v in c.values], w)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
print("OK", native.cpu_capability)
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability", cpu_builds())
def test_every_cpu_build_equals_reference(capability):
    run_in_cpu_build(_BUILD_SCRIPT, capability)


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_equals_cpu(dtype):
    shapes = [(5000,), (33, 3), (0,)]
    x = [tensors(dtype, seed=20 + k, shapes=shapes) for k in range(5)]
    res = tensors(dtype, seed=7, shapes=shapes, scale=0.1)
    for scope in ("tensor", "model"):
        cpu = [fedkernels.sparsify_topk(t, fraction=0.05, scope=scope, residual=res) for t in x]
        gpu = [fedkernels.sparsify_topk([a.cuda() for a in t], fraction=0.05, scope=scope,
                                        residual=[r.cuda() for r in res]) for t in x]
        for c, g in zip(cpu, gpu):
            for a, b in zip(g.indices + g.values + g.residual, c.indices + c.values + c.residual):
                exact(a.cpu(), b)
    base = tensors(dtype, seed=8, shapes=shapes)
    w = [0.3, 0.7, -0.1, 0.2, 0.05]
    want = fedkernels.aggregate_sparse(cpu, w, base)
    got = fedkernels.aggregate_sparse(gpu, w, [b.cuda() for b in base])
    for a, b in zip(got, want):
        exact(a.cpu(), b)
    bad = gpu[1].indices[0].clone()
    bad[3] = bad[2]
    gpu[1].indices[0] = bad
    _err(ValueError, lambda: fedkernels.aggregate_sparse(gpu, w, [b.cuda() for b in base]),
         "indices tensor 3 (client 1, tensor 0)", "repeats")


def test_a_dense_tensor_of_another_shape_than_the_clients_is_refused_before_writing():
    x = [torch.randn(4, 3), torch.randn(5)]
    c = fedkernels.sparsify_topk(x, 2)
    base = [torch.zeros(4, 3), torch.zeros(4)]  # numel 4 may still cover the sent indices
    before = [b.clone() for b in base]
    with pytest.raises(ValueError, match=r"base tensor 1 has shape \[4\], the clients' tensor 1 has \[5\]"):
        fedkernels.aggregate_sparse_(base, [c], [1.0])
    with pytest.raises(ValueError, match="base tensor 1 has shape"):
        fedkernels.aggregate_sparse([c], [1.0], base=base)
    with pytest.raises(ValueError, match="out tensor 1 has shape"):
        fedkernels.aggregate_sparse([c], [1.0], out=base)
    with pytest.raises(ValueError, match="1 base tensors for the clients' 2"):
        fedkernels.aggregate_sparse_(base[:1], [c], [1.0])
    assert all(torch.equal(a, b) for a, b in zip(base, before))
