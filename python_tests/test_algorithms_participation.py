"""Participation-aware aggregation (docs/algorithms/participation.md): FedAU's interval estimator
against the paper's Algorithm 2, its Bernoulli limit, FedAU on quadratic clients (converges to
the unweighted minimiser; averaging the participants does not), and MIFA/FedVARP against the
full-table rules of IBM/fedau."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algorithm_helpers import VectorModel, round_info, setup_info, sgd_server

from fedkernels.algorithms import build_strategy
from fedkernels.rules.participation_weights import IntervalWeightEstimator
from fedkernels.sim.participation import ParticipationHistory


def algorithm_2(masks, cutoff):
    """The paper's Algorithm 2 verbatim, one client at a time: omega_t from I_0..I_{t-1}.
    Returns omega[t, n] for t = 0..T-1 (the weight used in round t)."""
    rounds, n = masks.shape
    out = np.ones((rounds, n))
    for j in range(n):
        m, counter, omega = 0, 0, 1.0
        for t in range(1, rounds):
            counter += 1
            if masks[t - 1, j] or counter == cutoff:
                s = counter
                omega = s if m == 0 else (m * omega + s) / (m + 1)
                m += 1
                counter = 0
            out[t, j] = omega
    return out


def list_form(masks, cutoff):
    """IBM/fedau's form: mean of a list of intervals, the closing one counted from next round."""
    rounds, n = masks.shape
    out = np.ones((rounds, n))
    for j in range(n):
        intervals, counter = [], 0
        for t in range(rounds):
            out[t, j] = np.mean(intervals) if intervals else 1.0
            if masks[t, j]:
                intervals.append(counter + 1)
                counter = 0
            else:
                counter += 1
                if cutoff is not None and counter >= cutoff:
                    intervals.append(cutoff)
                    counter = 0
    return out


@pytest.mark.parametrize("cutoff", [None, 4])
def test_interval_estimator_matches_algorithm_2_and_list_form(cutoff):
    rng = np.random.default_rng(0)
    masks = rng.random((60, 7)) < np.array([0.9, 0.5, 0.3, 0.1, 0.05, 0.0, 1.0])
    estimator = IntervalWeightEstimator(7, cutoff)
    got = np.ones((60, 7))
    for t in range(60):
        got[t] = estimator.omega.numpy()
        estimator.observe(torch.from_numpy(masks[t]))
    np.testing.assert_allclose(got, list_form(masks, cutoff), rtol=1e-12)
    # Algorithm 2 with cutoff K == the list form (with no cutoff, K larger than T)
    np.testing.assert_allclose(got, algorithm_2(masks, cutoff or 10**9), rtol=1e-12)


def test_interval_estimator_bernoulli_limit():
    """E[omega] -> E[S] = (1 - (1-p)^K)/p for the cut-off geometric interval (p=0.1, K=50:
    9.948; p=0.3, K=3: 2.1)."""
    rng = np.random.default_rng(1)
    p = np.repeat([0.1, 0.3], 200)
    cutoff = np.array([50, 3])
    for k in cutoff:
        estimator = IntervalWeightEstimator(len(p), int(k))
        for _ in range(3000):
            estimator.observe(torch.from_numpy(rng.random(len(p)) < p))
        omega = estimator.omega.numpy()
        for value in (0.1, 0.3):
            expected = (1 - (1 - value) ** k) / value
            assert abs(omega[p == value].mean() - expected) < 0.03 * expected


def quadratic_run(name, params, centres, probabilities, rounds=2500, seed=0, lr=0.1, steps=5):
    """Algorithm 1 on F_n(x) = ½||x - c_n||²: I gradient steps give u_n = (1-(1-γ)^I)(c_n - x).
    Drives the real strategy and server; returns x averaged over the second half."""
    rng = np.random.default_rng(seed)
    n, dim = centres.shape
    model = VectorModel(dim)
    server = sgd_server(model)
    strategy = build_strategy(name, params)
    strategy.setup(setup_info(n, probabilities=probabilities, model=model))
    history = ParticipationHistory(n)
    shrink = 1 - (1 - lr) ** steps
    c = torch.from_numpy(centres)
    trace = []
    for t in range(rounds):
        mask = torch.from_numpy(rng.random(n) < probabilities)
        history.record(mask)
        ids = mask.nonzero().flatten()
        if len(ids):
            x = server.state["x"].clone()
            states = [{"x": x + shrink * (c[i] - x)} for i in ids.tolist()]
            info = round_info(
                np.ones(len(ids)),
                np.ones(len(ids)),
                {"x": x},
                states,
                participants=ids,
                num_clients=n,
                round_index=t,
                history=history,
            )
            strategy.aggregate(info, server)
        if t >= rounds // 2:
            trace.append(server.state["x"].numpy().copy())
    return np.mean(trace, axis=0)


@pytest.mark.slow
def test_fedau_converges_to_unweighted_minimiser_on_quadratics():
    rng = np.random.default_rng(3)
    n = 40
    probabilities = np.where(np.arange(n) < n // 2, 0.5, 0.05)
    centres = np.where((np.arange(n) < n // 2)[:, None], [2.0, 0.0], [-2.0, 1.0])
    centres = centres + 0.3 * rng.normal(size=(n, 2))
    uniform = centres.mean(0)
    p_weighted = (probabilities[:, None] * centres).sum(0) / probabilities.sum()
    fedau = quadratic_run("fedau", {"cutoff": 0}, centres, probabilities)
    participating = quadratic_run("avg-participating", None, centres, probabilities)
    known = quadratic_run("known-p", None, centres, probabilities)
    assert np.linalg.norm(fedau - uniform) < 0.2
    assert np.linalg.norm(known - uniform) < 0.2
    assert np.linalg.norm(participating - p_weighted) < 0.2
    assert np.linalg.norm(participating - uniform) > 1.0  # the bias FedAU removes
    # with cutoff K the fixed point weights client n by p_n E[omega_n] = 1 - (1-p_n)^K
    k = 5
    fedau_k = quadratic_run("fedau", {"cutoff": k}, centres, probabilities)
    weight = 1 - (1 - probabilities) ** k
    predicted = (weight[:, None] * centres).sum(0) / weight.sum()
    assert np.linalg.norm(fedau_k - predicted) < 0.2


def test_fedau_weights_and_resume():
    n = 5
    strategy = build_strategy("fedau", {"cutoff": 3})
    strategy.setup(setup_info(n))
    history = ParticipationHistory(n)
    masks = [[1, 0, 0, 1, 0], [0, 0, 0, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]]
    expected_omega = list_form(np.array(masks, dtype=bool), 3)
    for t, row in enumerate(masks):
        mask = torch.tensor(row, dtype=torch.bool)
        history.record(mask)
        ids = mask.nonzero().flatten()
        if not len(ids):
            continue  # the simulation skips empty rounds; the strategy catches up
        info = round_info(np.ones(len(ids)), np.ones(len(ids)), participants=ids,
                          num_clients=n, round_index=t, history=history,
                          global_state={}, client_states=[{}] * len(ids))
        w = strategy.client_weights(info).numpy()
        np.testing.assert_allclose(w, expected_omega[t, ids.numpy()] / n)
        if t == 2:
            saved = strategy.state_dict()
            resumed = build_strategy("fedau", {"cutoff": 3})
            resumed.setup(setup_info(n))
            resumed.load_state_dict(saved)
            strategy = resumed


def test_baseline_weights():
    probabilities = np.array([0.5, 0.2, 0.1, 0.4])
    info = round_info([1, 1], [3, 7], participants=[1, 2], num_clients=4)
    for name, expected in [
        ("avg-participating", [0.5, 0.5]),
        ("avg-all", [0.25, 0.25]),
        ("known-p", [1 / (4 * 0.2), 1 / (4 * 0.1)]),
    ]:
        strategy = build_strategy(name)
        strategy.setup(setup_info(4, probabilities=probabilities))
        np.testing.assert_allclose(strategy.client_weights(info).numpy(), expected)


@pytest.mark.parametrize("name", ["mifa", "fedvarp"])
def test_memory_strategies_match_full_table_rules(name):
    """The O(|S| P) buffer updates equal IBM/fedau's rules written on an N x d table: FedVARP
    v = mean_S(u - Y_old) + mean(Y_old); MIFA v = mean(Y_new); x += eta v."""
    rng = np.random.default_rng(4)
    n, dim, eta = 6, 5, 0.7
    model = VectorModel(dim)
    server = sgd_server(model, lr=eta)
    strategy = build_strategy(name)
    strategy.setup(setup_info(n, model=model))
    history = ParticipationHistory(n)
    table = np.zeros((n, dim))
    x = np.zeros(dim)
    for t in range(8):
        mask = rng.random(n) < 0.5
        mask[t % n] = True
        history.record(torch.from_numpy(mask))
        ids = np.flatnonzero(mask)
        updates = rng.normal(size=(len(ids), dim))
        glob = {"x": server.state["x"].clone()}
        states = [{"x": glob["x"] + torch.from_numpy(u)} for u in updates]
        info = round_info(np.ones(len(ids)), np.ones(len(ids)), glob, states,
                          participants=torch.from_numpy(ids), num_clients=n, round_index=t,
                          history=history)
        strategy.aggregate(info, server)
        if name == "fedvarp":
            v = (updates - table[ids]).mean(0) + table.mean(0)
            table[ids] = updates
        else:
            table[ids] = updates
            v = table.mean(0)
        x = x + eta * v
        np.testing.assert_allclose(server.state["x"].numpy(), x, rtol=1e-12, atol=1e-12)
        if t == 4:  # resume through state_dict
            saved = strategy.state_dict()
            strategy = build_strategy(name)
            strategy.setup(setup_info(n, model=model))
            strategy.load_state_dict(saved)
    np.testing.assert_allclose(strategy.table.buffer[:n].numpy(), table, atol=1e-12)
    np.testing.assert_allclose(strategy.table.buffer[n].numpy(), table.mean(0), atol=1e-12)
