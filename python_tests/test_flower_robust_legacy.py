"""fedkernels.integrations.flower.legacy_robust and .legacy_central_dp side by side with
Flower's legacy (``flwr.server.strategy``) FedMedian, FedTrimmedAvg, Krum, Bulyan and server-side DP wrappers:
identical ``FitRes`` results through both for three rounds (hyperparameters changed between
rounds), over float32, float64, float16, mixed dtypes, an int64 counter, even and odd K, ties,
shapes that differ and failures; checked: Parameters (dtype, shape, values to the arrays'
rounding), metrics, exception types. DP with the noise off (``noise_multiplier=0``) and the
adaptive clip-norm trajectory; the noise through its distribution."""

from __future__ import annotations

from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.common import (  # noqa: E402
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import strategy as flower  # noqa: E402

from fedkernels.integrations.flower import legacy as fk_legacy  # noqa: E402
from fedkernels.integrations.flower import legacy_central_dp as ours_dp  # noqa: E402
from fedkernels.integrations.flower import legacy_robust as ours_module  # noqa: E402

SHAPES = [(4, 3, 3), (4,), (5, 7), (1,)]


def fit(arrays, num_examples):
    return (MagicMock(), FitRes(status=Status(code=Code.OK, message="Success"),
                                parameters=ndarrays_to_parameters(arrays),
                                num_examples=num_examples, metrics={"loss": 0.5}))


def _metrics_fn(fit_metrics):
    total = sum(n for n, _ in fit_metrics)
    return {"loss": sum(n * m["loss"] for n, m in fit_metrics) / total}


CLASSES = {
    "FedMedian": ({}, {}, {}),
    "FedTrimmedAvg": ({"beta": 0.2}, {"beta": 0.0}, {"beta": 0.34}),
    "Krum": ({"num_malicious_clients": 1}, {"num_clients_to_keep": 3},
             {"num_malicious_clients": 2, "num_clients_to_keep": 0}),
    # Flower's Bulyan needs to_keep=0 for its Krum rule (without it: its TypeError, below)
    "Bulyan": ({"num_malicious_clients": 1, "to_keep": 0}, {"num_malicious_clients": 0},
               {"num_malicious_clients": 1}),
}


def test_bulyan_without_to_keep_raises_flowers_type_error():
    errors = []
    for cls in (flower.Bulyan, ours_module.Bulyan):
        errors.append(_outcome(cls(num_malicious_clients=1).aggregate_fit, 1,
                               _results("float32", 1, 1), [])[1])
    assert isinstance(errors[0], TypeError) and type(errors[1]) is type(errors[0])


@pytest.mark.parametrize("name,kwargs", [("FedMedian", {}), ("FedTrimmedAvg", {}),
                                         ("Krum", {}), ("Krum", {"num_clients_to_keep": 2}),
                                         ("Bulyan", {"num_malicious_clients": 1, "to_keep": 0})])
def test_models_without_arrays_like_flower(name, kwargs):
    """Clients that send no arrays: an empty result from the median and the trimmed mean,
    NumPy's ValueError from the Krum rules' concatenation of nothing, as in Flower."""
    outcomes = []
    for module in (flower, ours_module):
        results = [fit([], 3 + k) for k in range(7)]
        outcomes.append(_outcome(getattr(module, name)(**kwargs).aggregate_fit, 1, results, []))
    (got, got_err), (want, want_err) = outcomes[1], outcomes[0]
    assert type(got_err) is type(want_err), (got_err, want_err)
    if want_err is None:
        assert got[0].tensors == want[0].tensors == []


def _client(rng, k, r, dtype, shapes=SHAPES):
    scale = 10.0 if k in (1, 4) else 0.1
    return [np.asarray(0.5 * r + scale * rng.standard_normal(s), dtype=dtype) for s in shapes]


def _results(scenario, r, seed):
    rng = np.random.default_rng(seed)
    k = 8 if scenario == "even" else 7
    dtypes = {"float64": [np.float64], "float16": [np.float16],
              "mixed": [np.float32, np.float64]}.get(scenario, [np.float32])
    out = []
    for c in range(k):
        if scenario == "ties":
            arrays = [rng.integers(0, 3, s).astype(np.float32) for s in SHAPES]
        else:
            arrays = _client(rng, c, r, dtypes[c % len(dtypes)])
        if scenario == "int-counter":
            arrays.append(np.array([10 * r + c]))
        if scenario == "shapes-differ" and c == 3:
            arrays[1] = np.zeros(5, np.float32)
        out.append(fit(arrays, int(rng.integers(1, 50))))
    return out


SCENARIOS = ["float32", "even", "float64", "float16", "mixed", "int-counter", "ties",
             "shapes-differ", "failures"]
# Flower's legacy distances are per-pair float32 norms, squared: sqrt(d)^2 rounds, so scores
# that tie exactly (integer-valued replies) are ordered by that rounding, and float16 ones by
# much coarser rounding. Krum hands such near-ties, and float16, to Flower's code; Bulyan's
# iterative selection does not, and its β nearest values tie on integer data (argpartition).
SKIP = {("Bulyan", "ties"): "ties at Bulyan's β boundary (argpartition order)",
        ("Bulyan", "float16"): "Flower's float16 distances"}


def _tolerance(scenario):
    if scenario == "float16":
        return {"rtol": 4e-3, "atol": 4e-3}
    if scenario == "float64":
        return {"rtol": 1e-12, "atol": 1e-13}
    return {"rtol": 2e-5, "atol": 2e-6}


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except Exception as err:  # noqa: BLE001 - compared by type
        return None, err


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", list(CLASSES))
def test_side_by_side(name, scenario):
    if (name, scenario) in SKIP:
        pytest.skip(SKIP[name, scenario])
    kwargs, change2, change3 = CLASSES[name]
    theirs = getattr(flower, name)(fit_metrics_aggregation_fn=_metrics_fn, **kwargs)
    ours = getattr(ours_module, name)(fit_metrics_aggregation_fn=_metrics_fn, **kwargs)
    assert isinstance(ours, getattr(flower, name))
    for r in (1, 2, 3):
        for s in (theirs, ours):
            for key, value in ({2: change2, 3: change3}.get(r, {})).items():
                setattr(s, key, value)
        failures = [RuntimeError("client lost")] if scenario == "failures" else []
        if scenario == "failures" and r == 3:
            for s in (theirs, ours):
                s.accept_failures = False
        want, want_err = _outcome(theirs.aggregate_fit, r, _results(scenario, r, r), failures)
        got, got_err = _outcome(ours.aggregate_fit, r, _results(scenario, r, r), failures)
        assert type(got_err) is type(want_err), (got_err, want_err)
        if want_err is not None:
            continue
        assert got[1] == pytest.approx(want[1])
        if want[0] is None:
            assert got[0] is None
            continue
        for a, b in zip(parameters_to_ndarrays(got[0]), parameters_to_ndarrays(want[0]),
                        strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
            np.testing.assert_allclose(a, b, **_tolerance(scenario))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("nan_client, layer", [(0, 0), (3, 2), (6, 3)])
def test_bulyan_nan_client_raises_like_flower(dtype, nan_client, layer):
    """Flower's legacy Krum selection picks the NaN client first (its score is NaN) and then
    cannot find it among the clients: ValueError. Ours raises one too, naming the client."""
    rng = np.random.default_rng(nan_client)
    clients = [_client(rng, k, 1, dtype) for k in range(7)]
    clients[nan_client][layer].flat[0] = np.nan
    outcomes = []
    for cls in (flower.Bulyan, ours_module.Bulyan):
        results = [fit([a.copy() for a in c], 5) for c in clients]
        outcomes.append(_outcome(cls(num_malicious_clients=1, to_keep=0).aggregate_fit, 1,
                                 results, [])[1])
    theirs, ours = outcomes
    assert isinstance(theirs, ValueError) and "reference weights not found" in str(theirs)
    assert type(ours) is ValueError and f"client {nan_client}'s parameters contain NaN" in str(ours)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # Flower's inf - inf
def test_bulyan_inf_without_nan_gives_flowers_result():
    """Only NaN is refused: a client with an Inf value (a sum that is not finite, but no NaN)
    is aggregated, and left out, as by Flower."""
    rng = np.random.default_rng(1)
    clients = [_client(rng, k, 1, np.float32) for k in range(7)]
    clients[2][0].flat[0] = np.inf
    want, got = (cls(num_malicious_clients=1, to_keep=0).aggregate_fit(
        1, [fit([a.copy() for a in c], 5) for c in clients], [])[0]
        for cls in (flower.Bulyan, ours_module.Bulyan))
    for a, b in zip(parameters_to_ndarrays(got), parameters_to_ndarrays(want), strict=True):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(a, b, **_tolerance("float32"))


def test_krum_keeps_the_inlier():
    results = [fit([np.array([0.1 * k, -0.1 * k], np.float32)], k + 1) for k in range(4)]
    results.append(fit([np.array([100.0, 100.0], np.float32)], 1))
    params, _ = ours_module.Krum(num_malicious_clients=1).aggregate_fit(1, results, [])
    w = parameters_to_ndarrays(params)[0]
    assert np.all(np.abs(w) < 1.0)


@pytest.mark.parametrize("gamma, flowers", [(4e-6, True), (0.1, False)])
def test_krum_near_tie_on_a_large_model_is_flowers(monkeypatch, gamma, flowers):
    """Flower's legacy distances are float32 norms of 10^6-value differences, off by tens of
    units in the last place: a near tie between the two lowest scores (2 and 2 + 2γ,
    relative gap γ = 4e-6, past the 16 units the bound once allowed) is its rounding's, so its
    code runs; a clear gap keeps the fused choice (the client at -1)."""
    calls = []
    real = ours_module._flower_aggregate.aggregate_krum
    monkeypatch.setattr(ours_module._flower_aggregate, "aggregate_krum",
                        lambda *a: calls.append(1) or real(*a))
    u = np.random.default_rng(3).standard_normal(10**6).astype(np.float32)
    clients = [[(np.float32(t) * u).astype(np.float32)] for t in [-2.0, -1.0, 0.0, 1.0 + gamma, 3.0]]
    got = ours_module.Krum(num_malicious_clients=1)._combine(clients, [1] * 5)
    assert calls == ([1] if flowers else [])
    if not flowers:
        np.testing.assert_array_equal(got[0], clients[1][0])


@pytest.mark.parametrize("dtype", [np.bool_, np.int8])
def test_krum_on_integer_or_bool_models_is_flowers(dtype):
    # Flower's concatenation keeps these dtypes: bool differences are its TypeError, int8
    # differences wrap around. Either way ours gives what Flower gives.
    results = [fit([np.array([1, 0, k % 2, 100 * k], dtype=np.int64).astype(dtype)], 5)
               for k in range(4)]
    want, want_err = _outcome(flower.Krum(num_malicious_clients=0).aggregate_fit, 1, results, [])
    got, got_err = _outcome(ours_module.Krum(num_malicious_clients=0).aggregate_fit, 1,
                            results, [])
    assert type(got_err) is type(want_err), (got_err, want_err)
    if want_err is None:
        np.testing.assert_array_equal(parameters_to_ndarrays(got[0])[0],
                                      parameters_to_ndarrays(want[0])[0])


# ---------------------------------------------------------------- DP wrappers

K = 5


def _dp_results(seed, state, spread):
    rng = np.random.default_rng(seed)
    return [fit([np.asarray(v + s * rng.standard_normal(v.shape), v.dtype) for v in state],
                int(rng.integers(1, 20))) for s in spread]


def _dp_round(strategy, r, state, results):
    strategy.current_round_params = [v.copy() for v in state]
    return _outcome(strategy.aggregate_fit, r, results, [])


WRAPPED = {"flower-FedAvg": flower.FedAvg, "fedkernels-FedAvg": fk_legacy.FedAvg,
           "flower-FedMedian": flower.FedMedian}


@pytest.mark.parametrize("wrapped", list(WRAPPED))
@pytest.mark.parametrize("clip", [0.5, 100.0], ids=["clipping", "no-clipping"])
def test_fixed_clipping_noise_off(wrapped, clip):
    inner = WRAPPED[wrapped]
    theirs = flower.DifferentialPrivacyServerSideFixedClipping(
        inner(fit_metrics_aggregation_fn=_metrics_fn), 0.0, clip, K)
    ours = ours_dp.DifferentialPrivacyServerSideFixedClipping(
        inner(fit_metrics_aggregation_fn=_metrics_fn), 0.0, clip, K)
    rng = np.random.default_rng(1)
    state = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    spread = [0.01, 0.2, 0.05, 1.0, 0.3]
    for r in (1, 2, 3):
        want, want_err = _dp_round(theirs, r, state, _dp_results(r, state, spread))
        got, got_err = _dp_round(ours, r, state, _dp_results(r, state, spread))
        assert type(got_err) is type(want_err)
        for a, b in zip(parameters_to_ndarrays(got[0]), parameters_to_ndarrays(want[0]),
                        strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
        assert got[1] == pytest.approx(want[1])
        state = parameters_to_ndarrays(want[0])


def test_adaptive_clip_trajectory_noise_off():
    kwargs = {"initial_clipping_norm": 0.3, "target_clipped_quantile": 0.4, "clip_norm_lr": 0.5}
    theirs = flower.DifferentialPrivacyServerSideAdaptiveClipping(flower.FedAvg(), 0.0, K,
                                                                  **kwargs)
    ours = ours_dp.DifferentialPrivacyServerSideAdaptiveClipping(fk_legacy.FedAvg(), 0.0, K,
                                                                     **kwargs)
    rng = np.random.default_rng(2)
    state = [rng.standard_normal(s) for s in SHAPES]
    spread = [0.01, 0.05, 0.1, 0.2, 0.4]
    for r in range(1, 6):
        want, _ = _dp_round(theirs, r, state, _dp_results(r, state, spread))
        got, _ = _dp_round(ours, r, state, _dp_results(r, state, spread))
        assert ours.clipping_norm == pytest.approx(theirs.clipping_norm, rel=1e-12)
        for a, b in zip(parameters_to_ndarrays(got[0]), parameters_to_ndarrays(want[0])):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
        state = parameters_to_ndarrays(want[0])
    assert ours.clipping_norm != 0.3


def test_zero_update_raises_like_flower():
    state = [np.ones(3, np.float32)]
    out = []
    for cls in (flower.DifferentialPrivacyServerSideFixedClipping,
                ours_dp.DifferentialPrivacyServerSideFixedClipping):
        results = [fit([np.ones(3, np.float32)], 1), fit([np.zeros(3, np.float32)], 1)]
        out.append(_dp_round(cls(flower.FedAvg(), 0.0, 1.0, 2), 1, state, results)[1])
    assert isinstance(out[0], ZeroDivisionError) and isinstance(out[1], ZeroDivisionError)


def test_noise_distribution_and_generator():
    sigma, clip = 2.0, 0.5
    std = sigma * clip / K
    rng = np.random.default_rng(3)
    state = [rng.standard_normal((300, 400)), rng.standard_normal(400)]
    spread = [0.01, 0.2, 0.05, 1.0, 0.3]

    def noise(seed):
        gen = torch.Generator().manual_seed(seed)
        noisy = ours_dp.DifferentialPrivacyServerSideFixedClipping(
            flower.FedAvg(), sigma, clip, K, generator=gen)
        clean = ours_dp.DifferentialPrivacyServerSideFixedClipping(
            flower.FedAvg(), 0.0, clip, K)
        a, _ = _dp_round(noisy, 1, state, _dp_results(1, state, spread))
        b, _ = _dp_round(clean, 1, state, _dp_results(1, state, spread))
        return np.concatenate([(x - y).ravel() for x, y in
                               zip(parameters_to_ndarrays(a[0]), parameters_to_ndarrays(b[0]))])

    e1, e2, e1_again = noise(5), noise(6), noise(5)
    n = e1.size
    np.testing.assert_array_equal(e1, e1_again)
    for e in (e1, e2):
        assert abs(e.mean()) < 5 * std / np.sqrt(n)
        assert e.std() == pytest.approx(std, rel=5 * np.sqrt(2 / n))
    assert abs(np.corrcoef(e1, e2)[0, 1]) < 5 / np.sqrt(n)
