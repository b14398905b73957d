"""Tensors that are contiguous but whose data pointer is not a multiple of their element size
(torch.frombuffer at an odd byte offset): every CPU op reads such inputs, and writes such
in-place outputs, through aligned copies, and gives the bits it gives for aligned tensors.
A typed access to misaligned memory is undefined behaviour (a build with
-fsanitize=undefined reports it)."""

from __future__ import annotations

import pytest
import torch
from conftest import bitwise_equal

ops = torch.ops.fedkernels

_keep = []  # the buffers behind the misaligned tensors, alive for the session


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one byte past an aligned address."""
    nbytes = t.numel() * t.element_size()
    buf = bytearray(nbytes + 1)
    _keep.append(buf)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=1).view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % t.element_size() != 0
    return out


def make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


DTYPES = [torch.float32, torch.float64, torch.float16]
SHAPES = [(37,), (5, 7)]  # vector tails


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weighted_sum_and_robust_ops(dtype):
    K = 3
    xs = [make(s, dtype, 10 * k + i) for k in range(K) for i, s in enumerate(SHAPES)]
    base = [make(s, dtype, 100 + i) for i, s in enumerate(SHAPES)]
    mx, mbase = [misaligned(x) for x in xs], [misaligned(b) for b in base]
    w = torch.tensor([0.5, -1.25, 2.0], dtype=torch.float64)
    assert bitwise_equal(ops.weighted_sum(mx, misaligned(w), mbase, 0.5, True),
                         ops.weighted_sum(xs, w, base, 0.5, True))
    expected = [b.clone() for b in base]
    ops.weighted_sum_(expected, xs, w, 1.0, False)
    ops.weighted_sum_(mbase, mx, w, 1.0, False)
    assert bitwise_equal(mbase, expected)

    mbase = [misaligned(b) for b in base]
    assert bitwise_equal(ops.coordinate_median(mx, K), ops.coordinate_median(xs, K))
    assert bitwise_equal(ops.trimmed_mean(mx, K, 1), ops.trimmed_mean(xs, K, 1))
    assert bitwise_equal(ops.median_window_mean(mx, K, 2), ops.median_window_mean(xs, K, 2))
    out = [misaligned(torch.zeros_like(b)) for b in base]
    ops.coordinate_median.out(mx, K, out=out)
    assert bitwise_equal(out, ops.coordinate_median(xs, K))
    assert bitwise_equal(ops.pairwise_sq_distances(mx, K), ops.pairwise_sq_distances(xs, K))
    assert bitwise_equal(ops.update_norms(mx, K, mbase), ops.update_norms(xs, K, base))
    coef = torch.tensor([0.25, 0.5, 0.125], dtype=torch.float64)
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    assert bitwise_equal(ops.private_sum(mx, misaligned(coef), mbase, 0.5, gen()),
                         ops.private_sum(xs, coef, base, 0.5, gen()))
    expected = [b.clone() for b in base]
    ops.private_sum_(expected, xs, coef, 0.5, gen())
    ops.private_sum_(mbase, mx, coef, 0.5, gen())
    assert bitwise_equal(mbase, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sgld_ops(dtype):
    x, grad, noise = make((5, 7), dtype, 1), make((5, 7), dtype, 2), make((5, 7), dtype, 3)
    args = (0.1, 0.5, 1.0, -2.0, 2.0)
    assert bitwise_equal(ops.sgld_step(misaligned(x), misaligned(grad), *args, misaligned(noise), None),
                         ops.sgld_step(x, grad, *args, noise, None))
    mx, expected = misaligned(x), x.clone()
    ops.sgld_step_(expected, grad, *args, noise, None)
    ops.sgld_step_(mx, misaligned(grad), *args, misaligned(noise), None)
    assert bitwise_equal(mx, expected)

    K = 3
    grads, energies = make((K, 5, 7), dtype, 4), make((K, 5), torch.float32, 5)
    log_w = torch.log(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    mine = ops.sgld_compose_step(misaligned(x), misaligned(grads), misaligned(energies),
                                 misaligned(log_w), "exact", *args, misaligned(noise), None)
    assert bitwise_equal(mine, ops.sgld_compose_step(x, grads, energies, log_w, "exact", *args,
                                                     noise, None))
    logits, labels = make((6, 9), dtype, 6), torch.tensor([0, 8, 3, 3, 1, 2])
    assert bitwise_equal(ops.energy_from_logits(misaligned(logits), misaligned(labels)),
                         ops.energy_from_logits(logits, labels))
    assert bitwise_equal(ops.energy_from_logits(misaligned(logits), None),
                         ops.energy_from_logits(logits, None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_superfed_and_distill_ops(dtype):
    g = [make(s, dtype, 20 + i) for i, s in enumerate(SHAPES)]
    l_ = [make(s, dtype, 30 + i) for i, s in enumerate(SHAPES)]
    a = [make(s, dtype, 40 + i) for i, s in enumerate(SHAPES)]
    grads = [make(s, dtype, 50 + i) for i, s in enumerate(SHAPES)]
    mg, ml, ma, mgr = ([misaligned(t) for t in ts] for ts in (g, l_, a, grads))
    lam = torch.tensor([0.3, 0.8], dtype=torch.float64)
    h = make((2, 4), torch.float64, 60)
    assert bitwise_equal(ops.mix_endpoints(mg, ml, misaligned(lam)), ops.mix_endpoints(g, l_, lam))
    assert bitwise_equal(ops.superfed_stats(mg, ml, ma), ops.superfed_stats(g, l_, a))
    assert bitwise_equal(
        ops.mix_endpoints_with_stats_backward(mgr, misaligned(h), mg, ml, misaligned(lam), ma,
                                              [True, True, True, True]),
        ops.mix_endpoints_with_stats_backward(grads, h, g, l_, lam, a, [True, True, True, True]))

    logits, scores = make((3, 11, 19), dtype, 70), make((3, 11), dtype, 71)
    prior = torch.log(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    for weighting, sc in (("entropy", None), ("fedgo", scores)):
        mine = ops.ensemble_pseudo_labels(misaligned(logits), None if sc is None else misaligned(sc),
                                          misaligned(prior), weighting, "logits", 1.5, 1.0, True)
        ref = ops.ensemble_pseudo_labels(logits, sc, prior, weighting, "logits", 1.5, 1.0, True)
        assert bitwise_equal(mine, ref)
    student, target = make((7, 19), dtype, 72), torch.softmax(make((7, 19), torch.float64, 73), -1)
    target = target.to(dtype)
    assert bitwise_equal(ops.distill_kl(misaligned(student), misaligned(target), 2.0, 1.0, True),
                         ops.distill_kl(student, target, 2.0, 1.0, True))
