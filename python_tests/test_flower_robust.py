"""fedkernels' robust Message-API strategies (FedMedian, FedTrimmedAvg, Krum, MultiKrum,
Bulyan) side by side with Flower's classes: identical replies go through both for three rounds
(hyperparameters changed between rounds), over float32, float64, mixed dtypes, an int64
counter, 0-d arrays, even and odd K, ties, NaN, zero examples, error replies, no replies,
``Mock(spec=Message)`` replies and shapes that differ. Checked: the ArrayRecord (keys, dtypes,
shapes, values to fp32 rounding), the MetricRecord, the exception type, and the replies'
ArrayRecords afterwards (Flower empties some of them)."""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from conftest import slow_after_first  # noqa: E402
from flower_message_helpers import (  # noqa: E402
    arrayrecord,
    assert_arrays_equal,
    assert_metrics_equal,
    assert_same_exception,
    error_reply,
    mock_reply,
    outcome,
    real_reply,
)
from flwr.app import RecordDict  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402

from fedkernels.integrations.flower import robust as ours_module  # noqa: E402

SHAPES = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (5, 7), "scalar": ()}

# class name -> (constructor kwargs, changes before round 2, changes before round 3)
CLASSES = {
    "FedMedian": ({}, {"weighted_by_key": "weight"}, {}),
    "FedTrimmedAvg": ({"beta": 0.2}, {"beta": 0.0}, {"beta": 0.34}),
    "Krum": ({"num_malicious_nodes": 1}, {"num_malicious_nodes": 2}, {"num_malicious_nodes": 0}),
    "MultiKrum": ({"num_malicious_nodes": 1, "num_nodes_to_select": 3},
                  {"num_nodes_to_select": 2}, {"num_malicious_nodes": 2,
                                               "weighted_by_key": "weight"}),
    "Bulyan": ({"num_malicious_nodes": 1}, {"num_malicious_nodes": 0},
               {"num_malicious_nodes": 1}),
}


def _metrics(rng, n=None):
    n = float(rng.integers(5, 50)) if n is None else n
    return {"num-examples": n, "weight": float(rng.uniform(0.5, 2.0)),
            "train_loss": float(rng.uniform(0.2, 2.5)), "acc": [0.5, float(rng.uniform())]}


class Scenario:
    """The replies of each round as (arrays, metrics) pairs ("error": an error reply).
    Clients are a centre plus small noise; two of them are far off (the Byzantine ones),
    so the Krum scores are well apart."""

    k = 7
    dtypes = (np.float32,)
    shapes = SHAPES
    mock = False

    def model(self, rng, k, r):
        dtype = self.dtypes[k % len(self.dtypes)]
        scale = 10.0 if k in (1, 4) else 0.1
        return {n: np.asarray(np.full(s, 0.5 * r) + scale * rng.standard_normal(s), dtype=dtype)
                for n, s in self.shapes.items()}

    def replies(self, r, rng):
        return [(self.model(rng, k, r), _metrics(rng)) for k in range(self.k)]


class Float32Odd(Scenario):
    pass


class Float32Even(Scenario):
    k = 8


class Float64(Scenario):
    dtypes = (np.float64,)


class Float16(Scenario):
    dtypes = (np.float16,)


class MixedDtypes(Scenario):
    dtypes = (np.float32, np.float64, np.float32)


class ZeroDim(Scenario):
    shapes = {"a": (), "b": (), "c": (3,)}


class Int64Counter(Scenario):
    def replies(self, r, rng):
        out = super().replies(r, rng)
        for k, (arrays, _) in enumerate(out):
            arrays["bn.num_batches_tracked"] = np.array(10 * r + k, dtype=np.int64)
        return out


class IntArraysOnly(Scenario):
    k = 9

    def model(self, rng, k, r):
        return {n: rng.integers(-5, 5, s).astype(np.int32) for n, s in self.shapes.items()}


class Ties(Scenario):
    """Integer-valued floats: many equal values per coordinate, and equal Krum scores."""

    k = 9

    def model(self, rng, k, r):
        return {n: rng.integers(0, 3, s).astype(np.float32) for n, s in self.shapes.items()}


class Duplicates(Scenario):
    """Replies in equal pairs (ties in the distances and scores, harmless for every rule)."""

    k = 8

    def replies(self, r, rng):
        out = super().replies(r, rng)
        return [({n: a.copy() for n, a in out[k // 2 * 2][0].items()}, out[k][1])
                for k in range(self.k)]


class NaNInReply(Scenario):
    def replies(self, r, rng):
        out = super().replies(r, rng)
        out[4][0]["fc.weight"][0, 0] = np.nan
        return out


class ZeroExamples(Scenario):
    def replies(self, r, rng):
        out = super().replies(r, rng)
        for k, (_, metrics) in enumerate(out):
            if k == 0 or r == 3:
                metrics["num-examples"] = 0.0
                metrics["weight"] = 0.0
        return out


class ErrorReplies(Scenario):
    def replies(self, r, rng):
        return super().replies(r, rng) + ["error"]


class NoReplies(Scenario):
    def replies(self, r, rng):
        return []


class MockReplies(Scenario):
    mock = True


class ShapesDiffer(Scenario):
    def replies(self, r, rng):
        out = super().replies(r, rng)
        if r == 2:
            out[3][0]["conv.bias"] = np.zeros(5, dtype=np.float32)
        return out


class KeysDiffer(Scenario):
    def replies(self, r, rng):
        out = super().replies(r, rng)
        if r == 2:
            out[3][0]["extra"] = np.zeros(2, dtype=np.float32)
        return out


class EvenlySpaced(Scenario):
    """Reply k is a centre moved by 0.01 k in every coordinate (what a mocked grid often
    sends): exact Krum ties between the middle replies, which Flower's rounding breaks."""

    def model(self, rng, k, r):
        return {n: np.asarray(np.full(s, 0.5 * r) + 0.01 * k, dtype=np.float32)
                for n, s in self.shapes.items()}


class Identical(Scenario):
    """Every reply the same model: all Krum scores 0 (Flower's are its rounding), and the
    selected reply's metrics are the result's."""

    def replies(self, r, rng):
        same = self.model(rng, 0, r)
        return [({n: a.copy() for n, a in same.items()}, _metrics(rng)) for _ in range(self.k)]


class NoArrays(Scenario):
    """Replies whose ArrayRecord is empty: the median and the trimmed mean of nothing are an
    empty ArrayRecord, the Krum rules' concatenation of nothing is NumPy's ValueError."""

    shapes = {}


SCENARIOS = [Float32Odd, Float32Even, Float64, Float16, MixedDtypes, ZeroDim, Int64Counter,
             IntArraysOnly, Ties, Duplicates, NaNInReply, ZeroExamples, ErrorReplies,
             NoReplies, MockReplies, ShapesDiffer, KeysDiffer, NoArrays, EvenlySpaced,
             Identical]

# Bulyan keeps the β values nearest to the median, which NumPy picks with argpartition (no
# defined order among equal distances): integer-valued replies tie there with different
# values, so the kept ones may differ. Documented; the other rules are compared on them.
# Flower's float16 Krum selection is its rounding's (its float16 distances round away the
# inliers'), and ours is Flower's there: the float16 scenario is compared too.
SKIP = {("Bulyan", "Ties"): "ties at Bulyan's β boundary: NumPy's argpartition order",
        ("Bulyan", "IntArraysOnly"): "ties at Bulyan's β boundary: NumPy's argpartition order"}


def _messages(spec, mock):
    out = []
    for node, item in enumerate(spec, start=1):
        if item == "error":
            out.append(error_reply(node))
        elif mock:
            out.append(mock_reply(*item))
        else:
            out.append(real_reply(node, *item))
    return out


def _tolerance(spec):
    dtypes = {a.dtype for item in spec if item != "error" for a in item[0].values()}
    if np.dtype(np.float16) in dtypes:
        return 2e-3, 2e-3
    if np.dtype(np.float32) in dtypes:
        return 2e-5, 2e-6
    return 1e-12, 1e-13


@pytest.mark.parametrize("scenario", slow_after_first(SCENARIOS), ids=lambda s: s.__name__)
@pytest.mark.parametrize("name", list(CLASSES))
def test_side_by_side(name, scenario):
    if (name, scenario.__name__) in SKIP:
        pytest.skip(SKIP[name, scenario.__name__])
    kwargs, change2, change3 = CLASSES[name]
    theirs = getattr(flower, name)(**kwargs)
    ours = getattr(ours_module, name)(**kwargs)
    assert isinstance(ours, getattr(flower, name))
    sc = scenario()
    for r in (1, 2, 3):
        if r > 1:
            for s in (theirs, ours):
                for key, value in (change2 if r == 2 else change3).items():
                    setattr(s, key, value)
        spec = sc.replies(r, np.random.default_rng(100 * r))
        their_msgs, our_msgs = _messages(spec, sc.mock), _messages(spec, sc.mock)
        (want, want_err) = outcome(theirs.aggregate_train, r, their_msgs)
        (got, got_err) = outcome(ours.aggregate_train, r, our_msgs)
        assert_same_exception(got_err, want_err)
        if want_err is not None:
            continue
        rtol, atol = _tolerance(spec)
        assert_arrays_equal(got[0], want[0], rtol, atol, f"{name} round {r}")
        assert_metrics_equal(got[1], want[1])
        # Flower's side effects on the replies (arrays popped by some rules)
        for a, b in zip(our_msgs, their_msgs):
            if a.has_error():
                continue
            assert list(a.content.array_records["arrays"].keys()) == \
                list(b.content.array_records["arrays"].keys())


def test_krum_selects_the_inlier_and_multikrum_averages_the_selected():
    """Hand case: four replies near 0 and one at 100; Krum (f = 1) returns one of the four,
    Multi-Krum with three nodes the weighted mean of three of them, never the outlier."""
    rng = np.random.default_rng(0)
    spec = [({"w": np.array([0.1 * k, -0.1 * k], np.float32)}, {"num-examples": float(k + 1)})
            for k in range(4)] + [({"w": np.array([100.0, 100.0], np.float32)},
                                   {"num-examples": 1.0})]
    del rng
    arrays, _ = ours_module.Krum(num_malicious_nodes=1).aggregate_train(1, _messages(spec, False))
    w = arrays["w"].numpy()
    assert any(np.allclose(w, s[0]["w"]) for s in spec[:4])
    multi = ours_module.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=3)
    arrays, _ = multi.aggregate_train(1, _messages(spec, False))
    assert np.all(np.abs(arrays["w"].numpy()) < 1.0)


def test_median_and_trimmed_mean_hand_case():
    """K = 4 replies of one coordinate: 1, 2, 10, 100. Median (2 + 10) / 2 = 6; trimmed mean
    with β = 0.25 drops one value at each end: (2 + 10) / 2 = 6; β = 0: the mean 28.25."""
    spec = [({"w": np.array([v], np.float64)}, {"num-examples": 1.0}) for v in (10, 1, 100, 2)]
    median, _ = ours_module.FedMedian().aggregate_train(1, _messages(spec, False))
    assert median["w"].numpy().tolist() == [6.0]
    trimmed, _ = ours_module.FedTrimmedAvg(beta=0.25).aggregate_train(1, _messages(spec, False))
    assert trimmed["w"].numpy().tolist() == [6.0]
    mean, _ = ours_module.FedTrimmedAvg(beta=0.0).aggregate_train(1, _messages(spec, False))
    assert mean["w"].numpy().tolist() == [28.25]


def test_bulyan_with_a_custom_selection_rule_calls_it():
    calls = []

    def first_ones(contents, num_malicious, theta):
        calls.append((len(contents), num_malicious, theta))
        return contents[:theta]

    spec = Float32Odd().replies(1, np.random.default_rng(3))
    theirs = flower.Bulyan(num_malicious_nodes=1, selection_rule=first_ones)
    ours = ours_module.Bulyan(num_malicious_nodes=1, selection_rule=first_ones)
    want = theirs.aggregate_train(1, _messages(spec, False))
    got = ours.aggregate_train(1, _messages(spec, False))
    assert calls == [(7, 1, 5), (7, 1, 5)]
    assert_arrays_equal(got[0], want[0], 2e-5, 2e-6)
    assert_metrics_equal(got[1], want[1])


def test_bulyan_replies_sharing_an_arrayrecord_raise_like_flower():
    """Flower's Bulyan empties the selected replies' ArrayRecords as it reads them: two
    selected replies holding the same ArrayRecord object give zip's ValueError, in ours too."""
    sc = Float32Odd()
    outcomes = []
    for module in (flower, ours_module):
        spec = sc.replies(1, np.random.default_rng(7))
        messages = _messages(spec, mock=True)
        shared = messages[0].content["arrays"]
        for k in (2, 3):  # inliers: Multi-Krum selects them
            messages[k].content["arrays"] = shared
        strategy = module.Bulyan(num_malicious_nodes=1)
        with pytest.raises(ValueError) as error:
            strategy.aggregate_train(1, messages)
        outcomes.append(str(error.value))
    assert outcomes[0] == outcomes[1]


def test_bulyan_too_few_replies_skips_like_flower(caplog):
    spec = Float32Odd().replies(1, np.random.default_rng(4))[:6]
    ours = ours_module.Bulyan(num_malicious_nodes=1)
    assert ours.aggregate_train(1, _messages(spec, False)) == (None, None)


def test_constructor_and_summary_are_flowers():
    ours = ours_module.FedTrimmedAvg(0.5, beta=0.1)
    assert ours.fraction_train == 0.5 and ours.beta == 0.1
    with pytest.raises(ValueError, match="beta"):
        ours_module.FedTrimmedAvg(beta=0.5)
    ours_module.Bulyan(num_malicious_nodes=1).summary()
    assert ours_module.Krum().num_nodes_to_select == 1


@pytest.mark.parametrize("name, op", [("FedMedian", "coordinate_median"),
                                      ("FedTrimmedAvg", "trimmed_mean"),
                                      ("Krum", "pairwise_sq_distances"),
                                      ("MultiKrum", "pairwise_sq_distances"),
                                      ("Bulyan", "pairwise_sq_distances"),
                                      ("Bulyan", "nearest_to_median_mean")])
def test_float_replies_take_the_fedkernels_op(monkeypatch, name, op):
    """The arithmetic really is fedkernels': one call of the op for all float arrays."""
    calls = []
    real = getattr(ours_module, op)
    monkeypatch.setattr(ours_module, op, lambda *a, **k: calls.append(op) or real(*a, **k))
    spec = Float32Odd().replies(1, np.random.default_rng(5))
    kwargs = CLASSES[name][0]
    got = getattr(ours_module, name)(**kwargs).aggregate_train(1, _messages(spec, False))
    want = getattr(flower, name)(**kwargs).aggregate_train(1, _messages(spec, False))
    assert calls == [op]
    assert_arrays_equal(got[0], want[0], 2e-5, 2e-6)


def _on_a_line(positions, length=10**6):
    """float32 replies x_k = t_k u along one random direction u of ``length`` values."""
    u = np.random.default_rng(3).standard_normal(length).astype(np.float32)
    return [RecordDict({"arrays": arrayrecord({"w": (np.float32(t) * u).astype(np.float32)})})
            for t in positions]


def _spy_on_flowers_selection(monkeypatch) -> list:
    calls = []
    real = ours_module._flwr_select_multikrum
    monkeypatch.setattr(ours_module, "_flwr_select_multikrum",
                        lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("gamma, flowers", [(5e-5, True), (1.1e-4, True), (0.1, False)])
def test_krum_near_tie_on_a_large_model_is_flowers(monkeypatch, gamma, flowers):
    """Flower's distances of 10^6 float32 values, ‖x‖² + ‖y‖² − 2x·y with dot products of
    10^6 terms, round by more than a few units in the last place: where the two lowest scores
    (2 and 2 + 2γ, in units of ‖u‖²) are closer than that, Flower's rounding orders them, so
    its selection runs; a clear gap keeps the fused one (the reply at -1). γ = 1.1e-4 lies
    between the bound that ignored the length (1.9e-4 ‖u‖²) and this one (2.5e-4 ‖u‖²)."""
    calls = _spy_on_flowers_selection(monkeypatch)
    contents = _on_a_line([-2.0, -1.0, 0.0, 1.0 + gamma, 3.0])
    picked = ours_module.select_multikrum(contents, 1, 1)
    assert calls == ([1] if flowers else [])
    if not flowers:
        assert picked[0] is contents[1]


def test_krum_far_outlier_keeps_the_fused_selection(monkeypatch):
    """A reply 1000 units away does not widen the rounding bound of the replies that decide
    (the bound once took the largest norm of all replies, and sent every such call to
    Flower's code); the fused selection, the reply at -1, is Flower's too."""
    calls = _spy_on_flowers_selection(monkeypatch)
    contents = _on_a_line([-2.0, -1.0, 0.0, 1.1, 1000.0])
    picked = ours_module.select_multikrum(contents, 1, 1)
    assert calls == [] and picked[0] is contents[1]
    want = ours_module._flwr_select_multikrum(_on_a_line([-2.0, -1.0, 0.0, 1.1, 1000.0]), 1, 1)
    np.testing.assert_array_equal(want[0]["arrays"]["w"].numpy(), picked[0]["arrays"]["w"].numpy())
