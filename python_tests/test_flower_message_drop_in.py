"""One test per reported drop-in gap of fedkernels' Flower Message-API strategies, and the
fedkernels-only options (``int_policy``, ``check_finite``), each checked against Flower's class
where Flower defines the behaviour."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flower_message_helpers import (  # noqa: E402
    StandInGrid,
    arrayrecord,
    as_numpy,
    assert_arrays_equal,
    assert_metrics_equal,
    error_reply,
    mock_reply,
    real_reply,
    task_identity,  # noqa: F401 - fixture
)
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402
from flwr.serverapp.exception import AggregationError  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords  # noqa: E402

from fedkernels.integrations import flower as fkf  # noqa: E402

DROP_INS = ["FedAvg", "FedProx", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "QFedAvg"]


def make(module, name, **kwargs):
    if name == "QFedAvg":
        kwargs.setdefault("client_learning_rate", 0.1)
    return getattr(module, name)(**kwargs)


def replies(states, sizes=None, losses=None, mock=False):
    sizes = sizes or [10.0 * (k + 1) for k in range(len(states))]
    losses = losses or [0.5 + k for k in range(len(states))]
    out = []
    for k, (s, n, f) in enumerate(zip(states, sizes, losses)):
        metrics = {"num-examples": n, "train_loss": f}
        out.append(mock_reply(s, metrics) if mock else real_reply(k + 1, s, metrics))
    return out


def clients(rng, like, dtype, count=3):
    return [{k: np.asarray(v + 0.1 * rng.standard_normal(np.shape(v)), dtype=dtype)
             for k, v in like.items()} for _ in range(count)]


def set_current(strategy, name, state):
    if name in ("FedAdam", "FedYogi", "FedAdagrad"):
        strategy.current_arrays = {k: np.array(v) for k, v in state.items()}
    elif name in ("FedAvgM", "QFedAvg"):
        strategy.current_arrays = arrayrecord(state)


# ---------------------------------------------------------------- class and state


@pytest.mark.parametrize("name", DROP_INS)
def test_subclasses_flowers_class_and_keeps_its_state(name):
    ours, theirs = make(fkf, name), make(flower, name)
    assert isinstance(ours, getattr(flower, name))
    public = {k for k in vars(theirs) if not k.startswith("_")}
    assert public <= set(vars(ours)), public - set(vars(ours))
    for attr in public:
        assert getattr(ours, attr) == getattr(theirs, attr) or attr.endswith("_fn")


@pytest.mark.parametrize("name", DROP_INS)
def test_constructor_is_flowers_plus_two_keywords(name):
    theirs = inspect.signature(getattr(flower, name))
    ours = inspect.signature(getattr(fkf, name))
    assert list(ours.parameters)[: len(theirs.parameters)] == list(theirs.parameters)
    assert list(ours.parameters)[len(theirs.parameters):] == ["int_policy", "check_finite"]
    for p in ("int_policy", "check_finite"):
        assert ours.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY


def test_positional_arguments_as_in_flower():
    a, b = fkf.FedAvg(0.5, 0.25, 3), flower.FedAvg(0.5, 0.25, 3)
    assert (a.fraction_train, a.fraction_evaluate, a.min_train_nodes) == \
        (b.fraction_train, b.fraction_evaluate, b.min_train_nodes)
    assert fkf.QFedAvg(0.05, 0.3).q == 0.3
    assert fkf.FedAvgM(1.0, 1.0, 2, 2, 2, "n", "a", "c", None, None, 0.5, 0.9).server_opt
    with pytest.raises(TypeError):
        fkf.FedAdam(0.5)  # keyword-only in Flower too
    with pytest.raises(TypeError):
        flower.FedAdam(0.5)


def test_invalid_options_are_clear_errors():
    with pytest.raises(ValueError, match="int_policy"):
        fkf.FedAvg(int_policy="average")
    with pytest.raises(TypeError, match="check_finite"):
        fkf.FedAvg(check_finite="yes")
    strategy = fkf.FedAvgM(server_momentum=0.5)
    strategy.current_arrays = arrayrecord({"w": np.zeros(2)})
    strategy.int_policy = "sum"  # changed after construction: checked before anything moves
    with pytest.raises(ValueError, match="int_policy"):
        strategy.aggregate_train(1, replies([{"w": np.ones(2)}]))
    assert strategy.momentum_vector is None
    assert np.array_equal(strategy.current_arrays["w"].numpy(), np.zeros(2))


def test_selection_strategies_are_not_wrapped():
    """A trimmed mean or a median is not a weighted sum: they wait for a selection op."""
    assert not hasattr(fkf, "FedMedian") and not hasattr(fkf, "FedTrimmedAvg")


# ---------------------------------------------------------------- reported gaps


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "QFedAvg"])
def test_setting_current_arrays_directly(name):
    """Flower's tests and user code set ``current_arrays`` instead of calling
    configure_train; it used to fail with 'aggregate_train before configure_train'."""
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    states = clients(rng, start, np.float64)
    extra = {"server_momentum": 0.9} if name == "FedAvgM" else {}
    ours, theirs = make(fkf, name, **extra), make(flower, name, **extra)
    for s in (ours, theirs):
        set_current(s, name, start)
    a, _ = ours.aggregate_train(1, replies(states))
    b, _ = theirs.aggregate_train(1, replies(states))
    assert_arrays_equal(a, b, 1e-12, 1e-12)


@pytest.mark.parametrize("name,attr,value", [
    ("FedAdam", "eta", 0.5),
    ("FedYogi", "eta", 0.3),
    ("FedAdagrad", "tau", 0.05),
    ("FedAvgM", "server_learning_rate", 0.3),
    ("QFedAvg", "q", 2.0),
    ("QFedAvg", "client_learning_rate", 0.5),
])
def test_hyperparameters_changed_after_construction_take_effect(name, attr, value):
    """``s = FedAdam(); s.eta = 0.5`` aggregates with 0.5, as a FedAdam(eta=0.5) would."""
    rng = np.random.default_rng(1)
    start = {"w": rng.standard_normal((3, 4))}
    states = clients(rng, start, np.float64)
    extra = {"server_momentum": 0.5} if name == "FedAvgM" else {}
    mutated = make(fkf, name, **extra)
    setattr(mutated, attr, value)
    constructed = make(flower, name, **{**extra, attr: value})
    for s in (mutated, constructed):
        set_current(s, name, start)
    a, _ = mutated.aggregate_train(1, replies(states))
    b, _ = constructed.aggregate_train(1, replies(states))
    assert_arrays_equal(a, b, 1e-12, 1e-12)
    default = make(flower, name, **extra)
    set_current(default, name, start)
    c, _ = default.aggregate_train(1, replies(states))
    assert not np.allclose(a["w"].numpy(), c["w"].numpy())  # the change mattered


def test_fedavgm_server_opt_as_in_flower():
    """Flower decides ``server_opt`` at construction: changing the learning rate of a
    FedAvgM() without momentum has no effect until ``server_opt`` is set."""
    rng = np.random.default_rng(2)
    start = {"w": rng.standard_normal(5)}
    states = clients(rng, start, np.float64)
    results = []
    for module in (fkf, flower):
        s = module.FedAvgM()
        s.current_arrays = arrayrecord(start)
        s.server_learning_rate = 0.5
        plain, _ = s.aggregate_train(1, replies(states))
        s.server_opt = True
        moved, _ = s.aggregate_train(2, replies(states))
        results.append((plain["w"].numpy(), moved["w"].numpy()))
    (a1, a2), (b1, b2) = results
    np.testing.assert_allclose(a1, b1, rtol=1e-13)
    np.testing.assert_allclose(a2, b2, rtol=1e-13)
    assert not np.allclose(a1, a2)


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "QFedAvg"])
@pytest.mark.parametrize("global_dtype,reply_dtype", [(np.float64, np.float32),
                                                      (np.float32, np.float64)])
def test_mixed_precision_promotes_as_flower(name, global_dtype, reply_dtype):
    """A float64 global model (NumPy's default, e.g. initial_arrays from NumPy) with float32
    clients, and the reverse: no TypeError, Flower's result dtype and values."""
    rng = np.random.default_rng(3)
    start = {"w": np.asarray(rng.standard_normal((4, 4)), dtype=global_dtype),
             "s": np.asarray(rng.standard_normal(), dtype=global_dtype)}
    states = clients(rng, start, reply_dtype)
    extra = {"server_momentum": 0.9} if name == "FedAvgM" else {}
    ours, theirs = make(fkf, name, **extra), make(flower, name, **extra)
    for s in (ours, theirs):
        set_current(s, name, start)
    a, _ = ours.aggregate_train(1, replies(states))
    b, _ = theirs.aggregate_train(1, replies(states))
    assert_arrays_equal(a, b, 2e-6, 1e-6)


@pytest.mark.parametrize("name", ["FedAdam", "QFedAvg"])
def test_float32_models_come_back_float64_as_from_flower(name):
    rng = np.random.default_rng(4)
    start = {"w": np.asarray(rng.standard_normal(6), dtype=np.float32)}
    ours = make(fkf, name)
    set_current(ours, name, start)
    out, _ = ours.aggregate_train(1, replies(clients(rng, start, np.float32)))
    assert out["w"].numpy().dtype == np.float64


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # Flower's float16
@pytest.mark.parametrize("size,global_dtype", [(50, np.float16), (50, np.float32),
                                               (100_000, np.float16)])
def test_qfedavg_float16_replies_are_flowers(size, global_dtype):
    """Flower's QFedAvg computes a float16 reply's gradient, squared norm and weighted sum in
    float16 and subtracts the result from the global model in float64. Ours gives Flower's
    result: not rounded to float16, and with a squared norm past float16's 65504 (100 000
    coordinates moved by ~0.05 with L = 100) Flower's Inf, which makes every coefficient 0 and
    returns the global model unchanged."""
    rng = np.random.default_rng(13)
    start = {"w": rng.standard_normal(size).astype(global_dtype),
             "b": np.asarray(0.5, global_dtype)}
    states = [{k: np.asarray(v + 0.05 * rng.standard_normal(np.shape(v)), np.float16)
               for k, v in start.items()} for _ in range(3)]
    results = []
    for module in (fkf, flower):
        strategy = module.QFedAvg(client_learning_rate=0.01)
        strategy.current_arrays = arrayrecord(start)
        results.append(strategy.aggregate_train(1, replies(states)))
    (ours, our_metrics), (theirs, their_metrics) = results
    assert_arrays_equal(ours, theirs, 0.0, 0.0)
    assert_metrics_equal(our_metrics, their_metrics)
    if size == 100_000:
        np.testing.assert_array_equal(ours["w"].numpy(), start["w"].astype(np.float64))


def test_flowers_exception_types():
    rng = np.random.default_rng(5)
    start = {"w": rng.standard_normal(3)}
    states = clients(rng, start, np.float64)
    for module in (fkf, flower):
        with pytest.raises(AggregationError):  # no current arrays
            module.FedAdam().aggregate_train(1, replies(states))
        with pytest.raises(AggregationError):
            module.FedAvgM(server_momentum=0.5).aggregate_train(1, replies(states))
        with pytest.raises(AggregationError):
            module.QFedAvg(0.1).aggregate_train(1, replies(states))
        q = module.QFedAvg(0.1, train_loss_key="loss-before")
        q.current_arrays = arrayrecord(start)
        with pytest.raises(AggregationError):  # no such loss metric
            q.aggregate_train(1, replies(states))
        with pytest.raises(ZeroDivisionError):  # every reply has zero examples
            module.FedAvg().aggregate_train(1, replies(states, sizes=[0.0, 0, 0.0]))
        q = module.QFedAvg(0.0)
        q.current_arrays = arrayrecord(start)
        with pytest.raises(ZeroDivisionError):  # L = 1 / client_learning_rate
            q.aggregate_train(1, replies(states))
        s = module.FedAdagrad()
        s.current_arrays = {"other": np.zeros(3)}
        with pytest.raises(AggregationError):  # keys differ from the global model's
            s.aggregate_train(1, replies(states))


def test_qfedavg_replies_sharing_an_arrayrecord_raise_like_flower():
    """Flower's QFedAvg empties each reply's ArrayRecord as it reads it, so two replies that
    hold the same ArrayRecord object (a test that reuses one) give it no arrays the second
    time: zip's ValueError. Ours raises it too, and leaves the records as Flower does."""
    rng = np.random.default_rng(15)
    start = {"w": rng.standard_normal(4), "b": rng.standard_normal(2)}
    outcomes = []
    for module in (fkf, flower):
        shared = arrayrecord({k: v + 0.1 for k, v in start.items()})
        messages = replies(clients(np.random.default_rng(16), start, np.float64))
        for m in messages[1:]:
            m.content["arrays"] = shared
        strategy = module.QFedAvg(0.1)
        strategy.current_arrays = arrayrecord(start)
        with pytest.raises(ValueError) as error:
            strategy.aggregate_train(1, messages)
        outcomes.append((str(error.value), [len(m.content["arrays"]) for m in messages]))
    assert outcomes[0] == outcomes[1]


def _exception_cases(module):
    """Flower's failures of aggregate_train, on one global model {a, b}."""
    rng = np.random.default_rng(14)
    start = {"a": rng.standard_normal(3), "b": rng.standard_normal(2)}

    def with_state(strategy, **state):
        for attr, value in state.items():
            setattr(strategy, attr, value)
        return strategy

    both = [dict(start), dict(start)]
    return [
        (module.FedAvgM(server_momentum=0.5), 1, both),
        (with_state(module.FedAvgM(server_momentum=0.5),
                    current_arrays=arrayrecord({"a": start["a"]})), 1, both),
        (with_state(module.FedAvgM(server_momentum=0.5),
                    current_arrays=arrayrecord({**start, "c": np.zeros(1)})), 1, both),
        (with_state(module.FedAvgM(server_momentum=0.5), current_arrays=arrayrecord(start),
                    momentum_vector=[np.zeros(3)]), 2, both),
        (with_state(module.FedAvgM(server_momentum=0.5), current_arrays=arrayrecord(start),
                    momentum_vector=[np.zeros(3), np.zeros(2), np.zeros(1)]), 2, both),
        (module.FedAdam(), 1, both),
        (with_state(module.FedYogi(), current_arrays={"a": start["a"], "z": start["b"]}), 1,
         both),
        (with_state(module.FedAdagrad(), current_arrays={"a": start["a"], "b": np.zeros(5)}), 1,
         both),
        (with_state(module.FedAdam(), current_arrays=dict(start),
                    m_t={"a": np.zeros(3), "q": np.zeros(2)}), 1, both),
        (with_state(module.FedAdam(), current_arrays=dict(start), m_t={"b": np.zeros(2)}), 1,
         both),
        (with_state(module.FedYogi(), current_arrays=dict(start),
                    v_t={"b": np.zeros(2), "a": np.zeros(3), "q": 0.0}), 1, both),
        (module.QFedAvg(0.1), 1, both),
        (with_state(module.QFedAvg(0.1, train_loss_key="loss-before"),
                    current_arrays=arrayrecord(start)), 1, both),
    ]


def test_exception_messages_are_flowers():
    """An AggregationError is a ServerApp's exit reason, so its text is Flower's; so are the
    ValueError of FedAvgM's position pairing (zip's) and the key of FedOpt's KeyError."""
    for ours, theirs in zip(_exception_cases(fkf), _exception_cases(flower), strict=True):
        messages = []
        for strategy, server_round, states in (ours, theirs):
            with pytest.raises((AggregationError, ValueError, KeyError)) as error:
                strategy.aggregate_train(server_round, replies(states))
            messages.append((type(error.value), str(error.value)))
        assert messages[0] == messages[1], type(theirs[0]).__name__


@pytest.mark.parametrize("name", DROP_INS)
def test_mock_messages_without_a_numeric_node_id(name):
    """Flower's tests reply with Mock(spec=Message): metadata.src_node_id is a Mock."""
    rng = np.random.default_rng(6)
    start = {"w": rng.standard_normal((2, 3)), "b": np.asarray(0.5)}
    states = clients(rng, start, np.float64)
    ours, theirs = make(fkf, name), make(flower, name)
    for s in (ours, theirs):
        set_current(s, name, start)
    a, m = ours.aggregate_train(1, replies(states, mock=True))
    b, n = theirs.aggregate_train(1, replies(states, mock=True))
    assert_arrays_equal(a, b, 1e-12, 1e-12)
    assert dict(m) == pytest.approx(dict(n))


@pytest.mark.usefixtures("task_identity")
def test_fedavg_drop_in_through_configure_train():
    """The float64 NumPy initial_arrays and float32 torch clients of a typical app."""
    rng = np.random.default_rng(7)
    start = {"w": rng.standard_normal((3, 3))}
    strategy = fkf.FedAdam(eta=0.05)
    strategy.configure_train(1, arrayrecord(start), ConfigRecord(), StandInGrid([1, 2, 3]))
    out, _ = strategy.aggregate_train(1, replies(clients(rng, start, np.float32)))
    assert out["w"].numpy().dtype == np.float64
    assert strategy.m_t["w"].dtype == np.float64


# ---------------------------------------------------------------- int_policy


def _int_round(strategy_name, policy, module=fkf, momentum=0.9):
    rng = np.random.default_rng(8)
    start = {"w": rng.standard_normal(4), "n": np.asarray(5, dtype=np.int64)}
    states = [{"w": start["w"] + 0.1 * k, "n": np.asarray(5 + k, dtype=np.int64)}
              for k in range(1, 4)]
    extra = {"server_momentum": momentum} if strategy_name == "FedAvgM" else {}
    strategy = make(module, strategy_name, **extra) if module is flower else \
        make(module, strategy_name, int_policy=policy, **extra)
    set_current(strategy, strategy_name, start)
    return strategy, start, states


@pytest.mark.parametrize("name", DROP_INS)
def test_int_policy_max_keeps_integers_and_matches_flower_on_floats(name):
    strategy, start, states = _int_round(name, "max")
    out, _ = strategy.aggregate_train(1, replies(states))
    assert out["n"].numpy().dtype == np.int64 and int(out["n"].numpy()) == 8
    # The float arrays: what Flower computes when the replies carry no integer array.
    reference, _, _ = _int_round(name, "mean", module=flower)
    if name in ("FedAvgM", "QFedAvg"):
        reference.current_arrays = arrayrecord({"w": start["w"]})
    elif name not in ("FedAvg", "FedProx"):
        reference.current_arrays = {"w": start["w"]}
    expected, _ = reference.aggregate_train(1, replies([{"w": s["w"]} for s in states]))
    np.testing.assert_allclose(out["w"].numpy(), expected["w"].numpy(), rtol=1e-12)


@pytest.mark.parametrize("name,policy,value", [
    ("FedAvgM", "skip", 5), ("FedAdam", "skip", 5), ("QFedAvg", "skip", 5),
    ("FedAvg", "skip", 6), ("FedAvgM", "first", 6),
])
def test_int_policy_skip_and_first(name, policy, value):
    strategy, _, states = _int_round(name, policy)
    out, _ = strategy.aggregate_train(1, replies(states))
    assert int(out["n"].numpy()) == value and out["n"].numpy().dtype == np.int64


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "QFedAvg"])
def test_int_policy_error_raises_before_any_state_changes(name):
    """Used to raise after the float entries of the global model had moved."""
    rng = np.random.default_rng(9)
    strategy, start, states = _int_round(name, "error")
    # A first round without integer arrays builds up optimizer state.
    if name in ("FedAvgM", "QFedAvg"):
        strategy.current_arrays = arrayrecord({"w": start["w"], "n": start["n"]})
    floats_only = [{"w": s["w"], "n": np.asarray(0.0)} for s in states]
    strategy.aggregate_train(1, replies(floats_only))
    set_current(strategy, name, {"w": start["w"] + 1.0, "n": start["n"]})
    before = {k: as_numpy(getattr(strategy, k)) for k in
              ("current_arrays", "momentum_vector", "m_t", "v_t") if hasattr(strategy, k)}
    identities = {k: id(getattr(strategy, k)) for k in before}
    sent = replies(states)
    with pytest.raises(TypeError, match="int_policy='error'"):
        strategy.aggregate_train(2, sent)
    for k, value in before.items():
        assert id(getattr(strategy, k)) == identities[k], k
        if value is not None:
            assert_arrays_equal(getattr(strategy, k), value, 0, 0, what=k)
    assert all(len(m.content["arrays"]) == 2 for m in sent)  # replies left intact
    del rng


def test_check_finite_names_the_reply():
    states = [{"w": np.ones(3)}, {"w": np.array([1.0, np.nan, 2.0])}]
    with pytest.raises(ValueError, match="client 1"):
        fkf.FedAvg(check_finite=True).aggregate_train(1, replies(states))
    out, _ = fkf.FedAvg().aggregate_train(1, replies(states))  # Flower's: NaN propagates
    assert np.isnan(out["w"].numpy()[1])


def test_aggregate_arrayrecords_equals_flowers_utility():
    rng = np.random.default_rng(10)
    contents = [m.content for m in replies(clients(rng, {"a": np.zeros((7, 3)),
                                                         "z": np.asarray(1.0)}, np.float32))]
    ours = fkf.aggregate_arrayrecords(contents, "num-examples")
    theirs = aggregate_arrayrecords(contents, "num-examples")
    assert_arrays_equal(ours, theirs, 1e-6, 1e-7)


def _record(arrays=None, weight=1.0, **more):
    """A reply's RecordDict: an ArrayRecord "arrays" (unless None), more ArrayRecords by
    name, and a MetricRecord with the weight."""
    records = {} if arrays is None else {"arrays": arrayrecord(arrays)}
    records.update({name: arrayrecord(a) for name, a in more.items()})
    records["metrics"] = MetricRecord({"weight": weight})
    return RecordDict(records)


def _f32(*shape, value=1.0):
    return np.full(shape, value, np.float32)


AGGREGATE_CASES = {
    "extra key later": lambda: [_record({"a": _f32(2)}), _record({"a": _f32(2), "b": _f32(3)}, 3.0)],
    "key missing later": lambda: [_record({"a": _f32(2), "b": _f32(3, value=2)}), _record({"a": _f32(2)}, 3)],
    "keys in another order": lambda: [_record({"a": _f32(2), "b": _f32(3)}),
                                      _record({"b": _f32(3, value=4), "a": _f32(2, value=5)}, 2.0)],
    "two ArrayRecords": lambda: [_record({"a": _f32(2)}, 1.0, more={"c": _f32(1)}),
                                 _record({"a": _f32(2, value=3)}, 3.0, more={"c": _f32(1, value=3)})],
    "same key in two ArrayRecords": lambda: [_record({"a": _f32(2)}, 1.0, more={"a": _f32(2, value=2)}),
                                             _record({"a": _f32(2, value=3)}, 1.0)],
    "ArrayRecord names differ": lambda: [
        RecordDict({"x": arrayrecord({"a": _f32(2)}), "m": MetricRecord({"weight": 1.0})}),
        RecordDict({"y": arrayrecord({"a": _f32(2, value=3)}), "m": MetricRecord({"weight": 1.0})})],
    "empty list": lambda: [],
    "no ArrayRecord": lambda: [_record(None)],
    "some without ArrayRecord": lambda: [_record(None, 2.0), _record({"a": _f32(2, value=4)}, 2.0)],
    "empty ArrayRecord": lambda: [_record({})],
    "dtypes and 0-d, extra key": lambda: [
        _record({"w": np.arange(3.0), "n": np.array(4, np.int64), "h": _f32(2).astype(np.float16)}, 1),
        _record({"w": np.arange(3.0) * 2, "n": np.array(6, np.int64), "h": _f32(2).astype(np.float16),
                 "i": np.array([3, 5], np.int32), "z": np.asarray(np.float32(2.0))}, 3)],
    "int first then float, key missing": lambda: [
        _record({"a": np.array([1, 2], np.int64), "b": _f32(2)}, 1.0),
        _record({"a": np.array([0.5, 0.25], np.float32)}, 1.0)],
    "shapes that broadcast, extra key": lambda: [_record({"a": _f32(2, 3), "b": _f32(1)}),
                                                 _record({"a": _f32(3), "c": _f32(1)})],
    "shapes that do not broadcast, extra key": lambda: [_record({"a": _f32(2)}),
                                                        _record({"a": _f32(3), "c": _f32(1)})],
    "all weights 0, extra key": lambda: [_record({"a": _f32(2)}, 0.0), _record({"b": _f32(2)}, 0.0)],
    "common case": lambda: [_record({"a": _f32(2, 2, value=k), "b": np.arange(3.0) * k}, k + 1)
                            for k in range(4)],
}


@pytest.mark.parametrize("case", list(AGGREGATE_CASES))
def test_aggregate_arrayrecords_side_by_side_with_flowers(case):
    """Replies the built-in strategies would refuse (keys that differ, several or no
    ArrayRecords, no replies) take Flower's own semantics: its keys, values, dtypes, errors."""
    outcomes = []
    for fn in (fkf.aggregate_arrayrecords, aggregate_arrayrecords):
        try:
            outcomes.append(fn(AGGREGATE_CASES[case](), "weight"))
        except Exception as err:  # noqa: BLE001 - the exception is what is compared
            outcomes.append(err)
    ours, theirs = outcomes
    if isinstance(theirs, Exception):
        assert type(ours) is type(theirs), f"ours: {ours!r}, Flower's: {theirs!r}"
        return
    assert isinstance(ours, ArrayRecord), ours
    assert_arrays_equal(ours, theirs, 1e-6, 1e-7)


def test_aggregate_arrayrecords_options_on_flowers_path():
    """check_finite checks every array; int_policy other than "mean" needs aligned replies."""
    records = [_record({"a": _f32(2)}), _record({"a": np.array([1.0, np.nan]), "b": _f32(1)})]
    with pytest.raises(ValueError, match="record 1 carries NaN/Inf in array 'a'"):
        fkf.aggregate_arrayrecords(records, "weight", check_finite=True)
    out = fkf.aggregate_arrayrecords(records, "weight")  # Flower's: NaN propagates
    assert np.isnan(out["a"].numpy()[1])
    records = [_record({"n": np.array([1, 2])}), _record({"n": np.array([3, 4]), "b": _f32(1)})]
    with pytest.raises(ValueError, match="integer array 'n' in record 0 and int_policy='max'"):
        fkf.aggregate_arrayrecords(records, "weight", int_policy="max")
    with pytest.raises(TypeError, match="int_policy='error'"):
        fkf.aggregate_arrayrecords(records, "weight", int_policy="error")


class _FlowerLog:
    """The messages Flower's logger emits inside the block."""

    def __init__(self):
        self.lines: list[str] = []

    def __enter__(self):
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        FLOWER_LOGGER.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        FLOWER_LOGGER.removeHandler(self.handler)


@pytest.mark.parametrize("name", DROP_INS)
def test_summary_logs_exactly_flowers_lines(name):
    ours, theirs = make(fkf, name, int_policy="max"), make(flower, name)
    with _FlowerLog() as log_ours:
        ours.summary()
    with _FlowerLog() as log_theirs:
        theirs.summary()
    assert log_ours.lines == log_theirs.lines and log_theirs.lines


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # Flower's inf / inf
@pytest.mark.parametrize("why", ["big-endian arrays", "non-finite coefficients"])
def test_qfedavg_on_flowers_path_logs_the_replies_once(why):
    """Where QFedAvg hands over to Flower's aggregate_train, "Received N results and M
    failures" and the failures are logged once, as by Flower's class."""
    if why == "big-endian arrays":
        start = {"w": np.zeros(3, np.float32), "x": np.zeros(2, ">f4")}
        losses, q = [0.3, 1.3], 0.2
    else:  # (f + eps)^q overflows: inf / inf
        start = {"w": np.zeros(3, np.float32)}
        losses, q = [1e300, 1e300], 5.0
    states = [{k: np.asarray(v + k_ + 1, v.dtype) for k, v in start.items()} for k_ in range(2)]
    strategies = [fkf.QFedAvg(client_learning_rate=0.1, q=q),
                  flower.QFedAvg(client_learning_rate=0.1, q=q)]
    results = []
    for strategy in strategies:
        strategy.current_arrays = arrayrecord(start)
        with _FlowerLog() as log:
            out = strategy.aggregate_train(1, [error_reply(9)] + replies(states, losses=losses))
        results.append((out, [line for line in log.lines if "eceived" in line]))
    (ours, lines_ours), (theirs, lines_theirs) = results
    assert lines_ours == lines_theirs == ["aggregate_train: Received 2 results and 1 failures",
                                          "\t> Received error in reply from node 9: client failed"]
    assert_arrays_equal(ours[0], theirs[0], 1e-12, 1e-12)
    assert_metrics_equal(ours[1], theirs[1])
    assert vars(strategies[0]).keys() - vars(strategies[1]).keys() == {"int_policy", "check_finite"}


# ---------------------------------------------------------------- fedkernels' own strategies


@pytest.mark.usefixtures("task_identity")
def test_own_strategies_take_mock_replies_and_mixed_precision():
    rng = np.random.default_rng(11)
    start = {"w": rng.standard_normal((3, 2))}  # float64 global model
    states = clients(rng, start, np.float32)
    strategy = fkf.QFFL(q=0.5)
    strategy.configure_train(1, arrayrecord(start), ConfigRecord(), StandInGrid([1, 2, 3]))
    out, _ = strategy.aggregate_train(1, replies(states, mock=True))
    n = np.array([10.0, 20.0, 30.0])
    f = np.array([0.5, 1.5, 2.5])
    w = n * f**0.5 / (n * f**0.5).sum()
    expected = start["w"] + sum(wk * (s["w"].astype(np.float64) - start["w"])
                                for wk, s in zip(w, states))
    np.testing.assert_allclose(out["w"].numpy(), expected, rtol=1e-6)
    fedau = fkf.FedAU()
    fedau.configure_train(1, arrayrecord(start), ConfigRecord(), StandInGrid([1, 2, 3]))
    with pytest.raises(TypeError, match="src_node_id"):
        fedau.aggregate_train(1, replies(states, mock=True))


@pytest.mark.usefixtures("task_identity")
def test_own_strategies_int_policy_error_changes_nothing():
    start = {"w": np.zeros(3), "n": np.asarray(1)}
    strategy = fkf.TERM(int_policy="error")
    strategy.configure_train(1, arrayrecord(start), ConfigRecord(), StandInGrid([1, 2]))
    states = [{"w": np.ones(3), "n": np.asarray(2)}, {"w": 2 * np.ones(3), "n": np.asarray(3)}]
    with pytest.raises(TypeError, match="int_policy='error'"):
        strategy.aggregate_train(1, replies(states))
    assert np.array_equal(strategy.global_state["w"].numpy(), np.zeros(3))
