"""FedGO at paper fidelity (fedkernels/algorithms/generators.py, distillation.py;
docs/algorithms/distillation.md, section 5): the WGAN-GP gradient penalty on hand cases, the
DCGAN-style discriminator's shapes and the paper's parameter counts, the WGAN-GP trainer,
Fed-ET's consensus and diversity terms against hand computations, the generator file, and the
options from Python and the CLI."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedkernels.algorithms import build_strategy
from fedkernels.algorithms.distillation import (
    DistillationConfig,
    distillation_loss,
    diversity_targets,
)
from fedkernels.algorithms.generators import (
    ConvGenerator,
    DCGANDiscriminator,
    MLPGenerator,
    gradient_penalty,
    mlp,
    resolve_image_shape,
    train_wgan_gp,
)
from fedkernels.cli import main
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import ConfigError, from_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds=1, data=None):
    return from_dict(ExperimentConfig, {
        "rounds": rounds, "seed": 3,
        "data": data or {"name": "digits", "server_fraction": 0.5},
        "partition": {"kind": "dirichlet", "num_clients": 4, "alpha": 0.5},
        "participation": {"kind": "full"},
        "model": {"name": "mlp", "hidden": [16]},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.1},
    })


FAST = {"server_epochs": 1, "disc_epochs": 1, "server_batch_size": 256}


# ---------------------------------------------------------------- gradient penalty


class Linear2(nn.Module):
    """f(x) = w . x: its input gradient is w everywhere."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float64))

    def forward(self, x):
        return x @ self.w


class HalfSquare(nn.Module):
    """f(x) = a/2 |x|^2: its input gradient is a x."""

    def __init__(self, a):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a, dtype=torch.float64))

    def forward(self, x):
        return 0.5 * self.a * (x * x).sum(1)


def test_gradient_penalty_of_a_linear_critic():
    # |grad| = |(3, 4)| = 5 at every point: (5 - 1)^2 = 16 whatever the samples.
    real = torch.randn(7, 2, dtype=torch.float64)
    fake = torch.randn(7, 2, dtype=torch.float64)
    gp = gradient_penalty(Linear2([3.0, 4.0]), real, fake, torch.rand(7, dtype=torch.float64))
    assert float(gp.detach()) == pytest.approx(16.0, abs=1e-12)


def test_gradient_penalty_of_a_quadratic_critic_by_hand():
    # x_hat = m real + (1 - m) fake; grad = a x_hat; mean over rows of (|a x_hat| - 1)^2.
    real = torch.tensor([[1.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    fake = torch.tensor([[0.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    mix = torch.tensor([0.5, 0.25], dtype=torch.float64)
    critic = HalfSquare(2.0)
    gp = gradient_penalty(critic, real, fake, mix)
    # row 0: x_hat = (0.5, 1), |2 x_hat| = 2 sqrt(1.25); row 1: x_hat = (0.5, 0.5),
    # |2 x_hat| = 2 sqrt(0.5) = sqrt(2)
    want = ((2 * math.sqrt(1.25) - 1) ** 2 + (math.sqrt(2.0) - 1) ** 2) / 2
    assert float(gp.detach()) == pytest.approx(want, rel=1e-12)
    # Differentiable in the critic's parameters (WGAN-GP trains the critic through it):
    # d/da mean (a r_i - 1)^2 = mean 2 (a r_i - 1) r_i with r_i = |x_hat_i|.
    gp.backward()
    r = [math.sqrt(1.25), math.sqrt(0.5)]
    want_grad = sum(2 * (2 * ri - 1) * ri for ri in r) / 2
    assert float(critic.a.grad) == pytest.approx(want_grad, rel=1e-12)


def test_gradient_penalty_checks_shapes():
    with pytest.raises(ValueError, match="do not match"):
        gradient_penalty(Linear2([1.0, 1.0]), torch.zeros(3, 2), torch.zeros(2, 2), torch.zeros(3))


# ---------------------------------------------------------------- networks


def count(module):
    return sum(p.numel() for p in module.parameters())


def test_discriminator_has_the_papers_parameter_counts():
    # FedGO Table 14: the CNN discriminator 662,528 parameters, CNN+MLP 142,336 (3x32x32).
    cnn = DCGANDiscriminator((3, 32, 32), 64, "conv")
    cnn_mlp = DCGANDiscriminator((3, 32, 32), 64, "linear")
    assert count(cnn) == 662_528
    assert count(cnn_mlp) == 142_336
    assert all(p.dim() == 4 for p in cnn.parameters())  # convolutions only, no biases
    assert not any(isinstance(m, nn.BatchNorm2d) for m in cnn.modules())
    rows = torch.randn(5, 3 * 32 * 32)
    assert cnn(rows).shape == (5, 1) and cnn_mlp(rows).shape == (5, 1)
    assert torch.equal(cnn(rows), cnn(rows.view(5, 3, 32, 32)))  # rows or images


def test_discriminator_on_digits_shapes():
    disc = DCGANDiscriminator((1, 8, 8), 8, "conv")
    convs = [m for m in disc.modules() if isinstance(m, nn.Conv2d)]
    # 8x8 -> 4x4 -> 2x2 by two k4 s2 p1 layers, then a 2x2 kernel to one logit.
    assert [tuple(c.weight.shape) for c in convs] == [(8, 1, 4, 4), (16, 8, 4, 4), (1, 16, 2, 2)]
    assert disc(torch.rand(3, 64)).shape == (3, 1)
    with pytest.raises(ConfigError, match="at least 4x4"):
        DCGANDiscriminator((1, 2, 2))


def test_conv_generator_shapes_and_range():
    g = ConvGenerator(16, (1, 8, 8), 8, "sigmoid").eval()
    with torch.no_grad():
        x = g(torch.randn(5, 16))
    assert x.shape == (5, 64) and float(x.min()) >= 0 and float(x.max()) <= 1
    assert ConvGenerator(4, (3, 32, 32), 4).eval()(torch.randn(2, 4)).shape == (2, 3072)


def test_resolve_image_shape():
    assert resolve_image_shape(64) == (1, 8, 8)
    assert resolve_image_shape(12, [3, 2, 2]) == (3, 2, 2)
    assert resolve_image_shape(12, [3, 4]) == (1, 3, 4)
    with pytest.raises(ConfigError, match="not a square"):
        resolve_image_shape(10)
    with pytest.raises(ConfigError, match="does not describe"):
        resolve_image_shape(64, [2, 8, 8])


def test_wgan_gp_moves_the_generator_to_the_data():
    torch.manual_seed(0)
    data = torch.randn(512, 2) * 0.3 + torch.tensor([2.0, -1.0])
    gen = MLPGenerator(2, 2, [16], "linear")
    critic = mlp(2, [32], 1)
    before = gen(torch.randn(256, 2)).mean(0).detach()
    stats = train_wgan_gp(gen, critic, data, steps=300, noise_dim=2, seed=0, lr=5e-3,
                          betas=(0.5, 0.9))
    after = gen(torch.randn(256, 2)).mean(0).detach()
    target = data.mean(0)
    assert (after - target).norm() < 0.5 * (before - target).norm()
    assert all(math.isfinite(v) for v in stats.values())
    assert not gen.training
    with pytest.raises(ValueError, match="n_critic"):
        train_wgan_gp(gen, critic, data, steps=1, noise_dim=2, seed=0, n_critic=0)


# ---------------------------------------------------------------- Fed-ET terms


def test_diversity_targets_by_hand():
    # K = 3 teachers, N = 2 samples, C = 3 classes.
    L = torch.tensor([
        [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]],
        [[0.0, 3.0, 0.0], [0.0, 2.0, 0.0]],
        [[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]],
    ], dtype=torch.float64)
    w = torch.tensor([[0.5, 0.2], [0.3, 0.3], [0.2, 0.5]], dtype=torch.float64)
    consensus = torch.tensor([0, 1])
    d, has = diversity_targets(L, w, consensus)
    # Sample 0: teachers 1 and 2 disagree with class 0; weights 0.3, 0.2 -> 0.6, 0.4.
    m0 = 0.6 * L[1, 0] + 0.4 * L[2, 0]
    torch.testing.assert_close(d[0], torch.softmax(m0, 0))
    # Sample 1: every teacher says class 1: no diversity term, uniform placeholder.
    assert has.tolist() == [True, False]
    torch.testing.assert_close(d[1], torch.full((3,), 1 / 3, dtype=torch.float64))
    # Probability mode: the renormalised weights act on each teacher's softmax.
    dp, _ = diversity_targets(L, w, consensus, combine="probs")
    torch.testing.assert_close(dp[0], 0.6 * torch.softmax(L[1, 0], 0) + 0.4 * torch.softmax(L[2, 0], 0))


def test_diversity_targets_uniform_when_the_disagreeing_weights_vanish():
    L = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 2.0]]], dtype=torch.float64)
    w = torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64)
    d, has = diversity_targets(L, w, torch.tensor([0]))
    torch.testing.assert_close(d[0], torch.softmax(0.5 * L[1, 0] + 0.5 * L[2, 0], 0))
    assert has.tolist() == [True]


def test_distillation_loss_with_the_diversity_term_by_hand():
    S = torch.tensor([[0.5, -0.2, 0.1], [1.0, 0.0, -1.0], [0.0, 0.3, 0.0]], dtype=torch.float64,
                     requires_grad=True)
    y = torch.softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]],
                                   dtype=torch.float64), 1)
    d = torch.softmax(torch.tensor([[0.0, 1.0, 1.0], [9.0, 9.0, 9.0], [1.0, 0.0, 0.0]],
                                   dtype=torch.float64), 1)
    has = torch.tensor([True, False, True])
    lam, T = 0.05, 2.0
    loss = distillation_loss(S, y, temperature=T, hard=True, diversity=d, has_diversity=has,
                             diversity_lambda=lam)
    logq = torch.log_softmax(S.detach() / T, 1)
    ce = -(logq[0, 0] + logq[1, 1] + logq[2, 2]) / 3
    kl = lambda i: float((d[i] * (d[i].log() - logq[i])).sum())  # noqa: E731
    want = float(ce) + lam * T * T * (kl(0) + kl(2)) / 3
    assert float(loss.detach()) == pytest.approx(want, rel=1e-10)
    # Soft consensus: the batch-mean KL to the pseudo-labels instead of the cross-entropy.
    soft = distillation_loss(S, y, temperature=T, diversity=d, has_diversity=has,
                             diversity_lambda=lam)
    kl_y = float((y * (y.log() - logq)).sum()) * T * T / 3
    assert float(soft.detach()) == pytest.approx(kl_y + lam * T * T * (kl(0) + kl(2)) / 3, rel=1e-10)
    # Without lambda the term is absent.
    plain = distillation_loss(S, y, temperature=T, hard=True, diversity=d, has_diversity=has)
    assert float(plain.detach()) == pytest.approx(float(ce), rel=1e-12)
    # The gradient flows to the student.
    loss.backward()
    assert S.grad is not None and torch.isfinite(S.grad).all()
    assert float(F.cross_entropy(S.detach() / T, y.argmax(1))) == pytest.approx(float(ce))


def test_fedet_with_diversity_runs_and_logs():
    params = dict(FAST, consensus="hard", diversity_lambda=0.05)
    result = Simulation(config(rounds=2), build_strategy("fedet", params)).run()
    last = result.rounds[-1]
    assert 0 <= last["strategy_disagreeing_fraction"] <= 1
    assert math.isfinite(last["strategy_distill_loss"])


# ---------------------------------------------------------------- options in a run


def test_fedgo_with_wgan_gp_and_cnn_discriminator(tmp_path):
    path = tmp_path / "gen.pt"
    params = dict(FAST, generator="wgan_gp", gan_steps=2, n_critic=2, generator_width=4,
                  disc_arch="cnn", disc_width=4, generator_path=str(path))
    first = Simulation(config(), build_strategy("fedgo", params))
    r1 = first.run()
    s = first.strategy
    assert isinstance(s.generator, ConvGenerator)  # auto: conv for image rows
    assert isinstance(s.new_discriminator(), DCGANDiscriminator)
    assert set(s.generator_stats) == {"critic_loss", "generator_loss", "wasserstein"}
    assert path.is_file()
    # The second run loads the same generator instead of training it: identical results.
    second = Simulation(config(), build_strategy("fedgo", params))
    for a, b in zip(first.strategy.generator.state_dict().values(),
                    second.strategy.generator.state_dict().values()):
        assert torch.equal(a, b)
    assert second.run().rounds[-1]["test_accuracy"] == r1.rounds[-1]["test_accuracy"]
    # A file trained with other settings is refused, naming them.
    with pytest.raises(ConfigError, match="gan_steps"):
        Simulation(config(), build_strategy("fedgo", {**params, "gan_steps": 3}))


def test_conv_options_need_an_image_shape():
    data = {"name": "gaussian_mixture", "num_features": 10, "num_samples": 400,
            "server_fraction": 0.5}
    with pytest.raises(ConfigError, match="not a square"):
        Simulation(config(data=data), build_strategy("fedgo", dict(FAST, disc_arch="cnn")))
    # An MLP generator and discriminator work on any rows, with a linear output off [0, 1].
    sim = Simulation(config(data=data),
                     build_strategy("fedgo", dict(FAST, generator="wgan_gp", gan_steps=1)))
    assert isinstance(sim.strategy.generator, MLPGenerator)
    assert isinstance(sim.strategy.generator.output, nn.Identity)


def test_config_errors():
    for bad in ({"n_critic": 0}, {"gp_weight": -1.0}, {"diversity_lambda": -0.1},
                {"disc_width": 0}):
        with pytest.raises(ConfigError):
            DistillationConfig(**bad)


def test_cli_flags(tmp_path):
    out = tmp_path / "run"
    code = main([
        "run", "--algorithm", "fedet", "--rounds", "1", "--data.name", "digits",
        "--data.server_fraction", "0.5", "--partition.kind", "dirichlet",
        "--partition.num_clients", "3", "--partition.alpha", "0.5", "--model.hidden", "8",
        "--fedet.server_epochs", "1", "--fedet.consensus", "hard",
        "--fedet.diversity_lambda", "0.05", "--out", str(out),
    ])
    assert code in (0, None)
    assert "strategy_disagreeing_fraction" in (out / "results.json").read_text()
