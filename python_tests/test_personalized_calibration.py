"""ECE and MCE (fedkernels/sim/metrics.py, calibration_errors) against hand-computed cases, and
their place in the global evaluation and in the personalized strategies' evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict
from fedkernels.sim.metrics import calibration_errors

pytestmark = pytest.mark.usefixtures("one_thread")


def logits_for(confidence_of_predicted: list[float], predicted: list[int]) -> torch.Tensor:
    """Two-class logits whose softmax gives the predicted class that probability."""
    rows = []
    for p, c in zip(confidence_of_predicted, predicted):
        probs = [1 - p, p] if c == 1 else [p, 1 - p]
        rows.append([math.log(q) for q in probs])
    return torch.tensor(rows, dtype=torch.float64)


def test_hand_computed_ten_bins():
    # confidences 0.92 (right), 0.63 (wrong), 0.67 (right), 0.56 (wrong); 10 bins:
    # (0.9, 1]: acc 1, conf .92 -> gap .08, weight 1/4
    # (0.6, 0.7]: acc .5, conf .65 -> gap .15, weight 2/4
    # (0.5, 0.6]: acc 0, conf .56 -> gap .56, weight 1/4
    logits = logits_for([0.92, 0.63, 0.67, 0.56], [0, 0, 1, 1])
    y = torch.tensor([0, 1, 1, 0])
    ece, mce = calibration_errors(logits, y, bins=10)
    assert ece.item() == pytest.approx(0.08 / 4 + 0.15 * 2 / 4 + 0.56 / 4)
    assert mce.item() == pytest.approx(0.56)


def test_fifteen_bins_is_the_default_and_bins_matter():
    # 0.63 and 0.67 share a bin of width 1/10 but not of width 1/15 ((0.6, 0.667], (0.667, 0.733])
    logits = logits_for([0.63, 0.67], [0, 0])
    y = torch.tensor([1, 0])
    ece10, _ = calibration_errors(logits, y, bins=10)
    ece15, mce15 = calibration_errors(logits, y)
    assert ece10.item() == pytest.approx(0.15)  # one bin: |0.5 - 0.65|
    assert ece15.item() == pytest.approx((0.63 + 0.33) / 2)  # two bins: |0 - .63|, |1 - .67|
    assert mce15.item() == pytest.approx(0.63)


def test_per_group_and_empty_group():
    logits = logits_for([0.92, 0.63, 0.67, 0.56], [0, 0, 1, 1])
    y = torch.tensor([0, 1, 1, 0])
    owner = torch.tensor([0, 0, 2, 2])
    ece, mce = calibration_errors(logits, y, owner, 3, bins=10)
    assert ece[0].item() == pytest.approx((0.08 + 0.63) / 2)
    assert mce[0].item() == pytest.approx(0.63)
    assert math.isnan(ece[1].item()) and math.isnan(mce[1].item())
    assert ece[2].item() == pytest.approx((0.33 + 0.56) / 2)
    assert mce[2].item() == pytest.approx(0.56)


def test_perfect_and_bad_arguments():
    # always right with confidence 1: calibrated
    logits = torch.tensor([[50.0, 0.0], [0.0, 50.0]])
    ece, mce = calibration_errors(logits, torch.tensor([0, 1]))
    assert ece.item() == pytest.approx(0.0, abs=1e-12) and mce.item() == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="bins"):
        calibration_errors(logits, torch.tensor([0, 1]), bins=0)
    with pytest.raises(ValueError, match="logits must be"):
        calibration_errors(logits, torch.tensor([0, 1, 1]))


def config(**extra):
    return from_dict(
        ExperimentConfig,
        {
            "rounds": 2,
            "seed": 1,
            "data": {"name": "digits"},
            "partition": {"kind": "pathological", "num_clients": 5, "classes_per_client": 3},
            "participation": {"kind": "uniform", "fraction": 0.6},
            "model": {"name": "mlp", "hidden": [16]},
            "client": {"epochs": 1, "batch_size": 10, "lr": 0.05},
            **extra,
        },
        "test",
    )


def test_global_model_calibration_in_the_summary():
    sim = Simulation(config(), build_strategy("fedavg"))
    summary = sim.run().summary
    sim.eval_model.load_state_dict(sim.server.state)
    sim.eval_model.eval()
    clients = sim.federation.clients
    with torch.no_grad():
        per_client = [calibration_errors(sim.eval_model(c.test_x), c.test_y) for c in clients]
        pooled = calibration_errors(
            sim.eval_model(torch.cat([c.test_x for c in clients])),
            torch.cat([c.test_y for c in clients]),
        )
    assert summary["client_ece_mean"] == pytest.approx(sum(e.item() for e, _ in per_client) / 5)
    assert summary["client_mce_mean"] == pytest.approx(sum(m.item() for _, m in per_client) / 5)
    assert summary["test_ece"] == pytest.approx(pooled[0].item())
    assert summary["test_mce"] == pytest.approx(pooled[1].item())


@pytest.mark.parametrize("name", ["fedper", "ditto"])
def test_personalized_calibration_uses_each_clients_model(name):
    sim = Simulation(config(), build_strategy(name))
    summary = sim.run().summary
    s = sim.strategy
    model = s.eval_model()
    values = []
    with torch.no_grad():
        for k, c in enumerate(sim.federation.clients):
            model.load_state_dict(s.personal_state(k, sim.server.state, c))
            model.eval()
            values.append(calibration_errors(model(c.test_x), c.test_y))
    assert summary["personalized_ece"] == pytest.approx(sum(e.item() for e, _ in values) / 5)
    assert summary["personalized_mce"] == pytest.approx(sum(m.item() for _, m in values) / 5)
    assert 0 <= summary["personalized_ece_pooled"] <= summary["personalized_mce_pooled"] <= 1
