"""AAggFF against reference numbers (the paper's Table 3.3 for the CDFs, hand-computed first
steps of AAggFF-S and AAggFF-D, both variants) and an independent SLSQP solution of the ONS
problem (resume: test_algorithms_resume.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algorithm_helpers import round_info, setup_info
from scipy.optimize import minimize

from fedkernels.algorithms import build_strategy
from fedkernels.rules.aaggff import cdf_transform

F3 = np.array([0.01, 0.10, 0.02])


@pytest.mark.parametrize(
    "cdf, expected",
    [
        ("weibull", [0.05, 1.00, 0.19]),
        ("frechet", [0.01, 0.65, 0.11]),
        ("gumbel", [0.12, 0.76, 0.18]),
        ("exponential", [0.21, 0.90, 0.37]),
        ("logistic", [0.32, 0.79, 0.37]),
        ("normal", [0.22, 0.90, 0.295]),
    ],
)
def test_cdf_table_3_3(cdf, expected):
    np.testing.assert_allclose(cdf_transform(F3, cdf), expected, atol=0.006)


def test_official_normal_is_inverted():
    np.testing.assert_allclose(
        cdf_transform(F3, "normal", official_normal=True), [1.279, 0.595, 1.205], atol=1e-3
    )


def ons_by_slsqp(history, alpha, beta):
    """p = argmin over the simplex of sum<g,p> + alpha/2 |p|^2 + beta/2 sum <g, p - p_tau>^2."""
    k = len(history[0][0])

    def objective(p):
        return sum(g @ p + 0.5 * beta * (g @ (p - pt)) ** 2 for g, pt in history) + 0.5 * alpha * (
            p @ p
        )

    res = minimize(objective, np.full(k, 1 / k), bounds=[(0, 1)] * k, method="SLSQP",
                   constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1}],
                   options={"ftol": 1e-15, "maxiter": 500})
    return res.x


def aaggff_s(variant="paper", cdf="normal", k=3):
    strategy = build_strategy("aaggff-s", {"cdf": cdf, "variant": variant})
    strategy.setup(setup_info(k))
    return strategy


def test_aaggff_s_golden_first_step():
    strategy = aaggff_s("paper")
    r = cdf_transform(F3, "normal", 0, 1 / 3)
    np.testing.assert_allclose(r, [0.073626, 0.301504, 0.098376], atol=1e-6)
    g = -r / (1 + r.mean())
    np.testing.assert_allclose(g, [-0.063589, -0.260403, -0.084966], atol=1e-6)
    p = strategy.step(torch.from_numpy(F3))
    np.testing.assert_allclose(p, [0.315230, 0.364219, 0.320551], atol=1e-6)
    official = aaggff_s("official").step(torch.from_numpy(F3))
    np.testing.assert_allclose(official, [0.325837, 0.346123, 0.328040], atol=1e-6)


def test_aaggff_s_matches_ftrl_objective_over_rounds():
    rng = np.random.default_rng(0)
    k = 4
    strategy = aaggff_s("paper", cdf="weibull", k=k)
    history = []
    for _ in range(5):
        losses = rng.uniform(0.1, 2.0, size=k)
        p_before = strategy.decision.numpy().copy()
        r = cdf_transform(losses, "weibull", 0, 1 / k)
        history.append((-r / (1 + p_before @ r), p_before))
        p = strategy.step(torch.from_numpy(losses))
        ref = ons_by_slsqp(history, 4.0, k / 4)
        np.testing.assert_allclose(p, ref, atol=2e-5)


def test_aaggff_s_paper_vs_official_after_20_rounds():
    """Reference numbers from an independent NumPy run: 20 identical rounds, F = [.01, .1, .02],
    K = 3."""
    paper, official = aaggff_s("paper"), aaggff_s("official")
    for _ in range(20):
        p = paper.step(torch.from_numpy(F3))
        q = official.step(torch.from_numpy(F3))
    np.testing.assert_allclose(p, [0.0013, 0.8998, 0.0989], atol=2e-3)
    np.testing.assert_allclose(q, [0.161, 0.628, 0.212], atol=2e-3)


def test_aaggff_d_golden_step():
    strategy = build_strategy("aaggff-d", {"cdf": "weibull", "sampling_fraction": 0.5})
    strategy.setup(setup_info(6))
    info = round_info([1.0, 3.0, 2.0], [10, 10, 10], participants=[0, 2, 5], num_clients=6,
                      round_index=0)
    w = strategy.client_weights(info).numpy()
    np.testing.assert_allclose(
        strategy.gradient_sum.numpy(),
        [0.054302, -0.225599, -0.467181, -0.225599, -0.225599, -0.263916],
        atol=1e-6,
    )
    np.testing.assert_allclose(
        strategy.decision.numpy(),
        [0.149663, 0.166394, 0.182331, 0.166394, 0.166394, 0.168825],
        atol=1e-6,
    )
    np.testing.assert_allclose(w, [0.298837, 0.364065, 0.337099], atol=1e-6)


def test_aaggff_d_official_dr_estimate_drops_mean():
    strategy = build_strategy(
        "aaggff-d", {"cdf": "weibull", "sampling_fraction": 0.5, "variant": "official"}
    )
    strategy.setup(setup_info(6))
    p0 = np.full(6, 0.5)  # official init C * 1
    r_s = cdf_transform([1.0, 3.0, 2.0], "weibull", 0, 0.5)
    r_bar = r_s.mean()
    r = np.full(6, r_bar)
    r[[0, 2, 5]] = (r_s - r_bar) / 0.5
    den = 1 + r_bar * p0.sum()
    g = -r / den + r_bar * (p0 @ (r - r_bar)) / den**2
    info = round_info([1.0, 3.0, 2.0], [10, 10, 10], participants=[0, 2, 5], num_clients=6)
    strategy.client_weights(info)
    np.testing.assert_allclose(strategy.gradient_sum.numpy(), g, atol=1e-12)
