"""Central DP in the simulator (``--dp.*``) and its privacy accounting through dp-accounting."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from fedkernels.algorithms.registry import build_strategy
from fedkernels.cli import main
from fedkernels.privacy import epsilon, epsilon_from_rates
from fedkernels.sim.central_dp import CentralPrivacy, sampling_rate
from fedkernels.sim.config import ConfigError, ExperimentConfig, PrivacyConfig, from_dict
from fedkernels.sim.run import Simulation

dp_accounting = pytest.importorskip("dp_accounting")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


# ----------------------------------------------------------------- accounting


def test_rdp_matches_the_library_on_a_subsampled_gaussian():
    sigma, q, rounds, delta = 1.1, 0.01, 1000, 1e-5
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds
    )
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(event)
    assert epsilon(sigma, q, rounds, delta) == pytest.approx(accountant.get_epsilon(delta))


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of one Gaussian mechanism of sensitivity 1 (Balle and Wang 2018):
    delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma)."""
    def gap(eps):
        return (norm.cdf(0.5 / sigma - eps * sigma)
                - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma) - delta)
    return brentq(gap, 0.0, 500.0)


def test_pld_matches_the_analytic_gaussian_without_sampling():
    # T rounds of sigma with q = 1 are one Gaussian mechanism of noise sigma / sqrt(T)
    sigma, rounds, delta = 2.0, 16, 1e-5
    expected = gaussian_epsilon(sigma / math.sqrt(rounds), delta)
    got = epsilon(sigma, 1.0, rounds, delta, accountant="pld")
    assert got == pytest.approx(expected, rel=0.01)
    # RDP is an upper bound on the same thing
    assert epsilon(sigma, 1.0, rounds, delta) >= got


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    by_rounds = [epsilon(1.0, 0.1, t, 1e-5) for t in (1, 10, 100)]
    assert by_rounds[0] < by_rounds[1] < by_rounds[2]
    by_sigma = [epsilon(s, 0.1, 50, 1e-5) for s in (0.7, 1.0, 2.0, 4.0)]
    assert by_sigma == sorted(by_sigma, reverse=True) and len(set(by_sigma)) == 4
    assert epsilon(1.0, 0.1, 50, 1e-3) < epsilon(1.0, 0.1, 50, 1e-6)
    assert epsilon(1.0, 0.05, 50, 1e-5) < epsilon(1.0, 0.2, 50, 1e-5)
    assert epsilon(1.0, 0.1, 0, 1e-5) == 0.0


def test_rounds_with_different_rates_compose():
    mixed = epsilon_from_rates(1.0, [0.1, 0.2, 0.1, 0.0, 0.2], 1e-5)
    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), 2
        )
        for q in (0.1, 0.2)
    ]
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    assert mixed == pytest.approx(accountant.get_epsilon(1e-5))
    assert epsilon_from_rates(1.0, [0.1, 0.1], 1e-5) == pytest.approx(epsilon(1.0, 0.1, 2, 1e-5))


@pytest.mark.parametrize("args, message", [
    ((0.0, 0.1, 5, 1e-5), "noise_multiplier must be a finite number > 0"),
    ((1.0, 1.5, 5, 1e-5), "sampling rate of round 0 must be in"),
    ((1.0, 0.1, 5, 0.0), r"delta must be in \(0, 1\)"),
    ((1.0, 0.1, -1, 1e-5), "rounds must be >= 0"),
])
def test_bad_accounting_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        epsilon(*args)


def test_rates_as_an_iterator_are_counted():
    # The rates were checked in one pass and counted in another: an iterator counted no round
    # and gave epsilon 0, a privacy guarantee that did not hold.
    rates = [0.1, 0.2, 0.1]
    assert epsilon_from_rates(1.0, iter(rates), 1e-5) == epsilon_from_rates(1.0, rates, 1e-5)
    assert epsilon_from_rates(1.0, (q for q in rates), 1e-5) > 0


def test_many_rounds_take_no_memory_per_round():
    # epsilon() listed one rate per round: 10**12 rounds asked for terabytes.
    many = epsilon(1.0, 0.01, 10**12, 1e-5)
    assert math.isfinite(many) and many > epsilon(1.0, 0.01, 10**6, 1e-5)
    assert epsilon(1.0, 0.1, 7, 1e-5) == epsilon_from_rates(1.0, [0.1] * 7, 1e-5)
    with pytest.raises(TypeError, match="rounds must be an int"):
        epsilon(1.0, 0.1, 2.5, 1e-5)
    with pytest.raises(ValueError, match="accountant must be"):  # also with nothing to account
        epsilon(1.0, 0.1, 0, 1e-5, accountant="rpd")


def test_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ModuleNotFoundError, match=r"fedkernels\[dp\]"):
        epsilon(1.0, 0.1, 5, 1e-5)
    with pytest.raises(ConfigError, match=r"pip install 'fedkernels\[dp\]'"):
        CentralPrivacy(PrivacyConfig(clip=1.0, noise_multiplier=1.0), 10, seed=0)
    CentralPrivacy(PrivacyConfig(clip=1.0), 10, seed=0)  # no noise, no accountant needed


# ----------------------------------------------------------------- the mechanism


def params(values):
    return {"w": torch.tensor(values, dtype=torch.float64)}


def test_clipped_equal_weight_mean_by_hand():
    dp = CentralPrivacy(PrivacyConfig(clip=1.0), num_clients=4, seed=0)
    base = params([0.0, 0.0])
    clients = [params([3.0, 4.0]), params([0.3, 0.4])]  # norms 5 (clipped to 1) and 0.5
    averaged = dp.average(base, clients, round_index=0)
    torch.testing.assert_close(averaged["w"], torch.tensor([0.45, 0.6], dtype=torch.float64))
    record = dp.take_round_record(2)
    assert record["dp_clipped_fraction"] == 0.5 and record["dp_noise_std"] == 0.0
    assert record["dp_epsilon"] is None
    assert dp.sampling_rates == [0.5]


def test_noise_has_the_promised_spread_and_is_seeded():
    dp = CentralPrivacy(PrivacyConfig(clip=2.0, noise_multiplier=3.0), num_clients=10, seed=0)
    base = {"w": torch.zeros(200_000, dtype=torch.float64)}
    clients = [dict(base) for _ in range(5)]
    first = dp.average(base, clients, round_index=7)["w"]
    assert float(first.std()) == pytest.approx(3.0 * 2.0 / 5, rel=0.01)
    assert abs(float(first.mean())) < 0.01
    again = CentralPrivacy(dp.config, 10, seed=0).average(base, clients, round_index=7)["w"]
    assert torch.equal(first, again)
    other = CentralPrivacy(dp.config, 10, seed=0).average(base, clients, round_index=8)["w"]
    assert not torch.equal(first, other)


def test_adaptive_clip_moves_towards_the_target_quantile():
    config = PrivacyConfig(adaptive=True)  # no noise: the count is exact
    dp = CentralPrivacy(config, num_clients=4, seed=0)
    assert dp.clip == 0.1  # Flower's initial clipping norm
    base = params([0.0])
    big = [params([1.0]) for _ in range(4)]  # all clipped: the bound must grow
    dp.average(base, big, 0)
    assert dp.clip == pytest.approx(0.1 * math.exp(0.2 * 0.5))
    dp.clip = 10.0
    dp.average(base, big, 1)  # none clipped: it must shrink
    assert dp.clip == pytest.approx(10.0 * math.exp(-0.2 * 0.5))
    for t in range(2, 200):
        dp.average(base, [params([v]) for v in (0.5, 1.0, 2.0, 4.0)], t)
    assert 1.0 <= dp.clip <= 2.0  # between the middle two norms


def test_adaptive_noise_budget_is_checked():
    dp = CentralPrivacy(PrivacyConfig(adaptive=True, noise_multiplier=1.0), 20, seed=0)
    model_sigma, count_std = dp.noise_levels(20)
    assert count_std == 1.0
    assert model_sigma == pytest.approx((1.0 - 0.25) ** -0.5)
    with pytest.raises(ConfigError, match="dp.clipped_count_stddev > 0.5"):
        dp.noise_levels(10)  # K/20 = 0.5 is too little count noise for sigma = 1


# ----------------------------------------------------------------- runs


def dp_config(rounds=3, participation=None, **dp):
    return from_dict(ExperimentConfig, {
        "rounds": rounds, "partition": {"num_clients": 10}, "model": {"hidden": [8]},
        "client": {"steps": 2}, "participation": participation or {"kind": "full"}, "dp": dp,
    })


def test_run_reports_epsilon_every_round_and_at_the_end():
    config = dp_config(
        rounds=4, participation={"kind": "uniform", "fraction": 0.3},
        clip=0.5, noise_multiplier=1.5,
    )
    result = Simulation(config, build_strategy("fedavg")).run()
    rates = [r["participants"] / 10 for r in result.rounds]
    per_round = [r["dp_epsilon"] for r in result.rounds]
    assert per_round == sorted(per_round) and len(set(per_round)) == 4
    assert per_round[-1] == pytest.approx(epsilon_from_rates(1.5, rates, 0.1))
    assert result.summary["dp_epsilon"] == per_round[-1]
    assert result.summary["dp_delta"] == 0.1  # 1/N
    assert all(r["dp_clip"] == 0.5 for r in result.rounds)


def test_sampling_rate_per_participation_pattern():
    assert sampling_rate("full", None) == 1.0
    assert sampling_rate("uniform", None) is None  # the round's K / N
    assert sampling_rate("bernoulli", [0.1, 0.3, 0.2]) == 0.3  # the worst-off client
    assert sampling_rate("markov", [0.1, 0.1]) == 1.0  # not independent draws: no amplification
    assert sampling_rate("cyclic", [0.1, 0.1]) == 1.0
    config = dp_config(participation={"kind": "bernoulli", "fraction": 0.2},
                       clip=1.0, noise_multiplier=2.0)
    assert Simulation(config, build_strategy("fedavg")).server.private.rate == 0.2


def test_a_round_without_participants_still_counts_for_poisson_sampling():
    dp = CentralPrivacy(PrivacyConfig(clip=1.0, noise_multiplier=2.0), 10, seed=0, rate=0.2)
    record = dp.take_round_record(0)
    assert dp.sampling_rates == [0.2]
    assert record == {"dp_epsilon": pytest.approx(epsilon(2.0, 0.2, 1, 0.1))}


def test_clipping_without_noise_bounds_the_step():
    config = dp_config(rounds=1, clip=1e-3)
    simulation = Simulation(config, build_strategy("fedavg"))
    before = {n: t.clone() for n, t in simulation.server.state.items()}
    simulation.run()
    step = torch.cat([(simulation.server.state[n] - before[n]).flatten() for n in before])
    assert float(step.norm()) <= 1e-3 * (1 + 1e-6)


def test_dp_resume_equals_uninterrupted(tmp_path):
    config = dp_config(rounds=4, adaptive=True, noise_multiplier=0.5)
    straight = Simulation(config, build_strategy("fedavg")).run()
    path = tmp_path / "checkpoint.pt"
    first = Simulation(dp_config(rounds=2, adaptive=True, noise_multiplier=0.5),
                       build_strategy("fedavg"), checkpoint=path)
    first.run()
    resumed = Simulation(config, build_strategy("fedavg"), checkpoint=path).run(resume=True)
    for a, b in zip(straight.rounds, resumed.rounds):
        for key in ("dp_clip", "dp_epsilon", "test_accuracy", "test_loss"):
            assert a[key] == b[key], key


def test_cli_fixed_clipping_command(tmp_path, capsys):
    out = tmp_path / "run"
    code = main([
        "run", "--algorithm", "fedavg", "--dp.noise_multiplier", "1.0", "--dp.clip", "0.5",
        "--rounds", "2", "--partition.num_clients", "10", "--model.name", "logreg",
        "--out", str(out), "--no-progress", "--no-plots",
    ])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["dp_epsilon"] == pytest.approx(epsilon(1.0, 1.0, 2, 0.1))
    assert [r["dp_noise_std"] for r in results["rounds"]] == [0.05, 0.05]  # sigma C / K


@pytest.mark.parametrize("flags, message", [
    (["--dp.noise_multiplier", "1.0"], "dp.noise_multiplier needs dp.clip"),
    (["--dp.clip", "0"], "dp.clip must be > 0"),
    (["--dp.clip", "1", "--dp.delta", "1"], "dp.delta must be in (0, 1)"),
    (["--dp.clip", "1", "--dp.accountant", "moments"], "dp.accountant: 'moments' is not one"),
])
def test_cli_errors(tmp_path, capsys, flags, message):
    assert main(["run", *flags, "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_every_noised_release_is_accounted():
    from fedkernels.algorithms.fedavg import FedAvg

    class TwoSteps(FedAvg):
        name = "two-steps-test"

        def aggregate(self, info, server):
            super().aggregate(info, server)
            return super().aggregate(info, server)

    config = dp_config(rounds=2, clip=1.0, noise_multiplier=2.0)
    result = Simulation(config, TwoSteps()).run()
    assert result.summary["dp_releases"] == 4
    assert result.summary["dp_epsilon"] == pytest.approx(epsilon(2.0, 1.0, 4, 0.1))


def test_strategies_that_bypass_the_weighted_mean_are_refused():
    from fedkernels.algorithms.fedavg import FedAvg

    class OwnAverage(FedAvg):
        name = "own-average-test"

        def aggregate(self, info, server):
            return {}

    with pytest.raises(ConfigError, match="no noise was added"):
        Simulation(dp_config(rounds=1, clip=1.0), OwnAverage()).run()


def test_adaptive_step_direction_against_flower():
    """Documents the departure in docs/algorithms/robust_and_private.md: with every update clipped, the
    paper's rule (ours) raises C; Flower's server-side class lowers it by the same factor."""
    pytest.importorskip("flwr")
    from unittest.mock import MagicMock

    import numpy as np
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg

    flower = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), noise_multiplier=0.0, num_sampled_clients=4
    )
    flower.current_round_params = [np.zeros(3)]
    replies = [
        (MagicMock(), FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.ones(3)]), 10, {}))
        for _ in range(4)
    ]
    flower.aggregate_fit(1, replies, [])
    ours = CentralPrivacy(PrivacyConfig(adaptive=True), num_clients=4, seed=0)
    ours.average(params([0.0, 0.0, 0.0]), [params([1.0, 1.0, 1.0])] * 4, 0)
    assert flower.clipping_norm == pytest.approx(0.1 * math.exp(-0.1))
    assert ours.clip == pytest.approx(0.1 * math.exp(0.1))
