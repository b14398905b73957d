"""The quantized-update ops against their pure-PyTorch references: int8 and packed 4-bit
per-block quantization and fp8 e4m3 with a per-tensor scale (round to nearest and stochastic,
with and without error feedback) bit for bit over dtypes, block sizes and odd shapes; zero
blocks and NaN/inf blocks; the unbiasedness of stochastic rounding (fixed seeds, bounds far from
what the seeds give); the server's fused dequantize and weighted sum; thread-count
independence; bad inputs; opcheck and torch.compile; the CPU builds; the CUDA kernels against
the CPU ones where a GPU is visible."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FLOAT_DTYPES, cpu_builds, run_in_cpu_build

import fedkernels
from fedkernels.ops import quantize as qops
from fedkernels.ops import reference as ref

SHAPES = [(5, 7), (129,), (), (0,), (2, 3, 41), (300,)]
BLOCKS = [1, 7, 32, 256]
OPS = torch.ops.fedkernels


def tensors(dtype=torch.float32, seed=0, shapes=SHAPES, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype).to(device)
            for s in shapes]


def exact(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a.isnan(), b.isnan()), (a, b)
    assert torch.equal(a.nan_to_num(0.25), b.nan_to_num(0.25)), (a, b)


def assert_quantized_equal(got: qops.QuantizedTensors, want):
    values, scales, residual = want
    for a, b in zip(got.values, values):
        exact(a, b)
    for a, b in zip(got.scales, scales):
        exact(a, b)
    if residual is None:
        assert got.residual is None
    else:
        for a, b in zip(got.residual, residual):
            exact(a, b)


# ---------------------------------------------------------------- quantize_int8


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_quantize_equals_reference(dtype, block, stochastic, feedback):
    x = tensors(dtype, seed=block)
    res = tensors(dtype, seed=99, scale=0.01) if feedback else None
    got = fedkernels.quantize_int8(x, block, stochastic=stochastic, seed=12345, offset=3,
                                   residual=res)
    assert_quantized_equal(got, ref.quantize_int8_reference(x, block, stochastic, 12345, 3, res))
    assert all(v.dtype == torch.int8 and v.shape == t.shape for v, t in zip(got.values, x))
    assert [s.numel() for s in got.scales] == [math.ceil(t.numel() / block) for t in x]


def test_quantize_large_seed_offset_and_strided_input():
    x = torch.randn(40, 33).t()  # not contiguous
    seed, offset = 2**64 - 5, 2**40 + 7
    got = fedkernels.quantize_int8(x, 16, stochastic=True, seed=seed, offset=offset)
    assert_quantized_equal(got, ref.quantize_int8_reference([x], 16, True, seed, offset))


def test_ties_round_to_even_and_levels_stay_symmetric():
    # s = 127 / 127 = 1: v / s are the values themselves
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -127.0, 126.5])
    q = fedkernels.quantize_int8(x, 8).values[0]
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -127, 126]


def test_zero_blocks_have_zero_scales_and_keep_the_residual():
    x = torch.randn(100)
    x[32:64] = 0.0
    x[64:70] = -0.0
    res = torch.zeros(100)
    for stochastic in (False, True):
        got = fedkernels.quantize_int8(x, 32, stochastic=stochastic, seed=1, residual=[res])
        assert got.scales[0][1].item() == 0.0
        assert torch.all(got.values[0][32:64] == 0)
        assert torch.equal(got.residual[0][32:64], x[32:64])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_block_dequantizes_to_nan_and_spares_the_others(bad):
    x = torch.randn(96)
    x[40] = bad
    got = fedkernels.quantize_int8(x, 32, residual=[torch.zeros(96)])
    s = got.scales[0]
    assert math.isnan(s[1].item()) and math.isfinite(s[0].item()) and math.isfinite(s[2].item())
    assert torch.all(got.values[0][32:64] == 0)
    deq = got.dequantize()[0]
    assert torch.all(deq[32:64].isnan()) and not deq[:32].isnan().any() and not deq[64:].isnan().any()
    assert torch.all(got.residual[0][32:64].isnan())
    # the server's sum is NaN there too, as an fp32 sum of that client would be
    clean = fedkernels.quantize_int8(torch.randn(96), 32)
    total = fedkernels.aggregate_quantized([clean, got], [0.5, 0.5])[0]
    assert torch.all(total[32:64].isnan()) and not total[:32].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_error_bounds(dtype):
    x = tensors(dtype, seed=5, shapes=[(1000,), (77,)])
    for stochastic, bound in ((False, 0.5), (True, 1.0)):
        q = fedkernels.quantize_int8(x, 64, stochastic=stochastic, seed=9)
        for t, s in enumerate(q.scales):
            se = s.to(dtype).repeat_interleave(64)[: x[t].numel()]
            err = (x[t] - q.dequantize(dtype)[t]).abs()
            # |x - q s| <= s / 2 (nearest) or < s (stochastic), up to the rounding of v / s
            assert torch.all(err <= bound * se * (1 + 1e-5)), (stochastic, (err / se).max())


def test_stochastic_rounding_is_unbiased():
    """Each block holds its maximum 1.0 (so s = 1/127) and N copies of one value v; the mean
    of the dequantized copies is within 6 standard deviations of v. The seed is fixed, so the
    test cannot flake; 6 sigma would hold for all but ~1e-9 of seeds."""
    B, per_value = 128, 64 * 127
    values = [0.3, -0.7071, 0.5 / 127, 0.999, -0.0123]
    blocks = []
    for v in values:
        blk = torch.full((per_value // 127, B), v)
        blk[:, 0] = 1.0
        blocks.append(blk.reshape(-1))
    x = torch.cat(blocks)
    q = fedkernels.quantize_int8(x, B, stochastic=True, seed=20260101, offset=0)
    deq = q.dequantize()[0]
    s = 1.0 / 127
    start = 0
    for v, blk in zip(values, blocks):
        part = deq[start:start + blk.numel()].reshape(-1, B)[:, 1:].double()
        start += blk.numel()
        n = part.numel()
        frac = v / s - math.floor(v / s)
        sigma = s * math.sqrt(frac * (1 - frac)) / math.sqrt(n)
        assert abs(part.mean().item() - v) <= 6 * sigma + 1e-7, (v, part.mean().item(), sigma)
        # each value is one of the two neighbouring levels
        assert set(torch.unique(torch.round(part / s)).tolist()) <= {math.floor(v / s),
                                                                     math.floor(v / s) + 1}
    # rounding to nearest is biased for the same input (0.3 * 127 = 38.1 -> 38)
    near = fedkernels.quantize_int8(x, B).dequantize()[0][1:B]
    assert abs(near.double().mean().item() - 0.3) > 0.05 * s


def test_stochastic_stream_depends_on_seed_and_offset_only():
    x = tensors(torch.float32, seed=3)
    a = fedkernels.quantize_int8(x, 32, stochastic=True, seed=7, offset=1)
    b = fedkernels.quantize_int8(x, 32, stochastic=True, seed=7, offset=1)
    c = fedkernels.quantize_int8(x, 32, stochastic=True, seed=7, offset=2)
    d = fedkernels.quantize_int8(x, 32, stochastic=True, seed=8, offset=1)
    assert all(torch.equal(u, v) for u, v in zip(a.values, b.values))
    assert not all(torch.equal(u, v) for u, v in zip(a.values, c.values))
    assert not all(torch.equal(u, v) for u, v in zip(a.values, d.values))
    # seed=None draws one 64-bit seed from the generator: a seeded generator reproduces a call
    e = fedkernels.quantize_int8(x, 32, stochastic=True, generator=torch.Generator().manual_seed(4))
    f = fedkernels.quantize_int8(x, 32, stochastic=True, generator=torch.Generator().manual_seed(4))
    assert all(torch.equal(u, v) for u, v in zip(e.values, f.values))


def test_error_feedback_telescopes():
    """Over R rounds of the same x with error feedback, the dequantized sum is R x minus the
    last residual: what rounding drops in one round is sent in the next."""
    x = tensors(torch.float64, seed=11, shapes=[(1000,)])
    res = [torch.zeros_like(x[0])]
    total = torch.zeros_like(x[0])
    R = 20
    for r in range(R):
        q = fedkernels.quantize_int8(x, 64, residual=res, stochastic=r % 2 == 1, seed=5, offset=r)
        # q s in float64 (dequantize() sums in float32)
        total += q.values[0].double() * q.scales[0].double().repeat_interleave(64)[:1000]
        res = q.residual
    torch.testing.assert_close(total, R * x[0] - res[0], rtol=0, atol=1e-12)
    s = q.scales[0].double().repeat_interleave(64)[:1000]
    assert torch.all(res[0].abs() <= s * (1 + 1e-6))  # the residual stays within one level


def test_results_do_not_depend_on_threads():
    x = tensors(torch.float32, seed=2, shapes=[(1 << 20,), (3001,)])
    res = tensors(torch.float32, seed=3, shapes=[(1 << 20,), (3001,)], scale=0.01)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q = fedkernels.quantize_int8(x, 100, stochastic=True, seed=1, residual=res)
            s = fedkernels.aggregate_quantized([q, q, q], [0.2, 0.3, 0.5])
            outs.append((q, s))
    finally:
        torch.set_num_threads(before)
    (q1, s1), (q2, s2) = outs
    for a, b in zip(q1.values + q1.scales + q1.residual + s1, q2.values + q2.scales + q2.residual + s2):
        exact(a, b)


# ---------------------------------------------------------------- dequantize_weighted_sum


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", BLOCKS + [2000])
@pytest.mark.parametrize("K", [1, 3, 10])
def test_dequantize_weighted_sum_equals_reference(out_dtype, block, K):
    clients = [fedkernels.quantize_int8(tensors(seed=k), block) for k in range(K)]
    w = torch.linspace(-0.5, 1.5, K, dtype=torch.float64)
    got = fedkernels.aggregate_quantized(clients, w, dtype=out_dtype)
    values = [v for c in clients for v in c.values]
    scales = [s for c in clients for s in c.scales]
    want = ref.dequantize_weighted_sum_reference(values, scales, w, block, out_dtype)
    for a, b in zip(got, want):
        exact(a, b)
    # and close to the float sum of the dequantized clients
    deq = [c.dequantize(torch.float64) for c in clients]
    for t, a in enumerate(got):
        f = sum(w[k].item() * deq[k][t] for k in range(K))
        torch.testing.assert_close(a.double(), f, rtol=1e-2 if out_dtype in (
            torch.float16, torch.bfloat16) else 1e-5, atol=1e-5)


def test_aggregate_quantized_normalize_and_empty_tensors():
    clients = [fedkernels.quantize_int8(tensors(seed=k, shapes=[(0,), (9,)]), 4) for k in range(2)]
    got = fedkernels.aggregate_quantized(clients, [1, 3], normalize=True)
    assert got[0].shape == (0,)
    want = 0.25 * clients[0].dequantize()[1] + 0.75 * clients[1].dequantize()[1]
    torch.testing.assert_close(got[1], want)
    assert fedkernels.aggregate_quantized([fedkernels.quantize_int8([], 4)], [1.0]) == []


def test_quantized_round_tracks_the_float_round():
    """Quantize-and-aggregate is close to aggregating the floats: error <= sum |w_k| s_k / 2."""
    K = 5
    models = [tensors(seed=10 + k, shapes=[(4096,)]) for k in range(K)]
    w = torch.full((K,), 1.0 / K, dtype=torch.float64)
    q = [fedkernels.quantize_int8(m, 128) for m in models]
    got = fedkernels.aggregate_quantized(q, w)[0]
    exact_sum = fedkernels.aggregate([m[0] for m in models], w)
    bound = sum(c.scales[0].repeat_interleave(128) / (2 * K) for c in q)
    assert torch.all((got - exact_sum).abs() <= bound * (1 + 1e-4) + 1e-7)


def test_out_writes_the_functional_result_and_refuses_bad_buffers():
    clients = [fedkernels.quantize_int8(tensors(seed=k, shapes=[(5, 7), (300,)]), 32)
               for k in range(3)]
    w = [0.2, 0.3, 0.5]
    want = fedkernels.aggregate_quantized(clients, w, dtype=torch.bfloat16)
    out = [torch.full((7, 5), float("nan"), dtype=torch.bfloat16).t(),  # strided
           torch.full((300,), float("nan"), dtype=torch.bfloat16)]
    got = fedkernels.aggregate_quantized(clients, w, dtype=torch.bfloat16, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for a, b in zip(out, want):
        exact(a, b)
    values = [v for c in clients for v in c.values]
    scales = [s for c in clients for s in c.scales]
    wt = torch.tensor(w, dtype=torch.float64)
    f32 = [torch.empty(5, 7), torch.empty(300)]
    _err(TypeError, lambda: qops.dequantize_weighted_sum(values, scales, wt, 32, torch.bfloat16,
                                                         out=f32), "out tensor 0", "dtype")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(values, scales, wt, 32, out=f32[:1]),
         "out has 1 tensors")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(
        values, scales, wt, 32, out=[torch.empty(35), torch.empty(300)]), "out tensor 0", "shape")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(
        values, scales, wt, 32, out=[f32[0], torch.empty(1).expand(300)]), "out tensor 1")
    big = torch.empty(400)
    _err(ValueError, lambda: qops.dequantize_weighted_sum(
        values, scales, wt, 32, out=[big[:35].view(5, 7), big[30:330]]), "overlaps")


# ---------------------------------------------------------------- bad inputs: one-line errors


def _err(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg
    for w in words:
        assert w in msg, (w, msg)


def test_bad_inputs_are_one_line_errors():
    x = [torch.randn(10), torch.randn(3, 4)]
    q = fedkernels.quantize_int8(x, 4)
    v, s = q.values, q.scales
    one = torch.ones(1, dtype=torch.float64)
    _err(ValueError, lambda: fedkernels.quantize_int8(x, 0), "block_size")
    _err(ValueError, lambda: fedkernels.quantize_int8(x, 2**25), "block_size")
    _err(TypeError, lambda: fedkernels.quantize_int8([torch.arange(4)], 4), "x tensor 0", "dtype")
    _err(ValueError, lambda: fedkernels.quantize_int8(x, 4, residual=[torch.zeros(10)]), "residual")
    _err(ValueError, lambda: fedkernels.quantize_int8(x, 4, residual=[torch.zeros(10), torch.zeros(12)]),
         "residual tensor 1", "shape")
    _err(TypeError, lambda: fedkernels.quantize_int8(
        x, 4, residual=[torch.zeros(10), torch.zeros(3, 4, dtype=torch.float64)]), "residual tensor 1")
    _err(ValueError, lambda: fedkernels.quantize_int8(x, 4, stochastic=True, seed=-(2**64)), "seed")
    _err(TypeError, lambda: qops.dequantize_weighted_sum([v[0].float()], [s[0]], one, 4),
         "values tensor 0", "int8")
    _err(TypeError, lambda: qops.dequantize_weighted_sum([v[0]], [s[0].double()], one, 4),
         "scales tensor 0", "float32")
    _err(ValueError, lambda: qops.dequantize_weighted_sum([v[0]], [s[0][:2]], one, 4),
         "scales tensor 0", "expected [3]")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(v, s, one, 8), "expected [2]")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(v, s[:1], one, 4), "scales tensors")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(v + v[:1], s + s[:1], torch.ones(2), 4),
         "K = 2")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(v, s, torch.tensor([float("nan")]), 4),
         "weight of client 0")
    _err(ValueError, lambda: qops.dequantize_weighted_sum(v, s, torch.ones(1, 1), 4), "weights")
    _err(TypeError, lambda: qops.dequantize_weighted_sum(v, s, one, 4, torch.int32), "dtype")
    q8 = fedkernels.quantize_int8(x, 8)
    _err(ValueError, lambda: fedkernels.aggregate_quantized([q, q8], [1, 1]), "block sizes")
    _err(ValueError, lambda: fedkernels.aggregate_quantized([q, q], [1.0]), "2 clients")
    _err(ValueError, lambda: fedkernels.aggregate_quantized([q, q], [1.0, -1.0], normalize=True),
         "normalize")
    _err(TypeError, lambda: fedkernels.aggregate_quantized([q], [True]), "bool")
    q_other = fedkernels.quantize_int8([torch.randn(10), torch.randn(12)], 4)
    _err(ValueError, lambda: fedkernels.aggregate_quantized([q, q_other], [1, 1]),
         "values tensor 3", "shape")


# ---------------------------------------------------------------- 4-bit and fp8

BLOCKS4 = [2, 8, 32, 256]


def bits(t):
    """fp8 tensors as their bytes (exact comparisons, -0 included); others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def exact8(a, b):
    """fp8 tensors compared through their bytes (exact, -0 included)."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape == b.shape, (a, b)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (a, b)


def assert_fp8_equal(got: qops.QuantizedTensors, want):
    values, scales, residual = want
    for a, b in zip(got.values, values):
        exact8(a, b)
    assert_quantized_equal(got._replace(values=[]), ([], scales, residual))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", BLOCKS4)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_int4_equals_reference(dtype, block, stochastic, feedback):
    x = tensors(dtype, seed=block + 1)
    res = tensors(dtype, seed=98, scale=0.01) if feedback else None
    got = fedkernels.quantize_int4(x, block, stochastic=stochastic, seed=12345, offset=3,
                                   residual=res)
    assert_quantized_equal(got, ref.quantize_int4_reference(x, block, stochastic, 12345, 3, res))
    assert got.format == "int4" and got.shapes == [t.shape for t in x]
    assert [v.shape for v in got.values] == [((t.numel() + 1) // 2,) for t in x]
    assert all(v.dtype == torch.uint8 for v in got.values)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_fp8_equals_reference(dtype, stochastic, feedback):
    x = tensors(dtype, seed=17)
    x[0][1, 2] = 0.0
    x[0][2, 3] = -1e-9  # rounds to -0
    x[0][3, 3] = -0.0
    res = tensors(dtype, seed=97, scale=0.01) if feedback else None
    got = fedkernels.quantize_fp8(x, stochastic=stochastic, seed=12345, offset=3, residual=res)
    assert_fp8_equal(got, ref.quantize_fp8_reference(x, stochastic, 12345, 3, res))
    assert got.format == "fp8" and got.block_size == 0
    assert [s.shape for s in got.scales] == [(1,)] * len(x)
    assert [v.shape for v in got.values] == [t.shape for t in x]


def test_int4_packing_order():
    # s = 7 / 7 = 1: the levels are the values; element 2j low nibble, 2j + 1 high, 0 padding
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.0, -2.0])
    q = fedkernels.quantize_int4(x, 8)
    assert q.scales[0].tolist() == [1.0]
    assert q.values[0].tolist() == [0x97, 0xF1, 0x30, 0x0E]
    assert q.dequantize()[0].tolist() == x.tolist()
    # ties to even and the symmetric range: -8 is never used
    y = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -2.5, -7.0, 6.5])
    assert ref.unpack_int4_reference(fedkernels.quantize_int4(y, 8).values[0], 8).tolist() == \
        [7, 0, 2, 2, 0, -2, -7, 6]


def test_fp8_nearest_is_torchs_own_cast():
    """For float32 input, rounding to nearest equals PyTorch's float8_e4m3fn cast of v / s
    (saturated): an independent check of the grid arithmetic."""
    g = torch.Generator().manual_seed(8)
    x = torch.cat([torch.randn(5000, generator=g) * 10.0 ** torch.randint(-6, 3, (5000,),
                                                                        generator=g),
                   torch.tensor([448.0, -0.0, 1e-30])])
    q = fedkernels.quantize_fp8(x)
    s = q.scales[0]
    assert s.item() == (x.abs().max() / 448).item()
    want = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    exact8(q.values[0], want)


def test_fp8_and_int4_servers_decode_every_byte():
    """All 256 bytes (subnormals, -0, NaN included), twice over so that the vector loops see
    them, summed with weight 1 and scale 1: each value as PyTorch decodes it."""
    b = torch.arange(256, dtype=torch.uint8).repeat(2)
    got = qops.dequantize_fp8_weighted_sum([b.view(torch.float8_e4m3fn)], [torch.ones(1)],
                                           torch.ones(1, dtype=torch.float64))[0]
    exact(got, b.view(torch.float8_e4m3fn).float())  # -0 sums to +0, as in the reference
    got4 = qops.dequantize_int4_weighted_sum([b], [torch.ones(4)], torch.ones(1, dtype=torch.float64),
                                             256, [1024])[0]
    exact(got4, ref.unpack_int4_reference(b, 1024).float())


def test_fp8_saturates_and_never_makes_nan_from_finite_input():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = torch.tensor([3e38, -3e38, 1.0, -1e-38, 0.0, 2e38], dtype=dtype)
        for stochastic in (False, True):
            q = fedkernels.quantize_fp8(x, stochastic=stochastic, seed=2, residual=[torch.zeros_like(x)])
            assert not q.values[0].float().isnan().any()
            assert q.values[0].float().abs().max().item() == 448.0
            assert torch.isfinite(q.residual[0]).all()
    # the top of the range from v / s landing a hair above 448 saturates (448 x (1 + 2^-23))
    q = fedkernels.quantize_fp8(torch.tensor([1.0, 1.0000001]))
    assert not q.values[0].float().isnan().any()


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_zero_empty_and_non_finite_int4_fp8(fmt):
    quantize = fedkernels.quantize_int4 if fmt == "int4" else \
        (lambda x, block, **kw: fedkernels.quantize_fp8(x, **kw))
    # all-zero tensor and an empty one: scale 0, values 0, the residual keeps v
    z = [torch.zeros(64), torch.zeros(0)]
    got = quantize(z, 32, stochastic=True, seed=1, residual=[torch.zeros(64), torch.zeros(0)])
    assert all(torch.all(s == 0) for s in got.scales)
    assert all(torch.all(d == 0) for d in got.dequantize())
    # a NaN/inf in a block (int4) or tensor (fp8): NaN there, the rest spared
    for bad in (float("nan"), float("inf")):
        x = [torch.randn(96), torch.randn(10)]
        x[0][40] = bad
        got = quantize(x, 32, residual=[torch.zeros(96), torch.zeros(10)])
        deq = got.dequantize()
        nan_part = slice(32, 64) if fmt == "int4" else slice(0, 96)
        assert torch.all(deq[0][nan_part].isnan()) and not deq[1].isnan().any()
        assert torch.all(got.residual[0][nan_part].isnan())
        if fmt == "int4":
            assert not deq[0][:32].isnan().any() and not deq[0][64:].isnan().any()
        else:
            assert torch.all(got.values[0].float() == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int4_and_fp8_error_bounds(dtype):
    x = tensors(dtype, seed=5, shapes=[(1000,), (77,)])
    for stochastic, bound in ((False, 0.5), (True, 1.0)):
        q = fedkernels.quantize_int4(x, 64, stochastic=stochastic, seed=9)
        deq = q.dequantize(dtype)
        for t, s in enumerate(q.scales):
            se = s.to(dtype).repeat_interleave(64)[: x[t].numel()]
            assert torch.all((x[t] - deq[t]).abs() <= bound * se * (1 + 1e-5))
        # fp8: half a grid step to nearest (|v| 2^-4 relative, s 2^-10 among the subnormals),
        # less than a step stochastic
        q = fedkernels.quantize_fp8(x, stochastic=stochastic, seed=9)
        deq = q.dequantize(dtype)
        for t, s in enumerate(q.scales):
            s = s.to(dtype)
            step_bound = torch.maximum(x[t].abs() * 2.0**-3, s * 2.0**-9)
            assert torch.all((x[t] - deq[t]).abs() <= bound * step_bound * (1 + 1e-5))


def test_int4_stochastic_rounding_is_unbiased():
    """As the int8 test: blocks holding their maximum 1.0 (s = 1/7) and N copies of one value."""
    B, per_value = 128, 64 * 127
    values = [0.3, -0.7071, 0.5 / 7, 0.999, -0.0123]
    blocks = []
    for v in values:
        blk = torch.full((per_value // 127, B), v)
        blk[:, 0] = 1.0
        blocks.append(blk.reshape(-1))
    x = torch.cat(blocks)
    deq = fedkernels.quantize_int4(x, B, stochastic=True, seed=20260102).dequantize()[0]
    s = 1.0 / 7
    start = 0
    for v, blk in zip(values, blocks):
        part = deq[start:start + blk.numel()].reshape(-1, B)[:, 1:].double()
        start += blk.numel()
        frac = v / s - math.floor(v / s)
        sigma = s * math.sqrt(frac * (1 - frac)) / math.sqrt(part.numel())
        assert abs(part.mean().item() - v) <= 6 * sigma + 1e-7, (v, part.mean().item(), sigma)
        assert set(torch.unique(torch.round(part / s)).tolist()) <= {math.floor(v / s),
                                                                     math.floor(v / s) + 1}


def test_fp8_stochastic_rounding_is_unbiased():
    """One tensor whose maximum is 448 (so s = 1 and v / s = v) and N copies of each value, on
    the e4m3 grid's normal and subnormal steps: the mean of the rounded copies is within 6
    standard deviations of v, each copy one of the two neighbouring grid values."""
    n = 8000
    values = [0.3, -100.7, 0.001, -3.3, 447.0, 0.0172]
    x = torch.cat([torch.tensor([448.0])] + [torch.full((n,), v) for v in values])
    q = fedkernels.quantize_fp8(x, stochastic=True, seed=20260103)
    assert q.scales[0].item() == 1.0
    got = q.values[0].double()[1:].reshape(len(values), n)
    for v, row in zip(values, got):
        step = 2.0**-9 if abs(v) < 2.0**-6 else 2.0 ** (math.floor(math.log2(abs(v))) - 3)
        lo = math.floor(abs(v) / step) * step
        frac = (abs(v) - lo) / step
        sigma = step * math.sqrt(frac * (1 - frac)) / math.sqrt(n)
        assert abs(row.mean().item() - v) <= 6 * sigma + 1e-9, (v, row.mean().item(), sigma)
        assert set(row.abs().unique().tolist()) <= {lo, lo + step}, (v, row.unique())


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_int4_fp8_error_feedback_telescopes(fmt):
    x = tensors(torch.float64, seed=11, shapes=[(1000,)])
    res = [torch.zeros_like(x[0])]
    total = torch.zeros_like(x[0])
    R = 20
    for r in range(R):
        kw = dict(residual=res, stochastic=r % 2 == 1, seed=5, offset=r)
        if fmt == "int4":
            q = fedkernels.quantize_int4(x, 64, **kw)
            levels = ref.unpack_int4_reference(q.values[0], 1000).double()
            total += levels * q.scales[0].double().repeat_interleave(64)[:1000]
        else:
            q = fedkernels.quantize_fp8(x, **kw)
            total += q.values[0].double() * q.scales[0].double()
        res = q.residual
    torch.testing.assert_close(total, R * x[0] - res[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("K", [1, 3, 10])
def test_int4_fp8_sums_equal_reference(fmt, out_dtype, K):
    block = 8 if K == 3 else 256
    if fmt == "int4":
        clients = [fedkernels.quantize_int4(tensors(seed=k), block) for k in range(K)]
    else:
        clients = [fedkernels.quantize_fp8(tensors(seed=k)) for k in range(K)]
    w = torch.linspace(-0.5, 1.5, K, dtype=torch.float64)
    got = fedkernels.aggregate_quantized(clients, w, dtype=out_dtype)
    values = [v for c in clients for v in c.values]
    scales = [s for c in clients for s in c.scales]
    numels = [math.prod(s) for s in SHAPES]
    want = ref.dequantize_weighted_sum_reference(values, scales, w, block, out_dtype, numels)
    for a, b, shape in zip(got, want, SHAPES):
        assert a.shape == shape
        exact(a, b.reshape(shape))
    deq = [c.dequantize(torch.float64) for c in clients]
    for t, a in enumerate(got):
        f = sum(w[k].item() * deq[k][t] for k in range(K))
        torch.testing.assert_close(a.double(), f, rtol=1e-2 if out_dtype in (
            torch.float16, torch.bfloat16) else 1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_int4_fp8_out_and_threads(fmt):
    quantize = (lambda x: fedkernels.quantize_int4(x, 100, stochastic=True, seed=1,
                                                   residual=[0.01 * t for t in x])) \
        if fmt == "int4" else (lambda x: fedkernels.quantize_fp8(
            x, stochastic=True, seed=1, residual=[0.01 * t for t in x]))
    x = tensors(torch.float32, seed=2, shapes=[(1 << 20,), (3001,)])
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q = quantize(x)
            outs.append((q, fedkernels.aggregate_quantized([q, q, q], [0.2, 0.3, 0.5])))
    finally:
        torch.set_num_threads(before)
    (q1, s1), (q2, s2) = outs
    for a, b in zip(q1.values + q1.scales + q1.residual + s1,
                    q2.values + q2.scales + q2.residual + s2):
        exact(bits(a), bits(b))
    # out=: strided and reshaped buffers get the functional result
    small = [quantize(tensors(seed=k, shapes=[(5, 7), (300,)])) for k in range(3)]
    want = fedkernels.aggregate_quantized(small, [0.2, 0.3, 0.5], dtype=torch.bfloat16)
    out = [torch.full((7, 5), float("nan"), dtype=torch.bfloat16).t(),
           torch.full((300,), float("nan"), dtype=torch.bfloat16)]
    got = fedkernels.aggregate_quantized(small, [0.2, 0.3, 0.5], dtype=torch.bfloat16, out=out)
    assert got[0] is out[0]
    for a, b in zip(out, want):
        exact(a, b)


def test_int4_fp8_bad_inputs_are_one_line_errors():
    x = [torch.randn(10), torch.randn(3, 4)]
    q4 = fedkernels.quantize_int4(x, 4)
    q8 = fedkernels.quantize_fp8(x)
    one = torch.ones(1, dtype=torch.float64)
    v4, s4, v8, s8 = q4.values, q4.scales, q8.values, q8.scales
    _err(ValueError, lambda: fedkernels.quantize_int4(x, 3), "block_size", "even")
    _err(ValueError, lambda: fedkernels.quantize_int4([], 5), "block_size", "even")
    _err(ValueError, lambda: fedkernels.quantize_int4(x, 0), "block_size")
    _err(TypeError, lambda: fedkernels.quantize_fp8([torch.arange(4)]), "quantize_fp8",
         "x tensor 0", "dtype")
    _err(ValueError, lambda: fedkernels.quantize_fp8(x, residual=[torch.zeros(10)]), "residual")
    _err(ValueError, lambda: fedkernels.quantize_fp8(x, stochastic=True, seed=2**64), "seed")
    _err(TypeError, lambda: qops.dequantize_int4_weighted_sum(
        [q4.values[0].to(torch.int8)], [s4[0]], one, 4, [10]), "values tensor 0", "uint8")
    _err(ValueError, lambda: qops.dequantize_int4_weighted_sum(v4, s4, one, 4, [10]), "numels")
    _err(ValueError, lambda: qops.dequantize_int4_weighted_sum(v4, s4, one, 4, [12, 12]),
         "values tensor 0", "expected [6]")
    _err(ValueError, lambda: qops.dequantize_int4_weighted_sum(v4, s4, one, 8, [10, 12]),
         "scales tensor 0", "expected [2]")
    _err(ValueError, lambda: qops.dequantize_int4_weighted_sum(v4, s4, one, 4, [10, 12],
                                                                out=[torch.empty(10),
                                                                     torch.empty(13)]),
         "out tensor 1", "12 elements")
    _err(TypeError, lambda: qops.dequantize_fp8_weighted_sum([v8[0].float()], [s8[0]], one),
         "values tensor 0", "float8_e4m3fn")
    _err(ValueError, lambda: qops.dequantize_fp8_weighted_sum(v8, [s8[0], torch.ones(2)], one),
         "scales tensor 1", "expected [1]")
    _err(ValueError, lambda: fedkernels.aggregate_quantized([q4, q8], [1, 1]), "formats differ")
    q_other = fedkernels.quantize_int4([torch.randn(10), torch.randn(12)], 4)
    _err(ValueError, lambda: fedkernels.aggregate_quantized([q4, q_other], [1, 1]),
         "tensor 1 of client 1")
    # nothing written before the checks pass
    out = [torch.full((10,), 7.0), torch.full((3, 4), 7.0)]
    _err(ValueError, lambda: qops.dequantize_fp8_weighted_sum(
        v8 + v8[:1], s8 + s8[:1], torch.ones(2, dtype=torch.float64), out=out), "K = 2")
    assert all(torch.all(o == 7.0) for o in out)


def test_int4_fp8_opcheck_and_compile():
    x = tensors(seed=1, shapes=[(5, 7), (33,)])
    res = tensors(seed=2, shapes=[(5, 7), (33,)], scale=0.1)
    q4 = fedkernels.quantize_int4(x, 8)
    q8 = fedkernels.quantize_fp8(x)
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    cases = [
        (OPS.quantize_int4.default, (x, [], 8, False, 0, 0)),
        (OPS.quantize_int4.default, (x, res, 8, True, 5, 1)),
        (OPS.quantize_fp8.default, (x, [], False, 0, 0)),
        (OPS.quantize_fp8.default, (x, res, True, 5, 1)),
        (OPS.dequantize_int4_weighted_sum.default,
         (q4.values * 2, q4.scales * 2, w, 8, [35, 33], torch.bfloat16)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    torch.library.opcheck(OPS.dequantize_int4_weighted_sum.out,
                          (q4.values * 2, q4.scales * 2, w, 8, [35, 33], torch.float32),
                          {"out": [torch.empty(5, 7), torch.empty(33)]})
    # opcheck's test_schema compares the inputs before and after with arithmetic PyTorch lacks
    # for float8 on the CPU: the other checks, and the inputs' bytes checked here
    fp8_args = (q8.values * 2, q8.scales * 2, w, torch.float32)
    before = [bits(v).clone() for v in fp8_args[0]]
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(OPS.dequantize_fp8_weighted_sum.default, fp8_args, test_utils=no_schema)
    torch.library.opcheck(OPS.dequantize_fp8_weighted_sum.out, fp8_args,
                          {"out": [torch.empty(5, 7), torch.empty(33)]}, test_utils=no_schema)
    assert all(torch.equal(bits(v), b) for v, b in zip(fp8_args[0], before))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def round_trip(x, res):
        a = qops.quantize_int4(x, 16, stochastic=True, seed=3, offset=0, residual=res)
        b = qops.quantize_fp8(x, stochastic=True, seed=3, offset=0, residual=res)
        return (qops.aggregate_quantized([a, a], w), qops.aggregate_quantized([b, b], w),
                a.residual, b.residual)

    res0 = [torch.zeros_like(t) for t in x]
    got = round_trip(x, res0)
    a = fedkernels.quantize_int4(x, 16, stochastic=True, seed=3, offset=0, residual=res0)
    b = fedkernels.quantize_fp8(x, stochastic=True, seed=3, offset=0, residual=res0)
    want = (fedkernels.aggregate_quantized([a, a], w), fedkernels.aggregate_quantized([b, b], w),
            a.residual, b.residual)
    for g_list, e_list in zip(got, want):
        for g, e in zip(g_list, e_list):
            exact(g, e)


# ---------------------------------------------------------------- opcheck, torch.compile


def test_opcheck():
    x = tensors(seed=1, shapes=[(5, 7), (33,)])
    res = tensors(seed=2, shapes=[(5, 7), (33,)], scale=0.1)
    q = fedkernels.quantize_int8(x, 8)
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    cases = [
        (OPS.quantize_int8.default, (x, [], 8, False, 0, 0)),
        (OPS.quantize_int8.default, (x, res, 8, True, 5, 1)),
        (OPS.dequantize_weighted_sum.default,
         (q.values + q.values, q.scales + q.scales, w, 8, torch.bfloat16)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    out = [torch.empty(5, 7), torch.empty(33)]
    torch.library.opcheck(OPS.dequantize_weighted_sum.out,
                          (q.values + q.values, q.scales + q.scales, w, 8, torch.float32),
                          {"out": out})


def test_compile_fullgraph():
    x = tensors(seed=4, shapes=[(6, 9), (31,)])
    res = [torch.zeros_like(t) for t in x]
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def round_trip(x, res):
        a = qops.quantize_int8(x, 16, stochastic=True, seed=3, offset=0, residual=res)
        b = qops.quantize_int8(x, 16)
        return qops.aggregate_quantized([a, b], w), a.residual

    got, new_res = round_trip(x, res)
    a = fedkernels.quantize_int8(x, 16, stochastic=True, seed=3, offset=0, residual=res)
    b = fedkernels.quantize_int8(x, 16)
    for g, e in zip(got, fedkernels.aggregate_quantized([a, b], w)):
        exact(g, e)
    for g, e in zip(new_res, a.residual):
        exact(g, e)


# ---------------------------------------------------------------- every CPU build

_BUILD_SCRIPT = """
import torch
import fedkernels
from fedkernels.ops import native
from fedkernels.ops import reference as ref
x = [(torch.randn(s, generator=torch.Generator().manual_seed(i), dtype=torch.float64) * 3).to(dt)
     for i, (s, dt) in enumerate([((1000,), torch.float32), ((77, 5), torch.bfloat16),
                                  ((33,), torch.float16), ((129,), torch.float64)])]
res = [torch.full_like(t, 0.01) for t in x]
for stochastic in (False, True):
    q = fedkernels.quantize_int8(x, 32, stochastic=stochastic, seed=77, offset=5, residual=res)
    v, s, r = ref.quantize_int8_reference(x, 32, stochastic, 77, 5, res)
    for a, b in zip(q.values + q.scales + q.residual, v + s + r):
        assert torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5)), (a, b)
    got = fedkernels.aggregate_quantized([q, q, q], [0.1, -0.2, 0.7])
    want = ref.dequantize_weighted_sum_reference(q.values * 3, q.scales * 3, [0.1, -0.2, 0.7], 32)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    numels = [t.numel() for t in x]
    for q, (v, s, r) in (
            (fedkernels.quantize_int4(x, 32, stochastic=stochastic, seed=77, offset=5, residual=res),
             ref.quantize_int4_reference(x, 32, stochastic, 77, 5, res)),
            (fedkernels.quantize_fp8(x, stochastic=stochastic, seed=77, offset=5, residual=res),
             ref.quantize_fp8_reference(x, stochastic, 77, 5, res))):
        bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        for a, b in zip(q.values + q.scales + q.residual, v + s + r):
            assert torch.equal(bits(a).nan_to_num(0.5), bits(b).nan_to_num(0.5)), (a, b)
        got = fedkernels.aggregate_quantized([q, q, q], [0.1, -0.2, 0.7])
        want = ref.dequantize_weighted_sum_reference(q.values * 3, q.scales * 3, [0.1, -0.2, 0.7],
                                                     32, numels=numels)
        for a, b in zip(got, want):
            assert torch.equal(a, b.reshape(a.shape))
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
    x = tensors(dtype, seed=6)
    x[1][40] = float("nan")  # block 1 of tensor 1 is NaN, block 3 all zero
    x[1][96:128] = 0.0
    res = tensors(dtype, seed=7, scale=0.01)
    res[1][96:128] = 0.0
    for stochastic in (False, True):
        cpu = fedkernels.quantize_int8(x, 32, stochastic=stochastic, seed=5, offset=2, residual=res)
        gpu = fedkernels.quantize_int8([t.cuda() for t in x], 32, stochastic=stochastic, seed=5,
                                       offset=2, residual=[t.cuda() for t in res])
        for a, b in zip(gpu.values + gpu.scales + gpu.residual, cpu.values + cpu.scales + cpu.residual):
            exact(a.cpu(), b)
        w = [0.3, 0.7]
        for a, b in zip(fedkernels.aggregate_quantized([gpu, gpu], w, dtype=dtype),
                        fedkernels.aggregate_quantized([cpu, cpu], w, dtype=dtype)):
            exact(a.cpu(), b)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_int4_fp8_equal_cpu(fmt, dtype):
    x = tensors(dtype, seed=6)
    x[1][40] = float("nan")  # int4: block 1 of tensor 1 is NaN; fp8: all of tensor 1
    x[1][96:128] = 0.0
    res = tensors(dtype, seed=7, scale=0.01)
    res[1][96:128] = 0.0
    for stochastic in (False, True):
        kw = dict(stochastic=stochastic, seed=5, offset=2)
        if fmt == "int4":
            cpu = fedkernels.quantize_int4(x, 32, residual=res, **kw)
            gpu = fedkernels.quantize_int4([t.cuda() for t in x], 32,
                                           residual=[t.cuda() for t in res], **kw)
        else:
            cpu = fedkernels.quantize_fp8(x, residual=res, **kw)
            gpu = fedkernels.quantize_fp8([t.cuda() for t in x], residual=[t.cuda() for t in res],
                                          **kw)
        for a, b in zip(gpu.values + gpu.scales + gpu.residual, cpu.values + cpu.scales + cpu.residual):
            exact(bits(a.cpu()), bits(b))
        w = [0.3, 0.7]
        for a, b in zip(fedkernels.aggregate_quantized([gpu, gpu], w, dtype=dtype),
                        fedkernels.aggregate_quantized([cpu, cpu], w, dtype=dtype)):
            exact(a.cpu(), b)
