"""The secure-aggregation ops against their pure-PyTorch references: the client's fixed-point
codes plus signed Philox masks mod 2^32 and the server's ring sum minus masks, bit for bit over
dtypes, rounding modes, odd shapes and chunk edges; the mask words are Philox's; a whole round
with X25519 keys, Shamir shares and a client dropped after sharing its keys (the unmasked sum
equals the survivors' codes exactly, and decodes to their float sum within the fixed-point
step); thread-count independence; bad inputs; opcheck and torch.compile; every CPU build; the
CUDA kernels against the CPU ones where a GPU is visible."""

from __future__ import annotations

import pytest
import torch
from conftest import FLOAT_DTYPES, cpu_builds, run_in_cpu_build

from fedkernels.ops import reference as ref
from fedkernels.ops import secagg as sa
from fedkernels.privacy import secure_aggregation as keys

OPS = torch.ops.fedkernels
SHAPES = [(5, 7), (129,), (), (0,), (2, 3, 41), (20001,), (3,)]
SEEDS = torch.tensor([[1, 2], [-(2**63), 2**63 - 1], [12345678901, -77]], dtype=torch.int64)
SIGNS = [1, -1, -1]


def tensors(dtype=torch.float32, seed=0, shapes=SHAPES, device="cpu", scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype).to(device)
            for s in shapes]


def exact(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a, b), (a, b)


def _err(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_mask_equals_reference(dtype, stochastic):
    x = tensors(dtype, seed=1)
    x[0][0, 0], x[0][0, 1], x[0][0, 2] = 100.0, -100.0, float("nan")
    x[0][1, 0] = float("inf")
    got = sa.secagg_mask(x, clip=3.0, scale=2.0**20, seeds=SEEDS, signs=SIGNS,
                         stochastic=stochastic, seed=-5, offset=2**40)
    want = ref.secagg_mask_reference(x, 3.0, 2.0**20, stochastic, -5, 2**40, SEEDS, SIGNS)
    for a, b in zip(got, want):
        exact(a, b)


def test_codes_without_masks_round_to_nearest_even_and_clip():
    x = torch.tensor([0.5, 1.5, -0.5, -2.5, 0.49, 7.0, -7.0, float("nan")], dtype=torch.float64)
    (q,) = sa.secagg_mask([x], clip=4.0, scale=1.0)
    assert q.tolist() == [0, 2, 0, -2, 0, 4, -4, 0]
    (q,) = sa.secagg_mask([torch.tensor([1.0, -1.0])], clip=1.0, scale=float(sa.MAX_CODE))
    assert q.tolist() == [sa.MAX_CODE, -sa.MAX_CODE]


def test_mask_words_are_the_philox_stream():
    """x = 0 with one mask: the words of at::philox_engine(key, e / 4, offset), lane e % 4,
    as the reference module computes them (the convention of every random op here)."""
    x = [torch.zeros(7), torch.zeros(300), torch.zeros(5, 5)]
    key, off = 987654321, 2**33 + 5
    got = torch.cat([t.reshape(-1) for t in sa.secagg_mask(
        x, clip=1.0, scale=1.0, seeds=torch.tensor([[key, off]]), signs=[1])])
    e = torch.arange(got.numel())
    words = torch.stack(ref.philox_words_reference(key, off, e // 4), 1)
    want = words.gather(1, (e % 4).unsqueeze(1)).squeeze(1)
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200000,), 0.3, dtype=torch.float64)
    (q,) = sa.secagg_mask([x], clip=1.0, scale=1.0, stochastic=True, seed=9)
    assert set(q.unique().tolist()) == {0, 1}
    assert abs(q.double().mean().item() - 0.3) < 0.005  # 5 sigma of 0.001


@pytest.mark.parametrize("K", [1, 3])
def test_unmask_equals_reference(K):
    g = torch.Generator().manual_seed(2)
    masked = [[torch.randint(-2**31, 2**31 - 1, s, generator=g, dtype=torch.int32)
               for s in SHAPES] for _ in range(K)]
    got = sa.secagg_unmask_sum(masked, seeds=SEEDS, signs=SIGNS)
    want = ref.secagg_unmask_sum_reference(masked, SEEDS, SIGNS)
    for a, b in zip(got, want):
        exact(a, b)


def test_masks_cancel_and_the_sum_wraps_exactly():
    """Two clients whose pair masks cancel, codes near the int32 limits: the masked vectors
    look random, their ring sum minus the self-masks is the exact sum of the codes."""
    x = [torch.tensor([1.0, -1.0, 0.25, -0.75] * 100, dtype=torch.float64)]
    pair = torch.tensor([[42, 43]])
    s = 2.0**30
    own = [torch.tensor([[7, 0]]), torch.tensor([[8, 0]])]
    y0 = sa.secagg_mask(x, clip=1.0, scale=s, seeds=torch.cat([pair, own[0]]), signs=[1, 1])
    y1 = sa.secagg_mask(x, clip=1.0, scale=s, seeds=torch.cat([pair, own[1]]), signs=[-1, 1])
    codes = sa.secagg_mask(x, clip=1.0, scale=s)
    assert not torch.equal(y0[0], codes[0])
    (z,) = sa.secagg_unmask_sum([y0, y1], seeds=torch.cat(own), signs=[1, 1])
    want = (2 * codes[0].to(torch.int64) + 2**31) % 2**32 - 2**31  # wraps at +-2^31
    assert torch.equal(z.to(torch.int64), want)


def _round(K, drop, shapes, clip, scale, neighbours):
    """One SecAgg+ round in process: keys, shares, masked vectors of the survivors, the
    server's rebuilt secrets and its one unmasking pass. Returns (ring sum, survivors' codes,
    survivors' floats)."""
    threshold = 2
    pairs = {k: keys.generate_keypair() for k in range(K)}  # mask keys (sk1, pk1)
    seeds = {k: keys.self_seed() for k in range(K)}
    # Each client shares its self seed and mask key among its neighbours (itself included).
    b_shares, sk_shares = {}, {}
    for k in range(K):
        nb = sorted(neighbours[k])
        for holder, b, s in zip(nb, keys.share_secret(seeds[k], threshold, len(nb)),
                                keys.share_secret(pairs[k][0], threshold, len(nb))):
            b_shares.setdefault(k, {})[holder] = b
            sk_shares.setdefault(k, {})[holder] = s
    updates = {k: tensors(torch.float32, seed=10 + k, shapes=shapes) for k in range(K)}
    survivors = set(range(K)) - set(drop)
    masked = []
    for k in sorted(survivors):
        s, sg = keys.client_masks(k, pairs[k][0], {j: pairs[j][1] for j in neighbours[k]},
                                  seeds[k])
        masked.append(sa.secagg_mask(updates[k], clip=clip, scale=scale, seeds=s, signs=sg))
    # The survivors answer with the self-seed shares of survivors and key shares of the dropped.
    self_seeds = {k: keys.combine_shares([b_shares[k][h] for h in neighbours[k] & survivors])
                  for k in survivors}
    dropped = {d: keys.combine_shares([sk_shares[d][h] for h in neighbours[d] & survivors])
               for d in drop}
    s, sg = keys.server_masks(self_seeds, dropped, {k: p[1] for k, p in pairs.items()},
                              neighbours, survivors)
    z = sa.secagg_unmask_sum(masked, seeds=s, signs=sg)
    codes = [sa.secagg_mask(updates[k], clip=clip, scale=scale) for k in sorted(survivors)]
    return z, codes, [updates[k] for k in sorted(survivors)]


@pytest.mark.parametrize("graph", ["complete", "ring"])
def test_a_round_with_a_dropped_client_recovers_the_survivors_sum(graph):
    K, shapes, clip, scale = 6, [(33, 5), (7,), (1000,)], 4.0, 2.0**16
    if graph == "complete":
        neighbours = {k: set(range(K)) for k in range(K)}
    else:  # SecAgg+: each client masks with its two ring neighbours only
        neighbours = {k: {(k - 1) % K, k, (k + 1) % K} for k in range(K)}
    z, codes, floats = _round(K, [2], shapes, clip, scale, neighbours)
    for t in range(len(shapes)):
        plain = sum(c[t].to(torch.int64) for c in codes)
        assert torch.equal(z[t].to(torch.int64), plain)  # exact in the ring
    decoded = sa.secagg_decode(z, scale, torch.float64)
    for t in range(len(shapes)):
        total = sum(f[t].double().clamp(-clip, clip) for f in floats)
        err = (decoded[t] - total).abs().max().item()
        assert err <= len(floats) * 0.5 / scale + 1e-12


def test_pairwise_seeds_agree_and_differ_by_pair():
    (a, pa), (b, pb), (c, pc) = (keys.generate_keypair() for _ in range(3))
    assert keys.pairwise_seed(a, pb) == keys.pairwise_seed(b, pa)
    assert len(keys.pairwise_seed(a, pb)) == 16
    assert keys.pairwise_seed(a, pb) != keys.pairwise_seed(a, pc)
    k = keys.encryption_key(a, pb)
    assert keys.decrypt(keys.encryption_key(b, pa), keys.encrypt(k, b"share")) == b"share"
    shares = keys.share_secret(b"0123456789abcdef", 3, 5)
    assert keys.combine_shares(shares[1:4]) == b"0123456789abcdef"


def test_results_do_not_depend_on_threads():
    x = tensors(torch.float32, seed=2, shapes=[(1 << 18,), (3001,)])
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = sa.secagg_mask(x, clip=4.0, scale=2.0**16, seeds=SEEDS, signs=SIGNS,
                               stochastic=True, seed=3)
            outs.append(y + sa.secagg_unmask_sum([y, y, y], seeds=SEEDS, signs=SIGNS))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        exact(a, b)


def test_bad_inputs_are_one_line_errors():
    x = [torch.randn(10), torch.randn(3, 4)]
    y = sa.secagg_mask(x, clip=1.0, scale=10.0)
    _err(ValueError, lambda: sa.secagg_mask(x, clip=0.0, scale=1.0), "clip")
    _err(ValueError, lambda: sa.secagg_mask(x, clip=1.0, scale=float("nan")), "scale")
    _err(ValueError, lambda: sa.secagg_mask(x, clip=2.0, scale=2.0**31), "clip * scale")
    _err(TypeError, lambda: sa.secagg_mask([torch.arange(3)], clip=1.0, scale=1.0),
         "x tensor 0", "dtype")
    _err(ValueError, lambda: sa.secagg_mask(x, clip=1.0, scale=1.0, seeds=SEEDS, signs=[1]),
         "mask_signs")
    _err(ValueError, lambda: sa.secagg_mask(x, clip=1.0, scale=1.0, seeds=SEEDS,
                                            signs=[1, 0, 1]), "mask_signs[1]")
    _err(ValueError, lambda: sa.secagg_mask(x, clip=1.0, scale=1.0, seeds=torch.zeros(2, 3,
         dtype=torch.int64), signs=[1, 1]), "mask_seeds", "[M, 2]")
    _err(TypeError, lambda: sa.secagg_mask(x, clip=1.0, scale=1.0, seeds=torch.zeros(1, 2),
                                           signs=[1]), "mask_seeds", "int64")
    _err(ValueError, lambda: sa.secagg_mask(x, clip=1.0, scale=1.0, seed=2**64), "seed")
    _err(ValueError, lambda: sa.mask_seeds([b"short"]), "secret 0", "16 bytes")
    _err(TypeError, lambda: sa.secagg_unmask_sum([[t.float() for t in y]]),
         "masked tensor 0", "int32")
    _err(ValueError, lambda: sa.secagg_unmask_sum([y, [y[0], y[0]]]), "masked tensor 3",
         "shape")
    _err(ValueError, lambda: sa.secagg_unmask_sum([y, y[:1]]), "client 1 has 1 tensors")
    _err(ValueError, lambda: OPS.secagg_unmask_sum(y + y[:1], 2, SEEDS, SIGNS), "num_clients = 2")
    _err(ValueError, lambda: OPS.secagg_unmask_sum(y, 0, SEEDS, SIGNS), "num_clients")
    _err(TypeError, lambda: sa.secagg_decode([torch.zeros(3)], 1.0), "int32")
    _err(ValueError, lambda: sa.secagg_decode(y, 0.0), "scale")
    _err(ValueError, lambda: keys.share_secret(b"x" * 16, 4, 3), "threshold")


# ---------------------------------------------------------------- opcheck, torch.compile


def test_opcheck():
    x = tensors(seed=3, shapes=[(5, 7), (33,)])
    x[1] = x[1].double()
    y = sa.secagg_mask(x, clip=4.0, scale=1024.0)
    for op, args in [
        (OPS.secagg_mask.default, (x, 4.0, 1024.0, False, 0, 0, SEEDS, SIGNS)),
        (OPS.secagg_mask.default, (x, 4.0, 1024.0, True, 5, 1, SEEDS[:0], [])),
        (OPS.secagg_unmask_sum.default, (y + y, 2, SEEDS, SIGNS)),
    ]:
        torch.library.opcheck(op, args)


def test_compile_fullgraph():
    x = tensors(seed=4, shapes=[(6, 9), (31,)])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def round_trip(x, seeds):
        a = sa.secagg_mask(x, clip=4.0, scale=4096.0, seeds=seeds, signs=[1, -1, 1])
        b = sa.secagg_mask(x, clip=4.0, scale=4096.0, seeds=seeds[1:2], signs=[1])
        return sa.secagg_unmask_sum([a, b], seeds=seeds[[0, 2]], signs=[1, 1])

    got = round_trip(x, SEEDS)
    want = sa.secagg_mask(x, clip=4.0, scale=4096.0)
    for g, w in zip(got, want):
        exact(g, (w.to(torch.int64) * 2).to(torch.int32))


# ---------------------------------------------------------------- every CPU build

_BUILD_SCRIPT = """
import torch
from fedkernels.ops import native, secagg as sa
from fedkernels.ops import reference as ref
x = [(torch.randn(s, generator=torch.Generator().manual_seed(i), dtype=torch.float64) * 3).to(dt)
     for i, (s, dt) in enumerate([((1000,), torch.float32), ((77, 5), torch.bfloat16),
                                  ((33,), torch.float16), ((20001,), torch.float64)])]
seeds = torch.tensor([[1, 2], [-3, 2**62], [5, -6]])
for stochastic in (False, True):
    got = sa.secagg_mask(x, clip=4.0, scale=2.0**18, seeds=seeds, signs=[1, -1, 1],
                         stochastic=stochastic, seed=77, offset=5)
    want = ref.secagg_mask_reference(x, 4.0, 2.0**18, stochastic, 77, 5, seeds, [1, -1, 1])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    z = sa.secagg_unmask_sum([got, got], seeds=seeds, signs=[-1, 1, 1])
    want = ref.secagg_unmask_sum_reference([got, got], seeds, [-1, 1, 1])
    assert all(torch.equal(a, b) for a, b in zip(z, want))
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
    x[1][40] = float("nan")
    mixed = x[:3] + [t.double() for t in x[3:]]  # two dtypes in one list
    for stochastic in (False, True):
        for inputs in (x, mixed):
            kw = dict(clip=3.0, scale=2.0**20, seeds=SEEDS, signs=SIGNS, stochastic=stochastic,
                      seed=5, offset=2)
            cpu = sa.secagg_mask(inputs, **kw)
            gpu = sa.secagg_mask([t.cuda() for t in inputs], **{**kw, "seeds": SEEDS.cuda()})
            for a, b in zip(gpu, cpu):
                exact(a.cpu(), b)
            z_cpu = sa.secagg_unmask_sum([cpu, cpu, cpu], seeds=SEEDS, signs=SIGNS)
            z_gpu = sa.secagg_unmask_sum([gpu, gpu, gpu], seeds=SEEDS, signs=SIGNS)
            for a, b in zip(z_gpu, z_cpu):
                exact(a.cpu(), b)
