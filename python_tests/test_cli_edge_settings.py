"""Unusual but legal settings of ``fedkernels run``: settings a strategy cannot honour are
refused before the first round (naming the option), settings that must work do, and a run
whose numbers went NaN says so in results.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_process import FAST, assert_one_line_error, assert_success, fedkernels

from fedkernels.algorithms import build_strategy
from fedkernels.rules.simplex import simplex_qp
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import ConfigError, from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

# a tiny experiment: 4 clients of a 3-class Gaussian mixture, an MLP with 4 hidden units
TINY = {
    "rounds": 2,
    "data": {"name": "gaussian_mixture", "num_samples": 240, "num_features": 6,
             "num_classes": 3},
    "partition": {"num_clients": 4},
    "model": {"name": "mlp", "hidden": [4]},
}


def tiny_config(**changes) -> ExperimentConfig:
    tree = json.loads(json.dumps(TINY))
    for key, value in changes.items():
        if isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return from_dict(ExperimentConfig, tree)


# ------------------------------------------------------------ refused before the first round


@pytest.mark.parametrize("algorithm, params, changes, message", [
    # clients that reply with their own generative models cannot have their replies rewritten
    ("fedevg", {}, {"attack": {"kind": "signflip"}}, "attack.kind=signflip"),
    ("fedcvae", {}, {"attack": {"kind": "gaussian"}}, "attack.kind=gaussian"),
    # strategies that do not aggregate through the server's weighted mean, with central DP
    ("mifa", {}, {"dp": {"clip": 0.5}}, "mifa is not one"),
    ("fedvarp", {}, {"dp": {"clip": 0.5}}, "fedvarp is not one"),
    ("local", {}, {"dp": {"clip": 0.5}}, "local is not one"),
    ("fedevg", {}, {"dp": {"clip": 0.5}}, "fedevg is not one"),
    ("krum", {}, {"dp": {"clip": 0.5}}, "krum is not one"),
    # participant counts the rule can never have
    ("aaggff-s", {}, {"participation": {"kind": "uniform", "fraction": 0.5}},
     "participation.kind=full"),
    ("aaggff-s", {}, {"participation": {"kind": "bernoulli", "fraction": 0.5}},
     "participation.kind=full"),
    ("bulyan", {}, {"partition": {"num_clients": 2}}, "bulyan.num_malicious"),
    ("bulyan", {"num_malicious": 1}, {"participation": {"kind": "bernoulli", "fraction": 0.5}},
     "at least 7 participants"),
    ("multikrum", {"num_to_keep": 10}, {}, "multikrum.num_to_keep"),
    ("multikrum", {"num_malicious": 4}, {}, "multikrum.num_malicious"),
    ("multikrum", {"num_to_keep": 10}, {"participation": {"kind": "bernoulli"}},
     "multikrum.num_to_keep=10"),
    # the adaptive clip's count noise, for the K every round has
    ("fedavg", {}, {"dp": {"adaptive": True, "noise_multiplier": 1.0}},
     "dp.clipped_count_stddev"),
])
def test_unusable_settings_are_refused_before_training(algorithm, params, changes, message):
    # building the simulation trains nothing: the refusal comes before the first round
    config = tiny_config(**changes)
    with pytest.raises(ConfigError, match=message):
        Simulation(config, build_strategy(algorithm, params))


@pytest.mark.slow
def test_cli_refuses_a_reply_attack_on_fedevg_without_writing(tmp_path):
    out = tmp_path / "run"
    done = fedkernels("run", *FAST, "--algorithm", "fedevg", "--fedevg.spc", "1",
                      "--data.name", "gaussian_mixture", "--data.num_samples", "120",
                      "--attack.kind", "scale", "--rounds", "1", "--out", str(out))
    assert_one_line_error(done, "attack.kind=scale", "fedevg")
    assert not out.exists()


# ------------------------------------------------------------------- settings that must work


def test_simplex_qp_converges_with_two_identical_update_directions():
    # FedMGDA+'s min-norm problem when two clients send the same update direction (tiny
    # clients whose hidden units are dead): Q is singular along their difference, where the
    # active-set method used to step along rounding noise until it gave up
    rng = np.random.default_rng(0)
    d = rng.normal(size=(12, 43))
    d[2] = d[1]
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    q = d @ d.T + 1e-12 * np.eye(12)
    hi = 1 / 12 + 0.2
    p = simplex_qp(q, np.zeros(12), 0.0, hi)
    assert p.sum() == pytest.approx(1.0) and p.min() >= 0 and p.max() <= hi + 1e-12
    # the minimum value: that of the problem made positive definite
    reference = simplex_qp(q + 1e-8 * np.eye(12), np.zeros(12), 0.0, hi)
    assert 0.5 * p @ q @ p == pytest.approx(0.5 * reference @ q @ reference, abs=1e-9)


def test_fedmgda_with_clients_of_two_samples_runs():
    config = tiny_config(data={"num_samples": 24}, partition={"num_clients": 12})
    result = Simulation(config, build_strategy("fedmgda")).run()
    assert result.summary["rounds_completed"] == 2


@pytest.mark.parametrize("algorithm, params, key", [
    ("feddf", {"server_epochs": 0}, "strategy_distill_loss"),
    ("fedcvae", {"server_epochs": 0, "spc": 1}, "strategy_synthetic_ce"),
])
def test_no_server_training_reports_no_loss_rather_than_nan(algorithm, params, key):
    config = tiny_config(data={"server_fraction": 0.2}, rounds=1)
    result = Simulation(config, build_strategy(algorithm, params)).run()
    assert key not in result.rounds[0]
    assert "non_finite" not in result.summary


# -------------------------------------------------------------- honest results.json


def test_diverged_training_is_flagged_in_the_results():
    config = tiny_config(client={"weight_decay": 1e6})
    result = Simulation(config, build_strategy("fedavg")).run()
    summary = result.summary
    assert summary["diverged"] is True
    assert "test_loss" in summary["non_finite"]
    assert "train_loss" in result.rounds[-1]["non_finite"]


def test_a_sound_run_carries_no_flags():
    result = Simulation(tiny_config(rounds=1), build_strategy("fedavg")).run()
    assert "diverged" not in result.summary and "non_finite" not in result.summary
    assert "non_finite" not in result.rounds[0]


@pytest.mark.slow
def test_cli_warns_when_the_training_diverged(tmp_path):
    done = fedkernels("run", "--data.name", "gaussian_mixture", "--data.num_samples", "240",
                      "--data.num_features", "6", "--data.num_classes", "3",
                      "--partition.num_clients", "4", "--model.hidden", "4", "--threads", "1",
                      "--no-progress", "--no-plots", "--client.weight_decay", "1e6",
                      "--rounds", "2", "--out", str(tmp_path / "run"))
    assert_success(done)
    assert "warning: the training diverged" in done.stderr
    summary = json.loads((tmp_path / "run" / "results.json").read_text())["summary"]
    assert summary["diverged"] is True


# ------------------------------------------------------ resuming with another number of rounds


@pytest.mark.parametrize("algorithm, params, allowed", [
    ("feddf", {"lr_schedule": "cosine"}, False),  # the server lr decays over all the rounds
    ("feddf", {"lr_schedule": "none"}, True),
    ("superfed-mm", {"start_fraction": 0.4}, False),  # mixing starts at floor(0.4 R)
    ("fedavg", {}, True),
])
def test_extending_a_run_whose_schedule_depends_on_the_rounds(tmp_path, algorithm, params,
                                                              allowed):
    checkpoint = tmp_path / "checkpoint.pt"
    config = tiny_config(rounds=3, data={"server_fraction": 0.2})
    Simulation(config, build_strategy(algorithm, params), checkpoint=checkpoint).run()
    longer = tiny_config(rounds=5, data={"server_fraction": 0.2})
    extended = Simulation(longer, build_strategy(algorithm, params), checkpoint=checkpoint)
    if allowed:
        extended.load_checkpoint()
        return
    with pytest.raises(ConfigError, match="cannot resume with rounds=5: the run was set up "
                                          "for rounds=3"):
        extended.load_checkpoint()


# ---------------------------------------------------------- loss-based strategies that diverge


@pytest.mark.parametrize("name", ["qffl", "qfedavg", "afl", "term", "gifair", "delta-fl", "vred",
                                  "semi-vred"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_loss_weighted_strategies_stop_with_one_line_when_losses_diverge(name, bad):
    # they used to give NaN weights (an aggregate ValueError) or an IndexError (AFL's projection)
    from algorithm_helpers import round_info, setup_info

    strategy = build_strategy(name)
    strategy.setup(setup_info(3))
    info = round_info([1.0, bad, 2.0], [10, 10, 10], participants=[0, 1, 2], round_index=4)
    with pytest.raises(ConfigError, match=r"round 5: the training diverged: .* on clients \[1\]"):
        strategy.client_weights(info)


def test_simplex_projection_of_huge_values():
    # AFL's dual step with losses of 1e17: u_1 - 1 rounds to u_1, and the sorting method found
    # no index (IndexError)
    from fedkernels.rules.simplex import project_simplex

    p = project_simplex(np.array([1e17, 3e16, 1e17 + 16]))
    np.testing.assert_array_equal(p, [0.0, 0.0, 1.0])
    np.testing.assert_allclose(project_simplex(np.array([0.2, 0.5])), [0.35, 0.65])
    with pytest.raises(ValueError, match="NaN or infinite"):
        project_simplex(np.array([0.2, np.nan]))


# ------------------------------------------------------------- large and negative parameters


@pytest.mark.parametrize("value, expected", [("-1e-3", -1e-3), ("-1.5E+2", -150.0),
                                             ("-.5", -0.5), ("-2", -2.0)])
def test_negative_numbers_with_exponents_are_values(value, expected):
    # argparse took "-1e-3" for a flag: "argument --term.tilt: expected one argument"
    from fedkernels.cli.flags import parse_layers
    from fedkernels.cli.run import build_parser, resolve_config

    argv = ["--algorithm", "term", "--term.tilt", value]
    config = resolve_config(parse_layers(build_parser("term"), argv, algorithm="term")[1])
    assert build_strategy("term", config.algorithm_params).config.tilt == expected


def test_negative_infinity_gets_the_finite_number_message():
    from fedkernels.cli.flags import parse_layers
    from fedkernels.cli.run import build_parser

    argv = ["--algorithm", "term", "--term.tilt", "-inf"]
    with pytest.raises(ConfigError, match="term.tilt: expected a finite number"):
        parse_layers(build_parser("term"), argv, algorithm="term")


def test_large_q_gives_finite_weights():
    # n_k f_k^q overflowed to inf / inf = NaN weights for q = 1e6
    import torch

    from fedkernels.rules.fairness_weights import qfedavg_weights, qffl_weights

    n = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)
    f = torch.tensor([1.2, 3.0, 2.0], dtype=torch.float64)
    sq = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    np.testing.assert_allclose(qffl_weights(n, f, 1e6).numpy(), [0.0, 1.0, 0.0])
    assert torch.isfinite(qfedavg_weights(f, sq, 1e6, 10.0)).all()
    assert torch.isfinite(qfedavg_weights(f, sq, 1000.0, 1e-300)).all()


def test_weights_beyond_the_server_range_are_one_line_errors():
    from algorithm_helpers import round_info, setup_info

    strategy = build_strategy("gifair", {"coefficient": 1e300})
    strategy.setup(setup_info(3))
    info = round_info([1.0, 3.0, 2.0], [10, 20, 30])
    with pytest.raises(ConfigError, match=r"gifair's client weights reach .* gifair.coefficient"):
        strategy.aggregate(info, None)
    with pytest.raises(ConfigError, match="propfair.utility_bound must be at most"):
        build_strategy("propfair", {"utility_bound": 1e300})


@pytest.mark.parametrize("params, message", [
    ({"temperature": 1e20}, "temperature must be at most"),  # T^2 overflowed the KL's scale
    ({"server_lr": 3e38}, "server_lr and disc_lr must be at most"),  # Adam's step overflowed
])
def test_distillation_values_beyond_float32_are_refused(params, message):
    with pytest.raises(ConfigError, match=message):
        build_strategy("entropy-kd", params)


# ------------------------------------------------ rounds a rule cannot aggregate are skipped


@pytest.mark.parametrize("algorithm, params", [
    ("bulyan", {"num_malicious": 1}),       # needs 7 participants
    ("multikrum", {"num_to_keep": 5}),      # keeps 5: needs 5
])
def test_rounds_with_too_few_participants_are_skipped_not_fatal(algorithm, params):
    # 8 clients joining with probability 0.75: some rounds draw fewer than the rule needs.
    # Such a round is played like one nobody joined: no training, the model unchanged, the
    # reason recorded; the others aggregate as usual.
    config = tiny_config(rounds=12, partition={"num_clients": 8},
                         participation={"kind": "bernoulli", "fraction": 0.75})
    need = 7 if algorithm == "bulyan" else 5
    sim = Simulation(config, build_strategy(algorithm, params))
    states = []
    result = sim.run(on_round=lambda r: states.append(
        {k: v.clone() for k, v in sim.server.state.items()}))
    rounds = result.rounds
    skipped = [r for r in rounds if "skipped" in r]
    played = [r for r in rounds if "skipped" not in r and r["participants"] > 0]
    assert skipped and played, [r["participants"] for r in rounds]
    for r in skipped:
        assert 0 < r["participants"] < need
        assert f"the round drew {r['participants']}" in r["skipped"]
        assert r["time_client"] == 0 and "train_loss" not in r
        # states[i] is the model after round i + 1 (rounds are numbered from 1)
        before = states[r["round"] - 2] if r["round"] > 1 else None
        if before is not None:
            assert all(torch.equal(before[k], states[r["round"] - 1][k]) for k in before)
    assert all(r["participants"] >= need for r in played)
    assert result.summary["rounds_skipped"] == len(skipped)
    assert result.summary["rounds_completed"] == 12


@pytest.mark.slow
def test_cli_warns_about_skipped_rounds(tmp_path):
    out = tmp_path / "run"
    done = fedkernels("run", *FAST, "--algorithm", "bulyan", "--bulyan.num_malicious", "1",
                      "--data.name", "gaussian_mixture", "--data.num_samples", "240",
                      "--partition.num_clients", "8", "--participation.kind", "bernoulli",
                      "--participation.fraction", "0.75", "--rounds", "8", "--out", str(out))
    assert_success(done)
    results = json.loads((out / "results.json").read_text())
    n = results["summary"]["rounds_skipped"]  # most rounds draw fewer than 7 of 8
    assert 0 < n < 8
    assert f"warning: {n} of 8 rounds were skipped" in done.stderr


def test_vmap_records_whether_it_was_used():
    # --vmap asks the shared trainer to batch a round's clients; a strategy that trains its
    # own clients (SuPerFed's mixed local models) never reaches it, and results.json says so
    used = Simulation(tiny_config(vmap=True), build_strategy("fedavg")).run()
    assert used.summary["vmap_rounds"] == 2 and all(r["vmap"] for r in used.rounds)
    unused = Simulation(tiny_config(vmap=True), build_strategy("superfed-mm")).run()
    assert unused.summary["vmap_rounds"] == 0 and not any(r["vmap"] for r in unused.rounds)
    plain = Simulation(tiny_config(), build_strategy("fedavg")).run()
    assert "vmap_rounds" not in plain.summary and "vmap" not in plain.rounds[0]


def test_resume_across_skipped_rounds_equals_uninterrupted(tmp_path):
    # Bulyan under Bernoulli participation skips some rounds; a run checkpointed midway and
    # resumed ends bitwise where the uninterrupted run does, with the same skipped rounds.
    def build(rounds):
        return tiny_config(rounds=rounds, checkpoint_every=1, partition={"num_clients": 8},
                           participation={"kind": "bernoulli", "fraction": 0.75})

    straight = Simulation(build(8), build_strategy("bulyan", {"num_malicious": 1}))
    whole = straight.run()
    path = tmp_path / "ckpt.pt"
    Simulation(build(4), build_strategy("bulyan", {"num_malicious": 1}), checkpoint=path).run()
    resumed = Simulation(build(8), build_strategy("bulyan", {"num_malicious": 1}),
                         checkpoint=path)
    again = resumed.run(resume=True)
    assert 0 < whole.summary["rounds_skipped"] < 8
    assert [r.get("skipped") for r in again.rounds] == [r.get("skipped") for r in whole.rounds]
    for key, value in straight.server.state.items():
        assert torch.equal(resumed.server.state[key], value), key


_TINY_FLAGS = ["--data.name", "gaussian_mixture", "--data.num_samples", "240",
               "--data.num_features", "6", "--data.num_classes", "3", "--partition.num_clients",
               "4", "--model.hidden", "4", "--threads", "1", "--no-progress", "--no-plots"]


def test_cli_prints_the_personalized_accuracy_of_a_personalized_method(tmp_path, capsys):
    # 'local' never trains its global model: the global line alone would report a random one
    from fedkernels.cli import main

    out = tmp_path / "run"
    assert main(["run", *_TINY_FLAGS, "--algorithm", "local", "--rounds", "2",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert lines[0].startswith("test accuracy ")
    assert lines[1] == ("personalized accuracy (each client's own model) mean "
                        f"{summary['personalized_accuracy']:.4f} worst-10% "
                        f"{summary['personalized_accuracy_worst10']:.4f}")
    assert main(["run", *_TINY_FLAGS, "--rounds", "1", "--out", str(tmp_path / "avg")]) == 0
    assert "personalized" not in capsys.readouterr().out


def test_cli_warns_when_no_client_ever_trained(tmp_path, capsys):
    from fedkernels.cli import main

    flags = [*_TINY_FLAGS, "--participation.kind", "bernoulli", "--participation.fraction",
             "0.001", "--rounds", "2"]
    assert main(["run", *flags, "--out", str(tmp_path / "run")]) == 0
    rounds = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"]
    assert [r["participants"] for r in rounds] == [0, 0]
    assert "warning: no round had a client to train" in capsys.readouterr().err
    assert main(["run", *_TINY_FLAGS, "--rounds", "1", "--out", str(tmp_path / "full")]) == 0
    assert "no round had a client" not in capsys.readouterr().err
