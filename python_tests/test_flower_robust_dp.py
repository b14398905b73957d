"""fedkernels' server-side DP wrappers (fixed and adaptive clipping, Message API) side by side
with Flower's: with the noise switched off (``noise_multiplier=0``) the results, metrics and
clip-norm trajectories equal Flower's over several rounds, for a wrapped FedAvg (the fused
path) and a wrapped FedMedian (clip, then the wrapped strategy); with the same noise on the
clipped count the adaptive trajectories agree; the noise itself is compared through its
distribution (mean, standard deviation, independence across calls and against Flower's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flower_message_helpers import (  # noqa: E402
    StandInGrid,
    arrayrecord,
    assert_arrays_equal,
    assert_metrics_equal,
    assert_same_exception,
    outcome,
    real_reply,
    task_identity,  # noqa: F401 - fixture
)
from flwr.app import ConfigRecord  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402

from fedkernels.integrations import flower as fk_flower  # noqa: E402
from fedkernels.integrations.flower import central_dp as ours_module  # noqa: E402
from fedkernels.integrations.flower import robust as fk_robust  # noqa: E402

# No 0-d arrays here: Flower leaves those unclipped (test_zero_dim_arrays_are_clipped).
SHAPES = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (5, 7), "one": (1,)}
K = 5

WRAPPED = {
    "flower-FedAvg": lambda: flower.FedAvg(),
    "fedkernels-FedAvg": lambda: fk_flower.FedAvg(),
    "flower-FedMedian": lambda: flower.FedMedian(),
    "fedkernels-FedMedian": lambda: fk_robust.FedMedian(),
}


def _model(rng, dtype, shapes=SHAPES):
    return {n: np.asarray(rng.standard_normal(s), dtype=dtype) for n, s in shapes.items()}


def _replies(rng, global_state, dtype, spread):
    """K replies around the global model; reply k's update is scaled by spread[k] so some
    are clipped and some are not."""
    out = []
    for k in range(K):
        arrays = {n: np.asarray(v + spread[k] * rng.standard_normal(v.shape), dtype=dtype)
                  for n, v in global_state.items()}
        out.append(real_reply(k + 1, arrays, {"num-examples": float(rng.integers(1, 20)),
                                              "loss": float(rng.uniform())}))
    return out


def _round(strategy, r, global_state, messages):
    strategy.current_arrays = arrayrecord(global_state)
    return outcome(strategy.aggregate_train, r, messages)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("wrapped", list(WRAPPED))
@pytest.mark.parametrize("clip", [0.5, 100.0], ids=["clipping", "no-clipping"])
def test_fixed_clipping_noise_off(wrapped, dtype, clip):
    theirs = flower.DifferentialPrivacyServerSideFixedClipping(
        flower.FedAvg() if "FedAvg" in wrapped else flower.FedMedian(), 0.0, clip, K)
    ours = ours_module.DifferentialPrivacyServerSideFixedClipping(WRAPPED[wrapped](), 0.0, clip,
                                                                  K)
    rng = np.random.default_rng(1)
    state = _model(rng, dtype)
    tol = (2e-5, 2e-6) if dtype == np.float32 else (1e-12, 1e-13)
    for r in (1, 2, 3):
        seed = int(rng.integers(1 << 30))
        spread = [0.01, 0.2, 0.05, 1.0, 0.3]
        want, want_err = _round(theirs, r, state,
                                _replies(np.random.default_rng(seed), state, dtype, spread))
        got, got_err = _round(ours, r, state,
                              _replies(np.random.default_rng(seed), state, dtype, spread))
        assert_same_exception(got_err, want_err)
        assert_arrays_equal(got[0], want[0], *tol, f"round {r}")
        assert_metrics_equal(got[1], want[1])
        state = {k: v.numpy() for k, v in want[0].items()}


def _int_counter_replies(rng, state, shape):
    msgs = _replies(rng, state, np.float32, [0.01, 0.2, 0.05, 1.0, 0.3])
    for k, m in enumerate(msgs):
        m.content["arrays"]["bn.num_batches_tracked"] = flwr.app.Array(np.full(shape, 3 + k))
    return msgs


@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-d", "1-d"])
@pytest.mark.parametrize("clip", [0.5, 1e6], ids=["clipping", "no-clipping"])
def test_fixed_clipping_int_counter_like_flower(clip, shape):
    """An int64 counter in the model: Flower scales the update in place, which NumPy refuses
    for an integer array once the factor is below 1 (a 0-d one is a NumPy scalar and is left
    alone); without clipping the factor is 1 and the counter is averaged into float64. Every
    way, ours does what Flower does."""
    rng = np.random.default_rng(2)
    state = _model(rng, np.float32)
    state["bn.num_batches_tracked"] = np.full(shape, 2)
    theirs = flower.DifferentialPrivacyServerSideFixedClipping(flower.FedAvg(), 0.0, clip, K)
    ours = ours_module.DifferentialPrivacyServerSideFixedClipping(fk_flower.FedAvg(), 0.0, clip,
                                                                  K)
    want, want_err = _round(theirs, 1, state, _int_counter_replies(np.random.default_rng(5),
                                                                   state, shape))
    got, got_err = _round(ours, 1, state, _int_counter_replies(np.random.default_rng(5),
                                                               state, shape))
    assert_same_exception(got_err, want_err)
    if want_err is None:
        assert_arrays_equal(got[0], want[0], 2e-5, 2e-6)


@pytest.mark.parametrize("wrapped", ["flower-FedAvg", "flower-FedMedian"])
def test_zero_update_is_flowers_zero_division(wrapped):
    rng = np.random.default_rng(3)
    state = _model(rng, np.float32)
    make = [lambda: flower.DifferentialPrivacyServerSideFixedClipping(
        WRAPPED[wrapped](), 0.0, 1.0, K),
        lambda: ours_module.DifferentialPrivacyServerSideFixedClipping(
            WRAPPED[wrapped](), 0.0, 1.0, K)]
    results = []
    for build in make:
        msgs = _replies(np.random.default_rng(4), state, np.float32, [0.1] * K)
        msgs[2] = real_reply(3, {n: v.copy() for n, v in state.items()},
                             {"num-examples": 1.0, "loss": 0.5})
        results.append(_round(build(), 1, state, msgs))
    assert isinstance(results[0][1], ZeroDivisionError)
    assert_same_exception(results[1][1], results[0][1])


@pytest.mark.parametrize("wrapped", ["flower-FedAvg", "flower-FedMedian"])
@pytest.mark.parametrize("count_stddev", [None, 1.5], ids=["no-count-noise", "count-noise"])
def test_adaptive_clip_trajectory(monkeypatch, wrapped, count_stddev):
    """Five rounds; the clip norm after each round, the arrays and the metrics equal Flower's.
    With count noise, both get the same standard normal draw z_t for round t: Flower's
    ``np.random.normal(count, s)`` returns count + s z_t, torch's draw in
    ``adaptive_clip_norm`` returns z_t."""
    draws = iter([0.7, -1.3, 0.2, 2.1, -0.4] * 2)
    flower_draws, our_draws = [], []
    z = list(draws)
    if count_stddev:
        from flwr.serverapp.strategy import dp_adaptive_clipping

        real_normal = np.random.normal

        def numpy_normal(loc, scale, *args, **kwargs):
            if args or kwargs:  # the noise on the arrays (off here), not the count
                return real_normal(loc, scale, *args, **kwargs)
            flower_draws.append(z[len(flower_draws)])
            return loc + scale * flower_draws[-1]

        real_randn = torch.randn

        def torch_randn(*args, **kwargs):
            if args == ((),) and kwargs.get("dtype") == torch.float64:
                our_draws.append(z[len(our_draws)])
                return torch.tensor(our_draws[-1], dtype=torch.float64)
            return real_randn(*args, **kwargs)

        monkeypatch.setattr(dp_adaptive_clipping.np.random, "normal", numpy_normal)
        monkeypatch.setattr(torch, "randn", torch_randn)
    kwargs = {"initial_clipping_norm": 0.3, "target_clipped_quantile": 0.4, "clip_norm_lr": 0.5,
              "clipped_count_stddev": count_stddev}
    theirs = flower.DifferentialPrivacyServerSideAdaptiveClipping(
        WRAPPED[wrapped](), 0.0, K, **kwargs)
    ours = ours_module.DifferentialPrivacyServerSideAdaptiveClipping(
        WRAPPED[wrapped](), 0.0, K, **kwargs)
    rng = np.random.default_rng(6)
    state = _model(rng, np.float64)
    for r in range(1, 6):
        seed = int(rng.integers(1 << 30))
        spread = [0.01, 0.05, 0.1, 0.2, 0.4]
        want, want_err = _round(theirs, r, state,
                                _replies(np.random.default_rng(seed), state, np.float64, spread))
        got, got_err = _round(ours, r, state,
                              _replies(np.random.default_rng(seed), state, np.float64, spread))
        assert_same_exception(got_err, want_err)
        assert ours.clipping_norm == pytest.approx(theirs.clipping_norm, rel=1e-12)
        assert_arrays_equal(got[0], want[0], 1e-12, 1e-13, f"round {r}")
        assert_metrics_equal(got[1], want[1])
        state = {k: v.numpy() for k, v in want[0].items()}
    if count_stddev:
        assert flower_draws == our_draws == z[:5]
    assert ours.clipping_norm != 0.3  # the trajectory moved


BIG = {"w": (300, 400), "b": (400,)}


def _noise_of(strategy_cls, wrapped, seed_msgs, sigma, clip, **kw):
    """The noise a wrapper adds: its result minus the noise-free result (sigma = 0)."""
    rng = np.random.default_rng(7)
    state = _model(rng, np.float64, BIG)
    noisy = strategy_cls(wrapped(), sigma, clip, K, **kw)
    clean = strategy_cls(wrapped(), 0.0, clip, K)
    a, err = _round(noisy, 1, state, _replies(np.random.default_rng(seed_msgs), state,
                                               np.float64, [0.01, 0.2, 0.05, 1.0, 0.3]))
    assert err is None
    b, err = _round(clean, 1, state, _replies(np.random.default_rng(seed_msgs), state,
                                               np.float64, [0.01, 0.2, 0.05, 1.0, 0.3]))
    assert err is None
    return np.concatenate([(a[0][n].numpy() - b[0][n].numpy()).ravel() for n in BIG])


@pytest.mark.parametrize("wrapped", ["flower-FedAvg", "flower-FedMedian"])
def test_fixed_clipping_noise_distribution(wrapped):
    """N(0, (sigma C / m)^2) per coordinate: mean, standard deviation, no correlation between
    two calls or between neighbouring coordinates, and Flower's noise measured the same way
    has the same standard deviation."""
    sigma, clip = 2.0, 0.5
    std = sigma * clip / K
    gen = torch.Generator().manual_seed(11)
    cls = ours_module.DifferentialPrivacyServerSideFixedClipping
    first = _noise_of(cls, WRAPPED[wrapped], 1, sigma, clip, generator=gen)
    second = _noise_of(cls, WRAPPED[wrapped], 1, sigma, clip, generator=gen)
    n = first.size
    for e in (first, second):
        assert abs(e.mean()) < 5 * std / np.sqrt(n)
        assert e.std() == pytest.approx(std, rel=5 * np.sqrt(2 / n))
        assert abs(np.corrcoef(e[:-1], e[1:])[0, 1]) < 5 / np.sqrt(n)
        # fourth moment of a Gaussian: 3 sigma^4
        assert np.mean(e ** 4) / e.var() ** 2 == pytest.approx(3.0, abs=0.1)
    assert abs(np.corrcoef(first, second)[0, 1]) < 5 / np.sqrt(n)
    np.random.seed(12)
    theirs = _noise_of(flower.DifferentialPrivacyServerSideFixedClipping, WRAPPED[wrapped], 1,
                       sigma, clip)
    assert theirs.std() == pytest.approx(first.std(), rel=10 * np.sqrt(2 / n))


def test_noise_is_reproducible_from_the_generator():
    cls = ours_module.DifferentialPrivacyServerSideFixedClipping
    a = _noise_of(cls, WRAPPED["flower-FedAvg"], 1, 1.0, 0.5,
                  generator=torch.Generator().manual_seed(3))
    b = _noise_of(cls, WRAPPED["flower-FedAvg"], 1, 1.0, 0.5,
                  generator=torch.Generator().manual_seed(3))
    c = _noise_of(cls, WRAPPED["flower-FedAvg"], 1, 1.0, 0.5,
                  generator=torch.Generator().manual_seed(4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_fused_path_runs_for_a_wrapped_fedavg(monkeypatch):
    """The wrapped FedAvg's aggregate_train is not called: clip, mean and noise are one
    private_aggregate call (and Flower's per-reply clip is not run)."""
    calls = []
    real = ours_module.private_aggregate
    monkeypatch.setattr(ours_module, "private_aggregate",
                        lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    inner = flower.FedAvg()
    monkeypatch.setattr(inner, "aggregate_train", lambda *a: pytest.fail("not fused"))
    ours = ours_module.DifferentialPrivacyServerSideFixedClipping(inner, 1.0, 0.5, K)
    rng = np.random.default_rng(8)
    state = _model(rng, np.float32)
    got, err = _round(ours, 1, state, _replies(rng, state, np.float32, [0.1] * K))
    assert err is None and calls == [K]


def test_accountant_with_the_fused_fedavg(task_identity):  # noqa: F811
    """Flower's accountant accepts fedkernels' FedAvg through our wrapper and reports the
    same epsilon as Flower's wrapper around Flower's FedAvg."""
    from flwr.supercore.privacy_accounting import (
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    def accountant():
        return RdpAccountant(PrivacyConfig(1e-5, 100, NeighboringRelation.ADD_OR_REMOVE_ONE,
                                           SamplingMethod.NO_AMPLIFICATION))

    with pytest.raises(ValueError, match="FedAvg.aggregate_train"):
        flower.DifferentialPrivacyServerSideFixedClipping(fk_flower.FedAvg(), 1.0, 0.5, K,
                                                          accountant=accountant())
    theirs = flower.DifferentialPrivacyServerSideFixedClipping(flower.FedAvg(), 1.0, 0.5, K,
                                                               accountant=accountant())
    inner = fk_flower.FedAvg()
    ours = ours_module.DifferentialPrivacyServerSideFixedClipping(inner, 1.0, 0.5, K,
                                                                  accountant=accountant())
    assert ours.strategy is inner
    grid = StandInGrid(range(1, K + 1))
    rng = np.random.default_rng(9)
    state = _model(rng, np.float32)
    for r in (1, 2):
        for s in (theirs, ours):
            list(s.configure_train(r, arrayrecord(state), ConfigRecord(), grid))
            msgs = _replies(np.random.default_rng(r), state, np.float32, [0.1] * K)
            for m in msgs:
                m.content["metrics"]["num-examples"] = 4.0  # accounting needs equal weights
            arrays, _ = s.aggregate_train(r, msgs)
            assert arrays is not None
    assert ours.privacy_spent().epsilon == pytest.approx(theirs.privacy_spent().epsilon)
    assert ours.privacy_spent().num_releases == 2


def test_zero_dim_arrays_are_clipped():
    """A documented difference: Flower's in-place ``update *= factor`` does not write back
    into a 0-d array's NumPy scalar, so Flower leaves 0-d entries unclipped (while their value
    counts in the norm). Ours clips every entry by the same factor, as the clipping bound
    (and the DP guarantee) needs."""
    state = {"w": np.zeros(3), "s": np.array(0.0)}
    msgs = [real_reply(k + 1, {"w": np.full(3, 2.0), "s": np.array(2.0)},
                       {"num-examples": 1.0}) for k in range(2)]
    theirs = flower.DifferentialPrivacyServerSideFixedClipping(flower.FedAvg(), 0.0, 1.0, 2)
    ours = ours_module.DifferentialPrivacyServerSideFixedClipping(flower.FedAvg(), 0.0, 1.0, 2)
    want, _ = _round(theirs, 1, state, msgs)
    got, _ = _round(ours, 1, state, [real_reply(k + 1, {"w": np.full(3, 2.0),
                                                        "s": np.array(2.0)},
                                                {"num-examples": 1.0}) for k in range(2)])
    assert float(want[0]["s"].numpy()) == 2.0  # Flower: unclipped
    np.testing.assert_allclose(want[0]["w"].numpy(), 0.5)  # norm 4 -> factor 1/4
    np.testing.assert_allclose(got[0]["w"].numpy(), 0.5)
    assert float(got[0]["s"].numpy()) == pytest.approx(0.5)
    total = np.sqrt(np.sum(got[0]["w"].numpy() ** 2) + float(got[0]["s"].numpy()) ** 2)
    assert total == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_update_like_flower(bad):
    """NaN in a reply: Flower's factor min(1, C / nan) is 1 and the NaN reaches the mean;
    Inf: the factor is 0 and 0 * inf is NaN. Ours gives the same arrays (through the
    general path: fedkernels' private_aggregate refuses a non-finite update)."""
    rng = np.random.default_rng(10)
    state = _model(rng, np.float32)
    out = []
    for cls in (flower.DifferentialPrivacyServerSideFixedClipping,
                ours_module.DifferentialPrivacyServerSideFixedClipping):
        msgs = _replies(np.random.default_rng(11), state, np.float32, [0.1, 0.2, 0.3, 0.4, 0.5])
        arrays = msgs[1].content["arrays"]
        w = arrays["fc.weight"].numpy()
        w[0, 0] = bad
        arrays["fc.weight"] = flwr.app.Array(w)
        out.append(_round(cls(flower.FedAvg(), 0.0, 0.5, K), 1, state, msgs))
    assert out[0][1] is None and out[1][1] is None
    assert np.isnan(out[0][0][0]["fc.weight"].numpy()).any()
    assert_arrays_equal(out[1][0][0], out[0][0][0], 2e-5, 2e-6)


@pytest.mark.parametrize("wrapped", ["FedAvg", "FedAdam", "FedMedian"])
@pytest.mark.parametrize("wrapper", ["DifferentialPrivacyServerSideFixedClipping",
                                     "DifferentialPrivacyServerSideAdaptiveClipping"])
def test_no_replies_like_flower(wrapper, wrapped):
    """No replies: the fixed wrapper returns (None, None), whatever it wraps (FedAdam and
    FedMedian take the clip-then-aggregate path, FedAvg the fused one); the adaptive one
    divides its clipped count by zero replies in Flower, a ZeroDivisionError in both."""
    args = (0.0, 1.0, K) if "Fixed" in wrapper else (0.0, K)
    state = _model(np.random.default_rng(12), np.float32)
    want = _round(getattr(flower, wrapper)(getattr(flower, wrapped)(), *args), 1, state, [])
    got = _round(getattr(ours_module, wrapper)(getattr(flower, wrapped)(), *args), 1, state,
                 [])
    assert_same_exception(got[1], want[1])
    assert got[0] == want[0]


@pytest.mark.parametrize("wrapped", ["flower-FedAvg", "fedkernels-FedAvg", "flower-FedMedian"])
@pytest.mark.parametrize("wrapper", ["DifferentialPrivacyServerSideFixedClipping",
                                     "DifferentialPrivacyServerSideAdaptiveClipping"])
def test_flowers_noise_patched_out_reaches_ours(wrapper, wrapped):
    """Flower's own tests take the noise out by patching ``add_gaussian_noise_inplace`` in
    Flower's wrapper module, then check the noiseless aggregate. With ours swapped in, the
    replacement is called instead of our noise (on every array, with Flower's standard
    deviation), on the fused path and the general one."""
    from unittest.mock import patch

    module = "dp_fixed_clipping" if "Fixed" in wrapper else "dp_adaptive_clipping"
    args = (1.0, 0.5, K) if "Fixed" in wrapper else (1.0, K, 0.5, 0.5, 0.2, 10.0)
    state = _model(np.random.default_rng(13), np.float32)
    spread = [0.01, 0.2, 0.05, 1.0, 0.3]
    outcomes = []
    for side in (flower, ours_module):
        inner = flower.FedMedian() if "FedMedian" in wrapped else (
            fk_flower.FedAvg() if side is ours_module and "fedkernels" in wrapped
            else flower.FedAvg())
        strategy = getattr(side, wrapper)(inner, *args)
        messages = _replies(np.random.default_rng(14), state, np.float32, spread)
        with patch(f"flwr.serverapp.strategy.{module}.add_gaussian_noise_inplace") as noise:
            got, err = _round(strategy, 1, state, messages)
        assert err is None, err
        assert noise.call_count == 1
        arrays, stdv = noise.call_args.args
        outcomes.append((got, len(arrays), stdv))
    (ours, n_ours, std_ours), (theirs, n_theirs, std_theirs) = outcomes[1], outcomes[0]
    assert n_ours == n_theirs == len(SHAPES)
    if "Fixed" in wrapper:  # the adaptive C moves with the noisy clipped count (other draws)
        assert std_ours == pytest.approx(std_theirs, rel=1e-12)
    assert_arrays_equal(ours[0], theirs[0], 2e-5, 2e-6)
    assert_metrics_equal(ours[1], theirs[1])
