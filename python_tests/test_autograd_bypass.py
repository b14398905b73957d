"""The op wrappers call the kernel below the autograd layer only when no gradient can flow
(fedkernels/ops/autograd_bypass.py): the same bits either way, a graph exactly when an input
requires grad and grad mode is on, and gradients that match the op's autograd formula."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import bitwise_equal

import fedkernels
from fedkernels.ops import mix_endpoints, mix_endpoints_with_stats, superfed_stats, weighted_sum
from fedkernels.ops import reference as R

ops = torch.ops.fedkernels


def _cases():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    b = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    lam = torch.tensor(0.3, dtype=torch.float64)
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    logits = torch.randn(6, 4, generator=g)
    teachers = torch.randn(3, 6, 4, generator=g)
    target = torch.softmax(torch.randn(6, 4, generator=g), -1)
    return {
        # name: (wrapper, the op through autograd, the inputs that may require grad)
        "mix_endpoints": (lambda x, y: mix_endpoints(x, y, lam),
                          lambda x, y: ops.mix_endpoints(x, y, lam), (a, b)),
        "superfed_stats": (lambda x, y: superfed_stats(x, y),
                           lambda x, y: ops.superfed_stats(x, y, []), (a, b)),
        "weighted_sum": (lambda x, y: weighted_sum(x + y, w),
                         lambda x, y: ops.weighted_sum(x + y, w, [], 1.0, False), (a, b)),
        "energy_from_logits": (lambda x: fedkernels.energy_from_logits(x),
                               lambda x: ops.energy_from_logits(x, None), (logits,)),
        "ensemble_pseudo_labels": (
            lambda x: fedkernels.ensemble_pseudo_labels(x, weighting="entropy"),
            lambda x: ops.ensemble_pseudo_labels(x, None, None, "entropy", "logits", 1.0, 1.0,
                                                 True)[0], (teachers,)),
        "distill_kl": (lambda x: fedkernels.distill_kl(x, target),
                       lambda x: ops.distill_kl(x, target, 1.0, 1.0 / 6, x.requires_grad)[0],
                       (logits,)),
    }


def _flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _with_grad(inputs):
    return tuple([t.clone().requires_grad_(True) for t in x] if isinstance(x, list)
                 else x.clone().requires_grad_(True) for x in inputs)


@pytest.mark.parametrize("name", list(_cases()))
def test_graph_exactly_when_a_gradient_can_flow(name):
    wrapper, through_autograd, inputs = _cases()[name]
    plain = _flat(wrapper(*inputs))
    assert all(t.grad_fn is None for t in plain)
    assert bitwise_equal(plain, _flat(through_autograd(*inputs)))
    grad_inputs = _with_grad(inputs)
    with torch.no_grad():
        assert all(t.grad_fn is None for t in _flat(wrapper(*grad_inputs)))
    tracked = _flat(wrapper(*grad_inputs))
    assert all(t.grad_fn is not None for t in tracked)
    assert bitwise_equal([t.detach() for t in tracked], plain)
    sum(t.sum() for t in tracked).backward()
    ref_inputs = _with_grad(inputs)
    sum(t.sum() for t in _flat(through_autograd(*ref_inputs))).backward()
    leaves = lambda xs: [t for x in xs for t in (x if isinstance(x, list) else [x])]  # noqa: E731
    for got, want in zip(leaves(grad_inputs), leaves(ref_inputs)):
        assert bitwise_equal(got.grad, want.grad)


@pytest.mark.parametrize("name", ["energy_from_logits", "ensemble_pseudo_labels", "distill_kl"])
def test_torch_func_transforms_take_the_tensor_ops(name):
    # torch.func refuses PyTorch's register_autograd layer ("must override the setup_context
    # staticmethod"); the wrappers of the ops with tensor inputs run the same formula through
    # a Function it takes (EagerAutograd): grad, jacrev and vmap of grad give the gradients of
    # plain autograd.
    from torch.func import grad, jacrev, vmap

    wrapper, _, (x,) = _cases()[name]
    x = x.double()
    if name == "distill_kl":
        target = torch.softmax(torch.randn(6, 4, dtype=torch.float64), -1)
        wrapper = lambda s: fedkernels.distill_kl(s, target)  # noqa: E731
    x_eager = x.clone().requires_grad_(True)
    wrapper(x_eager).sum().backward()
    total = lambda t: wrapper(t).sum()  # noqa: E731
    torch.testing.assert_close(grad(total)(x), x_eager.grad)
    jac = jacrev(wrapper)(x)
    torch.testing.assert_close(jac.reshape(-1, x.numel()).sum(0).reshape(x.shape), x_eager.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ops' own vmap rules: not PyTorch's fallback
        batched = vmap(grad(total))(torch.stack([x, x]))
    torch.testing.assert_close(batched, torch.stack([x_eager.grad, x_eager.grad]))


def _leaves(out) -> list:
    return [t for x in _flat(out) for t in _flat(x)]


_LIST_REFERENCES = {
    "mix_endpoints": lambda x, y, lam: R.mix_endpoints_reference(x, y, lam),
    "superfed_stats": lambda x, y, lam: R.superfed_stats_reference(x, y, []),
    "mix_endpoints_with_stats": lambda x, y, lam: (R.mix_endpoints_reference(x, y, lam),
                                                   R.superfed_stats_reference(x, y, y)),
}


@pytest.mark.parametrize("name", list(_LIST_REFERENCES))
def test_torch_func_takes_the_list_ops(name):
    # The ops on lists of tensors pass them to their Function flattened. Under torch.func the
    # saved inputs do not require grad, and the second-derivative backward, which had asked
    # autograd for their gradients, then gave zeros; it goes through torch.func.vjp there.
    from torch.func import grad, jacrev, vjp

    g = torch.Generator().manual_seed(3)
    a, b = ([torch.randn(shape, generator=g, dtype=torch.float64) for shape in [(5, 3), (4,)]]
            for _ in range(2))
    lam = torch.tensor(0.3, dtype=torch.float64)
    ours = {"mix_endpoints": lambda x, y, t: mix_endpoints(x, y, t),
            "superfed_stats": lambda x, y, t: superfed_stats(x, y),
            "mix_endpoints_with_stats": lambda x, y, t: mix_endpoints_with_stats(x, y, t, y)}[name]
    ref = _LIST_REFERENCES[name]

    def first(f):
        return lambda x0, t: _leaves(f([x0, a[1]], b, t))[0]

    def total(f):
        return lambda x0, t: sum(o.pow(2).sum() for o in _leaves(f([x0, a[1]], b, t)))

    torch.testing.assert_close(jacrev(first(ours))(a[0], lam), jacrev(first(ref))(a[0], lam))
    torch.testing.assert_close(grad(total(ours), argnums=(0, 1))(a[0], lam),
                               grad(total(ref), argnums=(0, 1))(a[0], lam))
    torch.testing.assert_close(jacrev(jacrev(total(ours)))(a[0], lam),
                               jacrev(jacrev(total(ref)))(a[0], lam))
    out, pullback = vjp(lambda x0: _leaves(ours([x0, a[1]], b, lam)), a[0])
    want_out, want_pullback = vjp(lambda x0: _leaves(ref([x0, a[1]], b, lam)), a[0])
    cotangents = [torch.ones_like(o) for o in out]
    torch.testing.assert_close(pullback(cotangents), want_pullback(cotangents))


@pytest.mark.parametrize("delta", [False, True])
def test_torch_func_takes_weighted_sum(delta):
    # b + s * sum_k w_k (x_k - [delta] b): jacrev in the updates and in the weights, and the
    # Hessian in the weights, against the same expression in PyTorch ops.
    from torch.func import jacrev

    g = torch.Generator().manual_seed(4)
    x, y, base = ([torch.randn(shape, generator=g, dtype=torch.float64) for shape in [(3,), (2,)]]
                  for _ in range(3))
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)

    def ours(x0, w):
        return weighted_sum([x0, x[1], y[0], y[1]], w, base, 0.5, delta)[0]

    def ref(x0, w):
        b = base[0] if delta else 0
        return base[0] + 0.5 * (w[0] * (x0 - b) + w[1] * (y[0] - b))

    for argnums in (0, 1):
        torch.testing.assert_close(jacrev(ours, argnums=argnums)(x[0], w),
                                   jacrev(ref, argnums=argnums)(x[0], w))
    hessian = [jacrev(jacrev(lambda v, f=f: f(x[0], v).pow(2).sum()))(w) for f in (ours, ref)]
    torch.testing.assert_close(*hessian)


def test_vmap_rules_of_the_tensor_ops():
    # energy_from_logits runs a batch as one call of B * N rows; distill_kl and the
    # pseudo-labels once per entry. Batched and unbatched arguments, labels or not, an empty
    # batch of rows; no warning (PyTorch's fallback asks for a rule).
    from torch.func import vmap

    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    lab = torch.randint(0, 4, (3, 5), generator=g)
    y = torch.softmax(torch.randn(3, 5, 4, generator=g, dtype=torch.float64), -1)
    teachers = torch.randn(4, 3, 5, 6, generator=g, dtype=torch.float64)
    scores = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    energy, kl, pseudo = (fedkernels.energy_from_logits, fedkernels.distill_kl,
                          fedkernels.ensemble_pseudo_labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cases = [
            (vmap(energy)(x), [energy(t) for t in x]),
            (vmap(energy)(x, lab), [energy(t, v) for t, v in zip(x, lab)]),
            (vmap(energy, in_dims=(1, None))(x, lab[:, 0]), [energy(x[:, j], lab[:, 0]) for j in range(5)]),
            (vmap(energy, in_dims=(None, 0))(x[0], lab), [energy(x[0], v) for v in lab]),
            (vmap(lambda s, t: kl(s, t, 2.0))(x, y), [kl(s, t, 2.0) for s, t in zip(x, y)]),
            (vmap(lambda t: pseudo(t, weighting="entropy"))(teachers),
             [pseudo(t, weighting="entropy") for t in teachers]),
            (vmap(lambda s: pseudo(teachers[0], s, weighting="fedgo"))(scores),
             [pseudo(teachers[0], s, weighting="fedgo") for s in scores]),
        ]
        assert vmap(energy)(torch.zeros(2, 0, 4)).shape == (2, 0)
    # Checked per entry, before the rows are merged (B * N rows would fit 1-D logits).
    with pytest.raises(ValueError, match=r"got logits \[5, 4\] and labels \[6\] per vmap entry"):
        vmap(energy)(x, torch.zeros(3, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got logits \[4\] per vmap entry"):
        vmap(energy)(torch.randn(3, 4))
    for got, want in cases:
        torch.testing.assert_close(got, torch.stack(want))


@pytest.mark.parametrize("call", [
    lambda: weighted_sum([torch.ones(2), torch.ones(2)], [0.5, 0.5]),
    lambda: weighted_sum([np.ones(2), torch.ones(2)], torch.tensor([0.5, 0.5], dtype=torch.float64)),
    lambda: mix_endpoints([np.ones(2)], [np.ones(2)], 0.5),
    lambda: superfed_stats([np.ones(2)]),
    lambda: fedkernels.ensemble_pseudo_labels(np.ones((2, 2, 2))),
    lambda: fedkernels.ensemble_pseudo_labels(3),
    lambda: fedkernels.energy_from_logits([[1.0, 2.0]]),
], ids=["weights list", "numpy update", "numpy mix", "numpy stats", "numpy logits", "int logits",
        "list logits"])
def test_a_wrong_argument_reaches_the_op_check(call):
    """The bypass looks only at tensors: anything else goes to the op, whose dispatcher names
    the argument and the type it expected (not an AttributeError from the bypass)."""
    with pytest.raises((TypeError, RuntimeError)) as info:
        call()
    assert "requires_grad" not in str(info.value) and "not iterable" not in str(info.value)
