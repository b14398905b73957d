"""The scenarios of Flower's own strategy tests (``flwr/serverapp/strategy/fedavgm_test.py``,
``fedopt_test.py`` and ``strategy_utils_test.py`` of Flower 1.2x), re-expressed here and run
twice: with Flower's class and with ours swapped in. Then whole runs through ``start()`` with a
mocked ``Grid``, Flower's class and ours, hyperparameters changed between rounds by the
``evaluate_fn`` callback, compared result by result."""

from __future__ import annotations

import random

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flower_message_helpers import (  # noqa: E402
    assert_arrays_equal,
    mock_reply,
    task_identity,  # noqa: F401 - fixture
)
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import strategy as flower  # noqa: E402
from flwr.serverapp.exception import AggregationError  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import (  # noqa: E402
    aggregate_arrayrecords as flower_aggregate_arrayrecords,
)

from fedkernels.integrations import flower as ours  # noqa: E402

BOTH = pytest.mark.parametrize("module", [flower, ours], ids=["flower", "fedkernels"])


def _reply(arrays: list[np.ndarray], num_examples: float) -> Message:
    return mock_reply({str(i): a for i, a in enumerate(arrays)}, {"num-examples": num_examples})


# ---------------------------------------------------------------- fedavgm_test.py


def _fedavgm_setup(module):
    """Two replies with two arrays each, weighted 1 and 2; the global model is zeros."""
    first = [np.array([[1, 2, 3], [4, 5, 6]], np.float32), np.array([7, 8, 9, 10], np.float32)]
    second = [np.array([[29, 23, 19], [17, 13, 11]], np.float32),
              np.array([7, 5, 3, 2], np.float32)]
    replies = [_reply(first, 1), _reply(second, 2)]
    expected = [(a * 1 + b * 2) / 3 for a, b in zip(first, second)]
    strategy = module.FedAvgM()
    strategy.current_arrays = ArrayRecord([np.zeros((2, 3), np.float32),
                                           np.zeros(4, np.float32)])
    return strategy, replies, expected


@BOTH
def test_fedavgm_learning_rate_near_one_without_momentum(module):
    strategy, replies, expected = _fedavgm_setup(module)
    strategy.server_learning_rate = 1.0 + 1e-9
    actual, _ = strategy.aggregate_train(1, replies)
    for a, e in zip(actual.to_numpy_ndarrays(), expected, strict=True):
        np.testing.assert_almost_equal(a, e, decimal=5)


@BOTH
def test_fedavgm_learning_rate_and_momentum_over_two_rounds(module):
    strategy, replies, expected = _fedavgm_setup(module)
    strategy.server_learning_rate = 1.0 + 1e-9
    strategy.server_momentum = 1e-9
    strategy.aggregate_train(1, replies)
    actual, _ = strategy.aggregate_train(2, replies)
    for a, e in zip(actual.to_numpy_ndarrays(), expected, strict=True):
        np.testing.assert_almost_equal(a, e, decimal=5)


@BOTH
def test_fedavgm_scalar_arrays(module):
    strategy = module.FedAvgM(server_learning_rate=1.0 + 1e-9)
    strategy.current_arrays = ArrayRecord([np.array(0.0)])
    actual, _ = strategy.aggregate_train(1, [_reply([np.array(1.0)], 1),
                                             _reply([np.array(3.0)], 2)])
    value = actual.to_numpy_ndarrays()[0]
    assert value.shape == ()
    np.testing.assert_allclose(value, 7.0 / 3.0, rtol=1e-6)


# ---------------------------------------------------------------- fedopt_test.py


@BOTH
@pytest.mark.parametrize("name", ["FedAdam", "FedYogi", "FedAdagrad"])
@pytest.mark.parametrize("valid,arrays", [
    (True, lambda rng: [rng.standard_normal((7, 3)) for _ in range(4)]),
    (False, lambda rng: [rng.standard_normal((7, 3)) for _ in range(5)]),  # other keys
    (False, lambda rng: [rng.standard_normal((7, 5)) for _ in range(4)]),  # other shapes
])
def test_fedopt_delta_needs_matching_keys_and_shapes(module, name, valid, arrays):
    rng = np.random.default_rng(0)
    strategy = getattr(module, name)()
    global_record = ArrayRecord([rng.standard_normal((7, 3)) for _ in range(4)])
    strategy.current_arrays = {k: a.numpy() for k, a in global_record.items()}
    aggregated = ArrayRecord(arrays(rng))
    # Flower's private helper, inherited unchanged ...
    if valid:
        strategy._compute_deltat_and_mt(aggregated)
    else:
        with pytest.raises(AggregationError):
            strategy._compute_deltat_and_mt(aggregated)
    # ... and the same check through aggregate_train (our fused path).
    fresh = getattr(module, name)()
    fresh.current_arrays = {k: a.numpy() for k, a in global_record.items()}
    replies = [_reply(aggregated.to_numpy_ndarrays(), 1.0)]
    if valid:
        fresh.aggregate_train(1, replies)
    else:
        with pytest.raises(AggregationError):
            fresh.aggregate_train(1, replies)


# ---------------------------------------------------------------- strategy_utils_test.py


AGGREGATE = pytest.mark.parametrize("aggregate_arrayrecords", [
    flower_aggregate_arrayrecords, ours.aggregate_arrayrecords], ids=["flower", "fedkernels"])


@AGGREGATE
def test_arrayrecords_weighted_mean(aggregate_arrayrecords):
    rng = np.random.default_rng(1)
    weights = [0.25, 0.4, 0.35]
    arrays = [[rng.standard_normal((7, 3)) for _ in range(4)] for _ in weights]
    expected = [np.average([a[i] for a in arrays], axis=0, weights=weights) for i in range(4)]
    records = [RecordDict({"arrays": ArrayRecord(a), "metrics": MetricRecord({"weight": w})})
               for a, w in zip(arrays, weights)]
    result = aggregate_arrayrecords(records, "weight")
    assert all(np.allclose(a, b) for a, b in zip(result.to_numpy_ndarrays(), expected))


@AGGREGATE
def test_arrayrecords_weighted_mean_of_0d_arrays(aggregate_arrayrecords):
    rng = np.random.default_rng(2)
    weights = [0.25, 0.4, 0.35]
    values = [np.array(rng.standard_normal()) for _ in weights]
    records = [RecordDict({"arrays": ArrayRecord([v]), "metrics": MetricRecord({"weight": w})})
               for v, w in zip(values, weights)]
    result = aggregate_arrayrecords(records, "weight").to_numpy_ndarrays()[0]
    assert result.shape == ()
    assert np.isclose(result, np.average(values, weights=weights))


# ---------------------------------------------------------------- start() with a mocked Grid


class MockedGrid:
    """A Grid whose nodes answer at once: node n moves every float array by 0.01 n (in
    float32, as torch clients send) and reports 10 n examples and a loss; evaluation replies
    carry metrics only."""

    def __init__(self, nodes):
        self.nodes = list(nodes)
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in sorted(messages, key=lambda m: m.metadata.dst_node_id):
            self.sent.append(message)
            node = message.metadata.dst_node_id
            server_round = message.content["config"]["server-round"]
            metrics = {"num-examples": 10.0 * node, "train_loss": 1.0 + 0.1 * node + server_round}
            if message.metadata.message_type == MessageType.TRAIN:
                arrays = {k: np.asarray(v.numpy() + 0.01 * node * (1 + server_round),
                                        dtype=np.float32)
                          for k, v in message.content["arrays"].items()}
                content = RecordDict({"arrays": ArrayRecord({k: Array(a) for k, a in
                                                             arrays.items()}),
                                      "metrics": MetricRecord(metrics)})
            else:
                content = RecordDict({"metrics": MetricRecord({**metrics, "eval_acc": 0.5})})
            replies.append(Message(content, reply_to=message))
        return replies


START_CASES = {
    "FedAvg": ((), {}, {"fraction_evaluate": 0.5}),
    "FedProx": ((), {"proximal_mu": 0.1}, {"proximal_mu": 1.0}),
    "FedAvgM": ((), {"server_momentum": 0.5}, {"server_learning_rate": 0.5}),
    "FedAdam": ((), {}, {"eta": 0.5}),
    "FedYogi": ((), {}, {"eta": 0.2, "beta_2": 0.5}),
    "FedAdagrad": ((), {}, {"tau": 0.01}),
    "QFedAvg": ((0.1,), {}, {"q": 0.7}),
}


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("name", list(START_CASES))
def test_start_with_a_mocked_grid_equals_flowers(name):
    args, kwargs, change = START_CASES[name]
    results = {}
    for label, module in (("flower", flower), ("fedkernels", ours)):
        strategy = getattr(module, name)(*args, **kwargs)
        grid = MockedGrid([1, 2, 3, 4])

        def evaluate(server_round, arrays, strategy=strategy):
            if server_round == 1:  # changed between rounds 1 and 2
                for attr, value in change.items():
                    setattr(strategy, attr, value)
            return MetricRecord({"norm": float(sum(np.abs(a.numpy()).sum()
                                                   for a in arrays.values()))})

        random.seed(0)  # node sampling
        initial = ArrayRecord({"w": Array(np.linspace(-1.0, 1.0, 12).reshape(3, 4)),
                               "b": Array(np.zeros(4)), "s": Array(np.asarray(0.5))})
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=3,
                                train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=evaluate)
        configs = [(m.metadata.message_type, dict(m.content["config"])) for m in grid.sent]
        results[label] = (result, configs)
    (mine, my_configs), (theirs, their_configs) = results["fedkernels"], results["flower"]
    assert my_configs == their_configs  # proximal-mu, server-round, sampling, evaluation
    assert_arrays_equal(mine.arrays, theirs.arrays, 2e-5, 2e-5, what="result.arrays")
    for history in ("train_metrics_clientapp", "evaluate_metrics_clientapp",
                    "evaluate_metrics_serverapp"):
        a, b = getattr(mine, history), getattr(theirs, history)
        assert list(a) == list(b), history
        for r in b:
            assert dict(a[r]) == pytest.approx(dict(b[r]), rel=2e-5), (history, r)
