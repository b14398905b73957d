"""The scenarios of Flower's own unit tests for the robust strategies, which
test_flower_message_flower_tests.py and test_flower_legacy.py do not cover: the Message API's
``fedmedian_test``, ``fedtrimmedavg_test`` and ``multikrum_test`` (Krum and MultiKrum), and the
legacy API's ``fedmedian_test``, ``krum_test``, ``multikrum_test`` and ``bulyan_test``
(``flwr/serverapp/strategy`` and ``flwr/server/strategy`` of Flower 1.4x; the flwr wheel does
not ship them). Re-expressed here and run twice, with Flower's class and with ours.

Flower's assertions in these tests are exact (``assert_equal``, ``==`` on float32 arrays, the
``object_id`` hash of an ArrayRecord's bytes), so the checks below are exact as well: on these
inputs ours has to give Flower's bytes, not values within rounding."""

from __future__ import annotations

from unittest.mock import MagicMock

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flower_message_helpers import mock_reply  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from flwr.common import (  # noqa: E402
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import strategy as flower_legacy  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402

from fedkernels.integrations.flower import legacy_robust as ours_legacy  # noqa: E402
from fedkernels.integrations.flower import robust as ours  # noqa: E402

MESSAGE = pytest.mark.parametrize("module", [flower, ours], ids=["flower", "fedkernels"])
LEGACY = pytest.mark.parametrize("module", [flower_legacy, ours_legacy],
                                 ids=["flower", "fedkernels"])


def _replies(vectors, examples):
    """Mock replies (as Flower's tests build them), each with one unnamed 1-D array."""
    return [mock_reply({"0": np.asarray(v)}, {"num-examples": n})
            for v, n in zip(vectors, examples, strict=True)]


def _only_array(record: ArrayRecord) -> np.ndarray:
    (array,) = record.to_numpy_ndarrays()
    return array


# ---------------------------------------------------------------- Message API


@MESSAGE
def test_fedmedian_of_three_permuted_replies_is_exact(module):
    """Every coordinate holds 0.2, 0.5 and 1.0 in some order, so the median is 0.5 exactly,
    whatever the (ignored) example counts."""
    base = [0.2, 0.5, 1.0]
    vectors = [np.array([base[(i + k) % 3] for i in range(4)]) for k in range(3)]
    arrays, _ = module.FedMedian().aggregate_train(1, _replies(vectors, [4, 7, 1]))
    np.testing.assert_equal(_only_array(arrays), np.full(4, 0.5))


@MESSAGE
def test_fedtrimmedavg_drops_one_reply_at_each_end(module):
    """β = 0.25 of four replies trims one value per end per coordinate; the two kept ones
    are 0.5 and 0.5 wherever the other three values are 0.2, 0.5 and 1.0."""
    base = [0.2, 0.5, 1.0]
    vectors = [np.full(4, 0.5)] + [np.array([base[(i + k) % 3] for i in range(4)])
                                   for k in range(3)]
    arrays, _ = module.FedTrimmedAvg(beta=0.25).aggregate_train(1, _replies(vectors, [1] * 4))
    np.testing.assert_equal(_only_array(arrays), np.full(4, 0.5))


@MESSAGE
def test_fedtrimmedavg_keeps_a_0d_array_0d(module):
    values = [np.array(v) for v in (4.0, 0.25, 64.0, 1.0)]  # trimmed: 1.0 and 4.0
    arrays, _ = module.FedTrimmedAvg(beta=0.25).aggregate_train(1, _replies(values, [3] * 4))
    result = _only_array(arrays)
    assert result.shape == ()
    np.testing.assert_equal(result, np.array(2.5))


@MESSAGE
def test_krum_returns_the_middle_reply_bytes(module):
    """With f = 1 of three replies each score is the one nearest distance; the middle reply
    has the smallest, and Krum returns it as it came (same ArrayRecord hash)."""
    vectors = [np.full(4, 0.2), np.full(4, 0.7), np.full(4, 1.0)]
    arrays, _ = module.Krum(num_malicious_nodes=1).aggregate_train(1, _replies(vectors, [5] * 3))
    assert arrays.object_id == ArrayRecord([np.full(4, 0.7)]).object_id


@MESSAGE
def test_multikrum_mean_of_the_two_best_is_exact(module):
    """Scores with f = 1: 0.09, 0.09 and 0.25 per coordinate, so the replies at 0.2 and 0.5
    are kept; with equal example counts their mean is 0.35 (0.1 + 0.25 in float64)."""
    vectors = [np.full(4, 0.2), np.full(4, 0.5), np.full(4, 1.0)]
    strategy = module.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=2)
    arrays, _ = strategy.aggregate_train(1, _replies(vectors, [5] * 3))
    assert arrays.object_id == ArrayRecord([np.full(4, 0.35)]).object_id


# ---------------------------------------------------------------- legacy API


def _fit_results(vectors, num_examples=5):
    return [(MagicMock(), FitRes(status=Status(code=Code.OK, message="Success"),
                                 parameters=ndarrays_to_parameters([np.asarray(v, np.float32)]),
                                 num_examples=num_examples, metrics={}))
            for v in vectors]


def _initial():
    return ndarrays_to_parameters([np.full(4, 0.1, np.float32)])


def _aggregate_fit(strategy, vectors) -> np.ndarray:
    parameters, _ = strategy.aggregate_fit(1, _fit_results(vectors), [])
    (array,) = parameters_to_ndarrays(parameters)
    return array


@LEGACY
@pytest.mark.parametrize("name", ["FedMedian", "Krum"])
@pytest.mark.parametrize("available, fit_clients", [(20, 20), (19, 19), (10, 10), (9, 9)])
def test_legacy_sampling_is_flowers(module, name, available, fit_clients):
    cls = getattr(module, name)
    assert cls().num_fit_clients(available)[0] == fit_clients
    # fraction_evaluate=0.05 of 19 to 40 clients is below min_evaluate_clients (2)
    assert cls(fraction_evaluate=0.05).num_evaluation_clients(2 * available)[0] == 2


@LEGACY
def test_legacy_fedmedian_is_exact(module):
    strategy = module.FedMedian(initial_parameters=_initial())
    got = _aggregate_fit(strategy, [np.full(4, 1.0), np.full(4, 0.5), np.full(4, 0.2)])
    assert got.dtype == np.float32
    assert (got == np.full(4, 0.5, np.float32)).all()


@LEGACY
def test_legacy_krum_returns_the_middle_model(module):
    strategy = module.Krum(initial_parameters=_initial(), num_malicious_clients=1)
    got = _aggregate_fit(strategy, [np.full(4, 0.7), np.full(4, 1.0), np.full(4, 0.2)])
    assert (got == np.full(4, 0.7, np.float32)).all()


@LEGACY
def test_legacy_multi_krum_mean_is_exact(module):
    strategy = module.Krum(initial_parameters=_initial(), num_malicious_clients=1,
                           num_clients_to_keep=2)
    got = _aggregate_fit(strategy, [np.full(4, 1.0), np.full(4, 0.5), np.full(4, 0.2)])
    assert got.dtype == np.float32
    assert (got == np.full(4, 0.35, np.float32)).all()


@LEGACY
def test_legacy_bulyan_without_malicious_clients_is_the_plain_mean(module):
    """f = 0 and to_keep = 0: every client is selected and β = K, so Bulyan is the mean of all
    six. The values are sums of powers of two, so every partial sum is exact in float32 and the
    result is the one rounding of 13.75 / 6, in whatever order the values are added."""
    values = [0.25, 0.5, 0.75, 12.0, 0.125, 0.125]
    strategy = module.Bulyan(initial_parameters=_initial(), num_malicious_clients=0, to_keep=0)
    got = _aggregate_fit(strategy, [np.full(4, v) for v in values])
    assert got.dtype == np.float32
    assert (got == np.full(4, 13.75 / 6, np.float32)).all(), got
