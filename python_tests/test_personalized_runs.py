"""The personalized baselines end to end on digits (fedkernels/algorithms/personalized.py):
two rounds from the configuration tree the CLI builds, personalized accuracy per client in the
results, resume from a checkpoint equal to an uninterrupted run, the relations to FedAvg that
the rules imply, and the CLI and ``fedkernels compare``."""

from __future__ import annotations

import json

import pytest
import torch

from fedkernels.algorithms import available, build_strategy
from fedkernels.cli import main
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict

NAMES = ["local", "fedavg-ft", "fedper", "fedrep", "lg-fedavg", "apfl", "ditto", "pfedme"]
PARAMS = {"fedrep": {"head_epochs": "1"}, "apfl": {"learn_alpha": "true"}, "pfedme": {"inner_steps": "2"}}
NUM_CLIENTS = 6


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds=2, participation="uniform", **client):
    """What ``fedkernels run --data.name digits --partition.kind pathological ...`` builds."""
    return from_dict(
        ExperimentConfig,
        {
            "rounds": rounds,
            "seed": 4,
            "data": {"name": "digits"},
            "partition": {"kind": "pathological", "num_clients": NUM_CLIENTS, "classes_per_client": 2},
            "participation": {"kind": participation, "fraction": 0.5},
            "model": {"name": "mlp", "hidden": [16]},
            "client": {"epochs": 1, "batch_size": 10, "lr": 0.05, "momentum": 0.9,
                       "weight_decay": 1e-4, **client},
        },
    )


def strategy(name, **extra):
    return build_strategy(name, {**PARAMS.get(name, {}), **extra})


def test_registered():
    assert set(NAMES) <= set(available())


@pytest.mark.parametrize("name", NAMES)
def test_two_rounds_resume_and_personalized_accuracy(tmp_path, name):
    straight = Simulation(config(), strategy(name))
    result = straight.run()
    summary = result.summary
    per_client = summary["personalized_client_accuracy"]
    assert len(per_client) == NUM_CLIENTS and all(0.0 <= a <= 1.0 for a in per_client)
    assert summary["personalized_accuracy"] == pytest.approx(sum(per_client) / NUM_CLIENTS)
    assert summary["personalized_accuracy_worst10"] == min(per_client)
    for record in result.rounds:  # every round is evaluated (eval_every = 1)
        assert 0.0 <= record["personalized_accuracy"] <= 1.0
    assert json.loads(json.dumps(result.to_dict()))["summary"]["personalized_accuracy"] >= 0
    # interrupted after round 1, resumed: the same numbers as the uninterrupted run
    path = tmp_path / "ckpt.pt"
    Simulation(config(rounds=1), strategy(name), checkpoint=path).run()
    resumed = Simulation(config(), strategy(name), checkpoint=path)
    again = resumed.run(resume=True)
    for key, value in straight.server.state.items():
        assert torch.equal(resumed.server.state[key], value), key
    assert sorted(resumed.strategy.personal) == sorted(straight.strategy.personal)
    for k, state in straight.strategy.personal.items():
        for key, value in state.items():
            assert torch.equal(resumed.strategy.personal[k][key], value), (k, key)
    assert again.summary["personalized_client_accuracy"] == per_client
    assert again.rounds[-1]["personalized_accuracy"] == result.rounds[-1]["personalized_accuracy"]


def test_personal_state_grows_with_participation():
    sim = Simulation(config(rounds=1), strategy("ditto"))
    sim.run()
    assert len(sim.strategy.personal) == NUM_CLIENTS // 2  # fraction 0.5 of 6 clients


@pytest.mark.parametrize("name", ["ditto", "apfl"])
def test_global_model_follows_fedavg(name):
    """Ditto's and APFL's global copy w gets exactly FedAvg's local training (same batches), so
    their global models follow FedAvg's."""
    fedavg = Simulation(config(rounds=3), build_strategy("fedavg"))
    other = Simulation(config(rounds=3), strategy(name))
    fedavg.run()
    other.run()
    for key, value in fedavg.server.state.items():
        torch.testing.assert_close(other.server.state[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ditto", "apfl"])
def test_global_model_follows_fedavg_with_batch_norm(name):
    """With BatchNorm too: the personal model's forward passes (APFL's mixture, Ditto's v) must
    not move the running statistics the client uploads with w."""
    def with_batch_norm():
        c = config(rounds=2)
        c.model.batch_norm = True
        return c

    fedavg = Simulation(with_batch_norm(), build_strategy("fedavg"))
    other = Simulation(with_batch_norm(), strategy(name))
    fedavg.run()
    other.run()
    assert any("running_mean" in key for key in fedavg.server.state)
    for key, value in fedavg.server.state.items():
        torch.testing.assert_close(other.server.state[key], value, rtol=1e-5, atol=1e-6)


def test_local_only_never_federates():
    sim = Simulation(config(rounds=2, participation="full"), strategy("local"))
    initial = {k: v.clone() for k, v in sim.server.state.items()}
    result = sim.run()
    for key, value in initial.items():
        assert torch.equal(sim.server.state[key], value)
    assert result.summary["personalized_accuracy"] > result.summary["client_accuracy_mean"]
    # with full participation every client trained its own model from the initial one
    assert sorted(sim.strategy.personal) == list(range(NUM_CLIENTS))


def test_fedavg_ft_without_fine_tuning_is_fedavg():
    sim = Simulation(config(), strategy("fedavg-ft", finetune_epochs="0"))
    fedavg = Simulation(config(), build_strategy("fedavg"))
    summary = sim.run().summary
    assert summary["personalized_accuracy"] == pytest.approx(summary["client_accuracy_mean"])
    assert summary["client_accuracy_mean"] == fedavg.run().summary["client_accuracy_mean"]
    tuned = Simulation(config(), strategy("fedavg-ft", finetune_epochs="2")).run().summary
    assert tuned["client_accuracy_mean"] == summary["client_accuracy_mean"]  # same training
    assert tuned["personalized_accuracy"] != summary["personalized_accuracy"]


@pytest.mark.parametrize("name", ["fedper", "fedrep", "lg-fedavg"])
def test_personal_part_never_moves_on_the_server(name):
    sim = Simulation(config(rounds=2), strategy(name))
    initial = {k: v.clone() for k, v in sim.server.state.items()}
    sim.run()
    s = sim.strategy
    assert s.personal_keys and s.shared_keys
    for key in s.personal_keys:
        assert torch.equal(sim.server.state[key], initial[key]), key
    for key in s.shared_keys:
        assert not torch.equal(sim.server.state[key], initial[key]), key
    head = {"fedper": ["layers.2.weight", "layers.2.bias"], "fedrep": ["layers.2.weight", "layers.2.bias"],
            "lg-fedavg": ["layers.0.weight", "layers.0.bias"]}[name]
    assert s.personal_keys == head


def test_cli_run(tmp_path):
    out = tmp_path / "run"
    main([
        "run", "--algorithm", "fedrep", "--fedrep.head", "layers.2", "--fedrep.head_epochs", "1",
        "--rounds", "2", "--partition.kind", "pathological", "--partition.num_clients", "5",
        "--model.hidden", "8", "--no-progress", "--out", str(out),
    ])
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["algorithm_params"] == {"head": ["layers.2"], "head_epochs": 1}
    assert 0 <= result["summary"]["personalized_accuracy"] <= 1
    assert len(result["summary"]["personalized_client_accuracy"]) == 5


def test_cli_names_a_bad_head(tmp_path, capsys):
    code = main([
        "run", "--algorithm", "fedper", "--fedper.head", "nope", "--rounds", "1",
        "--no-progress", "--out", str(tmp_path / "bad"),
    ])
    assert code == 2
    assert "fedper.head: 'nope' names no parameter" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "results.json").exists()


def test_compare_accepts_the_baselines(tmp_path):
    code = main([
        "compare", "--algorithms", "local,ditto:lam=0.5@Ditto", "--seeds", "0",
        "--set", "rounds=1", "--set", "partition.num_clients=4", "--set", "model.hidden=8",
        "--out", str(tmp_path),
    ])
    assert code == 0
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [e["label"] for e in data["entries"]] == ["local", "Ditto"]
