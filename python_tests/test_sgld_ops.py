"""Tests of the SGLD / FedEvg ops (docs/algorithms/fedevg.md, sections 2, 4, 5, 8): against
the pure-PyTorch references with explicit noise, the noise's moments and reproducibility,
opcheck, float64 gradcheck of the energy, torch.compile and the errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, assert_close, bitwise_equal, cpu_builds, dtype_id, run_in_cpu_build
from torch import Tensor

import fedkernels
from fedkernels.ops import reference as ref

ops = torch.ops.fedkernels
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


# ---------------------------------------------------------------- energy_from_logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("conditional", [True, False])
def test_energy_matches_reference(device, dtype, conditional):
    g = _gen(0)
    logits = (torch.randn(37, 11, generator=g) * 4).to(dtype).to(device)
    labels = torch.randint(0, 11, (37,), generator=g).to(device) if conditional else None
    assert_close(
        fedkernels.energy_from_logits(logits, labels),
        ref.energy_from_logits_reference(logits, labels),
    )


@pytest.mark.parametrize("conditional", [True, False])
def test_energy_gradcheck(conditional):
    g = _gen(1)
    logits = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (6,), generator=g) if conditional else None
    assert torch.autograd.gradcheck(lambda f: fedkernels.energy_from_logits(f, labels), (logits,))
    # The gradients with respect to the logits: dE/df = -onehot(y) or -softmax(f).
    (gf,) = torch.autograd.grad(fedkernels.energy_from_logits(logits, labels).sum(), logits)
    want = (
        -torch.nn.functional.one_hot(labels, 5).double()
        if conditional
        else -torch.softmax(logits.detach(), 1)
    )
    torch.testing.assert_close(gf, want)


@pytest.mark.parametrize("device", DEVICES)
def test_energy_opcheck(device):
    logits = torch.randn(8, 4, device=device, requires_grad=True)
    labels = torch.randint(0, 4, (8,), device=device)
    torch.library.opcheck(ops.energy_from_logits, (logits, labels))
    torch.library.opcheck(ops.energy_from_logits, (logits, None))


def test_energy_empty_and_errors():
    assert fedkernels.energy_from_logits(torch.zeros(0, 3)).shape == (0,)
    with pytest.raises(ValueError, match=r"out of range"):
        fedkernels.energy_from_logits(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        fedkernels.energy_from_logits(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match=r"int64"):
        fedkernels.energy_from_logits(torch.zeros(2, 3), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"dtype"):
        fedkernels.energy_from_logits(torch.zeros(2, 3, dtype=torch.int64))


# Rows the CPU energy must route or bound with care (its base-2 exps apply to rows whose max is
# finite and at most 1e7 in size): -inf classes, a NaN, an all -inf row, a +inf, maxima far from
# 0 (base 2 up to 1e7, the full exp above), a huge spread, and rows of equal logits near 1e6,
# whose log-sum-exp m + log C is exact only if the rounding of m log2 e is taken back out.
_ENERGY_ROWS = """
import torch, fedkernels
from fedkernels.ops import native

g = torch.Generator().manual_seed(0)
for C in (1, 2, 7, 10, 16, 17, 33, 100, 1000):
    L = 3 * torch.randn(40, C, generator=g, dtype=torch.float64)
    L[1, : C // 2] = float("-inf")
    L[2, C - 1] = float("nan")
    L[3, :] = float("-inf")
    L[4, 0] = float("inf")
    L[5, :] += 3e7
    L[6, :] *= 1e6
    L[7, :] = -1e30
    L[7, 0] = 1e30
    L[8:24, :] = torch.empty(16, 1, dtype=torch.float64).uniform_(1e5, 1e7, generator=g)
    L[24:, :] += torch.empty(16, 1, dtype=torch.float64).uniform_(-1e4, 1e4, generator=g)
    for dtype, tol in ((torch.float32, 4e-7), (torch.float64, 1e-13)):
        L = L.to(dtype)
        got = fedkernels.energy_from_logits(L).double()
        want = -torch.logsumexp(L.double(), 1)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
        # Equal logits: within half a spacing of the exact value, plus a hair.
        spacing = torch.finfo(dtype).eps * want[8:24].abs()
        assert ((got[8:24] - want[8:24]).abs() <= 0.5 * spacing + 2 * tol).all(), C
        # A row's energy does not depend on the rows around it (blocks and lane groups).
        for i in (0, 2, 4, 5, 6, 17, 39):
            alone = fedkernels.energy_from_logits(L[i : i + 1]).double()
            same = torch.equal(alone, got[i : i + 1]) or alone.isnan().all() and got[i].isnan()
            assert same, (C, i, dtype)
print("OK", native.cpu_capability)
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_energy_edge_rows_in_every_cpu_build(capability):
    """Each CPU build (its own exps and row layouts) gives float64's -logsumexp of the float32
    (and float64) logits to a few roundings on the edge rows above, the same bits for a row
    alone or in a batch, and equal logits near 1e6 to about one spacing."""
    run_in_cpu_build(_ENERGY_ROWS, capability)


@pytest.mark.parametrize("device", DEVICES)
def test_energy_of_a_million_classes_keeps_float32_accuracy(device):
    """Long rows are summed in chunks added in float64 (CPU) or with compensated lane sums
    (CUDA): a float accumulator over 1e6 classes was 2e-6 off in relative terms
    (torch.logsumexp's cascade sum: 3e-8)."""
    g = _gen(3)
    logits = 5 * torch.randn(2, 1_000_000, generator=g)
    want = -torch.logsumexp(logits.double(), 1)
    got = fedkernels.energy_from_logits(logits.to(device)).cpu().double()
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)


# ---------------------------------------------------------------- sgld_step


def _step_inputs(shape, dtype, device, seed=0):
    g = _gen(seed)
    x = torch.rand(shape, generator=g).to(dtype).to(device)
    grad = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    noise = torch.randn(shape, generator=g).to(dtype).to(device)
    return x, grad, noise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("shape", [(), (7,), (3, 1, 5, 5), (64, 3, 4, 4)])
@pytest.mark.parametrize("clip_clamp", [(None, None), (3.0, (0.0, 1.0)), (1.0, (None, 0.5))])
def test_sgld_step_exact_with_given_noise(device, dtype, shape, clip_clamp):
    clip, clamp = clip_clamp
    x, grad, noise = _step_inputs(shape, dtype, device)
    kw = dict(step_size=0.7, noise_std=0.05, grad_clip=clip, clamp=clamp)
    got = fedkernels.sgld_step(x, grad, noise=noise, **kw)
    want = ref.sgld_step_reference(x, grad, 0.7, 0.05, noise=noise, grad_clip=clip, clamp=clamp)
    assert_close(got, want)
    # In place: the same values, written into x.
    y = x.clone()
    assert fedkernels.sgld_step_(y, grad, noise=noise, **kw) is y
    assert bitwise_equal(y, got)


def test_sgld_step_non_contiguous_inplace():
    base = torch.rand(6, 8)
    x = base.t()  # not contiguous
    grad = torch.randn(8, 6)
    noise = torch.randn(8, 6)
    want = ref.sgld_step_reference(x, grad, 1.0, 0.1, noise=noise, clamp=(0, 1))
    fedkernels.sgld_step_(x, grad, step_size=1.0, noise_std=0.1, clamp=(0, 1), noise=noise)
    assert_close(base.t(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_noise_moments(device):
    n = 1 << 20
    x = torch.zeros(n, device=device)
    z = fedkernels.sgld_step(x, x, step_size=0.0, noise_std=1.0, generator=_gen(3, device)).double().cpu()
    se = 1 / math.sqrt(n)
    assert abs(z.mean().item()) < 5 * se
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2) * se
    assert abs((z**3).mean().item()) < 5 * math.sqrt(15) * se  # skewness 0
    assert abs((z**4).mean().item() - 3) < 5 * math.sqrt(96) * se  # kurtosis 3
    assert abs((z.abs() < 1).double().mean().item() - 0.682689) < 5 * 0.47 * se
    # The 4 lanes of a Philox block, and neighbouring blocks, are uncorrelated.
    for lag in (1, 2, 3, 4):
        r = (z[:-lag] * z[lag:]).mean().item()
        assert abs(r) < 5 * se, (lag, r)
    lanes = z.reshape(-1, 4)
    for lane in range(4):
        assert abs(lanes[:, lane].mean().item()) < 10 * se
        assert abs(lanes[:, lane].var().item() - 1) < 10 * math.sqrt(2) * se
    # noise_std scales it.
    z2 = fedkernels.sgld_step(x, x, step_size=0.0, noise_std=0.25, generator=_gen(3, device))
    torch.testing.assert_close(z2.double().cpu(), 0.25 * z)


@pytest.mark.parametrize("device", DEVICES)
def test_noise_reproducible_from_seed(device):
    x = torch.rand(1001, device=device)
    grad = torch.randn(1001, device=device)
    kw = dict(step_size=0.1, noise_std=0.5)
    a = fedkernels.sgld_step(x, grad, generator=_gen(42, device), **kw)
    b = fedkernels.sgld_step(x, grad, generator=_gen(42, device), **kw)
    c = fedkernels.sgld_step(x, grad, generator=_gen(43, device), **kw)
    assert bitwise_equal(a, b)
    assert not torch.equal(a, c)
    gen = _gen(42, device)
    first = fedkernels.sgld_step(x, grad, generator=gen, **kw)
    second = fedkernels.sgld_step(x, grad, generator=gen, **kw)
    assert bitwise_equal(first, a)
    assert not torch.equal(first, second)  # the generator advanced
    # The default generator follows torch.manual_seed.
    torch.manual_seed(7)
    d1 = fedkernels.sgld_step(x, grad, **kw)
    torch.manual_seed(7)
    d2 = fedkernels.sgld_step(x, grad, **kw)
    assert bitwise_equal(d1, d2)
    # No noise drawn (noise_std = 0) leaves the generator alone.
    gen = _gen(5, device)
    state = gen.get_state()
    fedkernels.sgld_step(x, grad, step_size=1.0, noise_std=0.0, generator=gen)
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
def test_drawn_noise_same_across_dtypes_and_compose(dtype):
    """The noise stream depends only on the seed and the element index: the plain step and the
    composed step (any K) with the same seed add the same noise."""
    x = torch.zeros(5, 7, dtype=dtype)
    zero = torch.zeros(5, 7, dtype=dtype)
    a = fedkernels.sgld_step(x, zero, step_size=1.0, noise_std=1.0, generator=_gen(9))
    b = fedkernels.sgld_compose_step(
        x, torch.zeros(3, 5, 7, dtype=dtype), torch.randn(3, 5), torch.zeros(3),
        step_size=1.0, noise_std=1.0, generator=_gen(9),
    )
    assert bitwise_equal(a, b)
    ref32 = fedkernels.sgld_step(x.float(), zero.float(), step_size=1.0, noise_std=1.0, generator=_gen(9))
    # Same stream; fp64 evaluates Box-Muller in fp64, so it agrees to fp32 rounding.
    assert_close(a, ref32.to(dtype), dtype=torch.float32 if dtype == torch.float64 else dtype)


# ---------------------------------------------------------------- sgld_compose_step


def _compose_inputs(K, M, feat, dtype, device, seed=0):
    g = _gen(seed)
    x = torch.rand((M,) + feat, generator=g).to(dtype).to(device)
    grads = (torch.randn((K, M) + feat, generator=g) * 4).to(dtype).to(device)
    energies = (torch.randn(K, M, generator=g) * 3).to(device)
    energies[0, :2] = 0.0  # sign(0) = 0 in the signed mode
    log_w = torch.log(torch.rand(K, generator=g) + 0.1).to(device)
    noise = torch.randn((M,) + feat, generator=g).to(dtype).to(device)
    return x, grads, energies, log_w, noise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("mode", ["exact", "signed"])
@pytest.mark.parametrize("K,M,feat", [(1, 3, (5,)), (3, 10, (1, 3, 3)), (17, 9, (2, 7)), (4, 5, ())])
def test_compose_matches_reference(device, dtype, mode, K, M, feat):
    x, grads, energies, log_w, noise = _compose_inputs(K, M, feat, dtype, device)
    kw = dict(step_size=10.0, noise_std=0.01, grad_clip=3.0, clamp=(0.0, 1.0))
    got, pi = fedkernels.sgld_compose_step(
        x, grads, energies, log_w, mode=mode, noise=noise, return_weights=True, **kw
    )
    want, want_pi = ref.sgld_compose_step_reference(
        x, grads, energies, log_w, 10.0, 0.01, noise=noise, mode=mode, grad_clip=3.0, clamp=(0.0, 1.0)
    )
    assert_close(pi, want_pi)
    # Without the clamp the direction is visible (the clamp saturates most values at step 10).
    got2 = fedkernels.sgld_compose_step(
        x, grads, energies, log_w, mode=mode, noise=noise, step_size=0.3, noise_std=0.1
    )
    want2, _ = ref.sgld_compose_step_reference(x, grads, energies, log_w, 0.3, 0.1, noise=noise, mode=mode)
    assert_close(got, want, num_clients=K)
    assert_close(got2, want2, num_clients=K)
    y = x.clone()
    pi_ = fedkernels.sgld_compose_step(
        y, grads, energies, log_w, mode=mode, noise=noise, inplace=True, return_weights=True, **kw
    )[1]
    assert bitwise_equal(y, got) and bitwise_equal(pi_, pi)


def _compose_in_client_order(x, grads, pi, step, std, noise, tau, lo, hi):
    """The composed step as the CPU kernel rounds it, one elementwise op at a time in the
    accumulate dtype: acc = pi_0 clip(g_0), then acc + pi_k clip(g_k) for k = 1.., then
    clamp(x - step acc + std eps) (PyTorch's elementwise ops round each result once)."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    g = grads.to(acc_dtype).clamp(-tau, tau)
    w = pi.to(acc_dtype).reshape(pi.shape + (1,) * (x.dim() - 1))
    acc = w[0] * g[0]
    for k in range(1, grads.shape[0]):
        acc = acc + w[k] * g[k]
    v = x.to(acc_dtype) - step * acc + std * noise.to(acc_dtype)
    return v.clamp(lo, hi).to(x.dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("K", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("M,D", [(7, 3), (5, 37), (3, 2500)])
@pytest.mark.parametrize("threads", [1, 2])
def test_compose_bits_match_a_client_order_rendering(dtype, K, M, D, threads):
    """The CPU kernel adds the clients four at a time over runs of one sample, vector lanes and
    scalar tails, and finishes the step in the last group's pass: every element must still
    round exactly as the client-order sum (NaN, infinities and -0.0 among the gradients, runs
    that cross tiles and vectors)."""
    g = _gen(K * 1000 + M)
    x = torch.rand(M, D, generator=g).to(dtype)
    grads = (torch.randn(K, M, D, generator=g) * 4).to(dtype)
    grads[0, 0, 1] = float("nan")
    grads[K - 1, M - 1, D - 1] = float("-inf")
    grads[K // 2, M // 2, D // 2] = -0.0
    energies = torch.randn(K, M, generator=g)
    log_w = torch.randn(K, generator=g) * 0.3
    if dtype == torch.float64:
        energies, log_w = energies.double(), log_w.double()
    noise = torch.randn(M, D, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, pi = fedkernels.sgld_compose_step(
            x, grads, energies, log_w, mode="exact", step_size=0.3, noise_std=0.1,
            grad_clip=2.5, clamp=(0.0, 1.0), noise=noise, return_weights=True,
        )
    finally:
        torch.set_num_threads(before)
    want = _compose_in_client_order(x, grads, pi, 0.3, 0.1, noise, 2.5, 0.0, 1.0)
    assert torch.equal(got.isnan(), want.isnan())
    assert bitwise_equal(got.nan_to_num(), want.nan_to_num())


def test_compose_weight_formulas():
    """Signed weights are w_i e^{sgn(f)} / sum_k w_k e^{sgn(f)}, the exact
    ones w_i e^{-E_i} / sum_k w_k e^{-E_k}; K = 1 is the plain step."""
    x, grads, energies, log_w, noise = _compose_inputs(4, 6, (3,), torch.float64, "cpu")
    _, pi = fedkernels.sgld_compose_step(
        x, grads, energies, log_w, mode="signed", step_size=1.0, noise_std=0.0, return_weights=True
    )
    s = torch.exp(torch.sign(-energies.double())) * log_w.double().exp()[:, None]
    torch.testing.assert_close(pi, s / s.sum(0))
    _, pi = fedkernels.sgld_compose_step(
        x, grads, energies, log_w, mode="exact", step_size=1.0, noise_std=0.0, return_weights=True
    )
    s = torch.exp(-energies.double()) * log_w.double().exp()[:, None]
    torch.testing.assert_close(pi, s / s.sum(0))
    one = fedkernels.sgld_compose_step(
        x, grads[:1], energies[:1], log_w[:1], step_size=0.5, noise_std=0.2, noise=noise, grad_clip=1.0
    )
    plain = fedkernels.sgld_step(x, grads[0], step_size=0.5, noise_std=0.2, noise=noise, grad_clip=1.0)
    torch.testing.assert_close(one, plain)


def test_compose_deterministic_and_large_exact_energies():
    x, grads, energies, log_w, noise = _compose_inputs(100, 33, (3, 4, 4), torch.float32, "cpu")
    energies = energies * 1000  # softmax must stay finite (stable form)
    a = fedkernels.sgld_compose_step(x, grads, energies, log_w, step_size=1.0,
                                    noise_std=0.1, generator=_gen(1))
    b = fedkernels.sgld_compose_step(x, grads, energies, log_w, step_size=1.0,
                                    noise_std=0.1, generator=_gen(1))
    assert bitwise_equal(a, b) and torch.isfinite(a).all()
    torch.set_num_threads(1)
    try:
        c = fedkernels.sgld_compose_step(x, grads, energies, log_w, step_size=1.0,
                                    noise_std=0.1, generator=_gen(1))
    finally:
        torch.set_num_threads(2)
    assert bitwise_equal(a, c)


# ---------------------------------------------------------------- the noise, bit for bit

_M32 = 0xFFFFFFFF


def _f(v: float) -> Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _poly(coefs, x):
    acc = _f(coefs[0])
    for c in coefs[1:]:
        acc = acc * x + _f(c)
    return acc


def _box_muller_f32(r1: Tensor, r2: Tensor) -> tuple[Tensor, Tensor]:
    """csrc/normal_noise.h's BoxMullerF32, one float32 torch op per C++ operation."""
    i32 = lambda t: t.view(torch.int32).to(torch.int64) & _M32  # noqa: E731
    scale = _f(2.0**-32)
    u1 = (r1.to(torch.float32) + _f(1.0)) * scale
    u2 = r2.to(torch.float32) * scale
    b = i32(u1)
    m = (b & 0x7FFFFF) | 0x3F800000
    big = ((0x3FB504F3 - m) >> 31) & 1
    m = m - (big << 23)
    e = ((b >> 23) + big).to(torch.float32) - _f(127.0)
    f = m.to(torch.int32).view(torch.float32) - _f(1.0)
    q = _poly([-7.866667956e-02, 1.282174885e-01, -1.310163438e-01, 1.418900043e-01,
               -1.662759930e-01, 2.000196874e-01, -2.500077188e-01, 3.333332241e-01,
               -4.999999702e-01], f)
    log_u1 = e * _f(0.693145751953125) + (e * _f(1.428606765330187e-06) + (f + (f * f) * q))
    # float32 torch.sqrt is not always correctly rounded; via float64 it is (53 >= 2 * 24 + 2).
    r = torch.sqrt((_f(-2.0) * log_u1).double()).float()
    x = u2 * _f(4.0)
    shifted = x + _f(12582912.0)
    quadrant = i32(shifted) & 3
    d = x - (shifted - _f(12582912.0))
    z = d * d
    s = _poly([-4.602163099e-03, 7.968021929e-02, -6.459634900e-01, 1.570796371e00], z) * d
    c = _poly([9.036298725e-04, -2.086007036e-02, 2.536692023e-01, -1.233700514e00, 1.0], z)
    odd = (quadrant & 1) == 1
    cos, sin = torch.where(odd, s, c), torch.where(odd, c, s)
    cos = torch.where(((quadrant + 1) & 2) != 0, -cos, cos)
    sin = torch.where((quadrant & 2) != 0, -sin, sin)
    return r * cos, r * sin


def _noise_reference(seed: int, n: int) -> tuple[Tensor, Tensor]:
    """(fp32 noise as the kernels draw it, the same Box-Muller in float64 with libm's functions
    from the same uniforms)."""
    w = ref.philox_words_reference(seed, 0, torch.arange((n + 3) // 4, dtype=torch.int64))
    pairs = [_box_muller_f32(w[0], w[1]), _box_muller_f32(w[2], w[3])]
    ours = torch.stack([pairs[0][0], pairs[0][1], pairs[1][0], pairs[1][1]], 1).reshape(-1)[:n]
    exact = []
    for r1, r2 in ((w[0], w[1]), (w[2], w[3])):
        u1 = ((r1.to(torch.float32) + 1) * 2.0**-32).double()
        u2 = (r2.to(torch.float32) * 2.0**-32).double()
        rad = torch.sqrt(-2 * torch.log(u1))
        exact += [rad * torch.cos(2 * math.pi * u2), rad * torch.sin(2 * math.pi * u2)]
    return ours, torch.stack(exact, 1).reshape(-1)[:n]


def _seed_of(generator_seed: int) -> int:
    """The Philox seed the CPU ops draw from a torch.Generator seeded so (one random64)."""
    g = _gen(generator_seed)
    return torch.empty((), dtype=torch.int64).random_(-(2**63), None, generator=g).item() & (2**64 - 1)


@pytest.mark.parametrize("n", [1, 7, 4 * 64 + 3, 3 * 2048 + 17])
def test_drawn_noise_bits_match_the_pytorch_rendering(n):
    """The fp32 noise is BoxMullerF32 of at::philox_engine's words, bit for bit (the vector
    loops of the AVX2/AVX-512 builds included), and within 1e-6 of float64 libm's Box-Muller."""
    x = torch.zeros(n)
    got = fedkernels.sgld_step(x, x, step_size=0.0, noise_std=1.0, generator=_gen(11))
    want, exact = _noise_reference(_seed_of(11), n)
    assert torch.equal(got, want + 0.0)  # the op adds x = 0, which turns -0 into 0
    assert (want.double() - exact).abs().max().item() < 1e-6 * max(1.0, exact.abs().max().item())


_ISA_SCRIPT = """
import sys, torch, fedkernels
from fedkernels.ops import native
g = lambda s: torch.Generator().manual_seed(s)
out = {"capability": native.cpu_capability}
n = 3 * 2048 + 4 * 37 + 3
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    x = torch.rand(n, generator=g(1)).to(dtype)
    grads = (4 * torch.randn(3, 7, n // 7, generator=g(2))).to(dtype)
    xs = x[: 7 * (n // 7)].reshape(7, -1)
    out[str(dtype)] = [
        fedkernels.sgld_step(torch.zeros(n, dtype=dtype), x, step_size=0.0, noise_std=1.0,
                             generator=g(3)),
        fedkernels.sgld_step(x, x, step_size=0.5, noise_std=0.1, grad_clip=0.3,
                             clamp=(0.1, 0.9), generator=g(4)),
        fedkernels.sgld_compose_step(xs, grads, torch.randn(3, 7, generator=g(5)),
                                     torch.zeros(3), mode="signed", step_size=0.1,
                                     noise_std=0.01, grad_clip=3.0, clamp=(0.0, 1.0),
                                     generator=g(6), return_weights=True),
    ]
torch.save(out, sys.argv[1])
"""


@pytest.mark.slow
def test_cpu_builds_draw_the_same_bits(tmp_path):
    """Every CPU build this machine can load (default, avx2, avx512) gives the same bits for the
    drawn noise and the whole step, in every dtype."""
    results = {}
    for cap in cpu_builds():
        path = tmp_path / f"{cap}.pt"
        env = dict(os.environ, FEDKERNELS_CPU_CAPABILITY=cap, OMP_NUM_THREADS="2")
        proc = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(path)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[cap] = torch.load(path)
        assert results[cap].pop("capability") == cap
    if len(results) < 2:
        pytest.skip("this CPU loads only one build")
    first, *others = results
    for cap in others:
        assert bitwise_equal(results[cap], results[first]), (cap, first)


@pytest.mark.parametrize("device", DEVICES)
def test_sgld_opcheck(device):
    x, grads, energies, log_w, noise = _compose_inputs(3, 4, (2, 3), torch.float32, device)
    for args in (
        (x, grads[0], 0.5, 0.1, 3.0, 0.0, 1.0, noise, None),
        (x, grads[0], 0.5, 0.0, None, None, None, None, None),
    ):
        torch.library.opcheck(ops.sgld_step, args)
        torch.library.opcheck(ops.sgld_step_, (x.clone(),) + args[1:])
    for mode in ("exact", "signed"):
        args = (x, grads, energies, log_w, mode, 10.0, 0.01, 3.0, 0.0, 1.0, noise, None)
        torch.library.opcheck(ops.sgld_compose_step, args)
        torch.library.opcheck(ops.sgld_compose_step_, (x.clone(),) + args[1:])


def test_compile_fullgraph():
    x, grads, energies, log_w, noise = _compose_inputs(3, 4, (2, 3), torch.float32, "cpu")
    logits = torch.randn(4, 5)
    labels = torch.tensor([0, 1, 2, 3])

    @torch.compile(fullgraph=True)
    def step(x, grads, energies, log_w, noise, logits):
        e = fedkernels.energy_from_logits(logits, labels) + fedkernels.energy_from_logits(logits)
        y = fedkernels.sgld_compose_step(
            x, grads, energies + e, log_w, mode="signed", step_size=10.0, noise_std=0.01,
            grad_clip=3.0, clamp=(0.0, 1.0), noise=noise,
        )
        return fedkernels.sgld_step(y, grads[0], step_size=1.0, noise_std=0.01, noise=noise)

    e = fedkernels.energy_from_logits(logits, labels) + fedkernels.energy_from_logits(logits)
    want = fedkernels.sgld_step(
        fedkernels.sgld_compose_step(
            x, grads, energies + e, log_w, mode="signed", step_size=10.0, noise_std=0.01,
            grad_clip=3.0, clamp=(0.0, 1.0), noise=noise,
        ),
        grads[0], step_size=1.0, noise_std=0.01, noise=noise,
    )
    torch.testing.assert_close(step(x, grads, energies, log_w, noise, logits), want)


def test_errors_and_nothing_written():
    x, grads, energies, log_w, noise = _compose_inputs(3, 4, (5,), torch.float32, "cpu")
    kw = dict(step_size=1.0, noise_std=0.1)
    y = x.clone()
    cases = [
        (ValueError, r"mode", dict(mode="product")),
        (ValueError, r"noise or generator", dict(noise=noise, generator=_gen(0))),
        (ValueError, r"noise_std", dict(noise_std=-1.0)),
        (ValueError, r"clamp_min", dict(clamp=(1.0, 0.0))),
        (ValueError, r"grad_clip", dict(grad_clip=0.0)),
        (ValueError, r"noise has shape", dict(noise=noise[:2])),
    ]
    for exc, msg, over in cases:
        with pytest.raises(exc, match=msg):
            fedkernels.sgld_compose_step(y, grads, energies, log_w, inplace=True, **{**kw, **over})
    with pytest.raises(ValueError, match=r"log weight of client 1"):
        fedkernels.sgld_compose_step(
            y, grads, energies, torch.tensor([0.0, float("nan"), 0.0]), inplace=True, **kw
        )
    with pytest.raises(ValueError, match=r"energies must be \[K, M\]"):
        fedkernels.sgld_compose_step(y, grads, energies[:2], log_w, inplace=True, **kw)
    with pytest.raises(ValueError, match=r"grads must be \[K, M"):
        fedkernels.sgld_compose_step(y, grads[:, :3], energies, log_w, inplace=True, **kw)
    with pytest.raises(ValueError, match=r"at least one client"):
        fedkernels.sgld_compose_step(y, grads[:0], energies[:0], log_w[:0], inplace=True, **kw)
    with pytest.raises(TypeError, match=r"grads have dtype"):
        fedkernels.sgld_compose_step(y, grads.double(), energies, log_w, inplace=True, **kw)
    with pytest.raises(ValueError, match=r"grad has shape"):
        fedkernels.sgld_step_(y, grads[0, :3], **kw)
    with pytest.raises(TypeError, match=r"x has dtype"):
        fedkernels.sgld_step(y.long(), grads[0].long(), **kw)
    assert torch.equal(y, x)  # nothing written
    # Empty inputs.
    assert fedkernels.sgld_step(torch.zeros(0), torch.zeros(0), **kw).shape == (0,)
    out, pi = fedkernels.sgld_compose_step(
        torch.zeros(0, 3), torch.zeros(2, 0, 3), torch.zeros(2, 0), torch.zeros(2), return_weights=True, **kw
    )
    assert out.shape == (0, 3) and pi.shape == (2, 0)


def test_expanded_x_in_place_is_refused_before_any_noise_is_drawn():
    # An expanded view has one element of memory for many: the in-place result could not be
    # written (it was a RuntimeError after the generator had advanced).
    g = _gen(5)
    state = g.get_state()
    x = torch.zeros(1).expand(3)
    with pytest.raises(ValueError, match="x has elements that share memory"):
        fedkernels.sgld_step_(x, torch.ones(3), step_size=0.1, noise_std=1.0, generator=g)
    x2 = torch.zeros(1, 2).expand(3, 2)
    with pytest.raises(ValueError, match="x has elements that share memory"):
        fedkernels.sgld_compose_step(x2, torch.ones(2, 3, 2), torch.zeros(2, 3), torch.zeros(2),
                                     step_size=0.1, noise_std=1.0, generator=g, inplace=True)
    assert torch.equal(g.get_state(), state)
    # Out of place an expanded x is only read: fine.
    out = fedkernels.sgld_step(x, torch.ones(3), step_size=0.1, noise_std=0.0)
    assert out.tolist() == pytest.approx([-0.1] * 3)


# ---------------------------------------------------------------- CUDA against CPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
def test_cuda_matches_cpu(dtype):
    x, grads, energies, log_w, noise = _compose_inputs(10, 100, (3, 8, 8), dtype, "cpu")
    kw = dict(mode="signed", step_size=10.0, noise_std=0.01, grad_clip=3.0, clamp=(0.0, 1.0))
    cpu, pi = fedkernels.sgld_compose_step(x, grads, energies, log_w, noise=noise, return_weights=True, **kw)
    dev = [t.cuda() for t in (x, grads, energies, log_w, noise)]
    gpu, gpi = fedkernels.sgld_compose_step(*dev[:4], noise=dev[4], return_weights=True, **kw)
    assert_close(gpu, cpu, num_clients=10)
    assert_close(gpi, pi)
    # Drawn noise on the GPU: reproducible and standard normal.
    g1 = fedkernels.sgld_compose_step(*dev[:4], generator=_gen(3, "cuda"), **kw)
    g2 = fedkernels.sgld_compose_step(*dev[:4], generator=_gen(3, "cuda"), **kw)
    assert bitwise_equal(g1, g2)
