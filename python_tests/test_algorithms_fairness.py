"""Fair-aggregation strategies against independent NumPy formulas (docs/algorithms/fairness.md):
q-FFL, q-FedAvg, AFL, TERM, PropFair, GiFair, Delta-FL, FedMGDA+,
VRed, Semi-VRed; the simplex helpers; the batched update statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algorithm_helpers import SHAPES, flat, random_states, round_info, setup_info, sgd_server
from scipy.optimize import minimize
from torch import nn

from fedkernels.algorithms import build_strategy
from fedkernels.algorithms.update_stats import update_gram, update_sq_norms
from fedkernels.rules.simplex import project_simplex, simplex_qp

LOSSES = np.array([0.3, 1.7, 0.9, 2.4, 0.05])
SIZES = np.array([10.0, 40.0, 25.0, 5.0, 20.0])
P = SIZES / SIZES.sum()


def weights_of(name, params=None, losses=LOSSES, sizes=SIZES, **kw):
    strategy = build_strategy(name, params)
    strategy.setup(setup_info(len(sizes), sizes, **kw))
    info = round_info(losses, sizes)
    return strategy.client_weights(info).numpy(), info, strategy


# ---------------------------------------------------------------- helpers


def projection_by_bisection(v):
    """Euclidean projection onto the simplex: tau from bisection on sum(max(v - tau, 0)) = 1."""
    lo, hi = v.min() - 1.0, v.max()
    for _ in range(200):
        tau = 0.5 * (lo + hi)
        if np.maximum(v - tau, 0).sum() > 1:
            lo = tau
        else:
            hi = tau
    return np.maximum(v - 0.5 * (lo + hi), 0)


def test_project_simplex_worked_example_and_bisection():
    np.testing.assert_allclose(project_simplex(np.array([0.5, 1.2, -0.3, 0.9])), [0, 0.65, 0, 0.35])
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.normal(size=rng.integers(1, 9)) * 2
        np.testing.assert_allclose(project_simplex(v), projection_by_bisection(v), atol=1e-10)


@pytest.mark.parametrize("boxed", [False, True])
def test_simplex_qp_matches_slsqp(boxed):
    rng = np.random.default_rng(1 + boxed)
    for _ in range(15):
        k = int(rng.integers(2, 8))
        a = rng.normal(size=(k, k))
        q, c = a @ a.T + 0.05 * np.eye(k), rng.normal(size=k) * 2
        lo, hi = np.zeros(k), np.full(k, np.inf)
        if boxed:
            eps = rng.uniform(0.05, 0.4)
            lo, hi = np.full(k, max(0, 1 / k - eps)), np.full(k, 1 / k + eps)
        p = simplex_qp(q, c, lo, hi)
        ref = minimize(
            lambda x, q=q, c=c: 0.5 * x @ q @ x + c @ x,
            np.full(k, 1 / k),
            jac=lambda x, q=q, c=c: q @ x + c,
            bounds=list(zip(lo, np.minimum(hi, 2))),
            constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}],
            method="SLSQP",
            options={"ftol": 1e-15, "maxiter": 500},
        )
        assert abs(p.sum() - 1) < 1e-12 and (p >= lo - 1e-12).all() and (p <= hi + 1e-12).all()
        assert 0.5 * p @ q @ p + c @ p <= ref.fun + 1e-10


def test_update_norms_and_gram_match_numpy():
    glob, clients = random_states(4, seed=3)
    u = np.stack([flat(c) - flat(glob) for c in clients])
    np.testing.assert_allclose(update_sq_norms(clients, glob, list(SHAPES)), (u**2).sum(1))
    np.testing.assert_allclose(update_gram(clients, glob, list(SHAPES)), u @ u.T, rtol=1e-12)


# ---------------------------------------------------------------- loss-weighted rules


def test_qffl_mixing_weights():
    w, _, _ = weights_of("qffl", {"q": 2.0})
    expected = SIZES * LOSSES**2
    np.testing.assert_allclose(w, expected / expected.sum(), rtol=1e-12)
    w0, _, _ = weights_of("qffl", {"q": 0.0})
    np.testing.assert_allclose(w0, P, rtol=1e-12)


def test_qfedavg_is_li_et_al_update():
    """The server step equals Flower's q-FedAvg rule with per-client losses, written out."""
    q, lr = 0.5, 0.05
    strategy = build_strategy("qfedavg", {"q": q})
    strategy.setup(setup_info(5, SIZES, lr=lr))
    glob, clients = random_states(5, seed=7, scale=0.1)
    info = round_info(LOSSES, SIZES, glob, clients)
    lip = 1.0 / lr
    x = flat(glob)
    f = LOSSES + 1e-10
    grads = [lip * (x - flat(c)) for c in clients]
    deltas = [f[k] ** q * grads[k] for k in range(5)]
    hs = [q * f[k] ** (q - 1) * (grads[k] ** 2).sum() + lip * f[k] ** q for k in range(5)]
    expected = x - np.sum(deltas, axis=0) / np.sum(hs)

    model = nn.Module()
    for n in SHAPES:
        model.register_parameter(n, nn.Parameter(glob[n].clone()))
    server = sgd_server(model)
    strategy.info.parameter_names = list(SHAPES)
    strategy.aggregate(info, server)
    np.testing.assert_allclose(flat(server.state), expected, rtol=1e-10, atol=1e-12)


def test_afl_projected_dual_ascent_two_rounds():
    strategy = build_strategy("afl", {"step": 0.5})
    strategy.setup(setup_info(5, SIZES))
    lam = P.copy()
    for r, losses in enumerate([LOSSES, LOSSES[::-1].copy()]):
        w = strategy.client_weights(round_info(losses, SIZES, round_index=r)).numpy()
        lam = projection_by_bisection(lam + 0.5 * losses)
        np.testing.assert_allclose(w, lam, atol=1e-10)
    state = strategy.state_dict()
    other = build_strategy("afl", {"step": 0.5})
    other.setup(setup_info(5, SIZES))
    other.load_state_dict(state)
    np.testing.assert_allclose(other.dual.numpy(), lam, atol=1e-10)


def test_afl_partial_participation_keeps_other_entries():
    strategy = build_strategy("afl", {"step": 0.2, "init": "uniform"})
    strategy.setup(setup_info(6))
    info = round_info([1.0, 2.0], [10, 10], participants=[1, 4], num_clients=6)
    w = strategy.client_weights(info).numpy()
    np.testing.assert_allclose(w, projection_by_bisection(np.array([1 / 6 + 0.2, 1 / 6 + 0.4])))
    np.testing.assert_allclose(strategy.dual.numpy()[[0, 2, 3, 5]], 1 / 6)


def test_term_tilted_weights():
    w, _, _ = weights_of("term", {"tilt": 1.5})
    expected = P * np.exp(1.5 * LOSSES)
    np.testing.assert_allclose(w, expected / expected.sum(), rtol=1e-12)
    w, _, _ = weights_of("term", {"tilt": 1.5, "use_sizes": False})
    expected = np.exp(1.5 * (LOSSES - LOSSES.max()))
    np.testing.assert_allclose(w, expected / expected.sum(), rtol=1e-12)


def test_propfair_loss_transform_and_gradient():
    strategy = build_strategy("propfair", {"utility_bound": 3.0, "epsilon": 0.2})
    loss = torch.tensor([0.5, 1.5, 2.9, 5.0], dtype=torch.float64, requires_grad=True)
    out = strategy.transform_local_loss(loss)
    expected = [-np.log(1 - 0.5 / 3), -np.log(1 - 1.5 / 3), 2.9 / 3, 5.0 / 3]
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12)
    out.sum().backward()
    np.testing.assert_allclose(loss.grad.numpy(), [1 / 2.5, 1 / 1.5, 1 / 3, 1 / 3], rtol=1e-12)
    w, _, _ = weights_of("propfair")
    np.testing.assert_allclose(w, P)


def test_gifair_rank_offsets():
    w, _, _ = weights_of("gifair", {"coefficient": 1.0})
    m = len(P)
    lam = P.min() / (m - 1)
    rank = np.empty(m)
    rank[np.argsort(LOSSES)] = np.arange(1, m + 1)  # 1 = smallest loss
    np.testing.assert_allclose(w, P + lam * (2 * rank - (m + 1)), rtol=1e-12)
    assert abs(w.sum() - 1) < 1e-12 and (w >= -1e-15).all()
    # the highest-loss client gains the most, the lowest loses the most
    assert np.argmax(w - P) == np.argmax(LOSSES) and np.argmin(w - P) == np.argmin(LOSSES)


def test_delta_fl_cvar_weights_and_official_rule():
    sizes = np.full(4, 10.0)
    losses = np.array([4.0, 3.0, 2.0, 1.0])
    w, _, _ = weights_of("delta-fl", {"alpha": 0.375}, losses=losses, sizes=sizes)
    np.testing.assert_allclose(w, [2 / 3, 1 / 3, 0, 0])
    w, _, _ = weights_of(
        "delta-fl", {"alpha": 0.375, "variant": "official"}, losses=losses, sizes=sizes
    )
    np.testing.assert_allclose(w, [0.5, 0.5, 0, 0])
    # CVaR weights maximise sum(pi f) over 0 <= pi <= p/alpha, sum pi = 1 (a tiny LP, by sorting)
    w, _, _ = weights_of("delta-fl", {"alpha": 0.3})
    rng = np.random.default_rng(0)
    best = (w * LOSSES).sum()
    for _ in range(2000):
        pi = rng.dirichlet(np.ones(5))
        if (pi <= P / 0.3 + 1e-12).all():
            assert (pi * LOSSES).sum() <= best + 1e-12
    assert abs(w.sum() - 1) < 1e-12 and (w <= P / 0.3 + 1e-12).all()
    w, _, _ = weights_of("delta-fl", {"alpha": 1.0})
    np.testing.assert_allclose(w, P)


def test_fedmgda_min_norm_weights():
    strategy = build_strategy("fedmgda", {"epsilon": 0.15})
    strategy.setup(setup_info(4))
    glob, clients = random_states(4, seed=11)
    info = round_info(np.ones(4), np.ones(4), glob, clients)
    w = strategy.client_weights(info).numpy()
    u = np.stack([flat(c) - flat(glob) for c in clients])
    norms = np.linalg.norm(u, axis=1)
    d = u / norms[:, None]
    lo, hi = max(0, 0.25 - 0.15), 0.25 + 0.15
    ref = minimize(
        lambda x: ((x @ d) ** 2).sum(),
        np.full(4, 0.25),
        bounds=[(lo, hi)] * 4,
        constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}],
        method="SLSQP",
        options={"ftol": 1e-15},
    )
    lam = w * norms
    assert abs(lam.sum() - 1) < 1e-10 and (lam >= lo - 1e-10).all() and (lam <= hi + 1e-10).all()
    assert ((lam @ d) ** 2).sum() <= ref.fun + 1e-9


def test_vred_weights_equal_the_two_term_rule():
    """w = p(1 + 2 beta (a - A)) gives the paper's Delta = sum p Delta + 2 beta sum p a (Delta -
    mean Delta), for VRed and Semi-VRed; the weights sum to 1."""
    rng = np.random.default_rng(5)
    deltas = rng.normal(size=(5, 7))
    beta = 0.3
    fbar = (P * LOSSES).sum()
    mean_delta = P @ deltas
    for name in ("vred", "semi-vred"):
        w, _, _ = weights_of(name, {"beta": beta})
        a = LOSSES - fbar if name == "vred" else np.maximum(LOSSES - fbar, 0)
        rule = mean_delta + 2 * beta * ((P * a)[:, None] * (deltas - mean_delta)).sum(0)
        np.testing.assert_allclose(w @ deltas, rule, rtol=1e-12, atol=1e-12)
        assert abs(w.sum() - 1) < 1e-12


def test_semi_vred_lemma_2_equal_sizes():
    n, beta = 5, 0.2
    w, _, _ = weights_of("semi-vred", {"beta": beta}, sizes=np.ones(n))
    fbar = LOSSES.mean()
    above = LOSSES > fbar
    excess = (LOSSES[above] - fbar).sum()
    expected = np.where(
        above,
        1 / n + 2 * beta * (LOSSES - fbar) / n - 2 * beta * excess / n**2,
        1 / n - 2 * beta * excess / n**2,
    )
    np.testing.assert_allclose(w, expected, rtol=1e-12)
    # Lemma 1 (VRed): all weights positive iff beta < 1 / (2 (fbar - min f))
    bound = 1 / (2 * (fbar - LOSSES.min()))
    w_ok, _, _ = weights_of("vred", {"beta": 0.99 * bound}, sizes=np.ones(n))
    w_bad, _, _ = weights_of("vred", {"beta": 1.01 * bound}, sizes=np.ones(n))
    assert (w_ok > 0).all() and (w_bad < 0).any()
    w_clamped, _, _ = weights_of(
        "vred", {"beta": 1.01 * bound, "clamp_negative": True}, sizes=np.ones(n)
    )
    assert (w_clamped >= 0).all() and abs(w_clamped.sum() - 1) < 1e-12


def test_local_loss_source_uses_minibatch_losses():
    strategy = build_strategy("term", {"tilt": 1.0, "loss_source": "local"})
    assert strategy.wants_global_loss is False
    strategy.setup(setup_info(5, SIZES))
    info = round_info(LOSSES, SIZES, train_losses=np.zeros(5))
    np.testing.assert_allclose(strategy.client_weights(info).numpy(), P)
