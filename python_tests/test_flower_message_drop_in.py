"""One test per reported drop-in gap of fedkernels' Flower Message-API strategies, and the
fedkernels-only options (``int_policy``, ``check_finite``), each checked against Flower's class
where Flower defines the behaviour."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flower_message_helpers import (  # noqa: E402
    StandInGrid,
    arrayrecord,
    as_numpy,
    assert_arrays_equal,
    mock_reply,
    real_reply,
    task_identity,  # noqa: F401 - fixture
)
from flwr.app import ConfigRecord  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402
from flwr.serverapp.exception import AggregationError  # noqa: E402

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
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    rng = np.random.default_rng(10)
    contents = [m.content for m in replies(clients(rng, {"a": np.zeros((7, 3)),
                                                         "z": np.asarray(1.0)}, np.float32))]
    ours = fkf.aggregate_arrayrecords(contents, "num-examples")
    theirs = aggregate_arrayrecords(contents, "num-examples")
    assert_arrays_equal(ours, theirs, 1e-6, 1e-7)


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
