"""Ensemble distillation on the simulation loop (fedkernels/algorithms/distillation.py;
docs/algorithms/distillation.md): the server split, every method running from Python and the CLI, the
discriminators trained once per client and cached, FedGO's weights against an independent
formula, distillation moving the server model toward the ensemble, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedkernels.algorithms import available, build_strategy
from fedkernels.algorithms.distillation import distill, mlp, teacher_logits, train_discriminator
from fedkernels.cli import main
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import ConfigError, from_dict
from fedkernels.sim.federation import server_split

METHODS = ["feddf", "fedet", "entropy-kd", "dafkd", "fedgo"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds=2, server_fraction=0.5):
    return from_dict(
        ExperimentConfig,
        {
            "rounds": rounds,
            "seed": 1,
            "data": {"name": "digits", "server_fraction": server_fraction},
            "partition": {"kind": "dirichlet", "num_clients": 6, "alpha": 0.3},
            "participation": {"kind": "uniform", "fraction": 0.5},
            "model": {"name": "mlp", "hidden": [32]},
            "client": {"epochs": 3, "batch_size": 16, "lr": 0.1},
        },
    )


FAST = {"server_epochs": 1, "disc_epochs": 1, "server_batch_size": 128}


def test_registered():
    assert set(METHODS) <= set(available())
    assert "fedavg" in available()


def test_server_split_is_stratified_and_disjoint():
    labels = np.repeat(np.arange(4), [10, 20, 31, 1])
    rng = np.random.default_rng(0)
    clients, server = server_split(labels, 0.5, rng)
    assert len(np.intersect1d(clients, server)) == 0
    assert len(clients) + len(server) == len(labels)
    assert [int((labels[server] == c).sum()) for c in range(4)] == [5, 10, 16, 0]


def test_needs_server_data():
    with pytest.raises(ConfigError, match="server_fraction"):
        Simulation(config(server_fraction=0.0), build_strategy("feddf", FAST))


@pytest.mark.parametrize("method", METHODS)
def test_methods_run(method):
    sim = Simulation(config(), build_strategy(method, FAST))
    result = sim.run()
    last = result.rounds[-1]
    assert np.isfinite(last["strategy_distill_loss"]) and last["strategy_distill_loss"] >= 0
    assert 0 <= last["ensemble_accuracy"] <= 1
    assert 0 <= last["test_accuracy"] <= 1
    fed = sim.federation
    assert fed.server_x.shape[0] + sum(c.num_train + c.num_test for c in fed.clients) == 1797
    if method in ("dafkd", "fedgo"):
        trained = sim.strategy.discriminators
        assert trained and set(trained) <= set(range(6))
        # Cached once: rows of trained clients are finite, the others NaN.
        finite = torch.isfinite(sim.strategy.disc_scores).all(1)
        assert finite.nonzero().flatten().tolist() == sorted(trained)


def test_fedgo_weights_match_the_odds_formula():
    sim = Simulation(config(rounds=1), build_strategy("fedgo", FAST))
    sim.run()
    s = sim.strategy
    ids = s.last_participants
    sizes = torch.tensor(s.last_sizes, dtype=torch.float64)
    logits = teacher_logits(s.model, s.last_teachers, s.distill_x)
    _, w = s.pseudo_labels(logits, ids, sizes, s.disc_scores[ids])
    # Independent: D = sig(sig(z)) (double sigmoid), Phi = D / (1 - D), w = n Phi / sum n Phi.
    d = torch.sigmoid(torch.sigmoid(s.disc_scores[ids].double()))
    odds = sizes[:, None] * d / (1 - d)
    torch.testing.assert_close(w.double(), odds / odds.sum(0), rtol=1e-5, atol=1e-6)


def test_distillation_moves_student_to_ensemble():
    torch.manual_seed(0)
    x = torch.randn(256, 5)
    teacher = mlp(5, [16], 3)
    y = torch.softmax(teacher(x), -1).detach()
    student = mlp(5, [16], 3)
    before = torch.nn.functional.kl_div(torch.log_softmax(student(x), -1), y, reduction="batchmean")
    distill(student, x, y, epochs=30, batch_size=64, lr=1e-2, seed=0)
    after = torch.nn.functional.kl_div(torch.log_softmax(student(x), -1), y, reduction="batchmean")
    assert after < 0.3 * before


def test_discriminator_separates_real_from_fake():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(400, 2, generator=g) + torch.tensor([3.0, 3.0])
    fake = lambda n, gen: 12 * torch.rand(n, 2, generator=gen) - 6  # noqa: E731
    disc = train_discriminator(mlp(2, [32], 1), real, fake, epochs=30, batch_size=64, lr=1e-3,
                               seed=0)
    with torch.no_grad():
        assert disc(torch.tensor([[3.0, 3.0]])) > disc(torch.tensor([[-5.0, -5.0]]))


@pytest.mark.parametrize("generator", ["random", "gan"])
def test_generators_and_generated_distillation_set(generator):
    params = dict(FAST, generator=generator, distill_set="generated", num_generated=200,
                  gan_steps=20)
    sim = Simulation(config(rounds=1), build_strategy("fedgo", params))
    result = sim.run()
    assert sim.strategy.distill_x.shape == (200, 64)
    assert np.isfinite(result.rounds[-1]["strategy_distill_loss"])


def test_resume_matches_uninterrupted(tmp_path):
    # A constant server lr: the cosine schedule depends on the planned number of rounds.
    params = dict(FAST, lr_schedule="none")
    full = Simulation(config(rounds=3), build_strategy("fedgo", params)).run()
    path = tmp_path / "ckpt.pt"
    Simulation(config(rounds=2), build_strategy("fedgo", params), checkpoint=path).run()
    resumed = Simulation(config(rounds=3), build_strategy("fedgo", params), checkpoint=path).run(
        resume=True
    )
    assert resumed.rounds[-1]["test_accuracy"] == full.rounds[-1]["test_accuracy"]
    assert resumed.rounds[-1]["ensemble_accuracy"] == full.rounds[-1]["ensemble_accuracy"]


def test_cli_runs_fedgo(tmp_path):
    out = tmp_path / "run"
    code = main([
        "run", "--algorithm", "fedgo", "--rounds", "1", "--data.name", "digits",
        "--data.server_fraction", "0.5", "--partition.kind", "dirichlet",
        "--partition.num_clients", "4", "--partition.alpha", "0.5", "--model.hidden", "8",
        "--fedgo.server_epochs", "1", "--fedgo.disc_epochs", "1", "--out", str(out),
    ])
    assert code in (0, None)
    files = list(out.glob("*.json"))
    assert files
    text = json.dumps([json.loads(f.read_text()) for f in files])
    assert "ensemble_accuracy" in text
