"""Tests of the ensemble-distillation ops (fedkernels/ops/distill.py; docs/algorithms/distillation.md):
``ensemble_pseudo_labels`` and ``distill_kl`` against the pure-PyTorch references, the
weightings' properties, opcheck, float64 gradcheck, torch.compile and the errors."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import DEVICES, FLOAT_DTYPES, bitwise_equal, dtype_id, randn, run_in_cpu_build

import fedkernels
from fedkernels.ops import distill
from fedkernels.ops import reference as R

ops = torch.ops.fedkernels

WEIGHTINGS = list(distill.WEIGHTINGS)
# (K, N, C): one client, one class, vector tails, a row longer than a CUDA block's threads.
SHAPES = [(1, 3, 1), (3, 5, 7), (4, 17, 10), (2, 2, 300), (8, 9, 33)]


def tol(dtype):
    return {
        torch.float64: dict(rtol=1e-10, atol=1e-12),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    }[dtype]


def make_inputs(shape, dtype, weighting, seed=0, device="cpu", spread=3.0):
    g = torch.Generator().manual_seed(seed)
    K, N, C = shape
    logits = (spread * randn(shape, torch.float64, g)).to(dtype).to(device)
    scores = randn((K, N), torch.float64, g).to(device) * 2 if weighting in ("fedgo", "domain") else None
    return logits, scores


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **tol(dtype))


# ---------------------------------------------------------------- ensemble_pseudo_labels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("combine", ["logits", "probs"])
def test_pseudo_labels_match_reference(device, dtype, weighting, combine):
    for shape in SHAPES:
        logits, scores = make_inputs(shape, dtype, weighting, device=device)
        sizes = torch.arange(1, shape[0] + 1, dtype=torch.float64) * 10
        kw = dict(weighting=weighting, combine=combine, sample_sizes=sizes, return_weights=True)
        y, w = fedkernels.ensemble_pseudo_labels(logits, scores, **kw)
        y_ref, w_ref = R.ensemble_pseudo_labels_reference(logits, scores, **kw)
        close(y, y_ref, dtype)
        close(w, w_ref, dtype)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("options", [
    dict(temperature=2.5), dict(tau=0.3), dict(odds="exact"), dict(combine="probs", temperature=0.5),
])
def test_pseudo_labels_options(weighting, options):
    logits, scores = make_inputs((5, 11, 13), torch.float64, weighting, seed=3)
    y = fedkernels.ensemble_pseudo_labels(logits, scores, weighting=weighting, **options)
    close(y, R.ensemble_pseudo_labels_reference(logits, scores, weighting=weighting, **options),
          torch.float64)


def test_pseudo_labels_properties():
    logits, scores = make_inputs((6, 40, 10), torch.float64, "fedgo", seed=1)
    sizes = torch.tensor([5.0, 10, 20, 40, 80, 160], dtype=torch.float64)
    for weighting in WEIGHTINGS:
        s = scores if weighting in ("fedgo", "domain") else None
        y, w = fedkernels.ensemble_pseudo_labels(logits, s, weighting=weighting, return_weights=True)
        torch.testing.assert_close(w.sum(0), torch.ones(40, dtype=torch.float64))
        torch.testing.assert_close(y.sum(1), torch.ones(40, dtype=torch.float64))
        assert (w >= 0).all() and (y >= 0).all()
    # FedGO with equal z and equal n: uniform.
    _, w = fedkernels.ensemble_pseudo_labels(
        logits, torch.full((6, 40), 0.7, dtype=torch.float64), weighting="fedgo",
        sample_sizes=[3.0] * 6, return_weights=True)
    torch.testing.assert_close(w, torch.full_like(w, 1 / 6))
    # Double sigmoid: max/min weight <= e * n_max / n_min (the odds lie in (1, e)).
    big = 50 * torch.randn(6, 40, dtype=torch.float64)
    _, w = fedkernels.ensemble_pseudo_labels(
        logits, big, weighting="fedgo", sample_sizes=sizes, return_weights=True)
    ratio = (w.max(0).values / w.min(0).values).max()
    assert ratio <= math.e * 160 / 5 * (1 + 1e-12)
    # Exact odds: w = n Phi / sum n Phi with Phi = e^z (Theorem 3.6).
    _, w = fedkernels.ensemble_pseudo_labels(
        logits, scores, weighting="fedgo", sample_sizes=sizes, odds="exact", return_weights=True)
    d = torch.sigmoid(scores)
    odds = sizes[:, None] * d / (1 - d)
    torch.testing.assert_close(w, odds / odds.sum(0))
    # Entropy weights tend to uniform as tau grows.
    _, w = fedkernels.ensemble_pseudo_labels(logits, weighting="entropy", tau=1e9,
                                             return_weights=True)
    torch.testing.assert_close(w, torch.full_like(w, 1 / 6))
    # Variance of constant logits: uniform fallback.
    flat = torch.ones(3, 4, 5, dtype=torch.float64)
    _, w = fedkernels.ensemble_pseudo_labels(flat, weighting="variance", return_weights=True)
    torch.testing.assert_close(w, torch.full_like(w, 1 / 3))
    # One client: its own softmax.
    y = fedkernels.ensemble_pseudo_labels(logits[:1], weighting="entropy")
    torch.testing.assert_close(y, torch.softmax(logits[0], -1))


@pytest.mark.parametrize("spread", [0.01, 1.0, 10.0, 100.0, 1e4])
@pytest.mark.parametrize("K,N,C", [(4, 33, 10), (3, 20, 100), (2, 9, 17), (5, 8, 1000)])
def test_entropy_weights_over_the_exp_range(spread, K, N, C):
    """The CPU entropy pass takes its exps with a polynomial of its own: from spreads where
    every exponent is near 0 to ones where most underflow, float32 weights and labels match
    the float64 reference to float32 tolerance (short rows by lanes, long rows, tails)."""
    g = torch.Generator().manual_seed(C)
    L = (spread * torch.randn(K, N, C, generator=g, dtype=torch.float64)).float()
    y, w = fedkernels.ensemble_pseudo_labels(L, weighting="entropy", return_weights=True)
    y_ref, w_ref = R.ensemble_pseudo_labels_reference(L.double(), weighting="entropy",
                                                      return_weights=True)
    # H = max + log S - T / S rounds at the size of the logits, so the float32 error of the
    # weights and labels grows with the spread (as it does in the PyTorch composition).
    scale = max(1.0, spread)
    torch.testing.assert_close(w.double(), w_ref, rtol=min(3e-6 * scale, 1e-3), atol=1e-6)
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-5, atol=2e-6 * scale)


# Teacher rows the CPU entropy pass must route or bound with care (its base-2 exps apply to a
# row whose max is finite and below 1e7 in size): -inf classes (probability 0: they add 0 to the
# entropy), a NaN, an all -inf row, a +inf, maxima far from 0, and a huge spread.
_EDGE_ROWS = textwrap.dedent(
    """
    import sys, torch, fedkernels
    from fedkernels.ops import reference as R

    def edge_logits(C):
        g = torch.Generator().manual_seed(C)
        L = 3 * torch.randn(3, 40, C, generator=g, dtype=torch.float64)
        L[0, 1, : C // 2] = float("-inf")
        L[1, 2, C - 1] = float("nan")
        L[2, 3, :] = float("-inf")
        L[0, 4, 0] = float("inf")
        L[1, 5, :] += 3e7
        L[2, 6, :] *= 1e6
        L[0, 7, :] = -1e30
        L[0, 7, 0] = 1e30
        return L.float()

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for C, combine in [(C, c) for C in (1, 7, 10, 16, 100, 1000) for c in ("logits", "probs")]:
        L = edge_logits(C)
        y, w = fedkernels.ensemble_pseudo_labels(L.to(device), weighting="entropy",
                                                 combine=combine, return_weights=True)
        y, w = y.cpu(), w.cpu()
        y_ref, w_ref = R.ensemble_pseudo_labels_reference(L.double(), weighting="entropy",
                                                          combine=combine, return_weights=True)
        torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6, equal_nan=True)
        # Row 5's labels are a softmax of logits near 3e7, where float32's spacing is 2: skipped.
        keep = torch.arange(L.shape[1]) != 5
        torch.testing.assert_close(y[keep].double(), y_ref[keep], rtol=1e-5, atol=1e-6,
                                   equal_nan=True)
        assert torch.isfinite(w[:, 1]).all() and torch.isnan(w[:, 2]).all(), C
        # A class that is -inf for a teacher with weight > 0 is -inf in the combination of
        # logits: its label is exactly 0, as the reference's softmax gives (the base-2 exps
        # included).
        if combine == "logits":
            assert (y[1, : C // 2] == 0).all() and (y_ref[1, : C // 2] == 0).all(), C
    print("OK", fedkernels.ops.native.cpu_capability)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_entropy_edge_rows_in_every_cpu_build(capability):
    """Each CPU build (its own exps and lane layout) gives the float64 reference's weights and
    labels on the edge rows above: -inf classes count as probability 0, NaN and +-inf maxima
    give NaN as in the reference, and maxima beyond the base-2 range take the full exp."""
    run_in_cpu_build(_EDGE_ROWS, capability, threads=2)


# The CPU softmax statistics take a block's row maxima while the block before it runs its exps,
# and prefetch the block after (softmax_stats.h, SoftmaxStats::Ahead): for the energies, block
# after block; for the entropy weighting, teacher after teacher and then block after block. Rows
# of very different scales and offsets (a maximum taken from the wrong row, or a part of a row
# missed, would change the results), edge rows at block boundaries, rows longer than one
# summation chunk, and a short last block: every row must get the same bits as alone in a call
# of its own (where nothing is taken ahead), and match float64.
_LOOKAHEAD_ROWS = textwrap.dedent(
    """
    import torch, fedkernels
    from fedkernels.ops import reference as R

    def rows(n, C, seed):
        g = torch.Generator().manual_seed(seed)
        scale = torch.exp(torch.empty(n, 1, dtype=torch.float64).uniform_(-2, 3.4, generator=g))
        shift = torch.empty(n, 1, dtype=torch.float64).uniform_(-1000, 1000, generator=g)
        x = torch.randn(n, C, generator=g, dtype=torch.float64) * scale + shift
        x[0, -1] += 80  # maxima in the last (overlapping) vector and in the first
        x[1, 0] += 80
        edges = {2: "nan", 7: "inf", 8: "-inf", 9: "huge", n - 2: "nan", n - 1: "spike"}
        for i, kind in edges.items():
            if kind == "nan":
                x[i, C // 3] = float("nan")
            elif kind == "inf":
                x[i, -1] = float("inf")
            elif kind == "-inf":
                x[i, :] = float("-inf")
            elif kind == "huge":
                x[i, :] += 3e7
            else:
                x[i, C // 2] = 1e4
        return x.float()

    for C in (40, 100, 1000, 5000):
        # energies: several blocks per thread, the last one short
        x = rows(37 * max(1, 2048 // C) + 5, C, C)
        e = fedkernels.energy_from_logits(x)
        for i in range(x.shape[0]):
            alone = fedkernels.energy_from_logits(x[i : i + 1])
            assert torch.equal(alone, e[i : i + 1]) or (alone.isnan() & e[i].isnan()).all(), (C, i)
        ref = -torch.logsumexp(x.double(), -1)
        ok = torch.isfinite(ref) & (x.double().amax(-1).abs() < 1e6)
        torch.testing.assert_close(e[ok].double(), ref[ok], rtol=2e-6, atol=2e-6)
        # entropy pseudo-labels: three teachers, each with its own edge rows
        N = 9 * max(1, 2048 // C) + 3
        L = torch.stack([rows(N, C, C + k) for k in (1, 2, 3)])
        y, w = fedkernels.ensemble_pseudo_labels(L, weighting="entropy", return_weights=True)
        for i in range(N):
            ya, wa = fedkernels.ensemble_pseudo_labels(L[:, i : i + 1], weighting="entropy",
                                                       return_weights=True)
            assert torch.equal(ya.nan_to_num(7.0), y[i : i + 1].nan_to_num(7.0)), (C, i)
            assert torch.equal(wa.nan_to_num(7.0), w[:, i : i + 1].nan_to_num(7.0)), (C, i)
        w_ref = R.ensemble_pseudo_labels_reference(L.double(), weighting="entropy",
                                                   return_weights=True)[1]
        ok = torch.isfinite(w_ref).all(0)
        torch.testing.assert_close(w[:, ok].double(), w_ref[:, ok], rtol=1e-4, atol=1e-6)
    # past 32 MiB of logits the entropy pass also prefetches blocks far ahead (distill.cpp,
    # kEntropyFarMinBytes): rows get the bits they get in small calls
    L = torch.randn(20, 4200, 100, generator=torch.Generator().manual_seed(5)) * 3
    y, w = fedkernels.ensemble_pseudo_labels(L, weighting="entropy", return_weights=True)
    for i0 in (0, 2000, 4150):
        ya, wa = fedkernels.ensemble_pseudo_labels(L[:, i0 : i0 + 50].contiguous(),
                                                   weighting="entropy", return_weights=True)
        assert torch.equal(ya, y[i0 : i0 + 50]) and torch.equal(wa, w[:, i0 : i0 + 50]), i0
    print("OK", fedkernels.ops.native.cpu_capability)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_row_maxima_taken_ahead_in_every_cpu_build(capability, threads):
    """Energies and entropy pseudo-labels over many blocks: the maxima taken ahead and the
    prefetches change no bit of any row (see the script above)."""
    run_in_cpu_build(_LOOKAHEAD_ROWS, capability, threads=threads)


@pytest.mark.slow
@pytest.mark.cuda
def test_entropy_edge_rows_on_cuda():
    """The CUDA kernel (its one-pass combination of the warps' rows included) on the same rows."""
    _run_on_cuda(_EDGE_ROWS)


def _run_on_cuda(script: str) -> None:
    """Runs ``script`` (which prints ``OK``) in a fresh process on the GPU."""
    proc = subprocess.run([sys.executable, "-c", script, "cuda"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:1] == ["OK"], proc.stdout


# Labels whose rows span hundreds of units below their max: the base-2 softmax of a long float
# row evaluates its polynomial on exponents far below the normal range too (those classes are
# then set to 0), including the exponents whose integer part, scaled into the float's exponent
# bits, leaves the int32 range. Run in every CPU build; a build with -fsanitize=undefined
# reports any integer overflow there.
_FAR_BELOW_MAX = textwrap.dedent(
    """
    import torch, fedkernels
    from fedkernels.ops import reference as R

    for C in (16, 33, 64, 257):
        # each row falls linearly from its max by 150 .. 1500 in steps of 150
        depth = 150.0 * torch.arange(1, 11, dtype=torch.float64)[:, None]
        row = -depth * torch.linspace(0, 1, C, dtype=torch.float64)[None, :]
        L = torch.stack([row, 0.5 * row + 1.0]).float()  # [2, 10, C]
        for T in (1.0, 0.5):
            y = fedkernels.ensemble_pseudo_labels(L, temperature=T)
            y_ref = R.ensemble_pseudo_labels_reference(L.double(), temperature=T)
            torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    print("OK", fedkernels.ops.native.cpu_capability)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_softmax_of_rows_far_below_their_max_in_every_cpu_build(capability):
    """Classes hundreds of units below the row's max get label 0 (to float32 precision) in
    every CPU build, as in the float64 reference."""
    run_in_cpu_build(_FAR_BELOW_MAX, capability, threads=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combine", ["logits", "probs"])
def test_a_million_classes_keep_float32_accuracy(device, combine):
    """Long rows' sums (the entropy's, the softmaxes') are taken in chunks added in float64
    (CPU) or with compensated lane sums (CUDA): a float accumulator over 1e6 classes left the
    "probs" labels summing to 1 +- 3e-5 and the entropy weights 6e-6 off."""
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(3, 2, 1_000_000, generator=g)
    y, w = fedkernels.ensemble_pseudo_labels(logits.to(device), weighting="entropy",
                                             combine=combine, return_weights=True)
    y, w = y.cpu(), w.cpu()
    y_ref, w_ref = R.ensemble_pseudo_labels_reference(logits.double(), weighting="entropy",
                                                      combine=combine, return_weights=True)
    torch.testing.assert_close(w.double(), w_ref, rtol=0, atol=6e-7)
    assert (y.double().sum(1) - 1).abs().max() < 5e-7
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_pseudo_labels_empty_noncontiguous_deterministic(device):
    y, w = fedkernels.ensemble_pseudo_labels(torch.zeros(3, 0, 4, device=device),
                                             return_weights=True)
    assert y.shape == (0, 4) and w.shape == (3, 0)
    base = torch.randn(7, 10, 5, dtype=torch.float32, device=device)
    strided = base.transpose(0, 2)  # [5, 10, 7], not contiguous
    y = fedkernels.ensemble_pseudo_labels(strided, weighting="entropy")
    close(y, R.ensemble_pseudo_labels_reference(strided, weighting="entropy"), torch.float32)
    big = torch.randn(12, 300, 37, device=device)
    first = fedkernels.ensemble_pseudo_labels(big, weighting="variance")
    assert all(bitwise_equal(first, fedkernels.ensemble_pseudo_labels(big, weighting="variance"))
               for _ in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("K,N,C", [(3, 300, 10), (5, 133, 7), (4, 50, 1), (3, 120, 16),
                                   (7, 90, 100), (40, 200, 10)])
def test_rows_do_not_depend_on_their_position(dtype, K, N, C):
    """The CPU kernels work on blocks of rows (several rows per vector when C is small): a row's
    outputs must be the same bits wherever it sits in the call (block, lane, tail)."""
    g = torch.Generator().manual_seed(K * N + C)
    L = (3 * torch.randn(K, N, C, generator=g, dtype=torch.float64)).to(dtype)
    L[0, 5, 0] = float("inf")
    L[1, 17, :] = float("-inf")
    L[2, 30, C // 2] = float("nan")
    z = torch.randn(K, N, generator=g, dtype=torch.float64)
    for weighting in ("uniform", "entropy", "fedgo", "variance"):
        for combine in ("logits", "probs"):
            s = z if weighting == "fedgo" else None
            kw = dict(weighting=weighting, combine=combine, temperature=1.3, return_weights=True)
            y, w = fedkernels.ensemble_pseudo_labels(L, s, **kw)
            for a, b in [(1, N), (3, 37), (N // 3, N), (N - 1, N)]:
                ys, ws = fedkernels.ensemble_pseudo_labels(
                    L[:, a:b], None if s is None else s[:, a:b], **kw)
                assert bitwise_equal(ys, y[a:b]), (weighting, combine, a, b)
                assert bitwise_equal(ws, w[:, a:b]), (weighting, combine, a, b)
    S = (3 * torch.randn(N, C, generator=g, dtype=torch.float64)).to(dtype)
    Y = torch.softmax(torch.randn(N, C, generator=g, dtype=torch.float64), -1).to(dtype)
    _, grad = torch.ops.fedkernels.distill_kl(S, Y, 2.0, 1.0, True)
    for a, b in [(1, N), (N // 3, N)]:
        _, part = torch.ops.fedkernels.distill_kl(S[a:b], Y[a:b], 2.0, 1.0, True)
        assert bitwise_equal(part, grad[a:b]), (a, b)


def test_pseudo_labels_errors():
    L = torch.randn(3, 4, 5)
    z = torch.randn(3, 4)
    cases = [
        (lambda: fedkernels.ensemble_pseudo_labels(L[0]), ValueError, r"\[K, N, C\].*got 2-D"),
        (lambda: fedkernels.ensemble_pseudo_labels(L.int()), TypeError, "dtype"),
        (lambda: fedkernels.ensemble_pseudo_labels(L[:0]), ValueError, "at least one client"),
        (lambda: fedkernels.ensemble_pseudo_labels(L[:, :, :0]), ValueError, "at least one class"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, weighting="median"), ValueError, "weighting"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, combine="max"), ValueError, "combine"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, weighting="fedgo"), ValueError, "needs scores"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, z), ValueError, "does not use scores"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, z[:, :3], weighting="fedgo"), ValueError,
         r"\[K, N\]"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, sample_sizes=[1.0, 2.0]), ValueError,
         "log_prior"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, sample_sizes=[1.0, 0.0, 2.0]), ValueError,
         "client 1"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, temperature=0.0), ValueError, "temperature"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, weighting="entropy", tau=-1.0), ValueError,
         "tau"),
        (lambda: fedkernels.ensemble_pseudo_labels(L, odds="log"), ValueError, "odds"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("combine", ["logits", "probs"])
def test_pseudo_labels_opcheck(device, weighting, combine):
    logits, scores = make_inputs((3, 4, 5), torch.float64, weighting, device=device)
    logits.requires_grad_(True)
    if scores is not None:
        scores.requires_grad_(True)
    prior = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    torch.library.opcheck(
        ops.ensemble_pseudo_labels,
        (logits, scores, prior, weighting, combine, 1.5, 0.7, True),
    )


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("combine", ["logits", "probs"])
@pytest.mark.parametrize("double_sigmoid", [True, False])
def test_pseudo_labels_gradcheck(weighting, combine, double_sigmoid):
    if double_sigmoid is False and weighting != "fedgo":
        pytest.skip("odds only matter for fedgo")
    logits, scores = make_inputs((3, 4, 5), torch.float64, weighting, seed=5)
    logits.requires_grad_(True)
    prior = torch.tensor([0.1, 0.7, 1.3], dtype=torch.float64, requires_grad=True)
    inputs = [logits, prior]
    if scores is not None:
        scores.requires_grad_(True)
        inputs.append(scores)

    def f(L, p, *s):
        return ops.ensemble_pseudo_labels(L, s[0] if s else None, p, weighting, combine, 1.3, 0.8,
                                          double_sigmoid)

    assert torch.autograd.gradcheck(f, tuple(inputs))


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("combine", ["logits", "probs"])
def test_pseudo_labels_backward_without_the_logits_gradient(weighting, combine):
    # With fixed logits the backward skips their [K, N, C] terms; the scores' and the
    # prior's gradients must be those of the full backward.
    def grads(logits_need_grad):
        logits, scores = make_inputs((3, 4, 5), torch.float64, weighting, seed=6)
        logits.requires_grad_(logits_need_grad)
        prior = torch.tensor([0.1, 0.7, 1.3], dtype=torch.float64, requires_grad=True)
        inputs = [prior] + ([scores.requires_grad_(True)] if scores is not None else [])
        y, w = ops.ensemble_pseudo_labels(logits, scores, prior, weighting, combine, 1.3, 0.8,
                                          True)
        upstream = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
        loss = (y * upstream).sum() + (w * w).sum()
        return torch.autograd.grad(loss, inputs)

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("combine", ["logits", "probs"])
def test_pseudo_labels_backward_of_one_input_alone(weighting, combine):
    # Where only some inputs need a gradient the backward skips the stages the others need
    # (with FedGO's weights and fixed scores, everything after the combine); each gradient must
    # be the one of the full backward.
    def grads(wanted):
        logits, scores = make_inputs((3, 4, 5), torch.float64, weighting, seed=7)
        prior = torch.tensor([0.1, 0.7, 1.3], dtype=torch.float64)
        named = {"logits": logits, "prior": prior, "scores": scores}
        inputs = [named[k].requires_grad_(True) for k in wanted if named[k] is not None]
        y, w = ops.ensemble_pseudo_labels(logits, scores, prior, weighting, combine, 1.3, 0.8,
                                          True)
        upstream = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
        loss = (y * upstream).sum() + (w * w).sum()
        return dict(zip([k for k in wanted if named[k] is not None],
                        torch.autograd.grad(loss, inputs)))

    full = grads(["logits", "prior", "scores"])
    for name, expected in full.items():
        torch.testing.assert_close(grads([name])[name], expected, rtol=0, atol=0)
    # and through the wrapper, the way a distillation step asks (logits alone, y only)
    logits, scores = make_inputs((3, 4, 5), torch.float32, weighting, seed=8)
    logits.requires_grad_(True)
    kw = dict(weighting=weighting, combine=combine, temperature=2.0,
              sample_sizes=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    upstream = torch.rand(4, 5)
    (fedkernels.ensemble_pseudo_labels(logits, scores, **kw) * upstream).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    (R.ensemble_pseudo_labels_reference(ref, scores, **kw) * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_pseudo_labels_compile():
    logits, scores = make_inputs((4, 6, 5), torch.float32, "fedgo")

    @torch.compile(fullgraph=True)
    def f(L, z):
        return fedkernels.ensemble_pseudo_labels(L, z, weighting="fedgo", sample_sizes=None) * 2

    torch.testing.assert_close(
        f(logits, scores), 2 * R.ensemble_pseudo_labels_reference(logits, scores, weighting="fedgo"))


def test_wrappers_keep_autograd_exactly_when_a_gradient_can_flow():
    """Without a tensor that requires grad (or under no_grad) the wrappers call the kernel below
    the autograd layer: the same bits as the op through autograd, and no graph; with one, the
    graph is there and the gradient matches the op's."""
    logits, scores = make_inputs((5, 7, 6), torch.float32, "fedgo")
    args = (logits, scores, None, "fedgo", "logits", 1.0, 1.0, True)
    y = fedkernels.ensemble_pseudo_labels(logits, scores, weighting="fedgo")
    assert y.grad_fn is None and bitwise_equal(y, ops.ensemble_pseudo_labels(*args)[0])
    with_grad = logits.clone().requires_grad_(True)
    y2 = fedkernels.ensemble_pseudo_labels(with_grad, scores, weighting="fedgo")
    assert y2.grad_fn is not None and bitwise_equal(y2.detach(), y)
    with torch.no_grad():
        assert fedkernels.ensemble_pseudo_labels(with_grad, scores, weighting="fedgo").grad_fn is None
    s = torch.randn(7, 6)
    loss = fedkernels.distill_kl(s, y)
    assert loss.grad_fn is None and bitwise_equal(loss, ops.distill_kl(s, y, 1.0, 1.0 / 7, False)[0])
    s_grad = s.clone().requires_grad_(True)
    loss2 = fedkernels.distill_kl(s_grad, y)
    loss2.backward()
    s_ref = s.clone().requires_grad_(True)
    R.distill_kl_reference(s_ref, y).backward()
    assert bitwise_equal(loss2.detach(), loss)
    torch.testing.assert_close(s_grad.grad, s_ref.grad)


# ---------------------------------------------------------------- distill_kl


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduction", distill.REDUCTIONS)
def test_distill_kl_matches_reference(device, dtype, reduction):
    g = torch.Generator().manual_seed(2)
    for n, c in [(1, 1), (5, 7), (70, 10), (3, 1000), (130, 3)]:
        s = (3 * randn((n, c), torch.float64, g)).to(dtype).to(device)
        y = torch.softmax(2 * randn((n, c), torch.float64, g), -1).to(dtype).to(device)
        if c > 2:
            y[0, 0] = 0  # xlogy: 0 log 0 = 0
        for temperature in (1.0, 3.0):
            scale = distill.kl_scale(reduction, n, c, temperature)
            loss = fedkernels.ops.distill.distill_kl(s, y, temperature, reduction=reduction)
            ref = R.distill_kl_reference(s, y, temperature, scale)
            close(loss, ref, torch.float64 if dtype == torch.float64 else torch.float32)
            # The fused gradient.
            s2 = s.clone().requires_grad_(True)
            fedkernels.distill_kl(s2, y, temperature, reduction=reduction).backward()
            s3 = s.double().clone().requires_grad_(True)
            R.distill_kl_reference(s3, y.double(), temperature, scale).backward()
            close(s2.grad, s3.grad.to(dtype), dtype)


@pytest.mark.parametrize("reduction", distill.REDUCTIONS)
def test_distill_kl_exports_with_a_dynamic_batch(reduction):
    """The loss's factor carries 1/N (and 1/C for "dafkd"): traced with a dynamic batch, it
    must not fix the graph to the batch size it was traced with."""

    class Loss(torch.nn.Module):
        def forward(self, s, y):
            return fedkernels.distill_kl(s, y, 2.0, reduction=reduction)

    def inputs(n, c, seed):
        g = torch.Generator().manual_seed(seed)
        s = torch.randn(n, c, generator=g, requires_grad=True)
        return s, torch.softmax(torch.randn(n, c, generator=g), -1)

    batch, classes = torch.export.Dim("batch", min=2), torch.export.Dim("classes", min=2)
    program = torch.export.export(Loss(), inputs(8, 5, 0),
                                  dynamic_shapes=({0: batch, 1: classes}, {0: batch, 1: classes}))
    for n, c in [(8, 5), (3, 5), (40, 7)]:
        s, y = inputs(n, c, n)
        got = program.module()(s, y)
        want = R.distill_kl_reference(s, y, 2.0, distill.kl_scale(reduction, n, c, 2.0))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        (grad,) = torch.autograd.grad(got, s)
        (grad_want,) = torch.autograd.grad(fedkernels.distill_kl(s, y, 2.0, reduction=reduction), s)
        torch.testing.assert_close(grad, grad_want, rtol=1e-6, atol=1e-8)


def test_distill_kl_properties():
    s = torch.randn(20, 6, dtype=torch.float64)
    assert fedkernels.distill_kl(s, torch.softmax(torch.randn(20, 6, dtype=torch.float64), -1)) >= 0
    assert abs(float(fedkernels.distill_kl(s, torch.softmax(s, -1)))) < 1e-12
    assert abs(float(fedkernels.distill_kl(s, torch.softmax(s / 2, -1), 2.0))) < 1e-12
    # Matches torch's kl_div with batchmean (FedDF's form, no T^2).
    y = torch.softmax(torch.randn(20, 6, dtype=torch.float64), -1)
    expected = torch.nn.functional.kl_div(torch.log_softmax(s / 2, -1), y, reduction="batchmean")
    torch.testing.assert_close(fedkernels.distill_kl(s, y, 2.0, reduction="feddf"), expected)
    # No gradient pass when none is wanted.
    loss, grad = ops.distill_kl(s, y, 1.0, 0.05, False)
    assert grad.numel() == 0
    empty = fedkernels.distill_kl(torch.zeros(0, 6), torch.zeros(0, 6))
    assert float(empty) == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bad", [float("nan"), -0.2], ids=["nan", "negative"])
def test_distill_kl_is_nan_for_a_nan_or_negative_target(device, dtype, bad):
    # As the reference (log y of such a y is NaN): a broken target shows in the loss, not
    # only in the gradient. A zero target still adds 0 (0 log 0 = 0).
    s = torch.randn(3, 5, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    y = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(4)), -1)
    y[1, 2] = bad
    y = y.to(dtype).to(device)
    assert torch.isnan(fedkernels.distill_kl(s, y))
    assert torch.isnan(R.distill_kl_reference(s, y))
    y[1, 2] = 0
    assert torch.isfinite(fedkernels.distill_kl(s, y))


_KL_EDGE_ROWS = textwrap.dedent(
    """
    import sys, torch, fedkernels

    def expected(s, y, T):
        # float64, per row: sum_c y (log y - log q), 0 where y = 0 (even where q = 0), and the
        # gradient of the sum, (q sum y - y) / T
        log_q = torch.log_softmax(s / T, -1)
        terms = torch.where(y > 0, y * (torch.log(y) - log_q), torch.zeros_like(y))
        terms = torch.where(torch.isnan(y) | (y < 0), torch.full_like(y, float("nan")), terms)
        q = torch.exp(log_q)
        return terms.sum(-1), (q * y.sum(-1, keepdim=True) - y) / T

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for C in (1, 7, 16, 17, 31, 32, 100, 1000, 5000):
        g = torch.Generator().manual_seed(C)
        s = 3 * torch.randn(12, C, generator=g, dtype=torch.float64)
        y = torch.softmax(2 * torch.randn(12, C, generator=g, dtype=torch.float64), -1)
        h = max(C // 2, 1)
        s[1, :h] = float("-inf")            # classes of probability 0 that the target skips...
        y[1, :h] = 0
        y[1] /= y[1].sum()
        s[2, 0] = float("-inf")             # ...and one it does not: an infinite loss
        s[3, C - 1] = float("nan")
        s[4, 0] = float("inf")
        s[5] += 3e7                         # beyond the base-2 range: the full exp
        s[6] *= 1e6
        s[7] = -1e30
        s[7, 0] = 1e30
        y[8] = 0
        y[8, C - 1] = 1                     # one-hot target
        y[9, 0] = -0.1                      # a negative target: NaN
        s, y = s.float(), y.float()
        for T in (1.0, 2.0):
            rows = torch.stack([fedkernels.distill_kl(s[i:i + 1].to(device), y[i:i + 1].to(device),
                                                      T, reduction="sum").cpu() / (T * T)
                                for i in range(12)])
            x = s.clone().to(device).requires_grad_(True)
            fedkernels.distill_kl(x, y.to(device), T, reduction="sum").backward()
            want, want_grad = expected(s.double(), y.double(), T)
            torch.testing.assert_close(rows.double(), want, rtol=2e-6, atol=1e-6, equal_nan=True)
            finite = torch.isfinite(want_grad).all(-1)
            finite[5] = finite[6] = False   # logits near 3e7 and 1e6: float32 spacing decides
            torch.testing.assert_close(x.grad.cpu().double()[finite] / (T * T),
                                       want_grad[finite], rtol=1e-5, atol=1e-6)
            assert torch.isnan(x.grad[3:5].cpu()).all(), (C, T)
    print("OK", fedkernels.ops.native.cpu_capability)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_distill_kl_edge_rows_in_every_cpu_build(capability):
    """Each CPU build's KL loss and gradient (base-2 rows, full-exp rows, short rows) against
    float64 on edge rows: classes at -inf that the target skips add 0, one it does not makes
    the loss infinite, NaN and +inf logits and negative targets give NaN, and rows far beyond
    the base-2 range take the full exp."""
    run_in_cpu_build(_KL_EDGE_ROWS, capability, threads=2)


@pytest.mark.slow
@pytest.mark.cuda
def test_distill_kl_edge_rows_on_cuda():
    _run_on_cuda(_KL_EDGE_ROWS)


@pytest.mark.parametrize("device", DEVICES)
def test_distill_kl_of_a_million_classes_keeps_float32_accuracy(device):
    g = torch.Generator().manual_seed(6)
    s = 3 * torch.randn(2, 1_000_000, generator=g)
    y = torch.softmax(2 * torch.randn(2, 1_000_000, generator=g), -1)
    x = s.clone().to(device).requires_grad_(True)
    loss = fedkernels.distill_kl(x, y.to(device), 2.0)
    loss.backward()
    xr = s.double().requires_grad_(True)
    ref = R.distill_kl_reference(xr, y.double(), 2.0)
    ref.backward()
    torch.testing.assert_close(loss.detach().cpu().double(), ref.detach(), rtol=2e-6, atol=0)
    # The gradient (T / N)(q sum y - y) cancels where q and y are close, so its error is
    # bounded per element by float32 roundings of the larger term, not by a fixed atol: q
    # carries the exp's error (2.2e-7 relative, about two roundings) and the row sum's. The
    # AVX-512, AVX2 and default builds stay within 7 eps (q + y); a fixed atol of 1e-12 failed
    # the default build by one element of 2.5e-10, 1.2e-12 off.
    q = torch.softmax(s.double() / 2.0, -1)
    bound = 12 * torch.finfo(torch.float32).eps * (q + y.double()) * (2.0 / 2)  # T / N = 1
    err = (x.grad.cpu().double() - xr.grad).abs()
    assert bool((err <= bound).all()), f"{float((err / bound).max()) * 12:.2f} eps"


def test_distill_kl_backward_takes_the_kernel_gradient_without_filling_anything():
    # loss.backward() hands on the gradient the forward pass formed; the op's gradient output
    # gets no gradient of its own, and autograd must not fill an N x C tensor of zeros for it
    # (that fill was a quarter of a training step's time at N = 4096, C = 100).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    student = torch.randn(64, 10, requires_grad=True)
    target = torch.softmax(torch.randn(64, 10), 1)
    loss = fedkernels.distill_kl(student, target, 2.0)
    with Calls() as calls:
        loss.backward()
    assert not [n for n in calls.names if "zero" in n or "fill" in n], calls.names
    expected = torch.func.grad(
        lambda s: torch.nn.functional.kl_div(torch.log_softmax(s / 2.0, 1), target,
                                             reduction="batchmean") * 4.0)(student.detach())
    torch.testing.assert_close(student.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", ["wrapper", "op"])
def test_distill_kl_backward_twice_through_a_retained_graph(path):
    # loss.backward() hands on the kernel's gradient: accumulating twice through a retained
    # graph, with x.grad changed in place in between (as clipping does), a scaled loss and a
    # target that requires grad must still give the float64 reference's gradients. Through
    # the op's registered autograd x.grad had become the saved gradient, and the second
    # backward failed ("modified by an inplace operation").
    g = torch.Generator().manual_seed(5)
    s0 = randn((9, 6), torch.float64, g)
    y0 = torch.softmax(randn((9, 6), torch.float64, g), -1)
    scale = distill.kl_scale("batchmean", 9, 6, 2.0)
    s, y = s0.clone().requires_grad_(), y0.clone().requires_grad_()
    loss = (fedkernels.distill_kl(s, y, 2.0) if path == "wrapper"
            else ops.distill_kl(s, y, 2.0, scale, True)[0])
    loss.backward(retain_graph=True)
    s.grad.mul_(0.5)
    y.grad.mul_(0.5)
    loss.backward(retain_graph=True)
    (3 * loss).backward()
    sr, yr = s0.clone().requires_grad_(), y0.clone().requires_grad_()
    (4.5 * R.distill_kl_reference(sr, yr, 2.0, scale)).backward()
    torch.testing.assert_close(s.grad, sr.grad)
    torch.testing.assert_close(y.grad, yr.grad)
    assert loss.grad_fn is not None and loss.dim() == 0


def test_distill_kl_under_torch_func_transforms():
    # torch.func takes only an autograd.Function with its own setup_context; the op's
    # registered autograd is not one ("must override the setup_context staticmethod").
    from torch.func import grad, grad_and_value, jacrev, vmap

    g = torch.Generator().manual_seed(6)
    s0 = randn((7, 5), torch.float64, g)
    y0 = torch.softmax(randn((7, 5), torch.float64, g), -1)
    scale = distill.kl_scale("batchmean", 7, 5, 2.0)

    def ours(s, y=y0):
        return fedkernels.distill_kl(s, y, 2.0)

    def ref(s, y=y0):
        return R.distill_kl_reference(s, y, 2.0, scale)

    torch.testing.assert_close(grad(ours)(s0), grad(ref)(s0))
    torch.testing.assert_close(jacrev(jacrev(ours))(s0), jacrev(jacrev(ref))(s0))
    batch = torch.stack([s0, 2 * s0, -s0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the op's own vmap rule: not PyTorch's fallback
        torch.testing.assert_close(vmap(grad(ours))(batch), vmap(grad(ref))(batch))
    for a, b in zip(grad_and_value(lambda y: ours(s0, y))(y0), grad_and_value(lambda y: ref(s0, y))(y0)):
        torch.testing.assert_close(a, b)


def test_distill_kl_errors():
    s = torch.randn(4, 5)
    y = torch.softmax(torch.randn(4, 5), -1)
    with pytest.raises(ValueError, match="shape"):
        fedkernels.distill_kl(s, y[:, :4])
    with pytest.raises(TypeError, match="dtype"):
        fedkernels.distill_kl(s, y.double())
    with pytest.raises(ValueError, match="temperature"):
        fedkernels.distill_kl(s, y, 0.0)
    with pytest.raises(ValueError, match="reduction"):
        fedkernels.distill_kl(s, y, reduction="mean")
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        ops.distill_kl(s[0], y[0], 1.0, 1.0, False)


@pytest.mark.parametrize("device", DEVICES)
def test_distill_kl_opcheck(device):
    s = torch.randn(6, 5, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.softmax(torch.randn(6, 5, dtype=torch.float64, device=device), -1).requires_grad_()
    torch.library.opcheck(ops.distill_kl, (s, y, 2.0, 0.25, True))
    torch.library.opcheck(ops.distill_kl, (s.detach(), y.detach(), 1.0, 1.0, False))


def test_distill_kl_gradcheck():
    s = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.softmax(torch.randn(5, 4, dtype=torch.float64), -1).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: fedkernels.distill_kl(a, b, 1.7, reduction="dafkd"), (s, y))
    # Through the pseudo-labels too: the whole server objective, differentiable in the teachers.
    L = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, t: fedkernels.distill_kl(a, fedkernels.ensemble_pseudo_labels(t, weighting="entropy")),
        (s, L))


def test_distill_kl_compile():
    s = torch.randn(8, 5, requires_grad=True)
    y = torch.softmax(torch.randn(8, 5), -1)

    @torch.compile(fullgraph=True)
    def f(a, b):
        return fedkernels.distill_kl(a, b, 2.0)

    loss = f(s, y)
    loss.backward()
    s2 = s.detach().clone().requires_grad_(True)
    R.distill_kl_reference(s2, y, 2.0).backward()
    torch.testing.assert_close(loss, R.distill_kl_reference(s, y, 2.0))
    torch.testing.assert_close(s.grad, s2.grad)


@pytest.mark.cuda
def test_cuda_matches_cpu(cuda_device):
    for weighting in WEIGHTINGS:
        for combine in ("logits", "probs"):
            for shape in [(10, 256, 10), (40, 64, 1000), (3, 5, 20000)]:
                logits, scores = make_inputs(shape, torch.float32, weighting)
                cpu = fedkernels.ensemble_pseudo_labels(logits, scores, weighting=weighting,
                                                        combine=combine, return_weights=True)
                gpu = fedkernels.ensemble_pseudo_labels(
                    logits.to(cuda_device), None if scores is None else scores.to(cuda_device),
                    weighting=weighting, combine=combine, return_weights=True)
                for a, b in zip(gpu, cpu):
                    torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-6)
    s = torch.randn(4096, 100)
    y = torch.softmax(torch.randn(4096, 100), -1)
    torch.testing.assert_close(fedkernels.distill_kl(s.to(cuda_device), y.to(cuda_device)).cpu(),
                               fedkernels.distill_kl(s, y), rtol=1e-5, atol=1e-6)
