"""AUROC (binary and macro one-vs-rest), weighted tail statistics over clients, and their
place in a run's results: hand-computed cases with tied scores, one-class clients and weights."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedkernels.sim.metrics import (
    ClientEvaluation,
    auroc_by_group,
    client_auroc,
    distribution_summary,
    evaluate_clients,
    evaluation_metrics,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def pairwise_auroc(scores, positive) -> float:
    """The definition: P(score of a positive > score of a negative), ties one half."""
    s, p = np.asarray(scores, dtype=float), np.asarray(positive, dtype=bool)
    pos, neg = s[p], s[~p]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


# ------------------------------------------------------------------ AUROC by rank statistics


def test_binary_auroc_with_tied_scores_by_hand():
    # positives 0.4 and 0.8, negatives 0.1 and 0.4: 0.4 vs 0.1 wins, 0.4 vs 0.4 ties (1/2),
    # 0.8 wins twice -> 3.5 / 4
    auc = auroc_by_group(np.array([0.1, 0.4, 0.4, 0.8]), np.array([0, 0, 1, 1]),
                         np.zeros(4, dtype=int), 1)
    assert auc[0] == pytest.approx(0.875)


def test_all_scores_tied_is_one_half_and_order_does_not_matter():
    auc = auroc_by_group(np.full(5, 0.3), np.array([1, 0, 1, 0, 0]), np.zeros(5, dtype=int), 1)
    assert auc[0] == 0.5
    perm = np.array([3, 0, 4, 1, 2])
    s, p = np.array([0.2, 0.9, 0.2, 0.5, 0.9]), np.array([0, 1, 1, 0, 0])
    a = auroc_by_group(s, p, np.zeros(5, dtype=int), 1)[0]
    b = auroc_by_group(s[perm], p[perm], np.zeros(5, dtype=int), 1)[0]
    assert a == b == pytest.approx(pairwise_auroc(s, p))


def test_groups_are_independent_and_one_class_groups_are_nan():
    rng = np.random.default_rng(0)
    n = 300
    scores = rng.integers(0, 6, n).astype(float)  # many ties
    positive = rng.random(n) < 0.4
    groups = rng.integers(0, 5, n)
    positive[groups == 3] = True   # group 3: positives only
    positive[groups == 4] = False  # group 4: negatives only
    auc = auroc_by_group(scores, positive, groups, 7)  # groups 5 and 6 are empty
    for g in range(3):
        assert auc[g] == pytest.approx(pairwise_auroc(scores[groups == g], positive[groups == g]))
    assert np.isnan(auc[3:]).all()


def test_non_finite_scores_give_nan():
    auc = auroc_by_group(np.array([0.1, np.nan, 0.3, 0.4]), np.array([0, 1, 0, 1]),
                         np.array([0, 0, 1, 1]), 2)
    assert np.isnan(auc[0]) and auc[1] == 1.0


def test_perfect_and_reversed_rankings():
    g = np.zeros(4, dtype=int)
    assert auroc_by_group(np.array([1.0, 2, 3, 4]), np.array([0, 0, 1, 1]), g, 1)[0] == 1.0
    assert auroc_by_group(np.array([4.0, 3, 2, 1]), np.array([0, 0, 1, 1]), g, 1)[0] == 0.0


def test_binary_client_auroc_scores_class_one():
    logits = torch.tensor([[0.0, -1.0], [0.0, 0.5], [0.0, 0.5], [2.0, 0.0], [0.0, 3.0]])
    y = torch.tensor([0, 1, 0, 0, 1])
    owner = torch.tensor([0, 0, 0, 1, 1])
    per_client, pooled = client_auroc(logits, y, owner, 2)
    margin = (logits[:, 1] - logits[:, 0]).numpy()
    assert per_client[0].item() == pytest.approx(pairwise_auroc(margin[:3], y[:3].numpy()))
    assert per_client[0].item() == pytest.approx(0.75)  # the positive ties one of two negatives
    assert per_client[1].item() == 1.0
    assert pooled == pytest.approx(pairwise_auroc(margin, y.numpy()))


def test_multiclass_macro_one_vs_rest_matches_scikit_learn():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    torch.manual_seed(0)
    logits = torch.randn(60, 4)
    y = torch.arange(60) % 4
    _, pooled = client_auroc(logits, y, torch.zeros(60, dtype=torch.long), 1)
    probabilities = torch.softmax(logits.double(), 1).numpy()
    expected = sklearn_metrics.roc_auc_score(y.numpy(), probabilities, multi_class="ovr",
                                             average="macro")
    assert pooled == pytest.approx(expected)


def test_multiclass_client_averages_only_the_classes_it_has():
    # three classes; client 0 holds classes 0 and 2 only, client 1 only class 1
    logits = torch.tensor([
        [2.0, 0.0, 0.0],   # y=0
        [1.0, 0.0, 1.5],   # y=0, and class 2 scores higher here than on the true 2 below
        [0.0, 0.0, 0.5],   # y=2
        [0.0, 1.0, 0.0],   # client 1, y=1
        [0.0, 2.0, 0.0],   # client 1, y=1
    ])
    y = torch.tensor([0, 0, 2, 1, 1])
    owner = torch.tensor([0, 0, 0, 1, 1])
    per_client, _ = client_auroc(logits, y, owner, 2)
    log_p = torch.log_softmax(logits.double(), 1).numpy()
    class0 = pairwise_auroc(log_p[:3, 0], [1, 1, 0])
    class2 = pairwise_auroc(log_p[:3, 2], [0, 0, 1])
    assert (class0, class2) == (1.0, 0.5)  # by hand: p_0 = .98, .33 vs .27; p_2 = .05, .55 vs .45
    assert per_client[0].item() == pytest.approx((class0 + class2) / 2)  # class 1 absent: left out
    assert math.isnan(per_client[1].item())  # one class: undefined


# ------------------------------------------------------------------ statistics over clients


def test_weighted_tails_by_hand():
    values = torch.tensor([0.9, 0.2, 0.5, 0.2, 1.0, 0.7, 0.6, 0.8, 0.3, 0.4, 0.95, 0.65,
                           0.55, 0.45, 0.35, 0.85, 0.75, 0.25, 0.15, 0.05], dtype=torch.float64)
    weights = torch.arange(1, 21, dtype=torch.float64)
    s = distribution_summary(values, weights=weights)
    # 20 clients: the tails are 2 clients; worst are 0.05 (w 20) and 0.15 (w 19)
    assert s["worst10"] == pytest.approx(0.10)
    assert s["worst10_weighted"] == pytest.approx((20 * 0.05 + 19 * 0.15) / 39)
    assert s["best10_weighted"] == pytest.approx((5 * 1.0 + 11 * 0.95) / 16)
    assert s["mean_weighted"] == pytest.approx(float((values * weights).sum() / weights.sum()))
    assert s["gap"] == pytest.approx(0.95) and s["gap10"] == pytest.approx(0.975 - 0.10)
    assert s["min"] == 0.05


def test_ties_at_the_tail_boundary_follow_client_order():
    # 20 clients, tails of 2: the worst is client 0; clients 1 and 2 tie for second place
    values = torch.tensor([0.1, 0.2, 0.2] + [0.9] * 17, dtype=torch.float64)
    weights = torch.tensor([1.0, 5.0, 1.0] + [1.0] * 17)
    s = distribution_summary(values, weights=weights)
    assert s["worst10"] == pytest.approx(0.15)
    assert s["worst10_weighted"] == pytest.approx((0.1 + 5 * 0.2) / 6)  # client 1, the first
    small = distribution_summary(torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64),
                                 weights=torch.tensor([1.0, 3.0, 2.0]))
    assert small["mean_weighted"] == pytest.approx((0.5 + 0.3 + 1.8) / 6)
    assert (small["worst10_weighted"], small["best10_weighted"]) == pytest.approx((0.1, 0.9))


def test_evaluation_metrics_leave_out_one_class_clients():
    evaluation = ClientEvaluation(
        loss=torch.tensor([0.5, 0.4, 0.3], dtype=torch.float64),
        accuracy=torch.tensor([0.5, 1.0, 0.75], dtype=torch.float64),
        count=torch.tensor([2.0, 1.0, 4.0], dtype=torch.float64),
        auroc=torch.tensor([0.6, float("nan"), 0.9], dtype=torch.float64),
        auroc_pooled=0.8,
    )
    m = evaluation_metrics(evaluation)
    assert m["test_auroc"] == 0.8 and m["client_auroc_clients"] == 2
    assert m["client_auroc_mean"] == pytest.approx(0.75)
    assert m["client_auroc_mean_weighted"] == pytest.approx((2 * 0.6 + 4 * 0.9) / 6)
    assert m["client_auroc_min"] == 0.6 and m["client_auroc_gap"] == pytest.approx(0.3)
    assert m["client_accuracy_mean_weighted"] == pytest.approx(m["test_accuracy"])
    assert m["client_accuracy_min"] == 0.5
    evaluation.auroc = torch.full((3,), float("nan"), dtype=torch.float64)
    m = evaluation_metrics(evaluation)
    assert m["client_auroc_clients"] == 0 and m["client_auroc_mean"] is None
    assert m["client_auroc_worst10_weighted"] is None


def test_evaluate_clients_auroc_matches_the_pairwise_definition():
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    xs = [torch.randn(n, 3) for n in (6, 5, 7)]
    ys = [torch.tensor([0, 1, 0, 1, 1, 0]), torch.ones(5, dtype=torch.long),
          torch.tensor([1, 0, 0, 0, 1, 1, 0])]
    ev = evaluate_clients(model, xs, ys, auroc=True)
    with torch.no_grad():
        margins = [(model(x)[:, 1] - model(x)[:, 0]).numpy() for x in xs]
    assert ev.auroc[0].item() == pytest.approx(pairwise_auroc(margins[0], ys[0].numpy()))
    assert math.isnan(ev.auroc[1].item())
    assert ev.auroc[2].item() == pytest.approx(pairwise_auroc(margins[2], ys[2].numpy()))
    assert ev.auroc_pooled == pytest.approx(
        pairwise_auroc(np.concatenate(margins), torch.cat(ys).numpy()))
    assert evaluate_clients(model, xs, ys).auroc is None  # only on request


# ------------------------------------------------------------------ in a run's results


def _no_nan(text: str):
    def refuse(constant):
        raise AssertionError(f"results.json holds {constant}, which is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_run_records_auroc_and_writes_null_for_one_class_clients(tmp_path):
    from fedkernels.algorithms import build_strategy
    from fedkernels.sim.config import ExperimentConfig, from_dict
    from fedkernels.sim.run import Simulation

    # every client holds a single digit, so no client has an AUROC; the pooled one exists
    config = from_dict(ExperimentConfig, {
        "rounds": 2, "model": {"name": "logreg"},
        "partition": {"kind": "pathological", "classes_per_client": 1, "num_clients": 10},
    })
    result = Simulation(config, build_strategy("fedavg")).run()
    data = _no_nan((result.write_json(tmp_path / "results.json")).read_text())
    assert all(c["test_auroc"] is None for c in data["clients"])
    summary = data["summary"]
    assert 0.0 <= summary["test_auroc"] <= 1.0
    assert summary["client_auroc_clients"] == 0 and summary["client_auroc_mean"] is None
    for key in ("client_accuracy_mean_weighted", "client_accuracy_worst10_weighted",
                "client_accuracy_gap", "client_accuracy_min"):
        assert key in summary and key in data["rounds"][-1]


def test_run_auroc_per_client_when_defined():
    from fedkernels.algorithms import build_strategy
    from fedkernels.sim.config import ExperimentConfig, from_dict
    from fedkernels.sim.run import Simulation

    config = from_dict(ExperimentConfig, {
        "rounds": 2, "model": {"name": "logreg"}, "partition": {"num_clients": 4},
        "data": {"name": "gaussian_mixture", "num_classes": 2, "num_samples": 200},
    })
    result = Simulation(config, build_strategy("fedavg")).run()
    values = [c["test_auroc"] for c in result.clients]
    assert all(v is not None and 0.0 <= v <= 1.0 for v in values)
    assert result.summary["client_auroc_clients"] == 4
    assert result.summary["client_auroc_mean"] == pytest.approx(np.mean(values))
    assert result.summary["client_auroc_min"] == min(values)


def test_per_client_macro_matches_scikit_learn_class_by_class():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(90, 5, generator=gen)
    owner = torch.arange(90) // 30
    # client 0 sees all five classes, client 1 classes {1, 3}, client 2 classes {0, 2, 4}
    y = torch.cat([torch.arange(30) % 5, 1 + 2 * (torch.arange(30) % 2),
                   2 * (torch.arange(30) % 3)])
    per_client, _ = client_auroc(logits, y, owner, 3)
    log_p = torch.log_softmax(logits.double(), 1).numpy()
    for k in range(3):
        rows = (owner == k).numpy()
        labels = y.numpy()[rows]
        expected = np.mean([sklearn_metrics.roc_auc_score(labels == c, log_p[rows, c])
                            for c in np.unique(labels)])
        assert per_client[k].item() == pytest.approx(expected)
