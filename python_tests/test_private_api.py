"""fedkernels.private against NumPy and Flower's differential-privacy functions: update norms,
fixed clipping plus FedAvg (noise off), the noise stream's distribution and reproducibility,
the adaptive clip-norm update and its noise parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")  # the expected values come from Flower's own functions

from flwr.server.strategy import aggregate as flwr_agg  # noqa: E402
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg  # noqa: E402
from flwr.supercore import differential_privacy as flwr_dp  # noqa: E402

from fedkernels.ops.sgld import sgld_step
from fedkernels.privacy import (
    adaptive_clip_norm,
    adaptive_noise_params,
    clip_factors,
    private_aggregate,
    update_norms,
)

SHAPES = [(4, 3), (7,), (), (2, 5)]


def make_model(dtype=torch.float32, seed=0, scale=1.0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype) for s in shapes]


def make_round(K, dtype=torch.float32, seed=0, shapes=SHAPES):
    base = make_model(dtype, seed, shapes=shapes)
    # update norms spread around 1: some clipped at C = 1, some not
    clients = [[b + u for b, u in zip(base, make_model(dtype, seed + 1 + k,
                                                         scale=0.1 + 0.15 * k, shapes=shapes))]
               for k in range(K)]
    return base, clients


def np_list(model):
    return [t.numpy().copy() for t in model]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_norms_match_numpy_and_flower(dtype):
    base, clients = make_round(6, dtype)
    norms = update_norms(clients, base)
    assert norms.dtype == torch.float64 and norms.shape == (6,)
    exact = [math.sqrt(sum(((x.double() - b.double()) ** 2).sum().item()
                           for x, b in zip(c, base))) for c in clients]
    torch.testing.assert_close(norms, torch.tensor(exact, dtype=torch.float64),
                               rtol=1e-14, atol=0)
    flwr = [flwr_dp.get_norm([x - b for x, b in zip(np_list(c), np_list(base))])
            for c in clients]
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(norms, torch.tensor(flwr, dtype=torch.float64), rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("K", [1, 2, 7])
def test_fixed_clipping_equals_flower_without_noise(dtype, weighted, K):
    # No 0-d entry here: Flower's in-place clip of a 0-d array rebinds a NumPy scalar and
    # leaves that entry unclipped; fedkernels clips every entry.
    base, clients = make_round(K, dtype, seed=K, shapes=[(4, 3), (7,), (1,), (2, 5)])
    examples = [5 + 3 * k for k in range(K)] if weighted else [1] * K
    clip = 1.0
    result, norms = private_aggregate(clients, examples if weighted else None, base=base,
                                      clip_norm=clip, noise_std=0.0)
    # Flower: compute_clip_model_update on every reply, then FedAvg's weighted average
    restored = []
    for c in clients:
        params = np_list(c)
        flwr_dp.compute_clip_model_update(params, np_list(base), clip)
        restored.append(params)
    expected = flwr_agg.aggregate(list(zip(restored, examples)))
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    for r, e in zip(result, expected):
        assert r.dtype == dtype
        torch.testing.assert_close(r, torch.from_numpy(np.asarray(e)).to(dtype),
                                   rtol=tol, atol=tol)
    assert norms.tolist() == update_norms(clients, base).tolist()
    assert any(n > clip for n in norms.tolist()) or K == 1


def test_single_client_is_clipped_to_the_norm_exactly_in_float64():
    base, clients = make_round(1, torch.float64, seed=3)
    clients = [[b + 10 * (x - b) for x, b in zip(clients[0], base)]]
    result, norms = private_aggregate(clients, base=base, clip_norm=0.5, noise_std=0.0)
    assert norms[0] > 0.5
    delta = math.sqrt(sum(((r - b) ** 2).sum().item() for r, b in zip(result, base)))
    assert delta == pytest.approx(0.5, rel=1e-14)


def test_clip_factors_as_flower():
    norms = torch.tensor([0.0, 0.5, 1.0, 2.0, 1e300], dtype=torch.float64)
    assert clip_factors(norms, 1.0) == [1.0, 1.0, 1.0, 0.5, 1e-300]


def test_noise_reproducible_and_distributed_as_asked():
    shapes = [(300, 200), (1000,), (3,)]
    base = make_model(torch.float32, 1, shapes=shapes)
    clients = [[b.clone() for b in base] for _ in range(3)]  # zero updates: result - base = noise
    sigma = 0.3
    r1, _ = private_aggregate(clients, base=base, clip_norm=1.0, noise_std=sigma,
                              generator=torch.Generator().manual_seed(7))
    r2, _ = private_aggregate(clients, base=base, clip_norm=1.0, noise_std=sigma,
                              generator=torch.Generator().manual_seed(7))
    r3, _ = private_aggregate(clients, base=base, clip_norm=1.0, noise_std=sigma,
                              generator=torch.Generator().manual_seed(8))
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)
    n1 = torch.cat([(r - b).reshape(-1).double() for r, b in zip(r1, base)])
    n3 = torch.cat([(r - b).reshape(-1).double() for r, b in zip(r3, base)])
    count = n1.numel()
    assert abs(n1.mean().item()) < 5 * sigma / math.sqrt(count)
    assert n1.std().item() == pytest.approx(sigma, rel=0.02)
    corr = torch.corrcoef(torch.stack([n1, n3]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(count)  # independent across seeds
    # one stream over the whole model: element e is normal e of the SGLD ops' stream
    g = torch.Generator().manual_seed(7)
    stream = sgld_step(torch.zeros(count), torch.zeros(count), step_size=0.0, noise_std=sigma,
                       generator=g)
    torch.testing.assert_close(n1.float(), stream, rtol=0, atol=1e-6)


def test_zero_noise_draws_nothing_and_in_place():
    base, clients = make_round(4, torch.float64, seed=2)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    expected, _ = private_aggregate(clients, base=base, clip_norm=0.8, noise_std=0.0,
                                    generator=g)
    assert torch.equal(g.get_state(), state)
    sd_base = {f"t{i}": t.clone() for i, t in enumerate(base)}
    sd_base["count"] = torch.tensor(5)
    sds = [{**{f"t{i}": t for i, t in enumerate(c)}, "count": torch.tensor(9)} for c in clients]
    ptrs = [t.data_ptr() for t in sd_base.values()]
    result, _ = private_aggregate(sds, base=sd_base, clip_norm=0.8, noise_std=0.0, out=sd_base)
    assert result is sd_base and [t.data_ptr() for t in sd_base.values()] == ptrs
    assert int(sd_base["count"]) == 5  # integer entries: base's
    for i, e in enumerate(expected):
        assert torch.equal(sd_base[f"t{i}"], e)


def test_private_aggregate_errors():
    base, clients = make_round(3)
    clients[1][2] = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match=r"client 1 has norm nan \(NaN/Inf in clients \[1\]\)"):
        private_aggregate(clients, base=base, clip_norm=1.0, noise_std=0.1)
    base, clients = make_round(3)
    with pytest.raises(ValueError, match="clip_norm must be finite and > 0"):
        private_aggregate(clients, base=base, clip_norm=0.0, noise_std=0.1)
    with pytest.raises(ValueError, match="noise_std must be finite and >= 0"):
        private_aggregate(clients, base=base, clip_norm=1.0, noise_std=-1.0)
    with pytest.raises(ValueError, match="base tensor 1 is torch.float32 \\(8,\\)"):
        private_aggregate(clients, base=[base[0], torch.zeros(8)] + base[2:], clip_norm=1.0,
                          noise_std=0.0)
    with pytest.raises(ValueError, match="private_aggregate: out tensor 0 overlaps client 2, "
                                         "tensor 0"):
        private_aggregate(clients, base=base, clip_norm=1.0, noise_std=0.0,
                          out=[clients[2][0]] + [b.clone() for b in base[1:]])
    with pytest.raises(ValueError, match="weights sum to 0"):
        private_aggregate(clients, [0, 0, 0], base=base, clip_norm=1.0, noise_std=0.0)
    # Negative weights are refused before they are normalised: all negative ones too (their
    # normalised values would be positive).
    for weights, first in (([1, -1, 0], 1), ([-1.0, -3.0, -2.0], 0)):
        with pytest.raises(ValueError, match=f"client {first} has a negative weight"):
            private_aggregate(clients, weights, base=base, clip_norm=1.0, noise_std=0.0)


# ---------------------------------------------------------------- adaptive clipping


@pytest.mark.parametrize("target,lr", [(0.5, 0.2), (0.1, 0.05), (0.9, 1.0)])
def test_adaptive_clip_norm_equals_flower_strategy(target, lr):
    base, clients = make_round(7, torch.float32, seed=4)
    clip = 0.9
    norms = update_norms(clients, base)
    # Flower's own steps with the clipped-count noise off: norm bits from
    # adaptive_clip_inputs_inplace, then the strategy's fraction and geometric update.
    strategy = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), noise_multiplier=0.0, num_sampled_clients=7, initial_clipping_norm=clip,
        target_clipped_quantile=target, clip_norm_lr=lr, clipped_count_stddev=0.0)
    bits = sum(int(flwr_dp.adaptive_clip_inputs_inplace(
        [x - b for x, b in zip(np_list(c), np_list(base))], clip)) for c in clients)
    strategy._geometric_update(strategy._noisy_fraction(bits, len(clients)))
    ours = adaptive_clip_norm(clip, norms, target_quantile=target, clip_norm_lr=lr,
                              clipped_count_stddev=0.0)
    assert 0 < bits < 7
    assert ours == strategy.clipping_norm


def test_adaptive_clip_norm_noise_from_generator():
    norms = torch.tensor([0.2, 0.5, 1.5, 3.0])
    kw = dict(target_quantile=0.5, clip_norm_lr=0.2, clipped_count_stddev=0.7)
    a = adaptive_clip_norm(1.0, norms, generator=torch.Generator().manual_seed(1), **kw)
    b = adaptive_clip_norm(1.0, norms, generator=torch.Generator().manual_seed(1), **kw)
    z = torch.randn((), dtype=torch.float64, generator=torch.Generator().manual_seed(1)).item()
    assert a == b == 1.0 * math.exp(-0.2 * ((2 + 0.7 * z) / 4 - 0.5))
    with pytest.raises(ValueError, match=r"target_quantile must be finite and in \[0, 1\]"):
        adaptive_clip_norm(1.0, norms, target_quantile=1.5, clip_norm_lr=0.2,
                           clipped_count_stddev=0.0)
    with pytest.raises(ValueError, match="norms is empty"):
        adaptive_clip_norm(1.0, [], **kw)


@pytest.mark.parametrize("z,n,stddev", [(1.0, 100, None), (0.0, 10, None), (0.5, 10, 2.0),
                                        (2.0, 40, None)])
def test_adaptive_noise_params_as_flower(z, n, stddev):
    try:
        expected = flwr_dp.compute_adaptive_noise_params(z, n, stddev)
    except ValueError:
        with pytest.raises(ValueError, match="needs clipped_count_stddev >"):
            adaptive_noise_params(z, n, stddev)
        return
    assert adaptive_noise_params(z, n, stddev) == pytest.approx(expected, rel=1e-15)


def test_adaptive_noise_params_refuses_a_count_that_is_not_one():
    # Flower's formula gives (nan, nan) for a NaN count and a multiplier of 1 (no extra
    # noise for the count query) for an infinite one; both are refused.
    for n in (float("nan"), float("inf"), -10):
        with pytest.raises(ValueError, match="num_sampled must be finite and > 0"):
            adaptive_noise_params(1.0, n)
    with pytest.raises(TypeError, match="num_sampled must be a number"):
        adaptive_noise_params(1.0, "100")
    assert adaptive_noise_params(0.0, float("nan")) == (0.0, 0.0)  # no noise: n is not used
    assert adaptive_noise_params(1.0, float("nan"), 2.0) == adaptive_noise_params(1.0, 40)


def test_adaptive_clip_norm_refuses_text_and_an_overflowing_step():
    kw = dict(target_quantile=0.5, clip_norm_lr=0.2, clipped_count_stddev=0.0)
    with pytest.raises(TypeError, match="norms must be real numbers, got str"):
        adaptive_clip_norm(1.0, "12", **kw)  # was read as the norms 1 and 2
    with pytest.raises(TypeError, match="norms must be real numbers, got torch.complex64"):
        adaptive_clip_norm(1.0, torch.ones(2, dtype=torch.complex64), **kw)
    with pytest.raises(ValueError, match="beyond the float64 range; lower clip_norm_lr"):
        adaptive_clip_norm(1.0, [0.1], target_quantile=1.0, clip_norm_lr=1e308,
                           clipped_count_stddev=0.0)  # math.exp raised OverflowError


def test_weight_errors_name_private_aggregate():
    base = [torch.zeros(3)]
    clients = [[torch.randn(3)] for _ in range(3)]
    cases = [([1, 2], ValueError, r"private_aggregate: got 3 clients but weights of shape"),
             ([1, -1, 2], ValueError, r"private_aggregate: weights must be >= 0 .* client 1"),
             (torch.tensor([1.0, -2.0, 3.0]), ValueError, r"weights must be >= 0"),
             ([float("nan"), 1, 1], ValueError, r"private_aggregate: weight of client 0 is nan"),
             ([0, 0, 0], ValueError, r"private_aggregate: the weights sum to 0"),
             ("abc", TypeError, r"private_aggregate: weights must be real numbers, got str"),
             ([1, "2", 3], TypeError, r"private_aggregate: weights must be real numbers")]
    for weights, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            private_aggregate(clients, weights, base=base, clip_norm=1.0, noise_std=0.0)


# ---------------------------------------------------------------- tied weights, out=, counters


def _tied_model(value=0.0):
    shared = torch.full((20, 5), value)
    return {"emb": shared, "head": shared, "bias": torch.full((5,), value)}


def test_tied_weights_are_one_parameter():
    # A tensor under two keys is clipped, counted and noised once: the release holds one
    # noisy copy of it (two independent copies would average to less noise).
    clients = [_tied_model(0.1 * (k + 1)) for k in range(4)]
    untied = [{"emb": c["emb"], "bias": c["bias"]} for c in clients]
    base = _tied_model()
    g = torch.Generator().manual_seed(0)
    got, norms = private_aggregate(clients, base=base, clip_norm=1.0, noise_std=0.5, generator=g)
    assert got["emb"] is got["head"]
    g = torch.Generator().manual_seed(0)
    expected, expected_norms = private_aggregate(untied, base={"emb": base["emb"],
                                                               "bias": base["bias"]},
                                                 clip_norm=1.0, noise_std=0.5, generator=g)
    assert torch.equal(norms, expected_norms)
    assert torch.equal(got["emb"], expected["emb"]) and torch.equal(got["bias"], expected["bias"])
    # In place into the tied base: written once, the same values.
    g = torch.Generator().manual_seed(0)
    private_aggregate(clients, base=base, clip_norm=1.0, noise_std=0.5, generator=g, out=base)
    assert base["emb"] is base["head"] and torch.equal(base["emb"], expected["emb"])
    # Into an untied out: both keys get the one result.
    out = {"emb": torch.zeros(20, 5), "head": torch.zeros(20, 5), "bias": torch.zeros(5)}
    g = torch.Generator().manual_seed(0)
    private_aggregate(clients, base=_tied_model(), clip_norm=1.0, noise_std=0.5, generator=g,
                      out=out)
    assert torch.equal(out["emb"], expected["emb"]) and torch.equal(out["head"], expected["emb"])
    # A client whose two keys disagree cannot be released as one parameter.
    clients[2] = {"emb": torch.zeros(20, 5), "head": torch.ones(20, 5), "bias": torch.zeros(5)}
    with pytest.raises(ValueError, match="'emb' and 'head' are one tensor .* client 2"):
        private_aggregate(clients, base=_tied_model(), clip_norm=1.0, noise_std=0.5)


def test_out_must_not_alias_a_clients_counter():
    clients = [{"w": torch.randn(3), "n": torch.tensor(k)} for k in range(3)]
    out = {"w": torch.zeros(3), "n": clients[0]["n"]}
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    with pytest.raises(ValueError, match="out tensor 'n' overlaps client 0"):
        private_aggregate(clients, base={"w": torch.zeros(3), "n": torch.tensor(100)},
                          clip_norm=1.0, noise_std=1.0, generator=g, out=out)
    assert int(clients[0]["n"]) == 0 and not out["w"].any()
    assert torch.equal(g.get_state(), state)  # no noise drawn either


def test_counters_only_model_gives_the_base():
    clients = [{"n": torch.tensor(k)} for k in range(4)]
    got, norms = private_aggregate(clients, base={"n": torch.tensor(50)}, clip_norm=1.0,
                                   noise_std=1.0)
    assert int(got["n"]) == 50 and torch.equal(norms, torch.zeros(4, dtype=torch.float64))
    assert torch.equal(update_norms(clients, {"n": torch.tensor(1)}),
                       torch.zeros(4, dtype=torch.float64))


def test_release_carries_no_gradient():
    clients = [torch.randn(3).requires_grad_() for _ in range(3)]
    got, _ = private_aggregate(clients, base=torch.zeros(3).requires_grad_(), clip_norm=1.0,
                               noise_std=0.0)
    assert not got.requires_grad and got.grad_fn is None
