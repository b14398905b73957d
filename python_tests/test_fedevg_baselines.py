"""FedEvg's generative baseline and diagnostics (fedkernels/algorithms/fedevg.py,
generators.py; docs/algorithms/fedevg.md, sections 11-12): the conditional VAE's loss against
its formula, FedCVAE's averaging against the weighted mean (whole model and decoders only),
its run, resume and CLI, the synthetic-set diagnostics on a hand case, the diagnostics FedEvg
logs, and training the classifier only every few rounds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedkernels.algorithms import available, build_strategy
from fedkernels.algorithms.fedevg import (
    FedCVAEConfig,
    FedEvgConfig,
    classify_now,
    synthetic_set_diagnostics,
)
from fedkernels.algorithms.generators import ConditionalVAE
from fedkernels.cli import main
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import ConfigError, from_dict
from fedkernels.sim.strategy import RoundInfo

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds=2, participation=None):
    return from_dict(ExperimentConfig, {
        "rounds": rounds, "seed": 2, "data": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": 4, "alpha": 1.0},
        "participation": participation or {"kind": "full"},
        "model": {"name": "mlp", "hidden": [16]},
    })


CVAE = {"hidden": [16], "latent_dim": 3, "batch_size": 64, "server_epochs": 2, "spc": 4}


def test_cvae_loss_matches_its_formula():
    torch.manual_seed(0)
    cvae = ConditionalVAE(5, 3, [7], latent_dim=2, output="sigmoid")
    x, y = torch.rand(4, 5), torch.tensor([0, 2, 1, 2])
    loss = cvae.loss(x, y, torch.Generator().manual_seed(9))
    # Independent: the same draw, the reparameterisation, squared error and Gaussian KL.
    onehot = torch.nn.functional.one_hot(y, 3).float()
    h = cvae.encoder(torch.cat([x, onehot], 1))
    mu, log_var = h[:, :2], h[:, 2:]
    eps = torch.randn(4, 2, generator=torch.Generator().manual_seed(9))
    z = mu + (0.5 * log_var).exp() * eps
    recon = torch.sigmoid(cvae.decoder[0](torch.cat([z, onehot], 1)))
    kl = 0.5 * (mu**2 + log_var.exp() - 1 - log_var).sum(1)
    want = (((recon - x) ** 2).sum(1) + kl).mean()
    torch.testing.assert_close(loss, want)
    assert cvae.sample(torch.tensor([0, 1, 2])).shape == (3, 5)


def one_round(params, participants):
    strategy = build_strategy("fedcvae", params)
    sim = Simulation(config(rounds=1), strategy)
    fed = sim.federation
    ups = [strategy.train_client(sim.server.state, fed.clients[i], 0, i) for i in participants]
    n = torch.tensor([fed.clients[i].num_train for i in participants], dtype=torch.float64)
    before = {k: v.clone() for k, v in strategy.global_cvae.items()}
    info = RoundInfo(round=0, num_clients=fed.num_clients, participants=torch.tensor(participants),
                     num_samples=n, global_state=sim.server.state,
                     client_states=[u.state for u in ups],
                     train_losses=torch.zeros(len(ups), dtype=torch.float64), global_losses=None,
                     history=sim.history)
    extra = strategy.aggregate(info, sim.server)
    return strategy, sim, ups, n, before, extra


def test_fedcvae_averages_the_whole_model_by_sample_size():
    strategy, sim, ups, n, _, extra = one_round(CVAE, [0, 2, 3])
    w = n / n.sum()
    for k, v in strategy.global_cvae.items():
        want = sum(float(w[i]) * ups[i].state[k].double() for i in range(3))
        torch.testing.assert_close(v.double(), want, rtol=1e-5, atol=1e-6)
    # The synthetic set: balanced labels, decoded pixels in [0, 1]; the classifier trained on it
    # is the global model.
    assert strategy.synth_x.shape == (40, 64)
    assert float(strategy.synth_x.min()) >= 0 and float(strategy.synth_x.max()) <= 1
    assert torch.equal(torch.bincount(strategy.synth_y), torch.full((10,), 4))
    for name, value in strategy.classifier.state_dict().items():
        assert torch.equal(sim.server.state[name], value)
    assert math.isfinite(extra["synthetic_ce"]) and extra["within_class_distance"] > 0


def test_fedcvae_shares_only_decoders():
    strategy, _, ups, n, before, _ = one_round({**CVAE, "share": "decoder"}, [1, 3])
    w = n / n.sum()
    for k, v in strategy.global_cvae.items():
        if k.startswith("decoder."):
            want = w[0] * ups[0].state[k].double() + w[1] * ups[1].state[k].double()
            torch.testing.assert_close(v.double(), want, rtol=1e-5, atol=1e-6)
        else:  # the global encoder is untouched; each client keeps its own
            assert torch.equal(v, before[k])
    assert sorted(strategy.encoders) == [1, 3]
    for cid, up in zip([1, 3], ups):
        for k, v in strategy.encoders[cid].items():
            assert torch.equal(v, up.state["encoder." + k])


def test_fedcvae_run_resume_and_registration(tmp_path):
    assert "fedcvae" in available()
    full = build_strategy("fedcvae", CVAE)
    Simulation(config(rounds=3), full).run()
    path = tmp_path / "ckpt.pt"
    first = Simulation(config(rounds=3), build_strategy("fedcvae", CVAE), checkpoint=path)
    for t in range(2):
        first.records.append(first.play_round(t))
        first.next_round = t + 1
    first.save_checkpoint()
    resumed = build_strategy("fedcvae", CVAE)
    Simulation(config(rounds=3), resumed, checkpoint=path).run(resume=True)
    assert torch.equal(full.synth_x, resumed.synth_x)


def test_fedcvae_config_errors():
    for bad in ({"latent_dim": 0}, {"hidden": []}, {"lr_decay": 0.0}, {"classify_every": 0}):
        with pytest.raises(ConfigError):
            FedCVAEConfig(**bad)
    with pytest.raises(ConfigError):
        FedEvgConfig(classify_every=0)


def test_cli_runs_fedcvae(tmp_path):
    out = tmp_path / "run"
    code = main([
        "run", "--algorithm", "fedcvae", "--rounds", "1", "--data.name", "digits",
        "--partition.kind", "dirichlet", "--partition.num_clients", "3", "--partition.alpha", "1.0",
        "--model.hidden", "8", "--fedcvae.hidden", "16", "--fedcvae.share", "decoder",
        "--fedcvae.image_path", str(out / "synth.png"), "--out", str(out),
    ])
    assert code in (0, None)
    assert (out / "synth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "strategy_within_class_distance" in (out / "results.json").read_text()


@pytest.mark.parametrize("algorithm", ["fedcvae", "fedevg"])
def test_cli_flags_a_global_model_that_was_never_trained(tmp_path, capsys, algorithm):
    out = tmp_path / "run"
    args = ["run", "--algorithm", algorithm, "--rounds", "1", "--data.name", "digits",
            "--partition.num_clients", "2", "--model.hidden", "8", "--out", str(out)]
    if algorithm == "fedevg":
        args += ["--fedevg.spc", "1", "--fedevg.sgld_steps", "1"]
    assert main(args + [f"--{algorithm}.server_epochs", "0"]) == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert len(summary["caveats"]) == 1 and "never trained" in summary["caveats"][0]
    assert "warning: server_epochs = 0: the global model" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0  # the default trains it: no caveat
    assert "caveats" not in json.loads((out / "results.json").read_text())["summary"]
    assert "never trained" not in capsys.readouterr().err


# ---------------------------------------------------------------- diagnostics


def test_synthetic_set_diagnostics_by_hand():
    before = torch.tensor([[0.5, 0.5], [0.2, 0.9], [0.0, 0.3]])
    after = torch.tensor([[1.0, 0.5], [0.2, 0.9], [0.0, 0.0]])
    labels = torch.tensor([0, 0, 1])
    step = torch.tensor([[2.0, 0.0], [0.0, 0.0], [-1.0, -3.0]])
    d = synthetic_set_diagnostics(before, after, labels, step, 0.01, True)
    assert d["step_abs"] == pytest.approx(6.0 / 6)
    assert d["moved_abs"] == pytest.approx((0.5 + 0.3) / 6)
    assert d["changed_fraction"] == pytest.approx(2 / 6)
    assert d["saturated_fraction"] == pytest.approx(3 / 6)  # 1.0, 0.0, 0.0
    # Class 0 has two samples at distance |(0.8, -0.4)|; class 1 has one (left out).
    assert d["within_class_distance"] == pytest.approx(math.hypot(0.8, 0.4), rel=1e-6)
    assert d["noise_std"] == 0.01
    assert "saturated_fraction" not in synthetic_set_diagnostics(before, after, labels, step,
                                                                 0.01, False)


def test_fedevg_logs_its_diagnostics():
    params = {"hidden": [16], "batch_size": 64, "server_epochs": 2, "classify_every": 2}
    result = Simulation(config(rounds=3), build_strategy("fedevg", params)).run()
    r0, r1, r2 = result.rounds
    for key in ("energy_gap", "step_abs", "moved_abs", "changed_fraction", "saturated_fraction",
                "within_class_distance", "client_lr", "noise_std"):
        assert math.isfinite(r0[f"strategy_{key}"]), key
    assert 0 <= r0["strategy_saturated_fraction"] <= 1
    # classify_every=2 with 3 rounds: the classifier is trained in rounds 2 and 3 only.
    assert "strategy_synthetic_ce" not in r0
    assert "strategy_synthetic_ce" in r1 and "strategy_synthetic_ce" in r2


def test_classify_now():
    assert [classify_now(t, 7, 3) for t in range(7)] == [False, False, True, False, False, True,
                                                         True]
    assert all(classify_now(t, 5, 1) for t in range(5))


def test_partial_participation_run_keeps_everything_finite():
    part = {"kind": "uniform", "fraction": 0.5}
    result = Simulation(config(rounds=2, participation=part),
                        build_strategy("fedcvae", CVAE)).run()
    assert result.rounds[-1]["participants"] == 2
    assert json.dumps(result.rounds)  # plain numbers, no NaN placeholders
