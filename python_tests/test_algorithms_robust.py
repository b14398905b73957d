"""The robust aggregation strategies (fedmedian, trimmed-mean, krum, multikrum, bulyan): their
update on hand-made rounds, and that they hold up under attack on digits where FedAvg does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algorithm_helpers import SHAPES, flat, round_info

from fedkernels.algorithms.registry import build_strategy
from fedkernels.cli import main
from fedkernels.sim.config import ConfigError, ExperimentConfig, ServerConfig, from_dict
from fedkernels.sim.run import Simulation
from fedkernels.sim.server import Server, build_server_optimizer

RULES = ["fedmedian", "trimmed-mean", "krum", "multikrum", "bulyan"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def server_at(global_state, lr=1.0):
    model = torch.nn.Module()
    for n, t in global_state.items():
        model.register_parameter(n, torch.nn.Parameter(t.clone()))
    return Server(model, build_server_optimizer(ServerConfig(lr=lr)))


def honest_and_byzantine(k_honest=7, k_bad=2, seed=0):
    """Honest clients near 1 in every coordinate, Byzantine ones far away at -50."""
    g = torch.Generator().manual_seed(seed)
    glob = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    clients = [
        {n: 1.0 + 0.1 * torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}
        for _ in range(k_honest)
    ] + [{n: torch.full(s, -50.0, dtype=torch.float64) for n, s in SHAPES.items()}
         for _ in range(k_bad)]
    return glob, clients


def step(name, params, glob, clients, sizes=None, lr=1.0):
    strategy = build_strategy(name, params)
    sizes = [10.0] * len(clients) if sizes is None else sizes
    info = round_info([0.0] * len(clients), sizes, glob, clients)
    server = server_at(glob, lr)
    extra = strategy.aggregate(info, server)
    return flat(server.state), extra


def test_fedmedian_and_trimmed_mean_by_hand():
    glob = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    values = [3.0, -1.0, 100.0, 2.0, 0.0]
    clients = [{n: torch.full(s, v, dtype=torch.float64) for n, s in SHAPES.items()}
               for v in values]
    median, _ = step("fedmedian", {}, glob, clients)
    np.testing.assert_array_equal(median, np.full(8, 2.0))
    # beta = 0.2, K = 5: one value cut at each end -> mean of 0, 2, 3
    trimmed, _ = step("trimmed-mean", {"beta": 0.2}, glob, clients)
    np.testing.assert_allclose(trimmed, np.full(8, 5.0 / 3.0))
    # beta = 0: the plain mean, outlier included
    mean, _ = step("trimmed-mean", {"beta": 0.0}, glob, clients)
    np.testing.assert_allclose(mean, np.full(8, 104.0 / 5.0))


def test_server_learning_rate_moves_towards_the_robust_model():
    glob = {n: torch.full(s, 4.0, dtype=torch.float64) for n, s in SHAPES.items()}
    clients = [{n: torch.full(s, v, dtype=torch.float64) for n, s in SHAPES.items()}
               for v in [0.0, 2.0, 9.0]]
    moved, _ = step("fedmedian", {}, glob, clients, lr=0.5)
    np.testing.assert_allclose(moved, np.full(8, 3.0))  # 4 + 0.5 * (2 - 4)


@pytest.mark.parametrize("name, params", [
    ("fedmedian", {}), ("trimmed-mean", {"beta": 0.25}), ("krum", {"num_malicious": 2}),
    ("multikrum", {"num_malicious": 2}), ("bulyan", {"num_malicious": 1}),
])
def test_far_away_clients_do_not_move_the_rule(name, params):
    glob, clients = honest_and_byzantine()
    result, _ = step(name, params, glob, clients)
    honest = np.stack([flat(c) for c in clients[:7]])
    assert np.all(result >= honest.min(axis=0) - 1e-12)
    assert np.all(result <= honest.max(axis=0) + 1e-12)
    fedavg, _ = step("fedavg", {}, glob, clients)
    assert np.all(fedavg < -5)


def test_krum_returns_one_honest_client_and_logs_it():
    glob, clients = honest_and_byzantine()
    result, extra = step("krum", {"num_malicious": 2}, glob, clients)
    chosen = int(extra["selected_client"])
    assert chosen < 7
    np.testing.assert_array_equal(result, flat(clients[chosen]))


def test_multikrum_default_keeps_k_minus_f_weighted_by_examples():
    glob, clients = honest_and_byzantine()
    sizes = [float(s) for s in range(1, 10)]
    result, extra = step("multikrum", {"num_malicious": 2}, glob, clients, sizes=sizes)
    assert extra == {"selected": 7.0}
    honest = np.stack([flat(c) for c in clients[:7]])
    w = np.array(sizes[:7]) / sum(sizes[:7])
    np.testing.assert_allclose(result, w @ honest)


def test_bulyan_needs_enough_participants():
    glob, clients = honest_and_byzantine(k_honest=4, k_bad=2)
    with pytest.raises(ConfigError, match=r"bulyan with num_malicious=2 needs at least 11"):
        step("bulyan", {"num_malicious": 2}, glob, clients)


@pytest.mark.parametrize("name, params, message", [
    ("trimmed-mean", {"beta": 0.5}, r"trimmed-mean.beta must be in \[0, 0.5\)"),
    ("krum", {"num_malicious": -1}, "krum.num_malicious must be >= 0"),
    ("multikrum", {"num_to_keep": 0}, "multikrum.num_to_keep must be >= 1"),
    ("bulyan", {"selection": "best"}, "bulyan.selection: 'best' is not one of"),
])
def test_bad_parameters(name, params, message):
    with pytest.raises(ConfigError, match=message):
        build_strategy(name, params)


def digits_under_signflip(name, params, rounds=6):
    config = from_dict(ExperimentConfig, {
        "rounds": rounds, "eval_every": rounds, "seed": 1,
        "partition": {"num_clients": 10}, "participation": {"kind": "full"},
        "model": {"hidden": [16]}, "client": {"lr": 0.3, "epochs": 2},
        "attack": {"kind": "signflip", "fraction": 0.2, "scale": 10.0},
    })
    return Simulation(config, build_strategy(name, params)).run().summary["test_accuracy"]


def test_robust_rules_learn_digits_under_signflip_where_fedavg_fails():
    fedavg = digits_under_signflip("fedavg", {})
    assert fedavg < 0.3
    for name, params in [("fedmedian", {}), ("krum", {"num_malicious": 2}),
                         ("bulyan", {"num_malicious": 1})]:
        assert digits_under_signflip(name, params) > 0.75, name


def test_rules_refuse_central_dp():
    config = from_dict(ExperimentConfig, {
        "rounds": 1, "partition": {"num_clients": 5}, "model": {"name": "logreg"},
        "dp": {"clip": 1.0},
    })
    with pytest.raises(ConfigError, match="fedmedian is not one"):
        Simulation(config, build_strategy("fedmedian")).run()


@pytest.mark.parametrize("name", RULES)
def test_every_rule_runs_from_the_cli_and_resumes(tmp_path, capsys, name):
    common = [
        "--algorithm", name, "--partition.num_clients", "7", "--model.name", "logreg",
        "--attack.kind", "gaussian", "--no-progress", "--no-plots",
    ]
    if name != "fedmedian" and name != "trimmed-mean":
        common += [f"--{name}.num_malicious", "1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["run", *common, "--rounds", "3", "--out", str(straight)]) == 0
    assert main(["run", *common, "--rounds", "2", "--out", str(resumed)]) == 0
    assert main(["run", "--resume", "--rounds", "3", "--out", str(resumed), "--no-progress",
                 "--no-plots"]) == 0, capsys.readouterr().err
    a = torch.load(straight / "checkpoint.pt", weights_only=True)["server"]["global"]
    b = torch.load(resumed / "checkpoint.pt", weights_only=True)["server"]["global"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
