"""Second derivatives through the ops whose backward runs a native kernel: with
``create_graph=True`` the backward is recomputed through the PyTorch reference, so
``gradgradcheck`` holds and Hessian-vector products equal the reference's (a native backward
would silently give zero or missing second derivatives)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradgradcheck

import fedkernels as fk

D = torch.float64


def _leaf(*shape):
    return torch.randn(*shape, dtype=D, requires_grad=True)


CASES = {
    "mix_endpoints": lambda lam, g, l, a: tuple(fk.mix_endpoints([g], [l], lam)),
    "mix_endpoints per tensor": lambda lam, g, l, a: tuple(
        fk.mix_endpoints([g, l], [l, a], torch.stack([lam, 1 - lam]))),
    "cosine_orthogonality": lambda lam, g, l, a: fk.cosine_orthogonality([g], [l]),
    "cosine_orthogonality per tensor": lambda lam, g, l, a: fk.cosine_orthogonality(
        [g, a], [l, g], per_tensor=True, numerator_eps=1e-3),
    "proximal_term": lambda lam, g, l, a: fk.proximal_term([g], [a], mu=0.7),
    "superfed_regularizer": lambda lam, g, l, a: fk.superfed_regularizer(
        [g], [l], [a], nu=0.5, mu=0.3),
    "superfed_mix": lambda lam, g, l, a: fk.superfed_mix([g], [l], lam, [a], nu=0.5, mu=0.3),
    "distill_kl": lambda lam, g, l, a: fk.distill_kl(
        g.view(2, 3), torch.softmax(l.view(2, 3), -1), temperature=2.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradgradcheck(name):
    torch.manual_seed(0)
    lam = torch.tensor(0.3, dtype=D, requires_grad=True)
    inputs = (lam, _leaf(6), _leaf(6), _leaf(6))

    def fn(*args):
        out = CASES[name](*args)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list):
            return (*out[0], out[1])  # superfed_mix: (mixed params, regularizer)
        return out

    assert gradgradcheck(fn, inputs)


def test_mix_endpoints_mixed_second_derivative_matches_the_reference():
    torch.manual_seed(1)
    g, l = _leaf(4), _leaf(4)
    lam = torch.tensor(0.3, dtype=D, requires_grad=True)
    G = torch.randn(4, dtype=D)

    def second(fn):
        theta = fn([g], [l], lam)[0]
        (d_lam,) = torch.autograd.grad((theta * G).sum(), lam, create_graph=True)
        return torch.autograd.grad(d_lam, g)[0]

    assert torch.allclose(second(fk.mix_endpoints), -G)
    assert torch.allclose(second(fk.mix_endpoints), second(fk.reference.mix_endpoints_reference))


def test_distill_kl_hessian_vector_product_matches_the_reference():
    torch.manual_seed(2)
    student = _leaf(3, 4)
    target = torch.softmax(torch.randn(3, 4, dtype=D), -1)
    v = torch.randn(3, 4, dtype=D)

    def hvp(fn):
        (g,) = torch.autograd.grad(fn(student, target, 2.0), student, create_graph=True)
        return torch.autograd.grad((g * v).sum(), student)[0]

    ours, ref = hvp(fk.distill_kl), hvp(fk.reference.distill_kl_reference)
    assert ours.abs().max() > 0.01
    assert torch.allclose(ours, ref)


def test_first_derivatives_stay_on_the_native_backward():
    # Without create_graph the kernel's backward runs: same values, no graph on the gradient.
    torch.manual_seed(3)
    g, l = _leaf(5), _leaf(5)
    theta = fk.mix_endpoints([g], [l], 0.25)[0]
    (grad_g,) = torch.autograd.grad(theta.sum(), g)
    assert grad_g.grad_fn is None
    assert torch.allclose(grad_g, torch.full((5,), 0.75, dtype=D))
