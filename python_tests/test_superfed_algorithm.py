"""SuPerFed-MM/LM on the simulation loop (fedkernels/algorithms/superfed.py;
docs/algorithms/superfed.md): warm-up = FedProx, both endpoints trained after it, only the global
endpoint aggregated, per-module lambdas for LM, the lambda-grid evaluation, checkpoints, CLI."""

from __future__ import annotations

import json

import pytest
import torch

import fedkernels
from fedkernels.algorithms import available, build_strategy
from fedkernels.algorithms import superfed as superfed_module
from fedkernels.cli import main
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict
from fedkernels.sim.metrics import calibration_errors

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds=4, **client):
    return from_dict(
        ExperimentConfig,
        {
            "rounds": rounds,
            "seed": 3,
            "data": {"name": "digits"},
            "partition": {"kind": "pathological", "num_clients": 6, "classes_per_client": 2},
            "participation": {"kind": "uniform", "fraction": 0.5},
            "model": {"name": "mlp", "hidden": [16]},
            "client": {
                "epochs": 1,
                "batch_size": 10,
                "lr": 0.05,
                "momentum": 0.9,
                "weight_decay": 1e-4,
                **client,
            },
        },
        "test",
    )


def test_registered():
    assert {"superfed-mm", "superfed-lm"} <= set(available())
    assert build_strategy("superfed-lm").config.nu == 2.0
    assert build_strategy("superfed-mm", {"nu": "0.5"}).config.nu == 0.5


def test_warm_up_is_fedprox():
    """Before round floor(L*R) SuPerFed is FedProx (paper form) on the global endpoint: with
    L = 1 the whole run must match the fedprox strategy (same batches, same seeds; no
    validation rows held out)."""
    superfed = Simulation(
        config(),
        build_strategy(
            "superfed-mm", {"start_fraction": 1.0, "mu": 0.1, "lambda_selection": "train"}
        ),
    )
    fedprox = Simulation(config(), build_strategy("fedprox", {"mu": 0.1}))
    superfed.run()
    fedprox.run()
    for name, value in fedprox.server.state.items():
        torch.testing.assert_close(superfed.server.state[name], value, rtol=1e-5, atol=1e-6)
    # the local models were never trained: they are still their initialisation
    fresh = build_strategy("superfed-mm")
    fresh.setup(superfed.strategy.info)
    for k, local in superfed.strategy.local.items():
        assert all(torch.equal(a, b) for a, b in zip(local, fresh.local_model(k, {})))


def test_mixing_trains_both_endpoints_and_only_the_global_is_aggregated():
    sim = Simulation(config(rounds=3), build_strategy("superfed-lm", {"start_fraction": 0.0}))
    strategy = sim.strategy
    fresh = build_strategy("superfed-lm")
    fresh.setup(strategy.info)
    uploads = {}
    train = strategy.train_client

    def recording(global_state, data, round_index, client_id):
        update = train(global_state, data, round_index, client_id)
        uploads[client_id] = update.state
        return update

    strategy.train_client = recording
    before = {n: v.clone() for n, v in sim.server.state.items()}
    sim.play_round(0)
    assert len(uploads) == 3
    sizes = torch.tensor(
        [float(sim.federation.clients[k].num_train) for k in sorted(uploads)], dtype=torch.float64
    )
    weights = sizes / sizes.sum()
    for i, name in enumerate(strategy.names):
        # the local endpoint moved away from its initialisation, and was not uploaded
        for k in uploads:
            local = strategy.local[k][i]
            assert not torch.equal(local, fresh.local_model(k, {})[i])
            assert not torch.equal(uploads[k][name], local)
            assert not torch.equal(uploads[k][name], before[name])
        # the server's new model is the sample-weighted mean of the uploaded global endpoints
        mean = sum(w * uploads[k][name].double() for w, k in zip(weights, sorted(uploads)))
        torch.testing.assert_close(sim.server.state[name], mean.float(), rtol=1e-5, atol=1e-6)


class _ComposedStep:
    """The local step as it was before the fused optimizer: superfed_mix for theta and the
    regularizer, torch.optim.SGD over both endpoints (SuPerFedSGD's interface)."""

    def __init__(self, g, l, anchor, *, nu, mu, prox_form, numerator_eps, **sgd):
        self.g = [x.requires_grad_() for x in g]
        self.l = [x.requires_grad_() for x in l]
        self.anchor = anchor
        self.reg = dict(nu=nu, mu=mu, prox_form=prox_form, numerator_eps=numerator_eps)
        self.opt = torch.optim.SGD(self.g + self.l, **sgd)

    def mix(self, lam):
        return fedkernels.superfed_mix(self.g, self.l, lam, self.anchor, **self.reg)

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.opt.step()


@pytest.mark.parametrize("algorithm", ["superfed-mm", "superfed-lm"])
def test_fused_step_matches_superfed_mix_with_torch_sgd(monkeypatch, algorithm):
    """The trainer's fused optimizer (SuPerFedSGD) against the composition it replaced, over a
    whole run: the same global model, local models and metrics up to float32 rounding."""
    options = {"start_fraction": 0.25, "prox_form": "code", "numerator_eps": 1e-6}
    fused = Simulation(config(rounds=4), build_strategy(algorithm, options))
    fused_history = fused.run()
    monkeypatch.setattr(superfed_module, "SuPerFedSGD", _ComposedStep)
    composed = Simulation(config(rounds=4), build_strategy(algorithm, options))
    composed_history = composed.run()
    for name, value in composed.server.state.items():
        torch.testing.assert_close(fused.server.state[name], value, rtol=1e-4, atol=1e-5)
    assert fused.strategy.local.keys() == composed.strategy.local.keys()
    for k, local in composed.strategy.local.items():
        for a, b in zip(fused.strategy.local[k], local):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the mixing phase ran, and moved the local models
    fresh = build_strategy(algorithm)
    fresh.setup(fused.strategy.info)
    assert any(not torch.equal(a, b) for k, local in fused.strategy.local.items()
               for a, b in zip(local, fresh.local_model(k, {})))
    # the same training losses, round by round
    assert len(fused_history.rounds) == len(composed_history.rounds) == 4
    for ours, theirs in zip(fused_history.rounds, composed_history.rounds):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4)


def test_local_models_are_initialised_independently():
    sim = Simulation(config(), build_strategy("superfed-mm"))
    s = sim.strategy
    a, b = s.local_model(0, sim.server.state), s.local_model(1, sim.server.state)
    glob = [sim.server.state[n] for n in s.names]
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[0], glob[0])
    copy = build_strategy("superfed-mm", {"local_init": "copy_global"})
    copy.setup(s.info)
    assert all(torch.equal(x, y) for x, y in zip(copy.local_model(0, sim.server.state), glob))


def test_layer_mixing_draws_one_lambda_per_module():
    import numpy as np

    sim = Simulation(config(), build_strategy("superfed-lm"))
    s = sim.strategy
    lam = s.sample_lambda(np.random.default_rng(0))
    assert lam.shape == (len(s.names),)
    by_module = {}
    for name, value in zip(s.names, lam.tolist()):
        by_module.setdefault(name.rsplit(".", 1)[0], set()).add(value)
    assert all(len(v) == 1 for v in by_module.values())  # weight and bias share one lambda
    assert len({next(iter(v)) for v in by_module.values()}) == len(by_module)
    mm = Simulation(config(), build_strategy("superfed-mm")).strategy
    assert mm.sample_lambda(np.random.default_rng(0)).dim() == 0


def test_evaluation_over_the_lambda_grid():
    sim = Simulation(config(rounds=4), build_strategy("superfed-mm", {"start_fraction": 0.25}))
    result = sim.run()
    s = sim.strategy
    clients = sim.federation.clients
    test = s.grid_accuracy(sim.server.state, clients)
    validation = s.grid_accuracy(sim.server.state, clients, "validation")
    assert test.shape == validation.shape == (6, 11)
    summary = result.summary
    torch.testing.assert_close(summary["personalized_accuracy_oracle"], float(test.max(1).values.mean()))
    # the reported figure: test accuracy at the lambda each client picks on its validation rows
    chosen = validation.argmax(1)
    at_chosen = test.gather(1, chosen[:, None]).squeeze(1)
    torch.testing.assert_close(summary["personalized_accuracy"], float(at_chosen.mean()))
    torch.testing.assert_close(summary["personalized_client_accuracy"], at_chosen.tolist())
    torch.testing.assert_close(summary["personalized_lambda_mean"], float(chosen.double().mean() / 10))
    # lambda = 0 is the global model: the simulation's own per-client evaluation of it
    torch.testing.assert_close(summary["global_endpoint_accuracy"], summary["client_accuracy_mean"])
    for key in ("train_selected", "validation_selected"):
        assert summary["personalized_accuracy_oracle"] >= summary[f"personalized_accuracy_{key}"]
    assert summary["personalized_accuracy_oracle"] >= summary["global_endpoint_accuracy"]
    # ECE and MCE of each client's model at its chosen lambda, averaged over clients
    logits = s.grid_logits(sim.server.state, clients)
    per_client = [calibration_errors(z[j], c.test_y) for z, j, c in zip(logits, chosen.tolist(), clients)]
    torch.testing.assert_close(summary["personalized_ece"], sum(float(e) for e, _ in per_client) / 6)
    torch.testing.assert_close(summary["personalized_mce"], sum(float(m) for _, m in per_client) / 6)
    assert "personalized_accuracy" in result.rounds[-1]


def test_validation_rows_are_held_out_of_training():
    """With lambda_selection=validation each client trains on its training split less a seeded
    validation part (20% by default), picks lambda there, and never trains on it."""
    sim = Simulation(config(rounds=2), build_strategy("superfed-mm", {"start_fraction": 0.0}))
    s = sim.strategy
    seen: dict[int, list] = {}
    real = s.split

    def spy(data, client_id):
        fit, val = real(data, client_id)
        seen.setdefault(client_id, []).append((fit, val))
        return fit, val

    s.split = spy
    sim.run()
    assert seen
    for k, pairs in seen.items():
        fit, val = pairs[0]
        full = sim.federation.clients[k]
        assert len(val.train_y) == round(0.2 * full.num_train)
        assert sorted(fit.train_index.tolist() + val.train_index.tolist()) == full.train_index.tolist()
        assert not set(fit.train_index.tolist()) & set(val.train_index.tolist())
        assert all(torch.equal(p[1].train_x, val.train_x) for p in pairs)  # one split per client


@pytest.mark.parametrize("selection", ["train", "test"])
def test_other_lambda_selections(selection):
    sim = Simulation(
        config(rounds=3),
        build_strategy("superfed-lm", {"start_fraction": 0.0, "lambda_selection": selection}),
    )
    summary = sim.run().summary
    s, state, clients = sim.strategy, sim.server.state, sim.federation.clients
    test = s.grid_accuracy(state, clients)
    chosen = s.grid_accuracy(state, clients, selection).argmax(1)
    expected = float(test.gather(1, chosen[:, None]).mean())
    torch.testing.assert_close(summary["personalized_accuracy"], expected)
    assert "personalized_accuracy_validation_selected" not in summary
    if selection == "test":
        assert summary["personalized_accuracy"] == summary["personalized_accuracy_oracle"]


def test_bad_validation_fraction():
    with pytest.raises(ValueError, match="validation_fraction"):
        build_strategy("superfed-mm", {"validation_fraction": "1"})


def test_checkpoint_keeps_the_local_models(tmp_path):
    path = tmp_path / "ck.pt"
    first = Simulation(
        config(rounds=2), build_strategy("superfed-mm", {"start_fraction": 0.0}), checkpoint=path
    )
    first.run()
    resumed = Simulation(
        config(rounds=4), build_strategy("superfed-mm", {"start_fraction": 0.0}), checkpoint=path
    )
    resumed.run(resume=True)
    straight = Simulation(config(rounds=4), build_strategy("superfed-mm", {"start_fraction": 0.0}))
    straight.run()
    for name, value in straight.server.state.items():
        torch.testing.assert_close(resumed.server.state[name], value)
    assert sorted(resumed.strategy.local) == sorted(straight.strategy.local)


@pytest.mark.parametrize("algorithm", ["superfed-mm", "superfed-lm"])
def test_cli(tmp_path, algorithm):
    out = tmp_path / "run"
    main(
        [
            "run",
            "--algorithm",
            algorithm,
            "--rounds",
            "2",
            "--partition.kind",
            "pathological",
            "--partition.num_clients",
            "5",
            "--model.hidden",
            "8",
            f"--{algorithm}.nu",
            "1.5",
            f"--{algorithm}.prox_form",
            "code",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["algorithm"] == algorithm
    assert result["config"]["algorithm_params"]["nu"] == 1.5
    assert 0 <= result["summary"]["personalized_accuracy"] <= 1
