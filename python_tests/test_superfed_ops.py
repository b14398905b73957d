"""Tests of the SuPerFed ops (fedkernels/ops/mixing.py; docs/algorithms/superfed.md):
``mix_endpoints``, ``superfed_stats`` and the regularizers built on it, against the
pure-PyTorch references, with opcheck, float64 gradcheck, torch.compile and the errors."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, FLOAT_DTYPES, ODD_SHAPES, bitwise_equal, dtype_id, property_examples, randn

import fedkernels
from fedkernels.ops import mixing
from fedkernels.ops import reference as R

ops = torch.ops.fedkernels

# Odd shapes plus tensors longer than one CPU chunk (65,536) and one CUDA chunk (2,048).
SHAPES = ODD_SHAPES + [(70001,), (3, 2049)]


def make_pair(shapes, dtype, seed=0, device="cpu", anchor=False):
    g = torch.Generator().manual_seed(seed)
    glob = [randn(s, dtype, g, device) for s in shapes]
    loc = [randn(s, dtype, g, device) for s in shapes]
    if not anchor:
        return glob, loc
    anc = [(x.double() + 0.1 * randn(x.shape, torch.float64, g, device)).to(dtype) for x in glob]
    return glob, loc, anc


def lam_values(kind, n, seed=0):
    g = torch.Generator().manual_seed(seed + 7)
    if kind == "mm":
        return torch.rand((), generator=g, dtype=torch.float64)
    return torch.rand(n, generator=g, dtype=torch.float64)


def close(actual, expected, dtype, scale=1.0):
    tol = {
        torch.float64: dict(rtol=1e-10, atol=1e-10),
        torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    }[dtype]
    tol = {k: v * scale for k, v in tol.items()}
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            close(a, e, dtype, scale)
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **tol)


# ---------------------------------------------------------------- mix_endpoints


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ["mm", "lm"])
def test_mix_matches_reference(device, dtype, kind):
    g, l = make_pair(SHAPES, dtype, device=device)
    lam = lam_values(kind, len(g))
    out = fedkernels.mix_endpoints(g, l, lam)
    close(out, R.mix_endpoints_reference(g, l, lam), dtype)
    for o, x in zip(out, g):
        assert o.device == x.device and o.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_mix_endpoints_are_exact(device, dtype):
    g, l = make_pair(SHAPES, dtype, device=device)
    assert bitwise_equal(fedkernels.mix_endpoints(g, l, 0.0), g)
    assert bitwise_equal(fedkernels.mix_endpoints(g, l, 1.0), l)
    lam = torch.tensor([0.0, 1.0] * (len(g) // 2) + [0.0] * (len(g) % 2))
    out = fedkernels.mix_endpoints(g, l, lam)
    for t, o in enumerate(out):
        assert bitwise_equal(o, g[t] if lam[t] == 0 else l[t])


def test_mix_matches_foreach_lerp():
    g, l = make_pair(SHAPES, torch.float32)
    lam = lam_values("lm", len(g)).tolist()
    expected = torch._foreach_lerp(g, l, lam)
    close(fedkernels.mix_endpoints(g, l, lam), list(expected), torch.float32)


def test_mix_non_contiguous_and_lam_forms():
    base_g = torch.randn(6, 8, dtype=torch.float64)
    base_l = torch.randn(8, 6, dtype=torch.float64)
    g, l = [base_g.t(), base_g[:, ::2]], [base_l, base_l.t()[:, ::2]]
    assert not g[0].is_contiguous() and not l[1].is_contiguous()
    for lam in (0.25, [0.25], [0.25, 0.75], torch.tensor([[0.25, 0.75]]), torch.tensor(0.75)):
        expected = R.mix_endpoints_reference(g, l, torch.as_tensor(lam, dtype=torch.float64))
        close(fedkernels.mix_endpoints(g, l, lam), expected, torch.float64)


def test_mix_empty_list():
    assert fedkernels.mix_endpoints([], [], 0.5) == []
    grad_g, grad_l, grad_lam = ops.mix_endpoints_backward(
        [], [], [], torch.tensor(0.5), [True, True, True]
    )
    assert grad_g == [] and grad_l == [] and float(grad_lam) == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ["mm", "lm"])
def test_mix_backward_matches_reference(device, dtype, kind):
    shapes = [(5, 7), (129,), (), (0,), (70001,)]
    g, l = make_pair(shapes, dtype, device=device)
    lam = lam_values(kind, len(g))
    upstream = [randn(s, dtype, torch.Generator().manual_seed(3), device) for s in shapes]

    def grads(fn):
        gg = [x.clone().requires_grad_() for x in g]
        ll = [x.clone().requires_grad_() for x in l]
        lm = lam.clone().requires_grad_()
        out = fn(gg, ll, lm)
        torch.autograd.backward(out, upstream)
        return [x.grad for x in gg], [x.grad for x in ll], lm.grad

    ours = grads(fedkernels.mix_endpoints)
    ref = grads(R.mix_endpoints_reference)
    close(ours[0], ref[0], dtype)
    close(ours[1], ref[1], dtype)
    # The lam gradient is a sum over 70k+ products: compare relative to its size.
    scale = 1.0 if dtype == torch.float64 else 20.0
    torch.testing.assert_close(
        ours[2], ref[2].to(ours[2].dtype), rtol=1e-4 * scale, atol=1e-3 * scale
    )


def test_mix_backward_masks():
    g, l = make_pair([(4, 3), (7,)], torch.float32)
    upstream = [torch.ones_like(x) for x in g]
    lam = torch.tensor(0.3)
    grad_g, grad_l, grad_lam = ops.mix_endpoints_backward(upstream, g, l, lam, [False, True, False])
    assert grad_g == [] and len(grad_l) == 2 and float(grad_lam) == 0.0
    torch.testing.assert_close(grad_l[0], torch.full((4, 3), 0.3))
    # only the local endpoint requires grad: the others get None
    ll = [x.clone().requires_grad_() for x in l]
    out = fedkernels.mix_endpoints(g, ll, lam)
    sum(o.sum() for o in out).backward()
    torch.testing.assert_close(ll[1].grad, torch.full((7,), 0.3))


@pytest.mark.parametrize("kind", ["mm", "lm"])
def test_mix_gradcheck(kind):
    g, l = make_pair([(3, 4), (5,), ()], torch.float64)
    lam = lam_values(kind, 3)
    inputs = [x.requires_grad_() for x in g + l] + [lam.requires_grad_()]

    def fn(*args):
        return tuple(fedkernels.mix_endpoints(list(args[:3]), list(args[3:6]), args[6]))

    assert torch.autograd.gradcheck(fn, inputs)


def test_mix_deterministic_across_threads():
    g, l = make_pair([(300000,), (70001,), (33,)], torch.float32)
    upstream = [torch.randn_like(x) for x in g]
    lam = torch.tensor([0.2, 0.6, 0.9])
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            results.append(ops.mix_endpoints_backward(upstream, g, l, lam, [True, True, True]))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert bitwise_equal(
            list(r[0]) + list(r[1]) + [r[2]],
            list(results[0][0]) + list(results[0][1]) + [results[0][2]],
        )


# ---------------------------------------------------------------- stats and the regularizers


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("lists", ["gla", "gl", "ga", "g"])
def test_stats_match_reference(device, dtype, lists):
    g, l, a = make_pair(SHAPES, dtype, device=device, anchor=True)
    l = l if "l" in lists else []
    a = a if "a" in lists else []
    stats = mixing.superfed_stats(g, l, a)
    assert stats.dtype == torch.float64 and stats.shape == (len(g), 4)
    expected = R.superfed_stats_reference(g, l, a).to(stats.device)
    # fp32 accumulation over up to 70k elements (the reference is float64 throughout)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(stats, expected, rtol=rtol, atol=rtol * 100)


def test_stats_deterministic_across_threads():
    g, l, a = make_pair([(300000,), (70001,), (33,)], torch.float32, anchor=True)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            results.append(mixing.superfed_stats(g, l, a))
    finally:
        torch.set_num_threads(threads)
    assert all(bitwise_equal(r, results[0]) for r in results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("numerator_eps", [0.0, 1e-6])
def test_cosine_orthogonality_matches_reference(dtype, per_tensor, numerator_eps):
    shapes = [(20, 30), (17,), (3, 4, 5)]
    g, l = make_pair(shapes, dtype)
    # correlate the endpoints so that cos^2 is far from 0
    l = [(0.5 * x.double() + y.double()).to(dtype) for x, y in zip(g, l)]

    def run(fn):
        gg = [x.clone().requires_grad_() for x in g]
        ll = [x.clone().requires_grad_() for x in l]
        value = fn(gg, ll)
        value.sum().backward()
        return value, [x.grad for x in gg], [x.grad for x in ll]

    ours = run(
        lambda a, b: fedkernels.cosine_orthogonality(a, b, per_tensor, numerator_eps=numerator_eps)
    )
    ref = run(lambda a, b: R.cosine_orthogonality_reference(a, b, per_tensor, numerator_eps))
    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    scale = {torch.float64: 1.0, torch.float32: 1.0, torch.bfloat16: 10.0}[dtype]
    torch.testing.assert_close(ours[0].double(), ref[0], rtol=1e-5 * scale, atol=1e-7)
    for mine, theirs in zip(ours[1] + ours[2], ref[1] + ref[2]):
        close(mine, theirs.to(dtype), dtype, scale)


def test_cosine_matches_the_official_form():
    """[C] (06860db): s = sum_p sum(w_g * w_l + 1e-6); cos^2 = s^2 / (A B), no eps elsewhere."""
    g, l = make_pair([(200, 64), (200,), (10, 200)], torch.float64)
    s = sum((a * b + 1e-6).sum() for a, b in zip(g, l))
    a_sq = sum((a * a).sum() for a in g)
    b_sq = sum((b * b).sum() for b in l)
    expected = s**2 / (a_sq * b_sq)
    ours = fedkernels.cosine_orthogonality(g, l, numerator_eps=1e-6, eps=0.0)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=0)


def test_cosine_is_safe_at_zero_norm():
    g = [torch.zeros(4, 3), torch.zeros(5)]
    l = [torch.randn(4, 3), torch.randn(5)]
    gg = [x.clone().requires_grad_() for x in g]
    ll = [x.clone().requires_grad_() for x in l]
    value = fedkernels.cosine_orthogonality(gg, ll)
    value.backward()
    assert float(value.detach()) == 0.0
    for x in gg + ll:
        assert torch.isfinite(x.grad).all() and (x.grad == 0).all()
    per = fedkernels.cosine_orthogonality(
        [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.ones(2)], per_tensor=True
    )
    torch.testing.assert_close(per, torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("form", ["paper", "code"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
def test_proximal_matches_reference(form, dtype):
    g, _, a = make_pair([(20, 30), (17,), ()], dtype, anchor=True)

    def run(fn):
        gg = [x.clone().requires_grad_() for x in g]
        value = fn(gg)
        value.backward()
        return value, [x.grad for x in gg]

    ours = run(lambda p: fedkernels.proximal_term(p, a, 0.3, form))
    ref = run(lambda p: R.proximal_term_reference(p, a, 0.3, form))
    torch.testing.assert_close(ours[0].double(), ref[0], rtol=1e-5, atol=1e-7)
    close(ours[1], [x.to(dtype) for x in ref[1]], dtype)


def test_code_proximal_gradient_is_zero_at_the_anchor():
    """The first local step of every round has g == anchor: the code form's gradient is 0."""
    g = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    anchor = [g[0].detach().clone(), g[1].detach() + 1.0]
    value = fedkernels.proximal_term(g, anchor, 0.5, "code")
    value.backward()
    assert (g[0].grad == 0).all()
    torch.testing.assert_close(g[1].grad, torch.full((5,), -0.5 / 5**0.5))
    torch.testing.assert_close(value, torch.tensor(0.5 * 5**0.5))


@pytest.mark.parametrize("form", ["paper", "code"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_regularizer_is_the_sum_of_its_terms(form, per_tensor):
    g, l, a = make_pair([(20, 30), (17,)], torch.float64, anchor=True)
    fused = fedkernels.superfed_regularizer(
        g, l, a, nu=2.0, mu=0.01, prox_form=form, per_tensor=per_tensor
    )
    cos2 = fedkernels.cosine_orthogonality(g, l, per_tensor).sum()
    prox = fedkernels.proximal_term(g, a, 0.01, form)
    torch.testing.assert_close(fused, 2.0 * cos2 + prox, rtol=1e-12, atol=1e-15)
    # terms with a zero coefficient (or no list) are left out
    torch.testing.assert_close(
        fedkernels.superfed_regularizer(g, l, None, nu=2.0, mu=0.01),
        2.0 * fedkernels.cosine_orthogonality(g, l),
    )
    assert float(fedkernels.superfed_regularizer(g, l, a, nu=0.0, mu=0.0)) == 0.0


@pytest.mark.parametrize("form", ["paper", "code"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_regularizer_gradcheck(form, per_tensor):
    g, l, a = make_pair([(3, 4), (5,), ()], torch.float64, anchor=True)
    inputs = [x.requires_grad_() for x in g + l + a]

    def fn(*args):
        return fedkernels.superfed_regularizer(
            list(args[:3]),
            list(args[3:6]),
            list(args[6:]),
            nu=1.5,
            mu=0.7,
            prox_form=form,
            per_tensor=per_tensor,
            numerator_eps=1e-3,
        )

    assert torch.autograd.gradcheck(fn, inputs)


def test_stats_gradcheck_every_column():
    g, l, a = make_pair([(3, 4), (5,)], torch.float64, anchor=True)
    inputs = [x.requires_grad_() for x in g + l + a]
    weights = torch.randn(2, 4, dtype=torch.float64)

    def fn(*args):
        stats = mixing.superfed_stats(list(args[:2]), list(args[2:4]), list(args[4:]))
        return (stats * weights).sum()

    assert torch.autograd.gradcheck(fn, inputs)


# ---------------------------------------------------------------- the fused step op


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ["mm", "lm"])
def test_mix_with_stats_equals_the_separate_ops(device, dtype, kind):
    g, l, a = make_pair(SHAPES, dtype, device=device, anchor=True)
    lam = lam_values(kind, len(g))
    theta, stats = mixing.mix_endpoints_with_stats(g, l, lam, a)
    assert bitwise_equal(theta, fedkernels.mix_endpoints(g, l, lam))
    assert bitwise_equal(stats, mixing.superfed_stats(g, l, a))
    _, no_anchor = mixing.mix_endpoints_with_stats(g, l, lam)
    assert (no_anchor[:, 3] == 0).all()
    assert bitwise_equal(no_anchor[:, :3], stats[:, :3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind", ["mm", "lm"])
@pytest.mark.parametrize("form", ["paper", "code"])
def test_superfed_mix_gradients_equal_the_separate_ops(dtype, kind, form):
    shapes = [(20, 30), (17,), (), (70001,)]
    g, l, a = make_pair(shapes, dtype, anchor=True)
    lam = lam_values(kind, len(g))
    upstream = [randn(x.shape, dtype, torch.Generator().manual_seed(5)) for x in g]

    def run(fused):
        gg = [x.clone().requires_grad_() for x in g]
        ll = [x.clone().requires_grad_() for x in l]
        lm = lam.clone().requires_grad_()
        if fused:
            theta, reg = fedkernels.superfed_mix(gg, ll, lm, a, nu=2.0, mu=0.1, prox_form=form)
        else:
            theta = fedkernels.mix_endpoints(gg, ll, lm)
            reg = fedkernels.superfed_regularizer(gg, ll, a, nu=2.0, mu=0.1, prox_form=form)
        torch.autograd.backward([reg] + theta, [None] + upstream)
        return reg, [x.grad for x in gg], [x.grad for x in ll], lm.grad

    fused, separate = run(True), run(False)
    torch.testing.assert_close(fused[0], separate[0], rtol=1e-6, atol=1e-9)
    # one rounding of the sum instead of two (separate: each term rounded, then added)
    close(fused[1], separate[1], dtype, 2.0)
    close(fused[2], separate[2], dtype, 2.0)
    torch.testing.assert_close(fused[3], separate[3], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["mm", "lm"])
def test_superfed_mix_gradcheck(kind):
    g, l, a = make_pair([(3, 4), (5,), ()], torch.float64, anchor=True)
    lam = lam_values(kind, 3)
    inputs = [x.requires_grad_() for x in g + l + a] + [lam.requires_grad_()]
    weights = [torch.randn(x.shape, dtype=torch.float64) for x in g]

    def fn(*args):
        theta, reg = fedkernels.superfed_mix(
            list(args[:3]),
            list(args[3:6]),
            args[9],
            list(args[6:9]),
            nu=1.5,
            mu=0.7,
            prox_form="code",
            numerator_eps=1e-3,
        )
        return sum((t * w).sum() for t, w in zip(theta, weights)) + reg

    assert torch.autograd.gradcheck(fn, inputs)


def test_superfed_mix_theta_only_or_reg_only():
    g, l, a = make_pair([(4, 3), (5,)], torch.float64, anchor=True)
    gg = [x.clone().requires_grad_() for x in g]
    theta, reg = fedkernels.superfed_mix(gg, l, 0.25, a, nu=1.0, mu=0.1)
    sum(t.sum() for t in theta).backward()  # the regularizer's gradient is not asked for
    torch.testing.assert_close(gg[0].grad, torch.full((4, 3), 0.75, dtype=torch.float64))
    gg = [x.clone().requires_grad_() for x in g]
    theta, reg = fedkernels.superfed_mix(gg, l, 0.25, a, nu=1.0, mu=0.1)
    reg.backward()  # only the regularizer
    expected = [x.clone().requires_grad_() for x in g]
    fedkernels.superfed_regularizer(expected, l, a, nu=1.0, mu=0.1).backward()
    close([x.grad for x in gg], [x.grad for x in expected], torch.float64)


# ---------------------------------------------------------------- opcheck, compile


def _opcheck_cases():
    g, l, a = make_pair([(3, 4), (5,), (), (0,)], torch.float32, anchor=True)
    lam_mm, lam_lm = torch.tensor(0.3), torch.tensor([0.1, 0.5, 0.9, 0.2])
    grads = [torch.randn_like(x) for x in g]
    return [
        (ops.mix_endpoints.default, (g, l, lam_mm)),
        (ops.mix_endpoints.default, (g, l, lam_lm)),
        (
            ops.mix_endpoints.default,
            ([x.requires_grad_() for x in clone_list(g)], l, lam_lm.clone().requires_grad_()),
        ),
        (ops.mix_endpoints_backward.default, (grads, g, l, lam_lm, [True, True, True])),
        (ops.mix_endpoints_backward.default, (grads, g, l, lam_mm, [True, False, False])),
        (ops.superfed_stats.default, (g, l, a)),
        (ops.superfed_stats.default, (g, [], a)),
        (ops.superfed_stats.default, ([x.requires_grad_() for x in clone_list(g)], l, [])),
        (
            ops.superfed_stats_backward.default,
            (torch.randn(4, 4, dtype=torch.float64), g, l, a, [True, True, True]),
        ),
        (
            ops.superfed_stats_backward.default,
            (torch.randn(4, 4, dtype=torch.float64), g, [], a, [True, True, False]),
        ),
        (ops.mix_endpoints_with_stats.default, (g, l, lam_lm, a)),
        (
            ops.mix_endpoints_with_stats.default,
            (
                [x.requires_grad_() for x in clone_list(g)],
                [x.requires_grad_() for x in clone_list(l)],
                lam_mm.clone().requires_grad_(),
                [],
            ),
        ),
        (
            ops.mix_endpoints_with_stats_backward.default,
            (
                grads,
                torch.randn(4, 4, dtype=torch.float64),
                g,
                l,
                lam_lm,
                a,
                [True, True, True, True],
            ),
        ),
        (
            ops.mix_endpoints_with_stats_backward.default,
            (
                grads,
                torch.randn(4, 4, dtype=torch.float64),
                g,
                l,
                lam_mm,
                [],
                [True, False, True, True],
            ),
        ),
    ]


def clone_list(xs):
    return [x.detach().clone() for x in xs]


@pytest.mark.parametrize("case", range(14))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    """The whole SuPerFed step traced without graph breaks: aot_eager on the CPU (dynamo, the
    fake kernels, functionalization and the autograd formulas, without inductor's C++ compile),
    inductor on CUDA."""
    torch._dynamo.reset()
    g, l, a = make_pair([(8, 6), (8,), (4, 8)], torch.float32, device=device, anchor=True)
    x = torch.randn(5, 6, device=device)

    def step(g, l, a, lam, x):
        w1, b1, w2 = fedkernels.mix_endpoints(g, l, lam)
        out = torch.relu(x @ w1.t() + b1) @ w2.t()
        reg = fedkernels.superfed_regularizer(g, l, a, nu=1.0, mu=0.01, prox_form="code")
        (v1, c1, v2), reg2 = fedkernels.superfed_mix(g, l, lam, a, nu=2.0, mu=0.1)
        out2 = torch.relu(x @ v1.t() + c1) @ v2.t()
        return out.square().mean() + reg + out2.abs().mean() + reg2

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for lam in (torch.tensor(0.4, device=device), torch.tensor([0.1, 0.5, 0.9], device=device)):
        eager_in = [[p.clone().requires_grad_() for p in ps] for ps in (g, l)]
        comp_in = [[p.clone().requires_grad_() for p in ps] for ps in (g, l)]
        e = step(*eager_in, a, lam, x)
        c = compiled(*comp_in, a, lam, x)
        e.backward()
        c.backward()
        torch.testing.assert_close(c, e)
        for pe, pc in zip(eager_in[0] + eager_in[1], comp_in[0] + comp_in[1]):
            torch.testing.assert_close(pc.grad, pe.grad)


@pytest.mark.parametrize("numerator_eps", [0.0, 1e-3])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_export_with_dynamic_parameter_counts(numerator_eps, per_tensor):
    """The orthogonality term's numerator_eps counts the parameters: traced with dynamic
    shapes, the counts must stay symbols (float() of them had fixed the graph to the traced
    sizes: torch.export raised a constraint violation even with numerator_eps = 0)."""
    kw = dict(per_tensor=per_tensor, numerator_eps=numerator_eps)

    class Terms(torch.nn.Module):
        def forward(self, g1, g2, l1, l2, a1, a2):
            g, l, a = [g1, g2], [l1, l2], [a1, a2]
            _, mixed = fedkernels.superfed_mix(g, l, 0.3, a, nu=2.0, mu=0.1, **kw)
            return (fedkernels.cosine_orthogonality(g, l, **kw),
                    fedkernels.superfed_regularizer(g, l, a, nu=1.0, mu=0.01, **kw), mixed)

    def inputs(rows, n, seed):
        torch.manual_seed(seed)
        return tuple(torch.randn(*shape) for shape in [(rows, 3), (n,)] * 3)

    rows, n = torch.export.Dim("rows", min=2), torch.export.Dim("n", min=2)
    program = torch.export.export(Terms(), inputs(4, 5, 0),
                                  dynamic_shapes=[{0: rows}, {0: n}] * 3)
    for shape in [(4, 5), (7, 2), (30, 11)]:
        args = inputs(*shape, sum(shape))
        for got, want in zip(program.module()(*args), Terms()(*args)):
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- errors


def test_errors_name_the_tensor():
    g, l = make_pair([(3, 4), (5,)], torch.float32)
    with pytest.raises(ValueError, match="local_params has 1 tensors"):
        fedkernels.mix_endpoints(g, l[:1], 0.5)
    with pytest.raises(ValueError, match="local_params tensor 1 has shape"):
        fedkernels.mix_endpoints(g, [l[0], torch.randn(6)], 0.5)
    with pytest.raises(TypeError, match="local_params tensor 0 has dtype"):
        fedkernels.mix_endpoints(g, [l[0].double(), l[1]], 0.5)
    with pytest.raises(TypeError, match="global_params tensor 0 has dtype Long"):
        fedkernels.mix_endpoints([torch.ones(3, dtype=torch.long)], [torch.ones(3)], 0.5)
    with pytest.raises(ValueError, match="lam has 3 values"):
        fedkernels.mix_endpoints(g, l, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="lam of tensor 1 is nan"):
        fedkernels.mix_endpoints(g, l, [0.1, float("nan")])
    with pytest.raises(TypeError, match="lam must be a floating-point"):
        fedkernels.mix_endpoints(g, l, torch.tensor(1))
    with pytest.raises(ValueError, match="anchor tensor 1 has shape"):
        mixing.superfed_stats(g, l, [g[0], torch.randn(2)])
    with pytest.raises(ValueError, match="grads has 1 tensors"):
        ops.mix_endpoints_backward(g[:1], g, l, torch.tensor(0.5), [True, True, True])
    with pytest.raises(ValueError, match="grad_stats has shape"):
        ops.superfed_stats_backward(torch.zeros(3, 4), g, l, [], [True, True, True])
    with pytest.raises(ValueError, match="proximal form"):
        fedkernels.proximal_term(g, l, 1.0, "squared")


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_regularizer_coefficients_must_be_finite_and_non_negative(bad):
    """A negative nu or mu would reward what the term penalises, a NaN or inf would reach every
    gradient: each entry point refuses them and names the coefficient."""
    g, l = make_pair([(3, 4), (5,)], torch.float32)
    calls = {
        "mu": [
            lambda: fedkernels.proximal_term(g, l, mu=bad),
            lambda: fedkernels.superfed_regularizer(g, l, l, nu=0.1, mu=bad),
            lambda: fedkernels.superfed_mix(g, l, 0.5, l, nu=0.1, mu=bad),
        ],
        "nu": [
            lambda: fedkernels.superfed_regularizer(g, l, l, nu=bad, mu=0.1),
            lambda: fedkernels.superfed_mix(g, l, 0.5, l, nu=bad, mu=0.1),
        ],
        "eps": [lambda: fedkernels.cosine_orthogonality(g, l, eps=bad)],
        "numerator_eps": [lambda: fedkernels.cosine_orthogonality(g, l, numerator_eps=bad)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=f" {name} must be finite and >= 0, got "):
                fn()
    # 0 stays allowed: it leaves the term out
    assert float(fedkernels.superfed_regularizer(g, l, l, nu=0.0, mu=0.0)) == 0.0


# ---------------------------------------------------------------- CUDA against the CPU op


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_cuda_matches_cpu(dtype):
    g, l, a = make_pair(SHAPES, dtype, anchor=True)
    lam = lam_values("lm", len(g))
    cuda = [[x.cuda() for x in xs] for xs in (g, l, a)]
    close(
        fedkernels.mix_endpoints(cuda[0], cuda[1], lam.cuda()),
        fedkernels.mix_endpoints(g, l, lam),
        dtype,
    )
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(
        mixing.superfed_stats(*cuda).cpu(),
        mixing.superfed_stats(g, l, a),
        rtol=rtol,
        atol=rtol * 100,
    )
    # run twice: bitwise the same
    assert bitwise_equal(mixing.superfed_stats(*cuda), mixing.superfed_stats(*cuda))


@pytest.mark.cuda
def test_cuda_gradcheck_and_opcheck():
    g, l, a = make_pair([(3, 4), (5,), ()], torch.float64, device="cuda", anchor=True)
    inputs = [x.requires_grad_() for x in g + l + a]
    lam = torch.tensor([0.2, 0.5, 0.7], dtype=torch.float64, device="cuda", requires_grad=True)

    def fn(*args):
        mixed = fedkernels.mix_endpoints(list(args[:3]), list(args[3:6]), args[9])
        reg = fedkernels.superfed_regularizer(
            list(args[:3]), list(args[3:6]), list(args[6:9]), nu=1.0, mu=0.5
        )
        return sum(m.sum() for m in mixed) + reg

    assert torch.autograd.gradcheck(fn, inputs + [lam])
    torch.library.opcheck(
        ops.mix_endpoints.default, ([x.detach() for x in g], [x.detach() for x in l], lam.detach())
    )
    torch.library.opcheck(
        ops.superfed_stats.default,
        ([x.detach() for x in g], [x.detach() for x in l], [x.detach() for x in a]),
    )


# ---------------------------------------------------------------- properties (hypothesis)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_shapes = st.lists(
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)


@settings(
    max_examples=property_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    shapes=_shapes,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    layerwise=st.booleans(),
    lam_seed=st.integers(0, 2**16),
    nu=st.floats(0.0, 3.0),
    mu=st.floats(0.0, 1.0),
    form=st.sampled_from(["paper", "code"]),
)
def test_superfed_mix_properties(shapes, dtype, layerwise, lam_seed, nu, mu, form):
    """On random lists: theta is the reference mixture, lam = 0/1 give the endpoints exactly,
    and the fused regularizer equals the reference terms."""
    g, l, a = make_pair(shapes, dtype, seed=lam_seed, anchor=True)
    gen = torch.Generator().manual_seed(lam_seed)
    lam = torch.rand(len(g) if layerwise else (), generator=gen, dtype=torch.float64)
    theta, reg = fedkernels.superfed_mix(g, l, lam, a, nu=nu, mu=mu, prox_form=form)
    close(theta, R.mix_endpoints_reference(g, l, lam), dtype)
    expected = nu * R.cosine_orthogonality_reference(g, l) + R.proximal_term_reference(
        g, a, mu, form
    )
    torch.testing.assert_close(
        reg.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-6
    )
    assert bitwise_equal(fedkernels.mix_endpoints(g, l, 0.0), g)
    assert bitwise_equal(fedkernels.mix_endpoints(g, l, 1.0), l)
