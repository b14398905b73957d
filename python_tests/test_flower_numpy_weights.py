"""A reply whose weighting metric is a NumPy float64. A MetricRecord accepts one (np.float64
subclasses float) and keeps it, and Flower's ``x * w`` then follows NumPy's promotion: float16
and float32 arrays give a float64 mean. Our fused mean, and the fused clip-mean-noise path of
the DP wrappers, used to keep the replies' dtype there. Flower's class and ours get the same
replies; the arrays must have Flower's dtypes, and values equal to the replies' rounding."""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flower_message_helpers import assert_arrays_equal, mock_reply  # noqa: E402
from flwr.app import Array, ArrayRecord  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import (  # noqa: E402
    aggregate_arrayrecords as flower_aggregate_arrayrecords,
)

from fedkernels.integrations import flower as ours  # noqa: E402
from fedkernels.integrations.flower import central_dp as ours_dp  # noqa: E402
from fedkernels.integrations.flower import robust as ours_robust  # noqa: E402

SHAPES = {"w": (4, 3), "b": (3,), "scalar": ()}


def _model(rng, dtype, shapes=SHAPES):
    return {k: np.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}


def _replies(seed, dtype, weight_type, shapes=SHAPES, k=5):
    rng = np.random.default_rng(seed)
    return [mock_reply(_model(rng, dtype, shapes),
                       {"num-examples": weight_type(7.0 * (i + 1)),
                        "train_loss": weight_type(0.5 + 0.25 * i)})
            for i in range(k)]


def _global(dtype, shapes=SHAPES):
    arrays = _model(np.random.default_rng(99), dtype, shapes)
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _tolerance(dtype):
    return {"float16": (2e-3, 2e-3), "float32": (2e-5, 2e-6)}[np.dtype(dtype).name]


STRATEGIES = {
    "FedAvg": (ours, lambda m: m.FedAvg()),
    "FedProx": (ours, lambda m: m.FedProx(proximal_mu=0.1)),
    "FedAvgM": (ours, lambda m: m.FedAvgM(server_momentum=0.5)),
    "FedAdam": (ours, lambda m: m.FedAdam()),
    "FedYogi": (ours, lambda m: m.FedYogi()),
    "FedAdagrad": (ours, lambda m: m.FedAdagrad()),
    "QFedAvg": (ours, lambda m: m.QFedAvg(0.1)),
    "Krum": (ours_robust, lambda m: m.Krum(num_malicious_nodes=1)),
    "MultiKrum": (ours_robust, lambda m: m.MultiKrum(num_malicious_nodes=1,
                                                     num_nodes_to_select=3)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("weight_type", [float, np.float64], ids=["float", "np.float64"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategies_take_flowers_dtype_for_numpy_weights(name, weight_type, dtype):
    module, make = STRATEGIES[name]
    results = []
    for m in (flower, module):
        strategy = make(m)
        strategy.current_arrays = _global(dtype)
        if name in ("FedAdam", "FedYogi", "FedAdagrad"):  # FedOpt keeps NumPy arrays there
            strategy.current_arrays = {k: v.numpy() for k, v in strategy.current_arrays.items()}
        rounds = []
        for r in (1, 2):
            if name == "QFedAvg":  # it empties current_arrays while it aggregates, as Flower's
                strategy.current_arrays = _global(dtype)
            rounds.append(strategy.aggregate_train(r, _replies(r, dtype, weight_type))[0])
        results.append(rounds)
    rtol, atol = _tolerance(dtype)
    for theirs, got in zip(*results, strict=True):
        assert_arrays_equal(got, theirs, rtol, atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_aggregate_arrayrecords_takes_flowers_dtype_for_numpy_weights(dtype):
    def contents():
        return [m.content for m in _replies(3, dtype, np.float64)]

    theirs = flower_aggregate_arrayrecords(contents(), "num-examples")
    got = ours.aggregate_arrayrecords(contents(), "num-examples")
    assert {v.numpy().dtype for v in theirs.values()} == {np.dtype(np.float64)}
    assert_arrays_equal(got, theirs, *_tolerance(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("wrapper", ["Fixed", "Adaptive"])
def test_dp_wrappers_take_flowers_dtype_for_numpy_weights(wrapper, dtype):
    """Noise off: the clipped mean of the wrapped FedAvg, in Flower's dtype (0-d arrays are
    left out: Flower does not clip them, ours does, a documented difference)."""
    shapes = {"w": (4, 3), "b": (3,)}
    results = []
    for m, inner in ((flower, flower.FedAvg), (ours_dp, ours.FedAvg)):
        if wrapper == "Fixed":
            strategy = m.DifferentialPrivacyServerSideFixedClipping(inner(), 0.0, 1.0, 5)
        else:
            strategy = m.DifferentialPrivacyServerSideAdaptiveClipping(
                inner(), 0.0, 5, initial_clipping_norm=1.0, clipped_count_stddev=0.0)
        strategy.current_arrays = _global(dtype, shapes)
        results.append(strategy.aggregate_train(1, _replies(4, dtype, np.float64, shapes))[0])
    theirs, got = results
    assert {v.numpy().dtype for v in theirs.values()} == {np.dtype(np.float64)}
    assert_arrays_equal(got, theirs, *_tolerance(dtype))
