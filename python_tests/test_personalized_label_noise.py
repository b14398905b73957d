"""Label noise on the clients' training labels (data.label_noise / data.noise_rate;
fedkernels/sim/federation.py, noisy_labels): symmetric and pair flips at the asked rate, test
labels untouched, seeded, recorded, and rejected when misconfigured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import ConfigError, DataConfig, from_dict
from fedkernels.sim.federation import noisy_labels

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pair_flips_to_the_next_class():
    labels = torch.arange(10).repeat(2000)
    noisy = noisy_labels(labels, "pair", 0.4, 10, np.random.default_rng(0))
    changed = noisy != labels
    assert torch.equal(noisy[changed], (labels[changed] + 1) % 10)
    assert changed.double().mean().item() == pytest.approx(0.4, abs=0.02)


def test_symmetric_flips_to_every_other_class_uniformly():
    labels = torch.full((30000,), 3)
    noisy = noisy_labels(labels, "symmetric", 0.6, 10, np.random.default_rng(1))
    counts = torch.bincount(noisy, minlength=10).double() / len(labels)
    assert counts[3].item() == pytest.approx(0.4, abs=0.02)
    others = torch.cat([counts[:3], counts[4:]])
    torch.testing.assert_close(others, torch.full((9,), 0.6 / 9, dtype=torch.float64), atol=0.01, rtol=0)


def test_no_noise_and_bad_kind():
    labels = torch.tensor([0, 1, 2])
    assert noisy_labels(labels, "none", 0.0, 3, np.random.default_rng(0)) is labels
    assert noisy_labels(labels, "pair", 0.0, 3, np.random.default_rng(0)) is labels
    with pytest.raises(ValueError, match="symmetric or pair"):
        noisy_labels(labels, "shuffle", 0.5, 3, np.random.default_rng(0))


def config(kind="none", rate=0.0):
    return from_dict(
        ExperimentConfig,
        {
            "rounds": 1,
            "seed": 2,
            "data": {"name": "digits", "label_noise": kind, "noise_rate": rate},
            "partition": {"kind": "pathological", "num_clients": 10, "classes_per_client": 3},
            "model": {"name": "mlp", "hidden": [8]},
        },
        "test",
    )


@pytest.mark.parametrize("kind", ["symmetric", "pair"])
def test_only_training_labels_are_noisy(kind):
    clean = Simulation(config(), build_strategy("fedavg")).federation
    noisy = Simulation(config(kind, 0.4), build_strategy("fedavg")).federation
    flipped = total = 0
    for a, b in zip(clean.clients, noisy.clients):
        assert np.array_equal(a.train_index, b.train_index)
        assert torch.equal(a.test_y, b.test_y) and torch.equal(a.train_x, b.train_x)
        flipped += int((a.train_y != b.train_y).sum())
        total += len(a.train_y)
        if kind == "pair":
            changed = a.train_y != b.train_y
            assert torch.equal(b.train_y[changed], (a.train_y[changed] + 1) % 10)
    assert flipped / total == pytest.approx(0.4, abs=0.05)
    info = noisy.data_info["label_noise"]
    assert info["kind"] == kind and info["rate"] == 0.4
    assert info["flipped_fraction"] == pytest.approx(flipped / total)
    # the same seed gives the same noise
    again = Simulation(config(kind, 0.4), build_strategy("fedavg")).federation
    assert all(torch.equal(a.train_y, b.train_y) for a, b in zip(noisy.clients, again.clients))


def test_results_record_the_noise():
    result = Simulation(config("pair", 0.2), build_strategy("local")).run()
    assert result.data_preparation["label_noise"]["kind"] == "pair"


def test_configuration_errors():
    with pytest.raises(ConfigError, match="noise_rate needs data.label_noise"):
        DataConfig(noise_rate=0.2)
    with pytest.raises(ConfigError, match=r"noise_rate must be in \[0, 1\)"):
        DataConfig(label_noise="pair", noise_rate=1.0)
    with pytest.raises(ConfigError, match="label_noise"):
        from_dict(DataConfig, {"label_noise": "flip"}, "data")
