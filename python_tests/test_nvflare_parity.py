"""fedkernels' NVFlare aggregators side by side with NVFlare's own on identical contributions:
constructor checks and messages, accept/reject values and log messages, aggregation stats,
DXO collections, weights and weight diffs, exclusions, per-key weights, weigh_by_local_iter,
integer buffers, torch and NumPy inputs, partial keys, wrong shapes, late and duplicate
contributions; the FedAvg controller's built-in aggregation against WeightedModelAggregator
inside NVFlare's own controller code; BaseFedAvg.aggregate_fn against ours.
"""

from __future__ import annotations

import logging
import random
import re

import numpy as np
import pytest

pytest.importorskip("nvflare", reason="nvflare is not installed (pip install 'fedkernels[nvflare]')")

import torch  # noqa: E402
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable  # noqa: E402
from nvflare.apis.fl_constant import ReservedKey, ReturnCode  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.shareable import Shareable  # noqa: E402
from nvflare.app_common.abstract.aggregator import Aggregator  # noqa: E402
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402
from nvflare.app_common.aggregators import intime_accumulate_model_aggregator as flare_intime  # noqa: E402
from nvflare.app_common.aggregators import weighted_aggregation_helper as flare_helper  # noqa: E402
from nvflare.app_common.app_constant import AppConstants  # noqa: E402
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg  # noqa: E402
from nvflare.app_common.workflows.fedavg import FedAvg  # noqa: E402

from fedkernels.integrations import nvflare as fk  # noqa: E402

Theirs = flare_intime.InTimeAccumulateWeightedAggregator
Ours = fk.InTimeAccumulateWeightedAggregator


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.messages: list[tuple[str, str]] = []
        self.named: list[tuple[str, str, str]] = []  # (logger name, level, message)

    def emit(self, record):
        msg = record.getMessage()
        if "no engine in fl_ctx" not in msg:  # NVFlare's complaint about a bare FLContext
            self.messages.append((record.levelname, msg))
            self.named.append((record.name, record.levelname, msg))


@pytest.fixture
def records():
    handler = _Records()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


def make(cls, **kwargs):
    agg = cls(**kwargs)
    agg._initialize(agg.aggregation_weights, agg.exclude_vars, agg.expected_data_kind)
    return agg


def shareable(dxo: DXO, name: str, contribution_round: int, rc=None) -> Shareable:
    s = Shareable()
    s.set_peer_props({ReservedKey.IDENTITY_NAME: name})
    s.add_cookie(AppConstants.CONTRIBUTION_ROUND, contribution_round)
    s = dxo.update_shareable(s)
    if rc is not None:
        s.set_return_code(rc)
    return s


def ctx(current_round: int) -> FLContext:
    c = FLContext()
    c.set_prop(AppConstants.CURRENT_ROUND, current_round)
    return c


def run(cls, contributions, records=None, current_round=0, **kwargs):
    """contributions: (name, round, dxo[, rc]) tuples. Returns accept values, the result DXO,
    the stats put on the FLContext, and the log messages."""
    agg = make(cls, **kwargs)
    fl_ctx = ctx(current_round)
    if records is not None:
        records.messages.clear()
    accepted = [agg.accept(shareable(dxo, name, r, *rest), fl_ctx)
                for name, r, dxo, *rest in contributions]
    result = from_shareable(agg.aggregate(fl_ctx))
    logs = list(records.messages) if records is not None else None
    return accepted, result, fl_ctx.get_prop(AppConstants.AGGREGATION_STATS), logs


def same_values(ours, theirs, rtol=1e-6, atol=1e-7):
    assert type(ours) is type(theirs)
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        a, b = ours[k], theirs[k]
        assert type(a) is type(b), k
        if isinstance(b, (np.ndarray, torch.Tensor)):
            assert a.dtype == b.dtype, k
            assert tuple(a.shape) == tuple(b.shape), k
            a = a.double().cpu().numpy() if isinstance(a, torch.Tensor) else a
            b = b.double().cpu().numpy() if isinstance(b, torch.Tensor) else b
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=str(k))


def same_dxo(ours: DXO, theirs: DXO, **tol):
    assert ours.data_kind == theirs.data_kind
    assert ours.meta == theirs.meta
    if theirs.data_kind == DataKind.COLLECTION:
        assert list(ours.data) == list(theirs.data)
        for k in theirs.data:
            same_dxo(ours.data[k], theirs.data[k], **tol)
    else:
        same_values(ours.data, theirs.data, **tol)


# ---------------------------------------------------------------- construction


def test_is_an_nvflare_aggregator():
    agg = Ours()
    assert isinstance(agg, Aggregator) and isinstance(agg, Theirs)


@pytest.mark.parametrize(
    "exclude_vars,aggregation_weights,expected_data_kind,message",
    [
        (2.0, None, DataKind.WEIGHT_DIFF, f"exclude_vars = 2.0 should be a regex string but got {float}."),
        ({"dxo1": 3.0, "dxo2": ""}, None, {"dxo1": DataKind.WEIGHT_DIFF, "dxo2": DataKind.WEIGHT_DIFF},
         f"exclude_vars[dxo1] = 3.0 should be a regex string but got {float}."),
        (None, None, DataKind.ANALYTIC,
         f"expected_data_kind = {DataKind.ANALYTIC} is not {DataKind.WEIGHT_DIFF} or {DataKind.WEIGHTS}"),
        (None, None, {"dxo1": DataKind.WEIGHT_DIFF, "dxo2": DataKind.ANALYTIC},
         f"expected_data_kind[dxo2] = {DataKind.ANALYTIC} is not {DataKind.WEIGHT_DIFF} or "
         f"{DataKind.WEIGHTS}"),
        (None, {"dxo1": {"client_0": 1.0, "client_1": 2.0}},
         {"dxo1": DataKind.WEIGHT_DIFF, "dxo2": DataKind.WEIGHT_DIFF},
         "A dict of dict aggregation_weights should specify aggregation_weights "
         "for every key in expected_data_kind. But missed these keys: ['dxo2']"),
        ({"dxo2": ""}, None, {"dxo1": DataKind.WEIGHT_DIFF, "dxo2": DataKind.WEIGHT_DIFF},
         "A dict exclude_vars should specify exclude_vars for every key in expected_data_kind. "
         "But missed these keys: ['dxo1']"),
    ],
)
def test_invalid_create_same_errors(exclude_vars, aggregation_weights, expected_data_kind, message):
    errors = []
    for cls in (Theirs, Ours):
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            make(cls, exclude_vars=exclude_vars, aggregation_weights=aggregation_weights,
                 expected_data_kind=expected_data_kind)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(exclude_vars=None, aggregation_weights=None, expected_data_kind=DataKind.WEIGHTS),
        dict(exclude_vars="hello", aggregation_weights=None,
             expected_data_kind={"dxo1": DataKind.WEIGHTS, "dxo2": DataKind.WEIGHT_DIFF}),
        dict(exclude_vars=None, aggregation_weights={"client_0": 1.0, "client_1": 2.0},
             expected_data_kind={"dxo1": DataKind.WEIGHTS, "dxo2": DataKind.WEIGHT_DIFF}),
        dict(exclude_vars={"dxo1": "a", "dxo2": "b"},
             aggregation_weights={"dxo1": {"c": 1.0}, "dxo2": {"c": 3.0}},
             expected_data_kind={"dxo1": DataKind.WEIGHTS, "dxo2": DataKind.METRICS},
             weigh_by_local_iter=False),
    ],
)
def test_create_same_attributes(kwargs):
    theirs, ours = make(Theirs, **kwargs), make(Ours, **kwargs)
    for attr in ("exclude_vars", "aggregation_weights", "expected_data_kind", "_weigh_by_local_iter"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    for key, dxo_agg in ours.dxo_aggregators.items():
        assert isinstance(dxo_agg.aggregation_helper, fk.WeightedAggregationHelper)
        assert dxo_agg.expected_data_kind == theirs.dxo_aggregators[key].expected_data_kind


def test_start_run_event_installs_the_fused_helper():
    from nvflare.apis.event_type import EventType

    agg = Ours(expected_data_kind=DataKind.WEIGHTS)
    agg.handle_event(EventType.START_RUN, FLContext())
    helper = agg.dxo_aggregators[""].aggregation_helper
    assert isinstance(helper, fk.WeightedAggregationHelper)


# ---------------------------------------------------------------- accept / reject


def weights_dxo(data, n_iter=1, kind=DataKind.WEIGHT_DIFF, meta=None):
    m = {} if n_iter is None else {MetaKey.NUM_STEPS_CURRENT_ROUND: n_iter}
    m.update(meta or {})
    return DXO(kind, data=data, meta=m)


@pytest.mark.parametrize("current_round,contribution_round,expected", [(1, 1, True), (2, 1, False)])
def test_contribution_round_check(records, current_round, contribution_round, expected):
    outcomes = []
    for cls in (Theirs, Ours):
        agg = make(cls, aggregation_weights={"client_0": 0.3, "client_1": 0.9})
        records.messages.clear()
        accepted = agg.accept(shareable(weights_dxo({"var1": np.random.random(4)}), "client_0",
                                        contribution_round), ctx(current_round))
        outcomes.append((accepted, list(records.messages)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][0] is expected


def test_accept_and_reject_values_and_messages(records):
    """Late, duplicate, failed (rc), wrong kind, wrong data kind, not a DXO, missing weight and
    missing NUM_STEPS: the same return values and log messages."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    bad = Shareable()
    bad.set_peer_props({ReservedKey.IDENTITY_NAME: "site-9"})
    contributions = [
        ("site-1", 3, weights_dxo({"w": x}, n_iter=2)),
        ("site-1", 3, weights_dxo({"w": x + 1})),                           # duplicate
        ("site-2", 2, weights_dxo({"w": x + 2})),                           # late
        ("site-3", 3, weights_dxo({"w": x + 3}), ReturnCode.EXECUTION_EXCEPTION),
        ("site-4", 3, weights_dxo({"w": x + 4}, kind=DataKind.WEIGHTS)),    # wrong kind
        ("site-5", 3, weights_dxo({"w": x + 5}, kind=DataKind.ANALYTIC)),   # unsupported kind
        ("site-6", 3, weights_dxo({"w": x + 6}, n_iter=None)),              # no NUM_STEPS
        ("site-7", 3, weights_dxo({"w": x + 7}, n_iter=3)),                 # no weight given
    ]
    outcomes = {}
    for cls in (Theirs, Ours):
        agg = make(cls, aggregation_weights={f"site-{i}": 0.5 * i for i in range(1, 7)})
        fl_ctx = ctx(3)
        records.messages.clear()
        accepted = [agg.accept(shareable(dxo, n, r, *rest), fl_ctx) for n, r, dxo, *rest in contributions]
        accepted.append(agg.accept(bad, fl_ctx))
        result = from_shareable(agg.aggregate(fl_ctx))
        outcomes[cls] = (accepted, list(records.messages), result,
                         fl_ctx.get_prop(AppConstants.AGGREGATION_STATS))
    (a_t, logs_t, res_t, stats_t), (a_o, logs_o, res_o, stats_o) = outcomes[Theirs], outcomes[Ours]
    assert a_o == a_t == [True, False, False, False, False, False, True, True, False]
    assert logs_o == logs_t
    same_dxo(res_o, res_t)
    assert stats_o == stats_t
    expected = (1.0 * x + 3.0 * (x + 6) + 3.0 * (x + 7)) / 7.0
    np.testing.assert_allclose(res_o.data["w"], expected, rtol=1e-6)


def test_processed_algorithm_meta():
    meta = {MetaKey.PROCESSED_ALGORITHM: "quantize"}
    contributions = [(f"c{i}", 0, weights_dxo({"w": np.full(3, float(i))}, meta=meta)) for i in range(3)]
    contributions.append(("c9", 0, weights_dxo({"w": np.ones(3)},
                                                meta={MetaKey.PROCESSED_ALGORITHM: "other"})))
    a_t, r_t, s_t, _ = run(Theirs, contributions)
    a_o, r_o, s_o, _ = run(Ours, contributions)
    assert a_o == a_t == [True, True, True, False]
    same_dxo(r_o, r_t)
    assert r_o.get_meta_prop(MetaKey.PROCESSED_ALGORITHM) == "quantize"
    assert s_o == s_t


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("shape", [4, (6, 6), (3, 5, 7)])
@pytest.mark.parametrize("n_clients", [10, 50])
@pytest.mark.parametrize("kind", [DataKind.WEIGHT_DIFF, DataKind.WEIGHTS])
def test_random_contributions(shape, n_clients, kind):
    rng = np.random.default_rng(n_clients)
    weights = {f"client_{i}": float(rng.random()) for i in range(n_clients)}
    contributions = [(name, 0, weights_dxo({"var1": rng.random(shape), "var2": rng.random(3)},
                                            n_iter=int(rng.integers(1, 50)), kind=kind))
                     for name in weights]
    a_t, r_t, s_t, _ = run(Theirs, contributions, aggregation_weights=weights, expected_data_kind=kind)
    a_o, r_o, s_o, _ = run(Ours, contributions, aggregation_weights=weights, expected_data_kind=kind)
    assert a_o == a_t
    same_dxo(r_o, r_t, rtol=1e-10, atol=1e-12)  # float64 arrays accumulate in float64
    assert s_o == s_t
    num = sum(weights[n] * d.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) * d.data["var1"]
              for n, _, d in contributions)
    den = sum(weights[n] * d.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) for n, _, d in contributions)
    np.testing.assert_allclose(r_o.data["var1"], num / den)


@pytest.mark.parametrize("num_dxo", [1, 2, 3])
@pytest.mark.parametrize("n_clients", [10, 30])
def test_dxo_collections(num_dxo, n_clients):
    rng = np.random.default_rng(num_dxo)
    names = [f"dxo_{i}" for i in range(num_dxo)]
    clients = [f"client_{i}" for i in range(n_clients)]
    weights = {d: {c: float(rng.random()) for c in clients} for d in names}
    contributions = []
    for c in clients:
        n_iter = int(rng.integers(1, 50))
        data = {d: weights_dxo({"var1": rng.random((6, 6)).astype(np.float32)}, n_iter=n_iter)
                for d in names}
        contributions.append((c, 0, DXO(DataKind.COLLECTION, data=data)))
    kinds = {d: DataKind.WEIGHT_DIFF for d in names}
    a_t, r_t, s_t, _ = run(Theirs, contributions, aggregation_weights=weights, expected_data_kind=kinds)
    a_o, r_o, s_o, _ = run(Ours, contributions, aggregation_weights=weights, expected_data_kind=kinds)
    assert a_o == a_t
    same_dxo(r_o, r_t)
    assert s_o == s_t


def test_collection_with_missing_and_metrics_entries(records):
    """A collection lacking one expected DXO, and a METRICS DXO next to the weights."""
    kinds = {"model": DataKind.WEIGHTS, "metrics": DataKind.METRICS}
    contributions = [
        ("a", 0, DXO(DataKind.COLLECTION, data={
            "model": weights_dxo({"w": np.ones(3, np.float32)}, kind=DataKind.WEIGHTS, n_iter=2),
            "metrics": weights_dxo({"acc": 0.5, "loss": np.float64(2.0)}, kind=DataKind.METRICS)})),
        ("b", 0, DXO(DataKind.COLLECTION, data={
            "model": weights_dxo({"w": np.full(3, 3.0, np.float32)}, kind=DataKind.WEIGHTS)})),
        ("c", 0, DXO(DataKind.COLLECTION, data={
            "metrics": weights_dxo({"acc": 0.9, "loss": np.float64(1.0)}, kind=DataKind.METRICS)})),
    ]
    a_t, r_t, s_t, l_t = run(Theirs, contributions, records, expected_data_kind=kinds)
    a_o, r_o, s_o, l_o = run(Ours, contributions, records, expected_data_kind=kinds)
    assert a_o == a_t == [True, True, True]
    same_dxo(r_o, r_t)
    assert s_o == s_t
    assert [m for m in l_o if "InTime" not in m[1]] == [m for m in l_t if "InTime" not in m[1]]
    assert type(r_o.data["metrics"].data["loss"]) is np.float64


@pytest.mark.parametrize("weigh_by_local_iter", [True, False])
def test_exclude_vars_and_weigh_by_local_iter(weigh_by_local_iter):
    rng = np.random.default_rng(3)
    contributions = [(f"s{i}", 0, weights_dxo({
        "layer1.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "layer1.bias": rng.standard_normal(4).astype(np.float32),
        "bn.running_mean": rng.standard_normal(4).astype(np.float32),
    }, n_iter=i + 1)) for i in range(4)]
    kwargs = dict(exclude_vars="bias|bn", aggregation_weights={"s0": 2.0, "s2": 0.5},
                  weigh_by_local_iter=weigh_by_local_iter)
    a_t, r_t, s_t, _ = run(Theirs, contributions, **kwargs)
    a_o, r_o, s_o, _ = run(Ours, contributions, **kwargs)
    assert a_o == a_t
    same_dxo(r_o, r_t)
    assert list(r_o.data) == ["layer1.weight"]
    assert s_o == s_t and s_o["skipped_keys"] == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, bool])
def test_numpy_dtypes(dtype):
    """NumPy's promotion decides the result dtype (integer buffers give a float64 mean); float16
    accumulates in fp32 here, in float16 in NVFlare."""
    rng = np.random.default_rng(5)
    contributions = [(f"s{i}", 0, weights_dxo({"x": (rng.random((3, 4)) * 10).astype(dtype)}, n_iter=i + 1))
                     for i in range(5)]
    _, r_t, _, _ = run(Theirs, contributions)
    _, r_o, _, _ = run(Ours, contributions)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == np.float16 else dict(rtol=1e-6)
    same_dxo(r_o, r_t, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_torch_tensors(dtype):
    """DXOs of torch tensors give torch results of NVFlare's dtype (int -> default float)."""
    g = torch.Generator().manual_seed(0)
    contributions = [(f"s{i}", 0, weights_dxo({
        "w": (torch.rand(5, 7, generator=g) * 10).to(dtype),
        "b": torch.rand(7, generator=g).to(dtype),
        "num_batches_tracked": torch.tensor(10 * i),
    }, n_iter=i + 1)) for i in range(4)]
    _, r_t, s_t, _ = run(Theirs, contributions, expected_data_kind=DataKind.WEIGHTS)
    _, r_o, s_o, _ = run(Ours, contributions, expected_data_kind=DataKind.WEIGHTS)
    half = dtype in (torch.float16, torch.bfloat16)
    same_dxo(r_o, r_t, rtol=2e-2 if half else 1e-6, atol=2e-2 if half else 1e-6)
    assert s_o == s_t


def test_mixed_precision_contributions():
    """float32 from some sites and float64 from others: NumPy's float64 result."""
    contributions = [("a", 0, weights_dxo({"x": np.full(4, 1.0, np.float32)})),
                     ("b", 0, weights_dxo({"x": np.full(4, 2.0, np.float64)}, n_iter=3))]
    _, r_t, _, _ = run(Theirs, contributions)
    _, r_o, _, _ = run(Ours, contributions)
    same_dxo(r_o, r_t)
    assert r_o.data["x"].dtype == np.float64


def test_missing_key_is_averaged_over_the_contributions_that_have_it():
    contributions = [("a", 0, weights_dxo({"x": np.ones(3), "y": np.ones(2)})),
                     ("b", 0, weights_dxo({"x": np.full(3, 4.0)}, n_iter=3)),
                     ("c", 0, weights_dxo({"y": np.full(2, 5.0), "z": np.zeros(1)}))]
    _, r_t, s_t, _ = run(Theirs, contributions)
    _, r_o, s_o, _ = run(Ours, contributions)
    same_dxo(r_o, r_t)
    assert list(r_o.data) == list(r_t.data) == ["x", "y", "z"]
    np.testing.assert_allclose(r_o.data["x"], (1 + 12) / 4)
    np.testing.assert_allclose(r_o.data["y"], 3.0)
    assert s_o == s_t
    assert s_o["fully_matched_keys"] == 0 and s_o["partially_matched_keys"] == 3


def test_wrong_shape_is_rejected_before_anything_is_accumulated(records):
    """NVFlare raises from NumPy half-way through (its key counts are already bumped) or
    silently broadcasts; ours rejects the contribution, logs which key and shapes, and the round
    goes on as if it had not come."""
    good = [("a", 0, weights_dxo({"x": np.ones((2, 3)), "y": np.ones(3)})),
            ("b", 0, weights_dxo({"x": np.full((2, 3), 3.0), "y": np.full(3, 2.0)}))]
    wrong = ("c", 0, weights_dxo({"x": np.full((2, 3), 7.0), "y": np.ones(4)}))
    broadcast = ("d", 0, weights_dxo({"x": np.ones(3), "y": np.ones(3)}))

    theirs = make(Theirs)
    for n, r, d in good:
        theirs.accept(shareable(d, n, r), ctx(0))
    with pytest.raises(ValueError, match="could not be broadcast"):
        theirs.accept(shareable(wrong[2], "c", 0), ctx(0))
    assert theirs.accept(shareable(broadcast[2], "d", 0), ctx(0)) is True  # (3,) into (2, 3)

    accepted, result, stats, logs = run(Ours, good + [wrong, broadcast], records)
    assert accepted == [True, True, False, False]
    errors = [m for level, m in logs if level == "ERROR"]
    assert any("'c', key 'y': got a NumPy array of shape (4,)" in m and "(3,)" in m for m in errors)
    assert any("'d', key 'x': got a NumPy array of shape (3,)" in m and "(2, 3)" in m for m in errors)
    _, expected, expected_stats, _ = run(Theirs, good)
    same_dxo(result, expected)
    assert stats == expected_stats


def test_non_finite_weight_is_rejected(records):
    contributions = [("a", 0, weights_dxo({"x": np.ones(3)})),
                     ("b", 0, weights_dxo({"x": np.ones(3)}, n_iter=float("inf")))]
    accepted, result, _, logs = run(Ours, contributions, records)
    assert accepted == [True, False]
    assert any("'b': weight is inf" in m for _, m in logs)
    np.testing.assert_allclose(result.data["x"], 1.0)


def test_rounds_reset_between_aggregations():
    """One aggregator over three rounds, as a workflow uses it."""
    agg_t, agg_o = make(Theirs), make(Ours)
    rng = np.random.default_rng(9)
    for r in range(3):
        for name in ("a", "b", "c"):
            d = weights_dxo({"x": rng.random((4, 4)).astype(np.float32)}, n_iter=r + 1)
            assert agg_o.accept(shareable(d, name, r), ctx(r)) == agg_t.accept(shareable(d, name, r), ctx(r))
        c_t, c_o = ctx(r), ctx(r)
        same_dxo(from_shareable(agg_o.aggregate(c_o)), from_shareable(agg_t.aggregate(c_t)))
        assert c_o.get_prop(AppConstants.AGGREGATION_STATS) == c_t.get_prop(AppConstants.AGGREGATION_STATS)


def test_streaming_memory_does_not_grow_with_clients():
    """The helper keeps one accumulator per key, whatever the number of contributions."""
    helper = fk.WeightedAggregationHelper()
    for i in range(200):
        helper.add({"x": np.full((64, 64), float(i), np.float32)}, 1.0, f"s{i}", 0)
    assert len(helper.total) == 1
    assert helper.total["x"].numel() == 64 * 64 and helper.total["x"].dtype == torch.float32
    np.testing.assert_allclose(helper.get_result()["x"], 99.5)


# ---------------------------------------------------------------- the helper alone


HELPER_CASES = {
    "torch float": ([{"w1": torch.tensor([1.0, 2.0, 3.0]), "w2": torch.tensor([4.0, 5.0])},
                     {"w1": torch.tensor([2.0, 4.0, 6.0]), "w2": torch.tensor([3.0, 6.0])}], [2.0, 1.0]),
    "torch int": ([{"count": torch.tensor([10, 20, 30])}, {"count": torch.tensor([5, 10, 15])}], [2.0, 3.0]),
    "numpy": ([{"w": np.array([2.0, 4.0, 6.0])}, {"w": np.array([3.0, 6.0, 9.0])}], [1.0, 2.0]),
    "different keys": ([{"w1": torch.tensor([1.0]), "w2": torch.tensor([2.0])},
                        {"w2": torch.tensor([3.0]), "w3": torch.tensor([4.0])}], [1.0, 1.0]),
    "metrics": ([{"acc": 0.9, "n": 3, "flag": True}, {"acc": 0.7, "n": 5, "flag": False}], [1.0, 3]),
    "scalar tensors": ([{"t": torch.tensor(2.0), "s": np.float32(1.5)},
                        {"t": torch.tensor(4.0), "s": np.float32(0.5)}], [1.0, 1.0]),
    "empty": ([{}], [1.0]),
}


@pytest.mark.parametrize("case", sorted(HELPER_CASES))
@pytest.mark.parametrize("kwargs", [{}, {"exclude_vars": "w1|flag"}])
def test_helper_side_by_side(case, kwargs):
    datas, weights = HELPER_CASES[case]
    theirs = flare_helper.WeightedAggregationHelper(**kwargs)
    ours = fk.WeightedAggregationHelper(**kwargs)
    for i, (d, w) in enumerate(zip(datas, weights)):
        theirs.add(d, w, f"site-{i}", 0)
        ours.add(d, w, f"site-{i}", 0)
    assert ours.get_history() == theirs.get_history()
    assert ours.get_len() == theirs.get_len()
    assert ours.counts == theirs.counts
    assert list(ours.total) == list(theirs.total)
    assert ours.get_aggregation_stats() == theirs.get_aggregation_stats()
    result_t, result_o = theirs.get_result(), ours.get_result()
    same_values(result_o, result_t)
    assert list(result_o) == list(result_t)
    assert ours.last_aggregation_stats == theirs.last_aggregation_stats
    assert ours.get_len() == 0 and len(ours.total) == 0 and len(ours.counts) == 0


def test_helper_unweighted_int_tensors_average_where_nvflare_raises():
    data = [{"count": torch.tensor([10, 20])}, {"count": torch.tensor([5, 10])}]
    theirs = flare_helper.WeightedAggregationHelper(weigh_by_local_iter=False)
    ours = fk.WeightedAggregationHelper(weigh_by_local_iter=False)
    for i, d in enumerate(data):
        theirs.add(d, 2.0, f"s{i}", 0)
        ours.add(d, 2.0, f"s{i}", 0)
    with pytest.raises(RuntimeError):
        theirs.get_result()
    result = ours.get_result()["count"]
    assert result.dtype == torch.get_default_dtype()
    torch.testing.assert_close(result, torch.tensor([15.0 / 4, 30.0 / 4]))


def test_helper_does_not_modify_inputs_and_reads_read_only_arrays():
    a = np.arange(6, dtype=np.float32)
    a.flags.writeable = False
    t = torch.arange(6, dtype=torch.float32)
    helper = fk.WeightedAggregationHelper()
    helper.add({"a": a, "t": t, "rev": np.arange(6.0)[::-1]}, 3.0, "x", 0)
    helper.add({"a": a * 3, "t": t * 3, "rev": np.arange(6.0)}, 1.0, "y", 0)
    out = helper.get_result()
    np.testing.assert_array_equal(a, np.arange(6))
    torch.testing.assert_close(t, torch.arange(6, dtype=torch.float32))
    np.testing.assert_allclose(out["a"], np.arange(6) * 1.5)
    np.testing.assert_allclose(out["rev"], (3 * np.arange(6.0)[::-1] + np.arange(6.0)) / 4)


def test_helper_lazy_refs_are_materialized():
    class LazyRef:
        def __init__(self, value):
            self.value = value

        def materialize(self):
            return self.value

    ours = fk.WeightedAggregationHelper()
    theirs = flare_helper.WeightedAggregationHelper()
    for i in range(3):
        d = {"x": LazyRef(torch.full((4,), float(i)))}
        ours.add(d, 1.0 + i, f"s{i}", 0)
        theirs.add(d, 1.0 + i, f"s{i}", 0)
    same_values(ours.get_result(), theirs.get_result())


def test_helper_bad_weight_names_the_contributor():
    helper = fk.WeightedAggregationHelper()
    with pytest.raises(ValueError, match="'site-3': weight must be a number"):
        helper.add({"x": np.ones(2)}, "heavy", "site-3", 0)
    with pytest.raises(ValueError, match="'site-3': weight is nan"):
        helper.add({"x": np.ones(2)}, float("nan"), "site-3", 0)
    # float("2") is 2.0, but the text went into counts and get_result failed on it
    with pytest.raises(ValueError, match="'site-3': weight must be a number, got str"):
        helper.add({"x": np.ones(2)}, "2", "site-3", 0)
    assert helper.get_len() == 0 and not helper.total


def test_helper_weight_that_is_not_a_number_is_a_type_error():
    # NVFlare's `v * weight` raises TypeError for these; ours is that and a ContributionError,
    # and leaves nothing accumulated.
    for weight in (None, "2", object()):
        with pytest.raises(TypeError):
            flare_helper.WeightedAggregationHelper().add({"x": np.ones(2)}, weight, "site-3", 0)
        helper = fk.WeightedAggregationHelper()
        with pytest.raises(TypeError, match="'site-3': weight must be a number") as info:
            helper.add({"x": np.ones(2)}, weight, "site-3", 0)
        assert isinstance(info.value, fk.ContributionError)
        assert helper.get_len() == 0 and not helper.total and not helper.key_contribution_counts


@pytest.mark.parametrize("make", [
    lambda a: np.ma.masked_array(a, mask=a > 4),
    lambda a: np.matrix(a),
], ids=["masked array", "matrix"])
@pytest.mark.parametrize("first_plain", [False, True])
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_helper_numpy_array_subclasses_take_nvflares_formula(make, first_plain):
    # The op reads an array's raw data: a masked array's masked values were averaged in, and
    # the result was a plain float32 ndarray where NVFlare keeps the subclass and its dtype.
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    datas = [{"x": a if first_plain else make(a)}, {"x": make(a + 1)}, {"x": make(a * 2)}]
    ours, theirs = fk.WeightedAggregationHelper(), flare_helper.WeightedAggregationHelper()
    for i, (d, w) in enumerate(zip(datas, [1.0, 2.0, 0.5])):
        ours.add(d, w, f"site-{i}", 0)
        theirs.add(d, w, f"site-{i}", 0)
    got, expected = ours.get_result()["x"], theirs.get_result()["x"]
    assert type(got) is type(expected) and got.dtype == expected.dtype
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(expected))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)


def test_log_records_have_nvflares_logger_names(records):
    """NVFlare's log configuration picks records by logger name (log_fl.txt and the concise
    console keep INFO records of nvflare.app_common loggers); ours were filed under
    fedkernels.integrations.nvflare and left out there."""
    kinds = {"model": DataKind.WEIGHTS, "extra": DataKind.WEIGHTS}
    contributions = [("a", 0, DXO(DataKind.COLLECTION, data={
        "model": weights_dxo({"w": np.ones(3)}, kind=DataKind.WEIGHTS)})),
        ("b", 0, weights_dxo({"w": np.ones(3)}, kind=DataKind.WEIGHTS), ReturnCode.EXECUTION_EXCEPTION)]
    named = []
    for cls in (Theirs, Ours):
        records.named.clear()
        run(cls, contributions, records, expected_data_kind=kinds)
        named.append(list(records.named))
    assert named[1] == named[0]
    assert any(name.startswith("nvflare.app_common.aggregators.intime") and level == "INFO"
               for name, level, _ in named[1])


def test_helper_tensors_that_require_grad_are_read_as_values():
    # NVFlare's result records a graph that holds every contribution; ours is the same values
    # with none.
    datas = [{"w": torch.full((3,), float(i + 1), requires_grad=True)} for i in range(3)]
    ours, theirs = fk.WeightedAggregationHelper(), flare_helper.WeightedAggregationHelper()
    for i, d in enumerate(datas):
        ours.add(d, float(i + 1), f"site-{i}", 0)
        theirs.add(d, float(i + 1), f"site-{i}", 0)
    got, expected = ours.get_result()["w"], theirs.get_result()["w"]
    assert expected.requires_grad and not got.requires_grad
    torch.testing.assert_close(got, expected.detach())


@pytest.mark.parametrize("data", [{"x": np.ones(3, np.float32)}, {"x": torch.ones(3)}],
                         ids=["numpy", "torch"])
def test_helper_weight_beyond_float32_range_is_refused_for_fp32_keys(data):
    # NVFlare's float32 product is Inf; ours refuses the contribution, naming the key.
    with pytest.raises(fk.ContributionError, match="beyond the float32 range.*'x'"):
        fk.WeightedAggregationHelper().add(data, 1e39, "site-1", 0)
    helper = fk.WeightedAggregationHelper()
    helper.add({"x": np.ones(3)}, 1e39, "site-1", 0)  # float64: in range
    np.testing.assert_allclose(helper.get_result()["x"], 1.0)


def test_helper_sparse_tensors_take_nvflares_formula():
    # The fused op reads dense memory only; a sparse tensor for a new key made its pass fail
    # after the keys seen before had been accumulated in place, so the round's result counted
    # that contribution without its weight (here 4 where NVFlare gives 2).
    contributions = [({"a": torch.ones(3)}, 1.0),
                     ({"a": 3 * torch.ones(3), "b": torch.ones(3).to_sparse()}, 1.0),
                     ({"a": torch.ones(3), "b": 2 * torch.ones(3).to_sparse()}, 2.0)]
    ours, theirs = fk.WeightedAggregationHelper(), flare_helper.WeightedAggregationHelper()
    for i, (d, w) in enumerate(contributions):
        ours.add(d, w, f"site-{i}", 0)
        theirs.add(d, w, f"site-{i}", 0)
    got, expected = ours.get_result(), theirs.get_result()
    torch.testing.assert_close(got["a"], expected["a"])
    assert got["b"].layout == expected["b"].layout == torch.sparse_coo
    torch.testing.assert_close(got["b"].to_dense(), expected["b"].to_dense())



# NumPy semantics of the helper: the running total and the result have the dtype NumPy gives
# NVFlare's `v * w`, `total + ...` and `total * (1.0 / sum)`; integer and bool arrays keep
# NumPy's integer arithmetic (wrap-around, logical OR) before the division.
GRID_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, bool]
GRID_WEIGHTS = {
    "float": [2.5, 0.5, 1.0], "int": [3, 1, 2], "bool": [True, True, True],
    "np.float64": [np.float64(2.5), np.float64(0.5), np.float64(1.0)],
    "np.float32": [np.float32(2.5), np.float32(0.5), np.float32(1.0)],
    "np.float16": [np.float16(2.5), np.float16(0.5), np.float16(1.0)],
    "np.int64": [np.int64(3), np.int64(1), np.int64(2)],
    "np.int16": [np.int16(3), np.int16(1), np.int16(2)],
    "mixed": [2.5, np.float64(0.5), np.int16(2)],
}


def _grid_arrays(dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype is bool:
        return [rng.random(6) > 0.5 for _ in range(3)]
    if np.dtype(dtype).kind in "iu":
        hi = np.iinfo(dtype).max  # values near the top, so that NumPy's sums wrap around
        return [(hi - rng.integers(0, 40, 6)).astype(dtype) for _ in range(3)]
    return [(rng.random(6) * 10).astype(dtype) for _ in range(3)]


def _same_as_nvflare(ours, theirs, float16_tol):
    assert list(ours) == list(theirs)
    for k in theirs:
        a, b = ours[k], theirs[k]
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape, k
        # NVFlare sums float16 in float16, the fused op in fp32
        tol = dict(rtol=5e-3, atol=5e-3) if float16_tol else dict(rtol=1e-6, atol=0)
        np.testing.assert_allclose(a, b, err_msg=k, **tol)


@pytest.mark.parametrize("weigh", [True, False])
@pytest.mark.parametrize("weights", sorted(GRID_WEIGHTS))
@pytest.mark.parametrize("dtype", GRID_DTYPES, ids=lambda d: np.dtype(d).name)
def test_helper_numpy_dtype_and_weight_grid(dtype, weights, weigh):
    arrays = _grid_arrays(dtype, 3)
    theirs = flare_helper.WeightedAggregationHelper(weigh_by_local_iter=weigh)
    ours = fk.WeightedAggregationHelper(weigh_by_local_iter=weigh)
    for i, (a, w) in enumerate(zip(arrays, GRID_WEIGHTS[weights])):
        theirs.add({"x": a, "y": a[:2].copy()}, w, f"s{i}", 0)
        ours.add({"x": a, "y": a[:2].copy()}, w, f"s{i}", 0)
    assert ours.counts == theirs.counts
    result_t, result_o = theirs.get_result(), ours.get_result()
    float16 = result_t["x"].dtype == np.float16 or np.dtype(dtype) == np.float16
    _same_as_nvflare(result_o, result_t, float16)
    if np.dtype(dtype).kind in "biu":  # NVFlare's own NumPy formula: bitwise equal
        for k in result_t:
            np.testing.assert_array_equal(result_o[k], result_t[k])


@pytest.mark.parametrize("dtypes", [(np.float32, np.int64, np.float32), (np.int64, np.float32, np.float64),
                                    (np.float16, np.uint8, np.float16), (bool, np.float32, bool),
                                    (np.float32, np.float32, np.float64)],
                         ids=lambda ds: "-".join(np.dtype(d).name for d in ds))
@pytest.mark.parametrize("weigh", [True, False])
def test_helper_numpy_dtypes_that_change_between_contributions(dtypes, weigh):
    """One key whose dtype changes from contribution to contribution: NumPy's promotion of
    the running total, step by step, as in NVFlare."""
    theirs = flare_helper.WeightedAggregationHelper(weigh_by_local_iter=weigh)
    ours = fk.WeightedAggregationHelper(weigh_by_local_iter=weigh)
    for i, (dtype, w) in enumerate(zip(dtypes, [2.0, np.float32(1.5), 3])):
        a = _grid_arrays(dtype, i)[0]
        theirs.add({"x": a}, w, f"s{i}", 0)
        ours.add({"x": a}, w, f"s{i}", 0)
    _same_as_nvflare(ours.get_result(), theirs.get_result(), np.dtype(np.float16) in map(np.dtype, dtypes))


def test_helper_numpy_float32_then_numpy_float64_weight_accumulates_in_float64():
    """A float64 weight turns NumPy's running total float64; ours follows from then on."""
    big = np.full(4, 1e8, np.float32)
    theirs = flare_helper.WeightedAggregationHelper()
    ours = fk.WeightedAggregationHelper()
    for i, (a, w) in enumerate([(big, 1.0), (np.full(4, 1.0, np.float32), np.float64(1.0))]):
        theirs.add({"x": a}, w, f"s{i}", 0)
        ours.add({"x": a}, w, f"s{i}", 0)
    result_t, result_o = theirs.get_result()["x"], ours.get_result()["x"]
    assert result_o.dtype == result_t.dtype == np.float64
    np.testing.assert_array_equal(result_o, result_t)  # 1e8 + 1 is exact in float64 only


# ---------------------------------------------------------------- zero total weight


ZERO_TOTAL = {"all steps 0": ([0, 0], None),
              "aggregation_weights 0": ([10, 10], {"site-1": 0.0, "site-2": 0.0}),
              "weights cancel": ([1, 1], {"site-1": 1.0, "site-2": -1.0})}


def _zero_total_round(cls, steps, weights, kind):
    contributions = []
    for i, n in enumerate(steps):
        x = np.full((2, 2), float(i + 1), np.float32)
        data = {"w": x if kind == "numpy" else torch.from_numpy(x)}
        contributions.append((f"site-{i + 1}", 0, weights_dxo(data, n_iter=n, kind=DataKind.WEIGHTS)))
    return run(cls, contributions, aggregation_weights=weights, expected_data_kind=DataKind.WEIGHTS)


@pytest.mark.parametrize("case", sorted(ZERO_TOTAL))
def test_zero_total_weight_numpy_raises_like_nvflare(case):
    steps, weights = ZERO_TOTAL[case]
    with pytest.raises(ZeroDivisionError):
        _zero_total_round(Theirs, steps, weights, "numpy")
    with pytest.raises(ZeroDivisionError, match="key 'w': the weights of its 2 contribution"):
        _zero_total_round(Ours, steps, weights, "numpy")


@pytest.mark.parametrize("case", sorted(ZERO_TOTAL))
def test_zero_total_weight_torch_gives_nvflares_nan_or_inf(case):
    steps, weights = ZERO_TOTAL[case]
    _, r_t, _, _ = _zero_total_round(Theirs, steps, weights, "torch")
    _, r_o, _, _ = _zero_total_round(Ours, steps, weights, "torch")
    assert not torch.isfinite(r_t.data["w"]).any()
    same_dxo(r_o, r_t)


@pytest.mark.parametrize("data", [{"acc": 0.5}, {"x": np.ones(3, np.int64)}, {"x": np.ones(3)}],
                         ids=["python scalar", "int array", "float array"])
def test_helper_zero_total_weight_raises_where_nvflare_does(data):
    """NVFlare's ``1.0 / sum`` raises for a Python 0 only: NumPy-scalar weights that sum to 0
    give Inf/NaN in both, with NumPy's warning."""
    theirs = flare_helper.WeightedAggregationHelper()
    ours = fk.WeightedAggregationHelper()
    for h in (theirs, ours):
        h.add(data, 1.0, "a", 0)
        h.add(data, -1.0, "b", 0)
    with pytest.raises(ZeroDivisionError):
        theirs.get_result()
    name = next(iter(data))
    with pytest.raises(ZeroDivisionError, match=f"key '{name}'"):
        ours.get_result()
    assert ours.get_len() == 2  # nothing reset: the round can be inspected

    theirs = flare_helper.WeightedAggregationHelper()
    ours = fk.WeightedAggregationHelper()
    for h in (theirs, ours):
        h.add(data, np.float64(1.0), "a", 0)
        h.add(data, np.float64(-1.0), "b", 0)
    with pytest.warns(RuntimeWarning):
        result_t = theirs.get_result()
    with pytest.warns(RuntimeWarning):
        result_o = ours.get_result()
    same_values(result_o, result_t)


# ---------------------------------------------------------------- FedAvg controller


def fl_results(rng, n_clients=4, metrics=True, dtype=np.float32):
    results = []
    for i in range(n_clients):
        params = {"conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(dtype),
                  "fc.bias": rng.standard_normal(10).astype(dtype),
                  "bn.num_batches_tracked": np.array(10 * i)}
        meta = {"client_name": f"site-{i + 1}"}
        if i != 2:
            meta[MetaKey.NUM_STEPS_CURRENT_ROUND] = 5 * (i + 1)
        results.append(FLModel(params_type=ParamsType.FULL, params=params, current_round=7,
                               metrics={"acc": 0.5 + 0.1 * i, "report": {"x": 1}} if metrics else None,
                               meta=meta))
    return results


def run_controller(controller: FedAvg, results, current_round=7):
    """The per-round steps of FedAvg.run that touch aggregation, on NVFlare's own controller."""
    controller.fl_ctx = ctx(current_round)
    controller.current_round = current_round
    if controller.aggregator:
        controller.aggregator.fl_ctx = ctx(current_round)
        controller.aggregator.reset_stats()
    else:
        controller._aggr_helper = flare_helper.WeightedAggregationHelper(exclude_vars=controller.exclude_vars)
        controller._aggr_metrics_helper = flare_helper.WeightedAggregationHelper()
        controller._all_metrics = True
    controller._received_count, controller._expected_count = 0, len(results)
    controller._params_type, controller._site_metric_weights = None, {}
    for r in results:
        controller._aggregate_one_result(r)
    model = controller._get_aggregated_result()
    stats_ctx = controller.aggregator.fl_ctx if controller.aggregator else controller.fl_ctx
    return model, stats_ctx.get_prop(AppConstants.AGGREGATION_STATS)


@pytest.mark.parametrize("metrics", [True, False])
@pytest.mark.parametrize("kwargs", [{}, {"exclude_vars": "bn", "aggregation_weights": {"site-2": 3.0}}])
def test_fedavg_controller_builtin_vs_weighted_model_aggregator(metrics, kwargs):
    results = fl_results(np.random.default_rng(0), metrics=metrics)
    theirs, stats_t = run_controller(FedAvg(num_clients=4, **kwargs), results)
    ours, stats_o = run_controller(FedAvg(num_clients=4, aggregator=fk.WeightedModelAggregator(**kwargs)),
                                   results)
    same_values(ours.params, theirs.params)
    assert ours.params_type == theirs.params_type
    assert ours.current_round == theirs.current_round == 7
    if metrics:
        same_values(ours.metrics, theirs.metrics, rtol=1e-12)
    else:
        assert ours.metrics is theirs.metrics is None
    info_t = theirs.meta.pop(AppConstants.METRICS_AGGREGATION_INFO)
    info_o = dict(ours.meta.pop(AppConstants.METRICS_AGGREGATION_INFO))
    # The controller marks results of a custom aggregator with this flag; all else is equal.
    assert info_o.pop("use_contribution_sites") is False
    assert info_o == info_t
    assert ours.meta == theirs.meta
    assert stats_o == stats_t


def test_fedavg_controller_zero_aggregation_weights_raise_like_builtin():
    """All-zero aggregation_weights: the controller's built-in helper and ours both divide by 0."""
    results = fl_results(np.random.default_rng(2), metrics=False)
    kwargs = {"aggregation_weights": {f"site-{i + 1}": 0.0 for i in range(4)}}
    with pytest.raises(ZeroDivisionError):
        run_controller(FedAvg(num_clients=4, **kwargs), results)
    with pytest.raises(ZeroDivisionError, match="key 'conv.weight'"):
        run_controller(FedAvg(num_clients=4, aggregator=fk.WeightedModelAggregator(**kwargs)), results)


def test_weighted_model_aggregator_in_a_recipe():
    from nvflare.app_common.np.recipes.fedavg import NumpyFedAvgRecipe

    agg = fk.WeightedModelAggregator(aggregation_weights={"site-1": 2.0})
    recipe = NumpyFedAvgRecipe(name="fk", min_clients=2, num_rounds=1, train_script="train.py",
                               model=[[0.0, 0.0]], aggregator=agg)
    assert recipe._get_model_aggregator() is agg


def test_weighted_model_aggregator_arguments_are_checked():
    with pytest.raises(TypeError, match="exclude_vars must be a regex string"):
        fk.WeightedModelAggregator(exclude_vars=3)
    with pytest.raises(TypeError, match="aggregation_weights must be a dict"):
        fk.WeightedModelAggregator(aggregation_weights=[1.0, 2.0])


def test_weighted_model_aggregator_skips_empty_results():
    agg = fk.WeightedModelAggregator()
    assert agg.accept_model(FLModel(params={}, meta={"client_name": "a"})) is False
    assert agg.accept_model(FLModel(params={"x": np.ones(2)}, meta={"client_name": "b"})) is True
    assert agg.aggregate_model().meta["nr_aggregated"] == 1


@pytest.mark.parametrize("metrics", [True, False])
def test_aggregate_fn_equals_base_fedavg(metrics):
    results = fl_results(np.random.default_rng(1), metrics=metrics, dtype=np.float64)
    theirs, ours = BaseFedAvg.aggregate_fn(results), fk.aggregate_fn(results)
    same_values(ours.params, theirs.params, rtol=1e-12)
    if metrics:
        same_values(ours.metrics, theirs.metrics, rtol=1e-12)
    else:
        assert ours.metrics is theirs.metrics is None
    assert ours.meta == theirs.meta
    assert ours.params_type == theirs.params_type
    with pytest.raises(ValueError, match="received empty results for aggregation."):
        fk.aggregate_fn([])


def test_randomized_against_nvflare():
    """Random mixes of kinds, shapes, dtypes, weights and missing keys."""
    rng = random.Random(11)
    for trial in range(20):
        keys = {f"k{j}": tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
                for j in range(rng.randint(1, 5))}
        dtype = rng.choice([np.float32, np.float64])
        contributions = []
        for i in range(rng.randint(1, 8)):
            present = [k for k in keys if rng.random() > 0.2] or list(keys)[:1]
            data = {k: np.asarray(np.random.default_rng(trial * 100 + i).standard_normal(keys[k]), dtype)
                    for k in present}
            contributions.append((f"s{i}", 0, weights_dxo(data, n_iter=rng.choice([None, 1, 3, 7.5]))))
        weights = {f"s{i}": rng.uniform(0.1, 3.0) for i in range(8) if rng.random() > 0.3}
        _, r_t, s_t, _ = run(Theirs, contributions, aggregation_weights=weights)
        _, r_o, s_o, _ = run(Ours, contributions, aggregation_weights=weights)
        same_dxo(r_o, r_t, rtol=1e-5, atol=1e-6)
        assert s_o == s_t


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_first_contribution_under_inference_mode_then_outside(kind):
    """The running sums are normal tensors also when the first contribution arrives under
    torch.inference_mode(): made there, they were inference tensors, and the next add() outside
    it failed ('Inplace update to inference tensor outside InferenceMode'), where NVFlare's
    NumPy sums go on. The result is NVFlare's (for torch inputs NVFlare's own fails there)."""
    g = torch.Generator().manual_seed(3)
    data = [{"w": torch.randn(5, 3, generator=g)} for _ in range(3)]
    if kind == "numpy":
        data = [{"w": d["w"].numpy()} for d in data]
    ours, theirs = fk.WeightedAggregationHelper(), flare_helper.WeightedAggregationHelper()
    with torch.inference_mode():
        ours.add(data[0], 1.0, "site-0", 1)
    for i, d in enumerate(data[1:], start=1):
        ours.add(d, 1.0 + i, f"site-{i}", 1)
    for i, d in enumerate(data):
        theirs.add({"w": d["w"].numpy() if kind == "torch" else d["w"]}, 1.0 + i, f"site-{i}", 1)
    got, want = ours.get_result()["w"], theirs.get_result()["w"]
    got = got.numpy() if kind == "torch" else got
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_final_scaling_by_the_op_gives_nvflares_bits(dtype, monkeypatch):
    """The last step, total * (1.0 / W), runs in the fused op in batches of accumulators
    (a small batch size here: every batch boundary), grouped by W (partial keys give other
    sums), with NVFlare's bits and dtypes; the op runs on every NumPy float key."""
    monkeypatch.setattr(fk, "_SCALE_BATCH_BYTES", 3000)
    calls = []
    real = fk.summation.weighted_sum

    def counting(updates, weights, *args):
        calls.append(len(updates))
        return real(updates, weights, *args)

    rng = np.random.default_rng(3)
    shapes = {f"w{i}": (rng.integers(1, 40), rng.integers(1, 30)) for i in range(12)}
    datas = [{k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()
              if not (i == 2 and k in ("w3", "w7"))} for i in range(4)]
    theirs = flare_helper.WeightedAggregationHelper()
    ours = fk.WeightedAggregationHelper()
    for i, d in enumerate(datas):
        theirs.add(d, 0.5 + i, f"site-{i}", 0)
        ours.add(d, 0.5 + i, f"site-{i}", 0)
    monkeypatch.setattr(fk.summation, "weighted_sum", counting)
    got, want = ours.get_result(), theirs.get_result()
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k], want[k])
    assert sum(calls) == len(shapes) and len(calls) > 2


# ---------------------------------------------------------------- held contributions


def _torch_contributions(n, shapes, seed=0, dtypes=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        dtype = dtypes[i] if dtypes else torch.float32
        out.append({k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()})
    return out


@pytest.mark.parametrize("value", [-1, 1.5, True, "1", None])
def test_hold_bytes_is_checked(value):
    for make_one in (lambda: fk.WeightedAggregationHelper(hold_bytes=value),
                     lambda: Ours(hold_bytes=value),
                     lambda: fk.WeightedModelAggregator(hold_bytes=value)):
        with pytest.raises(ValueError, match="hold_bytes must be an int >= 0"):
            make_one()


def test_aggregators_hold_by_default_and_pass_it_to_their_helpers():
    agg = make(Ours)
    assert agg.hold_bytes == fk.AGGREGATOR_HOLD_BYTES > 0
    assert {h.aggregation_helper.hold_bytes for h in agg.dxo_aggregators.values()} \
        == {fk.AGGREGATOR_HOLD_BYTES}
    assert make(Ours, hold_bytes=0).dxo_aggregators[""].aggregation_helper.hold_bytes == 0
    assert fk.WeightedModelAggregator()._params_helper.hold_bytes == fk.AGGREGATOR_HOLD_BYTES
    assert fk.WeightedAggregationHelper().hold_bytes == 0  # NVFlare's helper sums at once


@pytest.mark.parametrize("hold_contributions", [0, 1, 2, 3, 100])
def test_held_contributions_are_summed_together_with_nvflares_result(hold_contributions,
                                                                     monkeypatch):
    """Contributions wait until hold_bytes would be passed, then one pass of the op sums them;
    the result is NVFlare's (to rounding) whatever the budget."""
    shapes = {"a": (7, 5), "b": (33,), "c": (2, 3, 4)}
    datas = _torch_contributions(10, shapes)
    size = sum(t.numel() * t.element_size() for t in datas[0].values())
    calls = []
    real = fk.summation.weighted_sum_
    monkeypatch.setattr(fk.summation, "weighted_sum_",
                        lambda accs, xs, w, *a: (calls.append(w.numel()), real(accs, xs, w, *a)))
    ours = fk.WeightedAggregationHelper(hold_bytes=hold_contributions * size)
    theirs = flare_helper.WeightedAggregationHelper()
    for i, d in enumerate(datas):
        ours.add(d, 0.5 + i, f"site-{i}", 0)
        theirs.add({k: v.clone() for k, v in d.items()}, 0.5 + i, f"site-{i}", 0)
    got, want = ours.get_result(), theirs.get_result()
    same_values(got, want, rtol=1e-5, atol=1e-6)
    # the first contribution makes the sums; the other 9 go in batches of up to hold + 1
    assert sum(calls) == 9
    assert max(calls) == min(9, hold_contributions + 1)
    assert len(calls) == -(-9 // min(9, hold_contributions + 1))


def test_held_contributions_with_other_keys_or_dtypes_are_summed_apart():
    """A contribution whose torch arrays differ (keys, dtypes) from those held sums the held
    ones first; partial keys, half-precision and float64 arrays give NVFlare's result."""
    shapes = {"a": (4, 3), "b": (5,), "c": (6,)}
    dtypes = [torch.float32, torch.float32, torch.float16, torch.float64, torch.float32,
              torch.bfloat16, torch.float32]
    datas = _torch_contributions(7, shapes, seed=1, dtypes=dtypes)
    del datas[4]["b"], datas[5]["c"]
    ours = fk.WeightedAggregationHelper(hold_bytes=1 << 20)
    theirs = flare_helper.WeightedAggregationHelper()
    for i, d in enumerate(datas):
        ours.add(d, 1.0 + i, f"site-{i}", 0)
        theirs.add({k: v.float() for k, v in d.items()}, 1.0 + i, f"site-{i}", 0)
    same_values(ours.get_result(), theirs.get_result(), rtol=2e-3, atol=2e-3)


def test_reading_total_sums_the_held_contributions_in():
    datas = _torch_contributions(4, {"w": (3, 2)}, seed=2)
    helper = fk.WeightedAggregationHelper(hold_bytes=1 << 20)
    for i, d in enumerate(datas):
        helper.add(d, 2.0, f"site-{i}", 0)
    torch.testing.assert_close(helper.total["w"], 2.0 * sum(d["w"] for d in datas))
    assert helper.counts["w"] == 8.0
    torch.testing.assert_close(helper.get_result()["w"], sum(d["w"] for d in datas) / 4)


def test_a_held_tensor_changed_in_place_is_refused_not_summed():
    """The held arrays are the caller's: one changed in place before it was summed would give
    its new values, so the sum is refused, and stays refused (no silent result)."""
    datas = _torch_contributions(3, {"w": (8,)}, seed=4)
    helper = fk.WeightedAggregationHelper(hold_bytes=1 << 20)
    for i, d in enumerate(datas):
        helper.add(d, 1.0, f"site-{i}", 0)
    datas[1]["w"].add_(1.0)
    for _ in range(2):
        with pytest.raises(fk.ContributionError,
                           match=r"'site-1': a tensor of shape \(8,\) was changed in place"):
            helper.get_result()
    # with hold_bytes=0 each contribution is summed in add(), as NVFlare's helper does
    helper = fk.WeightedAggregationHelper()
    want = sum(d["w"] for d in datas) / 3
    for i, d in enumerate(datas):
        helper.add(d, 1.0, f"site-{i}", 0)
        d["w"].zero_()
    torch.testing.assert_close(helper.get_result()["w"], want)


def test_inference_tensors_are_summed_at_once():
    """Inference tensors keep no version counter, so they are not held."""
    datas = _torch_contributions(3, {"w": (5,)}, seed=5)
    helper = fk.WeightedAggregationHelper(hold_bytes=1 << 20)
    helper.add(datas[0], 1.0, "site-0", 0)
    with torch.inference_mode():
        later = [{"w": d["w"].clone()} for d in datas[1:]]
    for i, d in enumerate(later, start=1):
        helper.add(d, 1.0, f"site-{i}", 0)
    assert helper._held == []
    torch.testing.assert_close(helper.get_result()["w"], sum(d["w"] for d in datas) / 3)


def test_aggregate_fn_sums_every_result_in_one_pass(monkeypatch):
    calls = []
    real = fk.summation.weighted_sum_
    monkeypatch.setattr(fk.summation, "weighted_sum_",
                        lambda accs, xs, w, *a: (calls.append(w.numel()), real(accs, xs, w, *a)))
    g = torch.Generator().manual_seed(6)
    results = [FLModel(params={"w": torch.randn(4, 4, generator=g)}, current_round=0,
                       meta={"NUM_STEPS_CURRENT_ROUND": 1 + i}) for i in range(5)]
    got = fk.aggregate_fn(results).params["w"]
    want = BaseFedAvg.aggregate_fn([FLModel(params={"w": r.params["w"].clone()}, current_round=0,
                                            meta=dict(r.meta)) for r in results]).params["w"]
    torch.testing.assert_close(got, want)
    assert calls == [4]
