"""Subnormal floats (below 2^-126 in float32) on the CPU (csrc/cpu/parallel.h, "How a thread
treats subnormal floats"): every worker thread of an op runs in its caller's mode, so
``torch.set_flush_denormal(True)`` flushes all of a result or none of it, whatever the number of
threads; the softmax-statistics ops (pseudo-labels, distillation KL, energies) take subnormal
inputs and results as 0 in any mode and leave the caller's mode as it was. Each case runs in a
fresh process per CPU build: the mode is per-thread state that a failing test could leave
behind."""

from __future__ import annotations

import pytest
from conftest import run_in_cpu_build

pytestmark = pytest.mark.slow

CAPABILITIES = ["default", "avx2", "avx512"]

_PRELUDE = """
import sys, torch, fedkernels
TINY = torch.finfo(torch.float32).tiny

def keeps_subnormals():
    # this thread's mode: a subnormal product survives unless the thread flushes
    return (torch.tensor([TINY]) * 0.5).item() != 0.0

def subnormal_heavy(shape, seed, frac=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    pick = torch.rand(shape, generator=g) < frac
    return torch.where(pick, TINY * torch.rand(shape, generator=g), x)

def flushed(x):
    return torch.where(x.abs() < TINY, torch.zeros_like(x), x)

def no_subnormals(*results):
    return all(not ((r != 0) & (r.abs() < TINY)).any() for r in results)
"""

_WORKERS_FOLLOW_THE_CALLER = _PRELUDE + """
if not torch.set_flush_denormal(True):
    print("SKIP no flush mode on this CPU")
    sys.exit(0)
torch.set_flush_denormal(False)
P = 1 << 21  # 8 MB a tensor: well above the size that runs on the calling thread
g = torch.Generator().manual_seed(0)
clients = [[TINY * torch.rand(P, generator=g), torch.randn(P, generator=g)] for _ in range(4)]
weights = torch.tensor([0.1, 0.2, 0.3, 0.4])
for flush in (False, True):
    torch.set_flush_denormal(flush)
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results[threads] = (
            fedkernels.aggregate(clients, weights),
            fedkernels.trimmed_mean(clients, 0.25),
            fedkernels.superfed_mix([c[0] for c in clients[:2]], [c[0] for c in clients[2:]],
                                    0.5, nu=0.0, mu=0.0)[0],
        )
    for one, two in zip(results[1], results[2]):
        for a, b in zip(one, two):
            assert torch.equal(a, b), (flush, "1 and 2 threads differ")
    subnormal_part = results[2][0][0]
    if flush:
        assert (subnormal_part == 0).all(), "a worker kept subnormals in flush mode"
    else:
        assert (subnormal_part != 0).float().mean() > 0.99, "subnormals lost in IEEE mode"
    assert keeps_subnormals() == (not flush), "the caller's mode changed"
torch.set_flush_denormal(False)
print("OK", fedkernels.ops.native.cpu_capability)
"""

_SOFTMAX_OPS_FLUSH = _PRELUDE + """
from fedkernels.ops import reference as R

K, N = 3, 40
g = torch.Generator().manual_seed(1)
for C in (7, 100, 1000):
    L = subnormal_heavy((K, N, C), C)
    L[0, 0] = 30 * L[0, 0]  # large gaps: exps far below the normal range
    scores = torch.randn(K, N, generator=g)
    # targets of a sharp softmax (many subnormal probabilities) and some made subnormal by hand
    target = torch.softmax(40 * torch.randn(N, C, generator=g), -1)
    target[:, 0] = TINY / 4
    target = target / target.sum(-1, keepdim=True)
    student = subnormal_heavy((N, C), C + 1).requires_grad_(True)
    Lf, tf, sf = flushed(L), flushed(target), flushed(student.detach()).requires_grad_(True)

    for flush in (False, True):
        torch.set_flush_denormal(flush)
        for weighting, s in (("entropy", None), ("fedgo", scores), ("uniform", None)):
            for combine in ("logits", "probs"):
                kw = dict(weighting=weighting, combine=combine, return_weights=True)
                y, w = fedkernels.ensemble_pseudo_labels(L, s, **kw)
                yf, wf = fedkernels.ensemble_pseudo_labels(Lf, s, **kw)
                assert torch.equal(y, yf) and torch.equal(w, wf), (C, weighting, combine)
                y_ref, w_ref = R.ensemble_pseudo_labels_reference(L.double(), s, **kw)
                torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(w.double(), w_ref, rtol=1e-4, atol=1e-6)
                # sharp teachers: probabilities far below 2^-126, which come out as 0
                y, w = fedkernels.ensemble_pseudo_labels(100 * Lf, s, **kw)
                assert no_subnormals(y, w), (C, weighting, combine)
        e, ef = fedkernels.energy_from_logits(L[0]), fedkernels.energy_from_logits(Lf[0])
        assert torch.equal(e, ef) and no_subnormals(e), C
        torch.testing.assert_close(e.double(), -torch.logsumexp(L[0].double(), -1),
                                   rtol=2e-6, atol=2e-6)
        loss = fedkernels.distill_kl(student, target)
        loss_f = fedkernels.distill_kl(sf, tf)
        assert torch.equal(loss, loss_f), C
        grad, = torch.autograd.grad(loss, student)
        grad_f, = torch.autograd.grad(loss_f, sf)
        assert torch.equal(grad, grad_f) and no_subnormals(grad), C
        ref = R.distill_kl_reference(student.detach().double(), target.double())
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
        assert keeps_subnormals() == (not flush), "the op changed the caller's mode"
    torch.set_flush_denormal(False)
print("OK", fedkernels.ops.native.cpu_capability)
"""


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_worker_threads_run_in_the_callers_subnormal_mode(capability):
    """aggregate, trimmed_mean and superfed_mix on 8 MB tensors of subnormals: with
    torch.set_flush_denormal(True) every thread flushes (all zeros), without it none does, and
    one and two threads give the same bits either way."""
    run_in_cpu_build(_WORKERS_FOLLOW_THE_CALLER, capability, threads=2)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_statistics_ops_take_subnormals_as_zero(capability, threads):
    """Pseudo-labels (every combination), energies and the KL with its gradient: inputs with
    30 % subnormals give the same bits as those inputs flushed to 0, in either mode of the
    caller, agree with the float64 reference, return no subnormal value (sharp teachers'
    probabilities below 2^-126 are 0), and leave the caller's mode as it was."""
    run_in_cpu_build(_SOFTMAX_OPS_FLUSH, capability, threads=threads)
