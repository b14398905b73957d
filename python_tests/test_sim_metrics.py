"""Per-client evaluation and the statistics over clients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.sim.metrics import distribution_summary, evaluate_clients, gini


def test_gini_matches_the_pairwise_formula():
    rng = np.random.default_rng(0)
    a = rng.random(17)
    expected = np.abs(a[:, None] - a[None, :]).sum() / (2 * len(a) ** 2 * a.mean())
    assert gini(torch.from_numpy(a)) == pytest.approx(expected)
    assert gini(torch.ones(5)) == 0.0 and gini(torch.zeros(5)) == 0.0
    assert gini(torch.tensor([0.0, 0.0, 0.0, 1.0])) == pytest.approx(
        0.75
    )  # (n-1)/n when one holds all


def test_distribution_summary():
    values = torch.arange(1, 21, dtype=torch.float64) / 20  # 0.05 .. 1.0
    s = distribution_summary(values)
    assert s["mean"] == pytest.approx(0.525)
    assert s["std"] == pytest.approx(float(np.std(values.numpy())))
    assert s["worst10"] == pytest.approx((0.05 + 0.10) / 2)  # 10% of 20 clients = 2
    assert s["best10"] == pytest.approx((0.95 + 1.0) / 2)
    assert (s["min"], s["max"]) == (0.05, 1.0)
    small = distribution_summary(torch.tensor([0.2, 0.9, 0.5], dtype=torch.float64))
    assert small["worst10"] == 0.2 and small["best10"] == 0.9  # at least one client


def test_evaluate_clients_per_client_and_pooled():
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    xs = [torch.randn(n, 3) for n in (5, 1, 9)]
    ys = [torch.randint(0, 4, (n,)) for n in (5, 1, 9)]
    ev = evaluate_clients(model, xs, ys)
    for k, (x, y) in enumerate(zip(xs, ys)):
        logits = model(x)
        assert ev.loss[k].item() == pytest.approx(
            nn.functional.cross_entropy(logits, y).item(), rel=1e-6
        )
        assert ev.accuracy[k].item() == pytest.approx(
            (logits.argmax(1) == y).double().mean().item()
        )
    x, y = torch.cat(xs), torch.cat(ys)
    assert ev.pooled_accuracy() == pytest.approx((model(x).argmax(1) == y).double().mean().item())
    assert ev.pooled_loss() == pytest.approx(
        nn.functional.cross_entropy(model(x), y).item(), rel=1e-6
    )
    assert model.training  # restored
