"""Substitutability of fedkernels' Flower Message-API strategies, side by side with Flower's.

For each drop-in class (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad, QFedAvg) and
each kind of reply (float32, float64, a float64 global model with float32 replies and the
reverse, replies of mixed dtypes, 0-d arrays, int64 counters, NaN, zero examples, a reply with
zero examples and NaN/Inf in its arrays, a missing MetricRecord or weight key or loss, error
replies, no replies, arrays in another order, and ``Mock(spec=Message)`` replies without a
numeric node id), Flower's class and ours go through
three rounds on identical replies, with hyperparameters changed between rounds. Checked every
round: the messages configure_train builds, the returned ArrayRecord (keys, dtypes, shapes,
values to fp32 rounding), the MetricRecord, the exception type, and the public state Flower
keeps (current_arrays, m_t, v_t, momentum_vector).
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from conftest import slow_after_first  # noqa: E402
from flower_message_helpers import (  # noqa: E402
    StandInGrid,
    arrayrecord,
    as_numpy,
    assert_arrays_equal,
    assert_metrics_equal,
    assert_same_exception,
    error_reply,
    mock_reply,
    outcome,
    real_reply,
    task_identity,  # noqa: F401 - fixture
)
from flwr.app import ConfigRecord  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402

from fedkernels.integrations import flower as ours_module  # noqa: E402

# class name -> (positional args, constructor kwargs, changes before round 2, before round 3)
CLASSES = {
    "FedAvg": ((), {}, {"weighted_by_key": "weight"}, {"weighted_by_key": "num-examples"}),
    "FedProx": ((), {"proximal_mu": 0.1}, {"proximal_mu": 0.5}, {"proximal_mu": 0.0}),
    "FedAvgM": ((), {"server_learning_rate": 0.8, "server_momentum": 0.5},
                {"server_learning_rate": 0.3}, {"server_momentum": 0.9}),
    "FedAdam": ((), {"eta": 0.05}, {"eta": 0.5, "beta_1": 0.5}, {"tau": 1e-2, "beta_2": 0.9}),
    "FedYogi": ((), {}, {"eta": 0.1}, {"tau": 1e-2, "beta_2": 0.5}),
    "FedAdagrad": ((), {}, {"eta": 0.5}, {"tau": 1e-2}),
    "QFedAvg": ((0.1,), {"q": 0.2}, {"q": 1.0}, {"client_learning_rate": 0.05}),
}

# The public state each Flower class keeps.
STATE = {
    "FedAvgM": ("current_arrays", "momentum_vector", "server_opt"),
    "FedAdam": ("current_arrays", "m_t", "v_t"),
    "FedYogi": ("current_arrays", "m_t", "v_t"),
    "FedAdagrad": ("current_arrays", "m_t", "v_t"),
    "QFedAvg": ("current_arrays",),
}

SHAPES = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (5, 7), "scalar": ()}
NODES = (11, 22, 33)


def _model(rng, dtype, shapes=SHAPES):
    return {k: np.asarray(rng.standard_normal(s), dtype=dtype) for k, s in shapes.items()}


def _move(rng, global_state, dtype):
    """A client's model: the global one moved by a little noise, in ``dtype``."""
    return {k: np.asarray(np.asarray(v, dtype=np.float64) + 0.1 * rng.standard_normal(v.shape),
                          dtype=dtype if np.asarray(v).dtype.kind == "f" else v.dtype)
            for k, v in global_state.items()}


def _metrics(rng, n=None):
    n = float(rng.integers(5, 50)) if n is None else n
    return {"num-examples": n, "weight": float(rng.uniform(0.5, 2.0)),
            "train_loss": float(rng.uniform(0.2, 2.5)), "acc": [0.5, float(rng.uniform())]}


class Scenario:
    """Initial global model and the replies of each round, as (node, arrays, metrics)
    triples ("error" for an error reply). ``mock``: Mock replies and current_arrays set
    directly, with no configure_train (as Flower's own tests do)."""

    global_dtype = np.float32
    reply_dtypes = (np.float32, np.float32, np.float32)
    shapes = SHAPES
    mock = False
    fp64_only = False

    def initial(self, rng):
        return _model(rng, self.global_dtype, self.shapes)

    def replies(self, r, rng, global_state):
        return [(n, _move(rng, global_state, d), _metrics(rng))
                for n, d in zip(NODES, self.reply_dtypes)]


class Float32(Scenario):
    pass


class Float64(Scenario):
    global_dtype = np.float64
    reply_dtypes = (np.float64,) * 3
    fp64_only = True


class Global64Replies32(Scenario):
    global_dtype = np.float64


class Global32Replies64(Scenario):
    reply_dtypes = (np.float64,) * 3


class MixedReplies(Scenario):
    reply_dtypes = (np.float64, np.float32, np.float64)


class ZeroDim(Scenario):
    global_dtype = np.float64
    reply_dtypes = (np.float32, np.float64, np.float32)
    shapes = {"a": (), "b": (), "c": ()}


class Int64Counter(Scenario):
    def initial(self, rng):
        state = super().initial(rng)
        state["bn.num_batches_tracked"] = np.array(0, dtype=np.int64)
        return state

    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        for k, (_, arrays, _) in enumerate(out):
            arrays["bn.num_batches_tracked"] = np.array(10 * r + k, dtype=np.int64)
        return out


class NaNInReply(Scenario):
    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        if r == 2:
            out[1][1]["fc.weight"][0, 0] = np.nan
        return out


class ZeroExamples(Scenario):
    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        for k, (_, _, metrics) in enumerate(out):
            if k == 0 or r == 3:  # one reply with zero examples; in round 3 all of them
                metrics["num-examples"] = 0.0
                metrics["weight"] = 0.0
        return out


class ZeroExamplesWithNaN(Scenario):
    """A reply with zero examples that carries NaN and Inf: 0 * NaN is NaN in Flower's sum."""

    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        out[0][2]["num-examples"] = 0.0
        out[0][1]["fc.weight"][0, :2] = [np.nan, np.inf]
        return out


class MissingMetricRecord(Scenario):
    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        if r == 2:
            out[2] = (out[2][0], out[2][1], None)
        return out


class MissingWeightKey(Scenario):
    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        if r == 2:
            for _, _, metrics in out:
                del metrics["num-examples"]
        return out


class MissingLoss(Scenario):
    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        for _, _, metrics in out:
            del metrics["train_loss"]
        return out


class ErrorReplies(Scenario):
    def replies(self, r, rng, global_state):
        return super().replies(r, rng, global_state) + ["error"]


class NoReplies(Scenario):
    def replies(self, r, rng, global_state):
        return [] if r == 2 else super().replies(r, rng, global_state)


class ReorderedArrays(Scenario):
    """Reply 0 lists its arrays in the reverse order (Flower pairs some of them by position)."""

    def replies(self, r, rng, global_state):
        out = super().replies(r, rng, global_state)
        node, arrays, metrics = out[0]
        out[0] = (node, dict(reversed(list(arrays.items()))), metrics)
        return out


class MockMessages(Scenario):
    mock = True
    global_dtype = np.float64


SCENARIOS = {cls.__name__: cls for cls in (
    Float32, Float64, Global64Replies32, Global32Replies64, MixedReplies, ZeroDim,
    Int64Counter, NaNInReply, ZeroExamples, ZeroExamplesWithNaN, MissingMetricRecord,
    MissingWeightKey,
    MissingLoss, ErrorReplies, NoReplies, ReorderedArrays, MockMessages)}


def _build(specs, mock):
    out = []
    for spec in specs:
        if spec == "error":
            out.append(error_reply(99))
        else:
            node, arrays, metrics = spec
            arrays = {k: np.array(v) for k, v in arrays.items()}
            out.append(mock_reply(arrays, metrics) if mock else real_reply(node, arrays, metrics))
    return out


def _set_current(name, strategy, global_state):
    """What Flower's tests do instead of configure_train."""
    if name in ("FedAdam", "FedYogi", "FedAdagrad"):
        strategy.current_arrays = {k: np.array(v) for k, v in global_state.items()}
    elif name in ("FedAvgM", "QFedAvg"):
        strategy.current_arrays = arrayrecord(global_state)


def _compare_state(name, ours, theirs, rtol, atol):
    for attr in STATE.get(name, ()):
        a, b = getattr(ours, attr), getattr(theirs, attr)
        if attr == "server_opt":
            assert a == b
        else:
            assert_arrays_equal(a, b, rtol, atol, what=attr)


def run_side_by_side(name: str, scenario: Scenario, seed: int = 0, rounds: int = 3):
    args, kwargs, *changes = CLASSES[name]
    theirs = getattr(flower, name)(*args, **kwargs)
    ours = getattr(ours_module, name)(*args, **kwargs)
    assert isinstance(ours, getattr(flower, name))
    # fp32 rounding, compounded over three rounds: each side feeds back its own result
    # (as start() does) through the optimizers' nonlinear steps.
    rtol, atol = (1e-9, 1e-12) if scenario.fp64_only else (2e-5, 2e-5)
    rng = np.random.default_rng(seed)
    global_state = scenario.initial(rng)
    arrays = {"ours": arrayrecord(global_state), "theirs": arrayrecord(global_state)}
    if scenario.mock:
        _set_current(name, ours, global_state)
        _set_current(name, theirs, global_state)
    grid = StandInGrid(NODES)
    for r in range(1, rounds + 1):
        if r >= 2:
            for attr, value in changes[r - 2].items():
                setattr(ours, attr, value)
                setattr(theirs, attr, value)
        if not scenario.mock:
            sent_ours = list(ours.configure_train(r, arrays["ours"], ConfigRecord(), grid))
            sent_theirs = list(theirs.configure_train(r, arrays["theirs"], ConfigRecord(), grid))
            assert sorted(m.metadata.dst_node_id for m in sent_ours) == \
                sorted(m.metadata.dst_node_id for m in sent_theirs)
            for a, b in zip(sent_ours, sent_theirs):
                assert dict(a.content["config"]) == dict(b.content["config"])
                assert_arrays_equal(a.content["arrays"], b.content["arrays"], rtol, atol)
            _compare_state(name, ours, theirs, rtol, atol)
        specs = scenario.replies(r, rng, as_numpy(arrays["theirs"]))
        result_theirs, err_theirs = outcome(
            theirs.aggregate_train, r, _build(specs, scenario.mock))
        result_ours, err_ours = outcome(ours.aggregate_train, r, _build(specs, scenario.mock))
        assert_same_exception(err_ours, err_theirs)
        if err_theirs is not None:
            return f"raised {type(err_theirs).__name__} in round {r}"
        (a_ours, m_ours), (a_theirs, m_theirs) = result_ours, result_theirs
        assert_arrays_equal(a_ours, a_theirs, rtol, atol, what=f"round {r} arrays")
        assert_metrics_equal(m_ours, m_theirs)
        _compare_state(name, ours, theirs, rtol, atol)
        if a_theirs is not None:  # what start() does with the result
            arrays = {"ours": a_ours, "theirs": a_theirs}
    return "completed"


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("scenario", slow_after_first(SCENARIOS))
@pytest.mark.parametrize("name", list(CLASSES))
def test_side_by_side_with_flower(name, scenario):
    run_side_by_side(name, SCENARIOS[scenario]())


@pytest.mark.usefixtures("task_identity")
def test_scenarios_reach_the_cases_they_are_for():
    """The matrix above exercises what it claims: these scenarios end in these exceptions
    (the same for Flower's class and ours), the others complete three rounds."""
    expected = {
        ("FedAvg", "ZeroExamples"): "raised ZeroDivisionError in round 3",
        ("FedAvg", "MissingMetricRecord"): "raised InconsistentMessageReplies in round 2",
        ("FedAdam", "MissingWeightKey"): "raised InconsistentMessageReplies in round 2",
        ("FedAvg", "MissingWeightKey"): "completed",  # it weighs by "weight" from round 2
        ("QFedAvg", "MissingLoss"): "raised AggregationError in round 1",
        ("QFedAvg", "Int64Counter"): "raised UFuncTypeError in round 1",
        ("QFedAvg", "MockMessages"): "raised ValueError in round 2",  # current_arrays emptied
        ("QFedAvg", "ReorderedArrays"): "raised ValueError in round 1",
        ("FedAvgM", "ReorderedArrays"): "raised ValueError in round 1",
        ("FedAdam", "ReorderedArrays"): "completed",  # FedOpt pairs arrays by name
        ("FedAdam", "NaNInReply"): "completed",
    }
    for (name, scenario), result in expected.items():
        assert run_side_by_side(name, SCENARIOS[scenario]()) == result, (name, scenario)
