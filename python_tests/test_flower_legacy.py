"""fedkernels.integrations.flower.legacy side by side with Flower's legacy strategies.

Every scenario hands the same ``FitRes`` results to Flower's ``flwr.server.strategy`` class and
to ours over several rounds (hyperparameters changed on the instances between rounds) and
checks that both give the same Parameters (dtype, shape, value to the arrays' rounding), the
same metrics, the same log warnings and NumPy warnings, the same exception type and the same
optimizer state. The scenarios of Flower's own tests for these strategies and for
``aggregate.py`` are rewritten here against our classes.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from unittest.mock import MagicMock

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.common import (  # noqa: E402
    Code,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import strategy as flower  # noqa: E402
from flwr.server.strategy import aggregate as flower_aggregate  # noqa: E402

from fedkernels.integrations.flower import legacy  # noqa: E402

# ---------------------------------------------------------------- helpers


def fit(arrays, num_examples, metrics=None):
    return (MagicMock(), FitRes(status=Status(code=Code.OK, message="Success"),
                                parameters=ndarrays_to_parameters(arrays),
                                num_examples=num_examples, metrics=metrics or {}))


def tolerance(dtype, precision=None) -> dict:
    """Rounding allowance for a result of ``dtype`` computed from inputs of ``precision``
    (a float32 model through Flower's FedAdam comes back float64, with float32 rounding)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and precision is not None and \
            np.dtype(precision).itemsize < dtype.itemsize:
        dtype = np.dtype(precision)
    if dtype == np.float16:
        return dict(rtol=4e-3, atol=4e-3)
    if dtype == np.float32:
        return dict(rtol=2e-5, atol=2e-6)
    if dtype.kind == "f":
        return dict(rtol=1e-9, atol=1e-12)
    return dict(rtol=0, atol=0)


def assert_same_arrays(ours, theirs, *, same_type=True, what="", precision=None):
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if same_type:
            assert type(a) is type(b), f"{what} array {i}: {type(a)} vs Flower's {type(b)}"
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"{what} array {i}: {a.dtype} vs Flower's {b.dtype}"
        assert a.shape == b.shape, f"{what} array {i}: {a.shape} vs Flower's {b.shape}"
        np.testing.assert_allclose(a, b, equal_nan=True, err_msg=f"{what} array {i}",
                                   **tolerance(b.dtype, precision))


def assert_same_parameters(ours, theirs, what="", precision=None):
    if theirs is None:
        assert ours is None, what
        return
    assert isinstance(ours, Parameters), what
    assert ours.tensor_type == theirs.tensor_type
    assert_same_arrays(parameters_to_ndarrays(ours), parameters_to_ndarrays(theirs), what=what,
                       precision=precision)


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))


@contextlib.contextmanager
def observed():
    """Collects Flower's log records and NumPy/Python warnings of the block, and its
    exception instead of raising it."""
    handler = LogRecords()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    outcome = {"logs": handler.records, "error": None, "value": None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield outcome
            except Exception as err:  # compared with the other side's
                outcome["error"] = err
        outcome["warnings"] = sorted({(w.category.__name__, str(w.message)) for w in caught})
    finally:
        logger.removeHandler(handler)


def call_both(ours_fn, theirs_fn):
    with observed() as mine:
        mine["value"] = ours_fn()
    with observed() as flowers:
        flowers["value"] = theirs_fn()
    assert type(mine["error"]) is type(flowers["error"]), (mine["error"], flowers["error"])
    assert mine["logs"] == flowers["logs"]
    assert mine["warnings"] == flowers["warnings"]
    return mine["value"], flowers["value"]


class StandInClientManager:
    def __init__(self, n):
        self.clients = [MagicMock() for _ in range(n)]

    def num_available(self):
        return len(self.clients)

    def sample(self, num_clients, min_num_clients=None, criterion=None):
        return self.clients[:num_clients]


SHAPES = [(3, 4), (4,), (), (2, 3, 2)]


def model(rng, dtypes, shift=0.0):
    out = []
    for shape, dtype in zip(SHAPES, dtypes):
        dtype = np.dtype(dtype)
        if dtype.kind == "f":
            out.append((rng.standard_normal(shape) + shift).astype(dtype))
        elif dtype.kind == "b":
            out.append(rng.random(shape) < 0.5)
        else:
            out.append(rng.integers(0, 50, size=shape).astype(dtype))
    return out


FLOAT32 = ["float32"] * 4
FLOAT64 = ["float64"] * 4
WITH_INT = ["float32", "float32", "int64", "float32"]


def layouts(kind, k):
    """Per-client dtype lists of a scenario."""
    if kind == "float32":
        return FLOAT32
    if kind == "float64":
        return FLOAT64
    if kind == "mixed":  # the same layer float32 on one client and float64 on another
        return ["float32", "float64", "float32", "float64"] if k % 2 else FLOAT64[:2] + FLOAT32[:2]
    if kind == "int64":
        return WITH_INT
    if kind == "float16":
        return ["float16"] * 4
    raise ValueError(kind)


def round_results(rng, kind, sizes, *, nan_client=None, metrics=None, shift=0.0):
    results = []
    for k, n in enumerate(sizes):
        arrays = model(rng, layouts(kind, k), shift)
        if k == nan_client:
            arrays[0] = arrays[0].copy()
            arrays[0][0, 0] = np.nan
        results.append(fit(arrays, n, None if metrics is None else metrics[k]))
    return results


def accuracy_mean(fit_metrics):
    total = sum(n for n, _ in fit_metrics)
    return {"accuracy": sum(n * m["accuracy"] for n, m in fit_metrics) / total}


def initial(kind):
    return ndarrays_to_parameters(model(np.random.default_rng(99), layouts(kind, 0)))


def loss_of(server_round, arrays, config):
    return float(np.mean(np.square(np.asarray(arrays[0], dtype=np.float64)))) + 0.25, {}


def make_pair(name, kind, **extra):
    """(ours, Flower's) with the same arguments."""
    kwargs = dict(extra)
    if name in ("FedAvgM", "FedAdam", "FedYogi", "FedAdagrad"):
        kwargs.setdefault("initial_parameters", initial(kind))
    if name == "FedProx":
        kwargs.setdefault("proximal_mu", 0.1)
    if name == "QFedAvg":
        kwargs.setdefault("evaluate_fn", MagicMock(side_effect=loss_of))
        ours_kwargs = dict(kwargs, evaluate_fn=MagicMock(side_effect=loss_of))
        return getattr(legacy, name)(**ours_kwargs), getattr(flower, name)(**kwargs)
    return getattr(legacy, name)(**kwargs), getattr(flower, name)(**kwargs)


STATE = {
    "FedAvgM": ["momentum_vector"],
    "FedAdam": ["current_weights", "m_t", "v_t"],
    "FedYogi": ["current_weights", "m_t", "v_t"],
    "FedAdagrad": ["current_weights", "m_t", "v_t"],
    "QFedAvg": ["pre_weights"],
}


def assert_same_state(name, ours, theirs, precision=None):
    for attr in STATE.get(name, []):
        a, b = getattr(ours, attr), getattr(theirs, attr)
        if b is None:
            assert a is None, attr
        else:
            assert_same_arrays(a, b, same_type=False, what=attr, precision=precision)
    if name == "FedAvgM":
        assert_same_parameters(ours.initial_parameters, theirs.initial_parameters,
                               "initial_parameters", precision)
    if name == "QFedAvg":
        assert ours.evaluate_fn.call_count == theirs.evaluate_fn.call_count
        for got, want in zip(ours.evaluate_fn.call_args_list, theirs.evaluate_fn.call_args_list):
            assert got.args[0] == want.args[0] and got.args[2] == want.args[2]
            assert_same_arrays(got.args[1], want.args[1], same_type=False, precision=precision)


def play(name, ours, theirs, rounds, initial_arrays, precision="float32"):
    """Runs configure_fit + aggregate_fit on both for every round; each strategy is fed its own
    previous result as the next round's global model, as Flower's server loop does."""
    manager = StandInClientManager(4)
    current = {"ours": initial_arrays, "theirs": initial_arrays}
    outcomes = []
    for server_round, spec in enumerate(rounds, start=1):
        for attr, value in spec.get("set", {}).items():
            setattr(ours, attr, value)
            setattr(theirs, attr, value)
        ours.configure_fit(server_round, current["ours"], manager)
        theirs.configure_fit(server_round, current["theirs"], manager)
        results, failures = spec["results"], spec.get("failures", [])
        got, want = call_both(
            lambda r=server_round, a=results, f=failures: ours.aggregate_fit(r, a, f),
            lambda r=server_round, a=results, f=failures: theirs.aggregate_fit(r, a, f))
        if want is not None:
            assert got is not None
            assert_same_parameters(got[0], want[0], f"round {server_round}", precision)
            assert got[1] == want[1]
            if want[0] is not None:
                current = {"ours": got[0], "theirs": want[0]}
        assert_same_state(name, ours, theirs, precision)
        outcomes.append(want)
    return outcomes


# ---------------------------------------------------------------- aggregate_ndarrays


def flower_mean(results):
    return flower_aggregate.aggregate([([np.array(a) if isinstance(a, np.ndarray) else a
                                         for a in arrays], n) for arrays, n in results])


def lowest_precision(results):
    """The least precise float dtype among the clients' arrays (None: no float arrays)."""
    floats = [np.asarray(a).dtype for arrays, _ in results for a in arrays
              if np.asarray(a).dtype.kind == "f"]
    return min(floats, key=lambda d: d.itemsize) if floats else None


def both_means(results):
    return call_both(lambda: legacy.aggregate_ndarrays(results), lambda: flower_mean(results))


def test_aggregate_ndarrays_integer_arrays_flower_example():
    # Flower's own aggregate test: integer weights with 1 and 2 examples give their float mean.
    first = [np.array([[1, 2, 3], [4, 5, 6]]), np.array([7, 8, 9, 10])]
    second = [np.array([[1, 2, 3], [4, 5, 6]]), np.array([7, 8, 9, 10])]
    ours = legacy.aggregate_ndarrays([(first, 1), (second, 2)])
    np.testing.assert_equal(ours, [np.array([[1, 2, 3], [4, 5, 6]]), np.array([7, 8, 9, 10])])
    assert [a.dtype for a in ours] == [np.float64, np.float64]


CASES = {
    "float32": lambda g: [(model(g, FLOAT32), 3), (model(g, FLOAT32), 10), (model(g, FLOAT32), 7)],
    "float64": lambda g: [(model(g, FLOAT64), 3), (model(g, FLOAT64), 1)],
    "float16": lambda g: [(model(g, ["float16"] * 4), 3), (model(g, ["float16"] * 4), 5)],
    "mixed float32/float64": lambda g: [(model(g, FLOAT32), 2), (model(g, FLOAT64), 5)],
    "float16 with float32": lambda g: [(model(g, ["float16"] * 4), 2), (model(g, FLOAT32), 5)],
    "int64": lambda g: [(model(g, ["int64"] * 4), 2), (model(g, ["int64"] * 4), 5)],
    "int32": lambda g: [(model(g, ["int32"] * 4), 2), (model(g, ["int32"] * 4), 5)],
    "bool": lambda g: [(model(g, ["bool"] * 4), 2), (model(g, ["bool"] * 4), 5)],
    "int with float": lambda g: [(model(g, WITH_INT), 2), (model(g, FLOAT32), 5)],
    "single client": lambda g: [(model(g, FLOAT32), 4)],
    "one example each": lambda g: [(model(g, FLOAT32), 1), (model(g, FLOAT32), 1)],
    "zero examples": lambda g: [(model(g, FLOAT32), 0), (model(g, FLOAT32), 0)],
    "zero examples float64": lambda g: [(model(g, FLOAT64), 0), (model(g, FLOAT64), 0)],
    "zero total, not all zero": lambda g: [(model(g, FLOAT32), 3), (model(g, FLOAT32), -3)],
    "some zero examples": lambda g: [(model(g, FLOAT32), 0), (model(g, FLOAT32), 4)],
    "numpy int counts": lambda g: [(model(g, FLOAT32), np.int64(2)), (model(g, FLOAT32), 3)],
    "large counts": lambda g: [(model(g, FLOAT32), 60_000), (model(g, FLOAT32), 1_000_000)],
    "nan": lambda g: [([np.array([np.nan, 1.0, 2.0], np.float32)], 2),
                      ([np.array([1.0, np.nan, 3.0], np.float32)], 5)],
    "inf": lambda g: [([np.array([np.inf, 1.0], np.float32)], 2),
                      ([np.array([1.0, -np.inf], np.float32)], 5)],
    "nan with zero examples": lambda g: [([np.array([np.nan, 1.0], np.float32)], 0),
                                         ([np.array([1.0, 2.0], np.float32)], 5)],
    "0-d only": lambda g: [([np.array(1.5, np.float32)], 1), ([np.array(2.5, np.float32)], 3)],
    "empty arrays": lambda g: [([np.zeros((0, 3), np.float32)], 1),
                               ([np.zeros((0, 3), np.float32)], 3)],
    "no arrays": lambda g: [([], 1), ([], 3)],
    "no results": lambda g: [],
    "fortran order": lambda g: [([np.asfortranarray(g.standard_normal((4, 3)))], 1),
                                ([g.standard_normal((4, 3))], 2)],
    "non-contiguous": lambda g: [([g.standard_normal((6, 4))[::2, ::-1]], 1),
                                 ([g.standard_normal((3, 4))], 2)],
    "big-endian": lambda g: [([g.standard_normal(5).astype(">f4")], 1),
                             ([g.standard_normal(5).astype(">f4")], 2)],
    "broadcasting shapes": lambda g: [([np.ones((3,))], 1), ([np.full((1,), 4.0)], 2)],
    "complex": lambda g: [([np.array([1 + 2j, 3j])], 1), ([np.array([2 + 0j, 1j])], 3)],
    "numpy scalars": lambda g: [([np.float32(1.5)], 1), ([np.float32(2.5)], 3)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_aggregate_ndarrays_equals_flower(case):
    results = CASES[case](np.random.default_rng(7))
    ours, theirs = both_means(results)
    if theirs is not None:
        assert_same_arrays(ours, theirs, what=case, precision=lowest_precision(results))


@pytest.mark.parametrize("case", ["float32", "float64", "mixed float32/float64", "int64",
                                  "bool", "int with float", "single client", "zero examples",
                                  "some zero examples", "nan", "0-d only", "no arrays",
                                  "no results", "fortran order", "float16",
                                  "float16 with float32", "numpy int counts"])
def test_aggregate_inplace_equals_flower(case):
    plain = CASES[case](np.random.default_rng(3))
    results = [fit(arrays, n) for arrays, n in plain]
    ours, theirs = call_both(lambda: legacy.aggregate_inplace(results),
                             lambda: flower_aggregate.aggregate_inplace(results))
    if theirs is not None:
        assert_same_arrays(ours, theirs, what=case, precision=lowest_precision(plain))


def test_aggregate_inplace_integer_layers_follow_flowers_truncation():
    # In place, Flower multiplies an integer layer by int(n_k / total): 0 unless one client.
    results = [fit([np.array([4, 8]), np.ones(2, np.float32)], 1),
               fit([np.array([2, 6]), np.ones(2, np.float32)], 3)]
    ours = legacy.aggregate_inplace(results)
    np.testing.assert_array_equal(ours[0], [0, 0])
    assert ours[0].dtype == np.int64 and ours[1].dtype == np.float32
    single = legacy.aggregate_inplace(results[:1])
    np.testing.assert_array_equal(single[0], [4, 8])


def test_aggregate_inplace_keeps_client_zeros_dtype():
    results = [fit([np.ones(3, np.float32)], 1), fit([np.full(3, 2.0)], 1)]
    assert legacy.aggregate_inplace(results)[0].dtype == np.float32
    assert legacy.aggregate_inplace(results[::-1])[0].dtype == np.float64


def test_aggregate_ndarrays_layer_count_mismatch_raises_value_error():
    a, b = [np.ones(2), np.ones(3)], [np.ones(2)]
    with pytest.raises(ValueError):
        flower_aggregate.aggregate([(a, 1), (b, 1)])
    with pytest.raises(ValueError, match="client 1 has 1 arrays"):
        legacy.aggregate_ndarrays([(a, 1), (b, 1)])
    with pytest.raises(ValueError, match="client 1 has 1 arrays"):
        legacy.aggregate_inplace([fit(a, 1), fit(b, 1)])


def test_aggregate_ndarrays_does_not_modify_inputs():
    arrays = [np.arange(4, dtype=np.float32), np.arange(3)]
    legacy.aggregate_ndarrays([(arrays, 2), ([a.copy() for a in arrays], 3)])
    np.testing.assert_array_equal(arrays[0], np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(arrays[1], np.arange(3))


# ---------------------------------------------------------------- FitRes bytes


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    np.array(2.5),
    np.zeros((0, 4), np.float16),
    np.arange(5, dtype=">f8"),
    np.array([True, False]),
    np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::-1],
], ids=["float32", "fortran", "0-d", "empty", "big-endian", "bool", "strided"])
def test_parameters_to_arrays_equals_flower(array):
    parameters = ndarrays_to_parameters([array])
    ours, theirs = legacy.parameters_to_arrays(parameters), parameters_to_ndarrays(parameters)
    assert ours[0].dtype == theirs[0].dtype and ours[0].shape == theirs[0].shape
    np.testing.assert_array_equal(ours[0], theirs[0])


@pytest.mark.parametrize("payload", [b"not an npy payload", ndarrays_to_parameters(
    [np.arange(10.0)]).tensors[0][:-8]], ids=["garbage", "truncated"])
def test_parameters_to_arrays_bad_bytes_raise_flowers_error(payload):
    parameters = Parameters(tensors=[payload], tensor_type="numpy.ndarray")
    with pytest.raises(Exception) as theirs:
        parameters_to_ndarrays(parameters)
    with pytest.raises(type(theirs.value)):
        legacy.parameters_to_arrays(parameters)


# ---------------------------------------------------------------- strategies side by side

ALL = ["FedAvg", "FedProx", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "QFedAvg"]


def test_classes_subclass_flowers_legacy_classes():
    for name in ALL:
        assert issubclass(getattr(legacy, name), getattr(flower, name))
        assert issubclass(getattr(legacy, name), legacy.FedAvg)


def changes(name, server_round):
    """Hyperparameters set on both instances before a round."""
    table = {
        "FedAvg": {2: {"inplace": False}, 3: {"inplace": True}},
        "FedProx": {2: {"proximal_mu": 0.5, "inplace": False}},
        "FedAvgM": {2: {"server_momentum": 0.5}, 3: {"server_learning_rate": 0.3}},
        "FedAdam": {2: {"eta": 0.02, "beta_1": 0.5}, 3: {"beta_2": 0.9, "tau": 1e-3}},
        "FedYogi": {2: {"eta": 0.05}, 3: {"tau": 1e-2, "beta_2": 0.5}},
        "FedAdagrad": {2: {"eta": 0.3}, 3: {"tau": 1e-2}},
        "QFedAvg": {2: {"q_param": 0.5}, 3: {"learning_rate": 0.3}},
    }
    return table[name].get(server_round, {})


def scenario(name, kind, seed=0, **round_options):
    rng = np.random.default_rng(seed)
    sizes = [[5, 10, 3], [7, 2], [4, 4, 4, 1], [9, 6]]
    rounds = []
    for r, s in enumerate(sizes, start=1):
        rounds.append({"results": round_results(rng, kind, s, shift=0.1 * r, **round_options),
                       "set": changes(name, r)})
    return rounds


@pytest.mark.parametrize("kind", ["float32", "float64", "mixed", "int64"])
@pytest.mark.parametrize("name", ALL)
def test_strategy_equals_flower_over_rounds(name, kind):
    extra = {"server_learning_rate": 0.8, "server_momentum": 0.9} if name == "FedAvgM" else {}
    if name == "QFedAvg":
        extra = {"q_param": 0.2, "qffl_learning_rate": 0.1}
    ours, theirs = make_pair(name, kind, **extra)
    outcomes = play(name, ours, theirs, scenario(name, kind),
                    ndarrays_to_parameters(model(np.random.default_rng(99), layouts(kind, 0))),
                    precision="float64" if kind == "float64" else "float32")
    assert any(o is not None and o[0] is not None for o in outcomes)


@pytest.mark.parametrize("name", ALL)
def test_strategy_float16_equals_flower(name):
    ours, theirs = make_pair(name, "float16")
    play(name, ours, theirs, scenario(name, "float16")[:2],
         ndarrays_to_parameters(model(np.random.default_rng(99), layouts("float16", 0))),
         precision="float16")


@pytest.mark.parametrize("name", ALL)
def test_strategy_nan_client_equals_flower(name):
    ours, theirs = make_pair(name, "float32")
    play(name, ours, theirs, scenario(name, "float32", nan_client=1),
         ndarrays_to_parameters(model(np.random.default_rng(99), FLOAT32)))


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("name", ALL)
def test_zero_examples_equal_flower(name, inplace):
    # In place Flower divides by zero (ZeroDivisionError); not in place NumPy gives NaN with a
    # RuntimeWarning; QFedAvg does not use the counts.
    ours, theirs = make_pair(name, "float32")
    rng = np.random.default_rng(5)
    rounds = [{"results": round_results(rng, "float32", [3, 4])},
              {"results": round_results(rng, "float32", [0, 0]), "set": {"inplace": inplace}},
              {"results": round_results(rng, "float32", [2, 5])}]
    play(name, ours, theirs, rounds,
         ndarrays_to_parameters(model(np.random.default_rng(99), FLOAT32)))


@pytest.mark.parametrize("name", ALL)
def test_failures_and_accept_failures_equal_flower(name):
    ours, theirs = make_pair(name, "float32", accept_failures=False)
    rng = np.random.default_rng(6)
    rounds = [
        {"results": round_results(rng, "float32", [3, 4]), "failures": [RuntimeError("lost")]},
        {"results": [], "failures": []},
        {"results": round_results(rng, "float32", [3, 4]), "failures": []},
        {"results": round_results(rng, "float32", [2, 2]),
         "failures": [(MagicMock(), MagicMock())], "set": {"accept_failures": True}},
    ]
    outcomes = play(name, ours, theirs, rounds,
                    ndarrays_to_parameters(model(np.random.default_rng(99), FLOAT32)))
    assert outcomes[0] == (None, {}) and outcomes[1] == (None, {})
    assert outcomes[2][0] is not None and outcomes[3][0] is not None


@pytest.mark.parametrize("name", ALL)
def test_metrics_and_missing_metrics_equal_flower(name):
    # With a metrics function: its result; a client without the metric: the same KeyError;
    # without a function: Flower's warning in round 1 only.
    ours, theirs = make_pair(name, "float32", fit_metrics_aggregation_fn=accuracy_mean)
    rng = np.random.default_rng(8)
    good = [{"accuracy": 0.5}, {"accuracy": 0.75}]
    rounds = [
        {"results": round_results(rng, "float32", [3, 1], metrics=good)},
        {"results": round_results(rng, "float32", [3, 1], metrics=[{"accuracy": 0.1}, {}])},
        {"results": round_results(rng, "float32", [2, 2], metrics=good)},
    ]
    outcomes = play(name, ours, theirs, rounds,
                    ndarrays_to_parameters(model(np.random.default_rng(99), FLOAT32)))
    assert outcomes[0][1] == {"accuracy": 0.5625}
    ours, theirs = make_pair(name, "float32")
    rng = np.random.default_rng(8)
    rounds = [{"results": round_results(rng, "float32", [3, 1])} for _ in range(2)]
    with observed() as seen:
        play(name, ours, theirs, rounds,
             ndarrays_to_parameters(model(np.random.default_rng(99), FLOAT32)))
    assert seen["error"] is None, seen["error"]
    assert seen["logs"].count((logging.WARNING, "No fit_metrics_aggregation_fn provided")) == 2


def test_fedavgm_without_initial_parameters_raises_like_flower():
    ours, theirs = legacy.FedAvgM(server_momentum=0.9), flower.FedAvgM(server_momentum=0.9)
    results = round_results(np.random.default_rng(0), "float32", [1, 2])
    call_both(lambda: ours.aggregate_fit(1, results, []),
              lambda: theirs.aggregate_fit(1, results, []))
    messages = []
    for s in (ours, theirs):
        with pytest.raises(AssertionError) as error:
            s.aggregate_fit(1, results, [])
        messages.append(str(error.value))
    assert messages[0] == messages[1]  # Flower's words
    ours.initial_parameters = theirs.initial_parameters = initial("float32")
    for s in (ours, theirs):  # round 2 without a momentum vector
        with pytest.raises(AssertionError, match="Momentum should have been created on round 1"):
            s.aggregate_fit(2, results, [])


def test_fedavgm_plain_mean_without_server_opt():
    # server_opt is fixed at construction, as in Flower: changing the rate later does nothing.
    ours, theirs = make_pair("FedAvgM", "float32")
    assert not ours.server_opt
    rng = np.random.default_rng(2)
    rounds = [{"results": round_results(rng, "float32", [1, 3]),
               "set": {"server_learning_rate": 0.5}} for _ in range(2)]
    play("FedAvgM", ours, theirs, rounds, initial("float32"))
    assert ours.momentum_vector is None


def test_qfedavg_without_evaluate_fn_raises_like_flower():
    ours, theirs = legacy.QFedAvg(), flower.QFedAvg()
    manager = StandInClientManager(2)
    ours.configure_fit(1, initial("float32"), manager)
    theirs.configure_fit(1, initial("float32"), manager)
    results = round_results(np.random.default_rng(0), "float32", [1, 2])
    call_both(lambda: ours.aggregate_fit(1, results, []),
              lambda: theirs.aggregate_fit(1, results, []))
    with pytest.raises(NameError, match="evaluate_fn"):
        ours.aggregate_fit(1, results, [])


def test_qfedavg_without_pre_weights_raises_like_flower():
    ours, theirs = make_pair("QFedAvg", "float32")
    results = round_results(np.random.default_rng(0), "float32", [1, 2])
    call_both(lambda: ours.aggregate_fit(1, results, []),
              lambda: theirs.aggregate_fit(1, results, []))
    with pytest.raises(AttributeError, match="pre_weights"):
        ours.aggregate_fit(1, results, [])


@pytest.mark.parametrize("loss", [0.0, -1.0, float("nan")], ids=["zero", "negative", "nan"])
def test_qfedavg_degenerate_losses_equal_flower(loss):
    # loss + 1e-10 <= 0 makes Flower's q-power NaN (with NumPy's warning): the result is NaN.
    evaluate = {}
    for side in ("ours", "theirs"):
        evaluate[side] = MagicMock(return_value=(loss, {}))
    ours = legacy.QFedAvg(evaluate_fn=evaluate["ours"])
    theirs = flower.QFedAvg(evaluate_fn=evaluate["theirs"])
    rng = np.random.default_rng(4)
    play("QFedAvg", ours, theirs, [{"results": round_results(rng, "float32", [1, 2])}],
         initial("float32"))


def test_qfedavg_reply_of_a_shape_that_only_broadcasts_raises_like_flower():
    # Flower adds the replies' steps in place: a later (5,) step does not fit the (4, 1) sum.
    pre = [np.zeros((4, 1), np.float32)]
    results = [fit([np.ones((4, 1), np.float32)], 10), fit([np.ones(5, np.float32)], 10)]
    strategies = []
    for cls in (legacy.QFedAvg, flower.QFedAvg):
        strategy = cls(evaluate_fn=lambda r, p, c: (0.5, {}))
        strategy.pre_weights = pre
        strategies.append(strategy)
    call_both(lambda: strategies[0].aggregate_fit(1, results, []),
              lambda: strategies[1].aggregate_fit(1, results, []))
    with pytest.raises(ValueError, match="non-broadcastable"):
        strategies[0].aggregate_fit(1, results, [])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # Flower's float16
@pytest.mark.parametrize("size", [50, 100_000])
def test_qfedavg_float16_models_are_flowers(size):
    """A float16 global model with float16 clients: Flower's gradients and their squared norm
    are float16 (Inf past 65504: 100 000 coordinates moved by ~0.05 with a learning rate of
    0.01, which zeroes the update), its result float64 and not rounded to float16. Ours gives
    exactly Flower's result, and calls evaluate_fn once, as Flower does."""
    rng = np.random.default_rng(12)
    pre = [rng.standard_normal(size).astype(np.float16), np.asarray(0.5, np.float16)]
    clients = [[np.asarray(a + 0.05 * rng.standard_normal(a.shape), np.float16) for a in pre]
               for _ in range(3)]
    outcomes = []
    for cls in (legacy.QFedAvg, flower.QFedAvg):
        evaluate = MagicMock(return_value=(1.3, {}))
        strategy = cls(q_param=0.2, qffl_learning_rate=0.01, evaluate_fn=evaluate)
        strategy.pre_weights = pre
        got, _ = strategy.aggregate_fit(1, [fit(c, 10) for c in clients], [])
        outcomes.append(parameters_to_ndarrays(got))
        assert evaluate.call_count == 1
    for a, b in zip(*outcomes):
        assert a.dtype == b.dtype == np.float64
        np.testing.assert_array_equal(a, b)
    if size == 100_000:
        np.testing.assert_array_equal(outcomes[0][0], pre[0].astype(np.float64))


def test_qfedavg_model_without_arrays_raises_like_flower():
    strategies = []
    for cls in (legacy.QFedAvg, flower.QFedAvg):
        strategy = cls(evaluate_fn=lambda r, p, c: (0.5, {}))
        strategy.pre_weights = []
        strategies.append(strategy)
    results = [fit([], 10), fit([], 20)]
    call_both(lambda: strategies[0].aggregate_fit(1, results, []),
              lambda: strategies[1].aggregate_fit(1, results, []))
    with pytest.raises(IndexError):  # Flower's norm reads the first gradient
        strategies[0].aggregate_fit(1, results, [])


def test_qfedavg_matches_the_q_ffl_formula():
    # An independent float64 evaluation of x + c * sum_k (x_k - x), c = L^q / (lr * H).
    q, lr, loss = 0.3, 0.2, 0.8
    ours = legacy.QFedAvg(q_param=q, qffl_learning_rate=lr,
                          evaluate_fn=lambda r, a, c: (loss, {}))
    rng = np.random.default_rng(11)
    x = [rng.standard_normal((4, 3)), rng.standard_normal(3)]
    clients = [[rng.standard_normal((4, 3)), rng.standard_normal(3)] for _ in range(3)]
    ours.configure_fit(1, ndarrays_to_parameters(x), StandInClientManager(3))
    got, _ = ours.aggregate_fit(1, [fit(c, 1) for c in clients], [])
    big_l = loss + 1e-10
    sq = [sum(float(np.sum((a - b) ** 2)) for a, b in zip(x, c)) / lr**2 for c in clients]
    h = sum(q * big_l ** (q - 1) * s + big_l**q / lr for s in sq)
    c = big_l**q / (lr * h)
    expected = [xl + c * sum(cl[i] - xl for cl in clients) for i, xl in enumerate(x)]
    assert_same_arrays(parameters_to_ndarrays(got), expected, same_type=False)


def test_fedadam_round_one_matches_the_adam_formula():
    # m = (1 - b1) d, v = (1 - b2) d^2 and the bias-corrected rate of Flower's FedAdam, with
    # d the example-weighted mean minus the initial weights.
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-9
    x0 = [np.zeros(4), np.ones((2, 2))]
    ours = legacy.FedAdam(initial_parameters=ndarrays_to_parameters(x0), eta=eta,
                          beta_1=b1, beta_2=b2, tau=tau)
    clients = [[np.full(4, 1.0), np.full((2, 2), 3.0)], [np.full(4, 4.0), np.zeros((2, 2))]]
    got, _ = ours.aggregate_fit(1, [fit(clients[0], 1), fit(clients[1], 2)], [])
    mean = [(1 * a + 2 * b) / 3 for a, b in zip(*clients)]
    d = [m - x for m, x in zip(mean, x0)]
    rate = eta * np.sqrt(1 - b2**2) / (1 - b1**2)
    expected = [x + rate * (1 - b1) * dl / (np.sqrt((1 - b2) * dl**2) + tau)
                for x, dl in zip(x0, d)]
    assert_same_arrays(parameters_to_ndarrays(got), expected, same_type=False)


# ---------------------------------------------------------------- Flower's own scenarios


@pytest.mark.parametrize("available, expected", [(20, 20), (19, 19), (10, 10), (9, 9)])
def test_fedavg_num_fit_clients(available, expected):
    assert legacy.FedAvg().num_fit_clients(available)[0] == expected


@pytest.mark.parametrize("available", [40, 39, 20, 19])
def test_fedavg_num_evaluation_clients(available):
    assert legacy.FedAvg(fraction_evaluate=0.05).num_evaluation_clients(available)[0] == 2


def test_fedavg_inplace_equals_not_inplace():
    rng = np.random.default_rng(0)
    results = [fit([rng.standard_normal((100, 64)), rng.standard_normal((314, 628, 3))], n)
               for n in (1, 5)]
    reference, _ = legacy.FedAvg(inplace=False).aggregate_fit(1, results, [])
    inplace, _ = legacy.FedAvg().aggregate_fit(1, results, [])
    for a, b in zip(parameters_to_ndarrays(reference), parameters_to_ndarrays(inplace)):
        np.testing.assert_allclose(a, b, rtol=1e-7)


def two_equal_clients():
    layer0 = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    layer1 = np.array([7, 8, 9, 10], dtype=np.float32)
    return [fit([layer0, layer1], 1), fit([layer0.copy(), layer1.copy()], 2)], [layer0, layer1]


def test_fedavgm_near_one_rate_near_zero_momentum_two_rounds():
    results, expected = two_equal_clients()
    zeros = [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)]
    strategy = legacy.FedAvgM(initial_parameters=ndarrays_to_parameters(zeros),
                              server_learning_rate=1.0 + 1e-9, server_momentum=1.0e-9)
    strategy.aggregate_fit(1, results, [])
    got, _ = strategy.aggregate_fit(2, results, [])
    for a, b in zip(parameters_to_ndarrays(got), expected):
        np.testing.assert_almost_equal(a, b)


def test_fedadagrad_flower_example_is_exact():
    strategy = legacy.FedAdagrad(eta=0.1, eta_l=0.316, tau=0.5, initial_parameters=(
        ndarrays_to_parameters([np.full(4, 0.1, np.float32)])))
    results = [fit([np.full(4, 0.2, np.float32)], 5), fit([np.full(4, 1.0, np.float32)], 5)]
    got, _ = strategy.aggregate_fit(1, results, [])
    assert (parameters_to_ndarrays(got)[0] == np.full(4, 0.15, np.float32)).all()
