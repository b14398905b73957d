"""fedkernels.robust against NumPy and against Flower's own aggregation functions (legacy
``flwr.server.strategy.aggregate`` and the Message API's helpers) on identical inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")  # the expected values come from Flower's own functions

from flower_message_helpers import content  # noqa: E402
from flwr.server.strategy import aggregate as flwr_agg  # noqa: E402
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights  # noqa: E402
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean as flwr_trim_mean  # noqa: E402
from flwr.serverapp.strategy.multikrum import select_multikrum  # noqa: E402

from fedkernels.robust import (
    bulyan,
    coordinate_median,
    krum,
    krum_scores,
    nearest_to_median_mean,
    pairwise_sq_distances,
    trimmed_mean,
)

SHAPES = [(3, 4), (5,), (), (2, 1, 3)]


def make_clients(K, dtype=torch.float32, seed=0, integer=False, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(K):
        if integer:  # small integers: many ties, and every sum below is exact
            out.append([torch.randint(-3, 4, s, generator=g).to(dtype) for s in shapes])
        else:
            out.append([torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
                        for s in shapes])
    return out


def np_layers(clients):
    return [[t.numpy() for t in c] for c in clients]


def assert_same(result, expected_np, exact=True, rtol=0.0, atol=0.0):
    assert len(result) == len(expected_np)
    for r, e in zip(result, expected_np):
        e = torch.from_numpy(np.asarray(e)).to(r.dtype)
        assert r.shape == e.shape
        if exact:
            assert torch.equal(r.nan_to_num(7.5), e.nan_to_num(7.5)), (r, e)
            assert torch.equal(r.isnan(), e.isnan())
        else:
            torch.testing.assert_close(r, e, rtol=rtol, atol=atol, equal_nan=True)


# ---------------------------------------------------------------- median


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("integer", [False, True])
def test_median_equals_numpy_and_flower(dtype, K, integer):
    clients = make_clients(K, dtype, seed=K, integer=integer)
    result = coordinate_median(clients)
    expected = [np.median(np.stack(layer), axis=0) for layer in zip(*np_layers(clients))]
    assert_same(result, expected)
    if dtype != torch.float16:
        assert_same(result, flwr_agg.aggregate_median([(c, 1) for c in np_layers(clients)]))


@pytest.mark.parametrize("K", [4, 5])
def test_median_nan_and_inf_follow_numpy(K):
    clients = make_clients(K, torch.float32, seed=3)
    clients[1][0][0, 0] = float("nan")
    clients[0][0][1, 1] = float("inf")
    clients[2][0][1, 1] = float("inf")
    clients[0][1][0] = float("inf")  # +inf and -inf as the two middle values of an even K
    clients[1][1][0] = float("-inf")
    if K == 4:
        clients[2][1][0] = float("inf")
        clients[3][1][0] = float("-inf")
    big = 3e38  # the two middle values' sum overflows in float32, as in NumPy
    for c in clients:
        c[1][1] = big
    result = coordinate_median(clients)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = [np.median(np.stack(layer), axis=0) for layer in zip(*np_layers(clients))]
    assert torch.isnan(result[0][0, 0])
    assert_same(result, expected)


def test_median_state_dict_and_flat_and_out():
    clients = make_clients(5, torch.float64, seed=1)
    sds = [{"w": c[0], "b": c[1], "steps": torch.tensor(k)} for k, c in enumerate(clients)]
    r = coordinate_median(sds)
    assert list(r) == ["w", "b", "steps"] and int(r["steps"]) == 4
    torch.testing.assert_close(r["w"], coordinate_median([c[0] for c in clients]), rtol=0, atol=0)
    flat = torch.stack([torch.cat([t.reshape(-1) for t in c]) for c in clients])
    rf = coordinate_median(flat)
    assert rf.shape == (flat.shape[1],)
    torch.testing.assert_close(rf, torch.from_numpy(np.median(flat.numpy(), axis=0)),
                               rtol=0, atol=0)
    out = [torch.empty_like(t) for t in clients[0]]
    assert coordinate_median(clients, out=out) is out
    for o, e in zip(out, coordinate_median(clients)):
        assert torch.equal(o, e)


def test_median_errors_name_the_fault():
    clients = make_clients(3)
    clients[2][1] = torch.zeros(6)
    with pytest.raises(ValueError, match="client 2, tensor 1"):
        coordinate_median(clients)
    clients = make_clients(3)
    clients[1][0] = clients[1][0].double()
    with pytest.raises(ValueError, match="client 1, tensor 0 is torch.float64"):
        coordinate_median(clients)
    clients = make_clients(3)
    with pytest.raises(ValueError, match="coordinate_median: out tensor 0 overlaps client 1, "
                                         "tensor 0"):
        coordinate_median(clients, out=[clients[1][0]] + [torch.empty_like(t)
                                                           for t in clients[0][1:]])
    with pytest.raises(ValueError, match="K = 0"):
        coordinate_median([])
    # the native op's check of out, with the user's state_dict keys in the message
    sds = [{"w": c[0], "b": c[1]} for c in make_clients(3)]
    out = {"w": sds[2]["w"], "b": torch.empty(5)}
    with pytest.raises(ValueError, match="coordinate_median: out tensor 'w' overlaps client 2, "
                                         "tensor 'w'"):
        coordinate_median(sds, out=out)


# ---------------------------------------------------------------- trimmed mean


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [1, 2, 5, 6, 10, 13])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.3, 0.49])
def test_trimmed_mean_equals_flower(dtype, K, beta):
    # Integer-valued data: every partial sum is exact, so Flower's summation order (whatever
    # np.partition leaves) cannot change the result and equality is bitwise.
    clients = make_clients(K, dtype, seed=K, integer=True)
    layers = np_layers(clients)
    result = trimmed_mean(clients, beta)
    assert_same(result, flwr_agg.aggregate_trimmed_avg([(c, 1) for c in layers], beta))
    assert_same(result, [flwr_trim_mean(np.stack(layer), beta) for layer in zip(*layers)])
    # Random data: equal up to the order of summation (a few ulps).
    clients = make_clients(K, dtype, seed=100 + K)
    layers = np_layers(clients)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert_same(trimmed_mean(clients, beta),
                flwr_agg.aggregate_trimmed_avg([(c, 1) for c in layers], beta),
                exact=False, rtol=tol, atol=tol)


def test_trimmed_mean_nan_sorts_last():
    clients = make_clients(5, torch.float64, seed=2)
    clients[3][1][0] = float("nan")  # among the cut top value at beta=0.2: dropped
    clients[3][1][1] = float("nan")
    clients[4][1][1] = float("nan")  # two NaNs, one kept: NaN
    r = trimmed_mean(clients, 0.2)
    expected = flwr_agg.aggregate_trimmed_avg([(c, 1) for c in np_layers(clients)], 0.2)
    assert torch.isfinite(r[1][0]) and torch.isnan(r[1][1])
    assert_same(r, expected, exact=False, rtol=1e-14, atol=1e-14)


def test_trimmed_mean_beta_checked():
    with pytest.raises(ValueError, match=r"beta must be in \[0, 0.5\), got 0.5"):
        trimmed_mean(make_clients(3), 0.5)
    with pytest.raises(TypeError, match="beta must be a number"):
        trimmed_mean(make_clients(3), "0.1")


# ---------------------------------------------------------------- distances and Krum


def outlier_clients(K, f, dtype=torch.float64, seed=0):
    """K - f honest clients near one point, f far away (well separated scores)."""
    clients = make_clients(K, dtype, seed=seed)
    for k in range(K - f, K):
        clients[k] = [t * 50 + 20 for t in clients[k]]
    return clients


def test_pairwise_distances_match_flower():
    clients = make_clients(7, torch.float64, seed=4)
    d = pairwise_sq_distances(clients)
    assert d.dtype == torch.float64 and d.shape == (7, 7)
    expected = flwr_agg._compute_distances(np_layers(clients))
    torch.testing.assert_close(d, torch.from_numpy(expected), rtol=1e-12, atol=1e-12)
    assert torch.equal(d, d.T) and torch.all(d.diagonal() == 0)
    # float32 clients: float64 accumulation of the exact differences
    c32 = [[t.float() for t in c] for c in clients]
    flat = torch.stack([torch.cat([t.reshape(-1) for t in c]) for c in c32]).double()
    exact = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    torch.testing.assert_close(pairwise_sq_distances(c32), exact, rtol=1e-15, atol=0)


@pytest.mark.parametrize("K,f", [(5, 1), (8, 2), (11, 3), (3, 0)])
def test_krum_selects_as_flower(K, f):
    clients = outlier_clients(K, f, seed=K)
    layers = np_layers(clients)
    result, selected = krum(clients, f)
    expected = flwr_agg.aggregate_krum([(c, 1) for c in layers], f, 0)
    assert_same(result, expected)  # the selected client itself
    assert selected[0] < K - f
    scores = flwr_scores(layers, f)
    assert selected == [int(np.argmin(scores))]
    torch.testing.assert_close(krum_scores(pairwise_sq_distances(clients), f),
                               torch.tensor(scores, dtype=torch.float64), rtol=1e-12, atol=0)


def flwr_scores(layers, f):
    d = flwr_agg._compute_distances(layers)
    n = max(1, len(layers) - f - 2)
    return [float(np.sum(d[i, np.argsort(d[i])[1:n + 1]])) for i in range(len(layers))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,f,m", [(7, 2, 3), (10, 3, 5), (6, 1, 6)])
def test_multikrum_weighted_average_as_flower(dtype, K, f, m):
    clients = outlier_clients(K, f, dtype, seed=10 + K)
    layers = np_layers(clients)
    examples = [10 + 7 * k for k in range(K)]
    result, selected = krum(clients, f, m, weights=examples)
    expected = flwr_agg.aggregate_krum(list(zip(layers, examples)), f, m)
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    assert_same(result, expected, exact=False, rtol=tol, atol=tol)
    assert sorted(selected) == sorted(np.argsort(flwr_scores(layers, f))[:m].tolist())
    # the Message API's selection: the same clients (its float32 Gram-form distances may
    # order the close honest scores differently)
    contents = [content({"w": c[0], "b": c[1]}, {"num-examples": n})
                for c, n in zip(layers, examples)]
    chosen = select_multikrum(contents, f, m)
    assert sorted(next(i for i, c in enumerate(contents) if c is x) for x in chosen) == \
        sorted(selected)


def test_krum_nan_client_ranks_last_and_arguments_checked():
    clients = outlier_clients(6, 1, seed=1)
    clients[0][0][0, 0] = float("nan")
    result, selected = krum(clients, 1, 2)
    assert 0 not in selected and all(torch.isfinite(t).all() for t in result)
    with pytest.raises(ValueError, match=r"num_to_keep must be in \[1, 6\], got 7"):
        krum(clients, 1, 7)
    with pytest.raises(TypeError, match="num_malicious must be an int"):
        krum(clients, 1.5)
    with pytest.raises(ValueError, match="weight of client 2 is -1.0"):
        krum(clients, 1, 2, weights=[1, 1, -1, 1, 1, 1])
    # Booleans are refused however they come, as aggregate refuses them.
    for mask in ([True] * 6, np.ones(6, dtype=bool), torch.ones(6, dtype=torch.bool)):
        with pytest.raises(TypeError, match="weights must be real numbers"):
            krum(clients, 1, 2, weights=mask)


# ---------------------------------------------------------------- Bulyan


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,f", [(7, 1), (8, 1), (11, 2), (3, 0), (12, 2)])
def test_bulyan_iterative_equals_flower_legacy(dtype, K, f):
    clients = outlier_clients(K, f, dtype, seed=20 + K)
    layers = np_layers(clients)
    result = bulyan(clients, f)
    expected = flwr_agg.aggregate_bulyan([(c, 1) for c in layers], f, flwr_agg.aggregate_krum,
                                         to_keep=0)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert_same(result, expected, exact=False, rtol=tol, atol=tol)


@pytest.mark.parametrize("K,f", [(7, 1), (10, 1), (11, 2)])
def test_bulyan_multikrum_equals_flower_message_api(K, f):
    clients = outlier_clients(K, f, torch.float64, seed=30 + K)
    layers = np_layers(clients)
    contents = [content({"w": c[0], "b": c[1], "s": c[2], "t": c[3]}, {"num-examples": 1})
                for c in layers]
    theta = K - 2 * f
    chosen = select_multikrum(contents, f, theta)
    selected = [layers[next(i for i, c in enumerate(contents) if c is x)] for x in chosen]
    median = [np.median(np.stack(layer), axis=0) for layer in zip(*selected)]
    expected = aggregate_n_closest_weights(median, selected, theta - 2 * f)
    assert_same(bulyan(clients, f, selection="multikrum"), expected, exact=False,
                rtol=1e-14, atol=1e-14)


def test_bulyan_integer_data_exact_and_errors():
    # Small integers with an odd number of selected clients: the median is one of the values,
    # the window of closest values has no distance ties at its edges only by chance, so use
    # f = 0 (beta = K: the plain mean of all clients).
    clients = make_clients(5, torch.float64, seed=5, integer=True)
    r = bulyan(clients, 0)
    mean = [np.mean(np.stack(layer), axis=0) for layer in zip(*np_layers(clients))]
    assert_same(r, mean, exact=False, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match=r"K >= 4 \* num_malicious \+ 3 = 7 clients, got K = 6"):
        bulyan(make_clients(6), 1)
    with pytest.raises(ValueError, match="selection must be one of"):
        bulyan(make_clients(7), 1, selection="krum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,window", [(1, 1), (4, 2), (5, 3), (6, 6), (9, 5)])
def test_nearest_to_median_mean_equals_flower(dtype, K, window):
    clients = make_clients(K, dtype, seed=40 + K)
    layers = np_layers(clients)
    median = [np.median(np.stack(layer), axis=0) for layer in zip(*layers)]
    expected = aggregate_n_closest_weights(median, layers, window)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert_same(nearest_to_median_mean(clients, window), expected, exact=False, rtol=tol,
                atol=tol)


def test_nearest_to_median_mean_state_dict_out_and_errors():
    sds = [{"w": c[0], "b": c[1], "n": torch.tensor(k)} for k, c in enumerate(make_clients(5))]
    out = {"w": torch.empty(3, 4), "b": torch.empty(5), "n": torch.tensor(0)}
    got = nearest_to_median_mean(sds, 3, out=out)
    assert got is out and int(out["n"]) == 4  # integer entries: the maximum, as in bulyan
    expected = nearest_to_median_mean([[c["w"], c["b"]] for c in sds], 3)
    assert torch.equal(out["w"], expected[0]) and torch.equal(out["b"], expected[1])
    with pytest.raises(ValueError, match=r"window must be in \[1, 5\], got 6"):
        nearest_to_median_mean(sds, 6)
    with pytest.raises(ValueError, match=r"window must be in \[1, 5\], got 0"):
        nearest_to_median_mean(sds, 0)
    with pytest.raises(TypeError, match="window must be an int"):
        nearest_to_median_mean(sds, 2.0)


# ---------------------------------------------------------------- out= memory, counters only

RULES = {
    "coordinate_median": lambda c, **kw: coordinate_median(c, **kw),
    "trimmed_mean": lambda c, **kw: trimmed_mean(c, 0.2, **kw),
    "nearest_to_median_mean": lambda c, **kw: nearest_to_median_mean(c, 3, **kw),
    "krum": lambda c, **kw: krum(c, 1, **kw)[0],
    "multikrum": lambda c, **kw: krum(c, 1, 3, **kw)[0],
    "bulyan": lambda c, **kw: bulyan(c, 1, **kw),
}


def _counted(K=7):
    return [{"w": torch.randn(3, generator=torch.Generator().manual_seed(k)),
             "n": torch.full((3,), k)} for k in range(K)]


@pytest.mark.parametrize("rule", list(RULES))
def test_bad_integer_out_is_refused_before_any_write(rule):
    clients = _counted()
    cases = {
        "expanded out": ({"n": torch.tensor([0]).expand(3)}, "has elements that share memory"),
        "a client's counter": ({"n": clients[4]["n"]}, "out tensor 'n' overlaps client 4"),
        "the float entry": (None, "out tensor '[nw]' overlaps out tensor '[wn]'"),
    }
    for case, (change, message) in cases.items():
        out = {"w": torch.zeros(4), "n": torch.zeros(3, dtype=torch.int64)}
        if change is None:  # 'n' placed over the float result's memory
            shared = torch.zeros(6, dtype=torch.int64)
            out = {"w": shared.view(torch.float32)[:3], "n": shared[1:4]}
        else:
            out.update(change)
            out["w"] = out["w"][:3]
        before = out["w"].clone()
        snapshot = [c["n"].clone() for c in clients]
        with pytest.raises(ValueError, match=message):
            RULES[rule](clients, out=out)
        assert torch.equal(out["w"], before), case
        assert all(torch.equal(c["n"], s) for c, s in zip(clients, snapshot)), case


@pytest.mark.parametrize("rule", ["krum", "multikrum"])
def test_krum_refuses_float_outs_that_overlap(rule):
    # Krum writes the selected floats itself (the native ops check their own outputs).
    clients = [{"a": torch.randn(3), "b": torch.randn(3)} for _ in range(5)]
    buffer = torch.zeros(4)
    with pytest.raises(ValueError, match="out tensor 'a' overlaps out tensor 'b'"):
        RULES[rule](clients, out={"a": buffer[:3], "b": buffer[1:]})
    assert not buffer.any()
    with pytest.raises(ValueError, match="out tensor 'a' overlaps client 2, tensor 'a'"):
        RULES[rule](clients, out=clients[2])


@pytest.mark.parametrize("rule", list(RULES))
def test_models_of_counters_only(rule):
    # No floating-point entry: the counters follow the rule's integer policy (the maximum
    # over the clients it uses), as with aggregate; no native op is called with nothing.
    clients = [{"n": torch.tensor(k)} for k in range(7)]
    got = RULES[rule](clients)
    assert set(got) == {"n"} and got["n"].dtype == torch.int64
    if rule in ("coordinate_median", "trimmed_mean", "nearest_to_median_mean"):
        assert int(got["n"]) == 6
    assert torch.equal(pairwise_sq_distances(clients), torch.zeros(7, 7, dtype=torch.float64))


@pytest.mark.parametrize("rule", list(RULES))
def test_results_carry_no_gradient(rule):
    # The rules have no derivative: clients that require grad are read as values.
    clients = [torch.randn(4, generator=torch.Generator().manual_seed(k)).requires_grad_()
               for k in range(7)]
    got = RULES[rule](clients)
    assert not got.requires_grad and got.grad_fn is None
