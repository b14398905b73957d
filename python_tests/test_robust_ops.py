"""The robust-aggregation and DP ops against their pure-PyTorch references (dtypes, odd and
empty shapes, non-contiguous inputs, NaN/Inf, K from 1 up), opcheck, torch.compile, the noise
stream, and the CUDA kernels against the CPU ones where a GPU is visible."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, FLOAT_DTYPES, cpu_builds, run_in_cpu_build

from fedkernels.ops import private as private_ops
from fedkernels.ops import reference as ref
from fedkernels.ops import robust as robust_ops
from fedkernels.ops.sgld import sgld_step

SHAPES = [(5, 3), (7,), (), (0,), (2, 1, 9)]


def clients_of(K, dtype=torch.float32, device="cpu", seed=0, shapes=SHAPES, ties=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(K):
        for s in shapes:
            if ties:
                t = torch.randint(-2, 3, s, generator=g).to(torch.float64)
            else:
                t = torch.randn(s, generator=g, dtype=torch.float64)
            out.append(t.to(dtype).to(device))
    return out


def exact(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.isnan(), b.isnan()), (a, b)
    assert torch.equal(a.nan_to_num(0.25), b.nan_to_num(0.25)), (a, b)


RULES = [
    ("median", lambda c, K: robust_ops.coordinate_median(c, K),
     lambda c, K: ref.coordinate_median_reference(c, K)),
    ("trimmed", lambda c, K: robust_ops.trimmed_mean(c, K, (K - 1) // 3),
     lambda c, K: ref.trimmed_mean_reference(c, K, (K - 1) // 3)),
    ("window", lambda c, K: robust_ops.median_window_mean(c, K, max(1, K - 2)),
     lambda c, K: ref.median_window_mean_reference(c, K, max(1, K - 2))),
]


@pytest.mark.parametrize("name,op,reference", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("K", [1, 2, 3, 4, 7, 10, 33])
def test_order_statistics_equal_reference(name, op, reference, dtype, K):
    # same ascending-order sums in the same accumulate type: bitwise equal
    for ties in (False, True):
        c = clients_of(K, dtype, seed=K, ties=ties)
        for a, b in zip(op(c, K), reference(c, K)):
            exact(a, b)


@pytest.mark.parametrize("name,op,reference", RULES, ids=[r[0] for r in RULES])
def test_order_statistics_nan_inf_and_strided(name, op, reference):
    K = 6
    c = clients_of(K, torch.float32, seed=1)
    T = len(SHAPES)
    c[0 * T][0, 0] = float("nan")
    c[1 * T][1, 1] = float("inf")
    c[2 * T][1, 1] = float("-inf")
    c[3 * T][2, 2] = float("inf")
    c[4 * T][2, 2] = float("inf")
    c[5 * T + 1][3] = float("nan")
    c[4 * T + 1][3] = float("nan")
    strided = [t.t() if t.dim() == 2 else t for t in c]  # non-contiguous views
    for a, b in zip(op(strided, K), reference(strided, K)):
        exact(a, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("K", [1, 2, 3, 5, 8, 17, 24])
def test_median_window_of_every_width_with_ties_infinities_and_overflow(dtype, K):
    # The CPU kernel finds the window of whole vectors of coordinates at once by counting the
    # starts it moves past, and takes the scalar growth where a value or the median is
    # infinite: long rows (both paths, every window width), exact ties, huge values whose
    # median overflows, and infinities must all give the reference's bits.
    g = torch.Generator().manual_seed(K)
    n = 1000
    values = torch.randint(-3, 4, (K, n), generator=g).to(torch.float64)  # exact ties
    values[:, : n // 2] = torch.randn(K, n // 2, generator=g, dtype=torch.float64)
    huge = torch.finfo(dtype).max
    signs = torch.randint(0, 2, (K, 40), generator=g).to(torch.float64) * 2 - 1
    values[:, 600:640] = signs * huge
    values[0, 700:705] = float("inf")
    values[K // 2, 706:711] = float("-inf")
    values = values.to(dtype)
    clients = list(values.unbind(0))
    for window in range(1, K + 1):
        got = robust_ops.median_window_mean(clients, K, window)[0]
        exact(got, ref.median_window_mean_reference(clients, K, window)[0])


def test_out_variants_and_errors():
    K = 5
    c = clients_of(K, torch.float64, seed=3)
    out = [torch.empty(s, dtype=torch.float64) for s in SHAPES]
    got = robust_ops.trimmed_mean(c, K, 1, out=out)
    assert all(g is o for g, o in zip(got, out))
    for a, b in zip(out, ref.trimmed_mean_reference(c, K, 1)):
        exact(a, b)
    strided_out = [torch.empty(3, 5, dtype=torch.float64).t()] + out[1:]
    robust_ops.coordinate_median(c, K, out=strided_out)
    exact(strided_out[0], ref.coordinate_median_reference(c, K)[0])
    with pytest.raises(ValueError, match="out tensor 0 overlaps client 2, tensor 0"):
        robust_ops.coordinate_median(c, K, out=[c[2 * len(SHAPES)]] + out[1:])
    with pytest.raises(ValueError, match=r"cut must be in \[0, K/2\)"):
        robust_ops.trimmed_mean(c, K, 3)
    with pytest.raises(ValueError, match=r"window must be in \[1, K\]"):
        robust_ops.median_window_mean(c, K, 0)
    bad = list(c)
    bad[len(SHAPES) + 1] = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"client 1, tensor 1 has shape \[8\], client 0 has \[7\]"):
        robust_ops.coordinate_median(bad, K)
    with pytest.raises(ValueError, match="expected K \\* T tensors"):
        robust_ops.coordinate_median(c[:-1], K)


def test_trimmed_mean_cut_whose_double_wraps_int64_is_refused():
    # 2 * cut in int64 wraps to a negative number for a cut of 2^62 (or 2^63 - 1): a check
    # written that way passed, and the kernel averaged values read far outside the K clients
    # (garbage, no error). The native op, the wrapper and the traced (fake) op all refuse it.
    K = 3
    c = clients_of(K, torch.float32, seed=4)
    for cut in (2**62, 2**62 + 1, 2**63 - 1):
        with pytest.raises(ValueError, match=r"cut must be in \[0, K/2\)"):
            torch.ops.fedkernels.trimmed_mean(c, K, cut)
        with pytest.raises(ValueError, match=r"cut must be in \[0, K/2\)"):
            robust_ops.trimmed_mean(c, K, cut)
        with pytest.raises(ValueError, match=r"cut must be in \[0, K/2\)"):
            robust_ops.trimmed_mean(c, K, cut, out=[torch.empty_like(t) for t in c[:len(SHAPES)]])
    traced = torch.compile(lambda *xs: torch.ops.fedkernels.trimmed_mean(list(xs), K, 2**62),
                           backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"cut must be in \[0, K/2\)"):
        traced(*c)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("K", [1, 2, 5, 12])
def test_pairwise_distances_equal_reference(dtype, K):
    c = clients_of(K, dtype, seed=K, shapes=[(300, 7), (5,), (), (70001,)])
    d = robust_ops.pairwise_sq_distances(c, K)
    assert d.dtype == torch.float64 and d.shape == (K, K)
    torch.testing.assert_close(d, ref.pairwise_sq_distances_reference(c, K), rtol=1e-13, atol=0)
    assert torch.equal(d, d.T) and torch.all(d.diagonal() == 0)
    assert torch.equal(d, robust_ops.pairwise_sq_distances(c, K))  # run to run


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_update_norms_equal_reference(dtype):
    K = 4
    shapes = [(300, 7), (5,), (), (70001,)]
    c = clients_of(K, dtype, seed=2, shapes=shapes)
    base = clients_of(1, dtype, seed=9, shapes=shapes)
    n = private_ops.update_norms(c, K, base)
    torch.testing.assert_close(n, ref.update_norms_reference(c, K, base), rtol=1e-13, atol=0)


_BUILD_BITS = """
import hashlib, sys, torch
from fedkernels.ops import native, private as P
sys.path.insert(0, sys.argv[1])
from test_robust_ops import clients_of
shapes = [(300, 7), (5,), (), (70001,), (3, 2048 * 9 + 5)]
h = hashlib.sha256()
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    c, base = clients_of(7, dtype, seed=3, shapes=shapes), clients_of(1, dtype, seed=4, shapes=shapes)
    h.update(P.update_norms(c, 7, base).numpy().tobytes())
    coef = torch.linspace(0.05, 0.4, 7, dtype=torch.float64)
    for t in P.private_sum(c, coef, base, 0.3, torch.Generator().manual_seed(5)):
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
print(native.cpu_capability, h.hexdigest())
"""


@pytest.mark.slow
def test_norms_and_private_sum_are_the_same_bits_in_every_cpu_build():
    # Fixed summation orders (sixteen interleaved float64 sums per norm, clients in order per
    # element) and the same noise on every path: a release does not depend on the CPU.
    import os
    import subprocess
    import sys
    from pathlib import Path

    digests = {}
    for cap in cpu_builds():
        env = dict(os.environ, FEDKERNELS_CPU_CAPABILITY=cap, OMP_NUM_THREADS="2")
        proc = subprocess.run([sys.executable, "-c", _BUILD_BITS, str(Path(__file__).parent)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got_cap, digest = proc.stdout.split()
        assert got_cap == cap
        digests[cap] = digest
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("K", [1, 3, 8])
def test_private_sum_without_noise_equals_reference(dtype, K):
    c = clients_of(K, dtype, seed=K)
    base = clients_of(1, dtype, seed=99)
    coef = torch.linspace(0.05, 0.4, K, dtype=torch.float64)
    got = private_ops.private_sum(c, coef, base, 0.0)
    tol = {torch.float64: 1e-14, torch.float32: 1e-6}.get(dtype, 1e-2)
    for a, b in zip(got, ref.private_sum_reference(c, coef, base, 0.0)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # in place into base, and into a strided out
    out = [torch.empty_like(b) for b in base]
    private_ops.private_sum(c, coef, base, 0.0, out=out)
    inplace = [b.clone() for b in base]
    private_ops.private_sum_(inplace, c, coef, 0.0)
    for a, b, g in zip(out, inplace, got):
        assert torch.equal(a, g) and torch.equal(b, g)


def test_private_sum_noise_is_the_sgld_stream():
    # element e of the whole list gets normal e of sgld_step's stream for the same generator
    shapes = [(3, 5), (7,), (), (0,), (1001,)]
    c = clients_of(2, torch.float32, seed=4, shapes=shapes)
    base = clients_of(1, torch.float32, seed=5, shapes=shapes)
    coef = torch.tensor([0.5, 0.5], dtype=torch.float64)
    sigma = 0.7
    noisy = private_ops.private_sum(c, coef, base, sigma, torch.Generator().manual_seed(11))
    clean = private_ops.private_sum(c, coef, base, 0.0)
    total = sum(b.numel() for b in base)
    stream = sgld_step(torch.zeros(total), torch.zeros(total), step_size=0.0, noise_std=sigma,
                       generator=torch.Generator().manual_seed(11))
    got = torch.cat([(n - k).reshape(-1) for n, k in zip(noisy, clean)])
    torch.testing.assert_close(got, stream, rtol=0, atol=2e-6)
    # a float64 model draws the same normals in float64
    c64 = [t.double() for t in c]
    b64 = [t.double() for t in base]
    n64 = private_ops.private_sum(c64, coef, b64, sigma, torch.Generator().manual_seed(11))
    k64 = private_ops.private_sum(c64, coef, b64, 0.0)
    got64 = torch.cat([(n - k).reshape(-1) for n, k in zip(n64, k64)])
    torch.testing.assert_close(got64.float(), stream, rtol=0, atol=2e-6)


def test_private_sum_errors_write_nothing():
    c = clients_of(3, torch.float32, seed=1)
    base = clients_of(1, torch.float32, seed=2)
    before = [b.clone() for b in base]
    with pytest.raises(ValueError, match="coefficient of client 1 is nan"):
        private_ops.private_sum_(base, c, torch.tensor([0.1, float("nan"), 0.2]), 0.0)
    with pytest.raises(ValueError, match="noise_std must be finite and >= 0"):
        private_ops.private_sum_(base, c, torch.tensor([0.1, 0.1, 0.2]), -1.0)
    with pytest.raises(ValueError, match="out tensor 0 overlaps client 0, tensor 0"):
        private_ops.private_sum(c, torch.tensor([0.1, 0.1, 0.2]), base, 0.0,
                                out=[c[0]] + [torch.empty_like(b) for b in base[1:]])
    for a, b in zip(base, before):
        assert torch.equal(a, b)


def test_opcheck():
    K = 4
    c = clients_of(K, torch.float32, seed=6, shapes=[(3, 4), (5,)])
    base = clients_of(1, torch.float32, seed=7, shapes=[(3, 4), (5,)])
    coef = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    ops = torch.ops.fedkernels
    cases = [
        (ops.coordinate_median.default, (c, K)),
        (ops.trimmed_mean.default, (c, K, 1)),
        (ops.median_window_mean.default, (c, K, 2)),
        (ops.pairwise_sq_distances.default, (c, K)),
        (ops.update_norms.default, (c, K, base)),
        (ops.private_sum.default, (c, coef, base, 0.0, None)),
        (ops.private_sum_.default, ([b.clone() for b in base], c, coef, 0.0, None)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_compile_fullgraph():
    K = 5
    c = clients_of(K, torch.float32, seed=8, shapes=[(6, 2), (3,)])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def rules(clients):
        med = robust_ops.coordinate_median(clients, K)
        trim = robust_ops.trimmed_mean(clients, K, 1)
        d = robust_ops.pairwise_sq_distances(clients, K)
        return med, trim, d

    med, trim, d = rules(c)
    for a, b in zip(med, ref.coordinate_median_reference(c, K)):
        exact(a, b)
    for a, b in zip(trim, ref.trimmed_mean_reference(c, K, 1)):
        exact(a, b)
    torch.testing.assert_close(d, ref.pairwise_sq_distances_reference(c, K), rtol=1e-13, atol=0)


def test_compile_keeps_the_strides_of_transposed_and_channels_last_clients():
    # The fake implementations give the kernels' strides (at::empty_like of each client
    # tensor), so a compiled graph that views the result as eager code would is accepted.
    K = 3
    g = torch.Generator().manual_seed(9)
    transposed = [torch.randn(3, 4, generator=g).t() for _ in range(K)]
    channels_last = [torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)
                     for _ in range(K)]
    coef = torch.full((K,), 1.0 / K, dtype=torch.float64)
    for clients in (transposed, channels_last):
        base = [torch.zeros_like(clients[0])]

        def rules(*c, base=base):
            return (robust_ops.coordinate_median(list(c), K)[0] + 1,
                    robust_ops.trimmed_mean(list(c), K, 1)[0] * 3,
                    robust_ops.median_window_mean(list(c), K, 2)[0] * 2,
                    private_ops.private_sum(list(c), coef, base, 0.0)[0] - 1)

        eager = rules(*clients)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            # Compiled afresh: a cached graph would not run the fakes at all.
            with torch._inductor.config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                compiled = torch.compile(rules, fullgraph=True, backend=backend)(*clients)
            for a, b in zip(compiled, eager):
                exact(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_devices_agree_with_reference(device, dtype):
    K = 9
    shapes = [(33, 65), (7,), (), (4097,)]
    c = clients_of(K, dtype, device=device, seed=12, shapes=shapes)
    base = clients_of(1, dtype, device=device, seed=13, shapes=shapes)
    for _, op, reference in RULES:
        for a, b in zip(op(c, K), reference(c, K)):
            exact(a, b)
    torch.testing.assert_close(robust_ops.pairwise_sq_distances(c, K),
                               ref.pairwise_sq_distances_reference(c, K), rtol=1e-13, atol=0)
    torch.testing.assert_close(private_ops.update_norms(c, K, base),
                               ref.update_norms_reference(c, K, base), rtol=1e-13, atol=0)
    coef = torch.linspace(0.1, 0.3, K, dtype=torch.float64)
    tol = {torch.float64: 1e-14, torch.float32: 1e-6}.get(dtype, 1e-2)
    for a, b in zip(private_ops.private_sum(c, coef, base, 0.0),
                    ref.private_sum_reference(c, coef, base, 0.0)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_cuda_noise_matches_sgld_stream_on_cuda():
    shapes = [(3, 5), (1001,)]
    c = clients_of(2, torch.float32, device="cuda", seed=4, shapes=shapes)
    base = clients_of(1, torch.float32, device="cuda", seed=5, shapes=shapes)
    coef = torch.tensor([0.5, 0.5], dtype=torch.float64)
    g1 = torch.Generator(device="cuda").manual_seed(3)
    g2 = torch.Generator(device="cuda").manual_seed(3)
    noisy = private_ops.private_sum(c, coef, base, 0.5, g1)
    clean = private_ops.private_sum(c, coef, base, 0.0)
    total = sum(b.numel() for b in base)
    z = torch.zeros(total, device="cuda")
    stream = sgld_step(z, z, step_size=0.0, noise_std=0.5, generator=g2)
    got = torch.cat([(n - k).reshape(-1) for n, k in zip(noisy, clean)])
    torch.testing.assert_close(got, stream, rtol=0, atol=2e-6)


_NAN_COUNTS = """
import sys, torch
from fedkernels.ops import reference as ref, robust as robust_ops

def exact(a, b):
    assert torch.equal(a.isnan(), b.isnan()), (a, b)
    assert torch.equal(a.nan_to_num(0.25), b.nan_to_num(0.25)), (a, b)

for dtype in (torch.float32, torch.float64, torch.bfloat16):
    for K in (3, 5, 10, 33):
        cut = (K - 1) // 3
        P = 3 * 64 + 5  # several vector groups of every build, and a scalar tail
        g = torch.Generator().manual_seed(K)
        x = torch.randint(-3, 4, (K, P), generator=g).double()
        x[:, ::3] = torch.randn(K, (P + 2) // 3, generator=g, dtype=torch.float64)
        x[1, ::11] = float("inf")
        # each coordinate gets 0, 1, cut, cut + 1 or K NaNs, in clients drawn at random
        choices = torch.tensor([0, 1, cut, cut + 1, K])
        counts = choices[torch.randint(0, 5, (P,), generator=g)]
        for e in range(P):
            x[torch.randperm(K, generator=g)[: int(counts[e])], e] = float("nan")
        x[0, :40] = float("nan")  # one client sending NaN for a stretch
        x[2, 40:120] = float("inf")  # and one sending +inf, next to one sending -inf
        x[K - 1, 60:100] = float("-inf")
        clients = [x[k].to(dtype) for k in range(K)]
        for op, reference in (
            (lambda c: robust_ops.coordinate_median(c, K),
             lambda c: ref.coordinate_median_reference(c, K)),
            (lambda c: robust_ops.trimmed_mean(c, K, cut),
             lambda c: ref.trimmed_mean_reference(c, K, cut)),
            (lambda c: robust_ops.median_window_mean(c, K, max(1, K - 2)),
             lambda c: ref.median_window_mean_reference(c, K, max(1, K - 2))),
        ):
            for a, b in zip(op(clients), reference(clients)):
                exact(a, b)
from fedkernels.ops import native
print("OK", native.cpu_capability)
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_nan_counts_and_infinite_clients_in_every_cpu_build(capability):
    # A vector group with a NaN goes through the sorting network with stand-ins for its NaNs,
    # and the window rule keeps its vector path around infinite values (csrc/cpu/robust.cpp):
    # coordinates with 0, 1, cut, cut + 1 and K NaNs, clients sending NaN, +inf and -inf, in
    # every build, against the reference's NaN-last rule.
    run_in_cpu_build(_NAN_COUNTS, capability)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 2, 3, 5, 6, 8, 9, 11, 16, 17, 31, 32, 33, 50, 64, 65, 100, 128])
def test_order_statistics_every_network_size(device, dtype, K):
    # Each K has its own sorting network (CPU: Batcher's for K, pruned from the next power of
    # two; CUDA: padded to 8, 16, 32, 64 or 128 values): every size, each side of a boundary,
    # with ties, signed zeros, infinities and NaN, against the reference.
    shapes = [(1030,), (3, 7), ()]
    g = torch.Generator().manual_seed(K)
    c = []
    for _ in range(K):
        for s in shapes:
            t = torch.randint(-3, 4, s, generator=g).to(torch.float64)
            special = torch.randint(0, 40, s, generator=g)
            t = torch.where(special == 0, torch.tensor(-0.0, dtype=torch.float64), t)
            t = torch.where(special == 1, torch.tensor(float("inf"), dtype=torch.float64), t)
            t = torch.where(special == 2, torch.tensor(float("-inf"), dtype=torch.float64), t)
            t = torch.where(special == 3, torch.tensor(float("nan"), dtype=torch.float64), t)
            t = torch.where(special >= 30, torch.randn(s, generator=g, dtype=torch.float64), t)
            c.append(t.to(dtype))
    on_device = [t.to(device) for t in c]
    for _, op, reference in RULES:
        for a, b in zip(op(on_device, K), reference(c, K)):
            exact(a.cpu(), b)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 23, 24, 25, 50, 64, 87, 100, 128])
def test_cuda_pairwise_distances_few_and_many_pairs(dtype, K):
    # Up to 23 clients (253 pairs) a thread takes one pair; from 24 a thread takes a 4 x 4
    # block of pairs (with several lanes per block, or several rounds per chunk above 88).
    c = clients_of(K, dtype, device="cuda", seed=K, shapes=[(300, 7), (5,), (), (20001,)])
    d = robust_ops.pairwise_sq_distances(c, K)
    assert d.dtype == torch.float64 and d.shape == (K, K)
    want = ref.pairwise_sq_distances_reference([t.cpu() for t in c], K)
    torch.testing.assert_close(d.cpu(), want, rtol=1e-13, atol=0)
    assert torch.equal(d, d.T) and torch.all(d.diagonal() == 0)
    assert torch.equal(d, robust_ops.pairwise_sq_distances(c, K))  # run to run
