"""Participation samplers and the participation history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkernels.sim.config import ConfigError, ParticipationConfig, PartitionConfig
from fedkernels.sim.data import load_digits
from fedkernels.sim.federation import build_federation
from fedkernels.sim.participation import (
    BernoulliParticipation,
    CyclicParticipation,
    MarkovParticipation,
    ParticipationHistory,
    UniformParticipation,
    build_sampler,
    client_probabilities,
)


@pytest.fixture(scope="module")
def federation():
    return build_federation(
        load_digits(), PartitionConfig(kind="dirichlet", num_clients=20, alpha=0.3), 0.2, 0
    )


def frequencies(sampler, rounds):
    return np.mean([sampler.sample() for _ in range(rounds)], axis=0)


def test_full_and_uniform(federation):
    full = build_sampler(ParticipationConfig(kind="full"), federation, 0)
    assert full.sample().all()
    uniform = build_sampler(ParticipationConfig(kind="uniform", fraction=0.25), federation, 0)
    masks = np.array([uniform.sample() for _ in range(400)])
    assert (masks.sum(axis=1) == 5).all()
    assert np.abs(masks.mean(axis=0) - 0.25).max() < 0.08  # every client equally likely


P = np.array([0.05, 0.2, 0.5, 0.9, 1.0, 0.0])


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: BernoulliParticipation(len(P), rng, P),
        lambda rng: MarkovParticipation(len(P), rng, P, delta=0.05),
        lambda rng: MarkovParticipation(len(P), rng, P, delta=0.9),  # saturated branch
    ],
    ids=["bernoulli", "markov", "markov-saturated"],
)
def test_stationary_frequency_is_p(make):
    freq = frequencies(make(np.random.default_rng(0)), 20000)
    np.testing.assert_allclose(freq, P, atol=0.03)


def test_markov_is_persistent():
    sampler = MarkovParticipation(1, np.random.default_rng(1), np.array([0.5]), delta=0.05)
    states = np.array([sampler.sample()[0] for _ in range(5000)])
    switches = np.count_nonzero(states[1:] != states[:-1])
    assert switches < 0.1 * len(states)  # Bernoulli(0.5) would switch half the time


def test_cyclic_follows_the_fedau_rule():
    p = np.array([0.1, 0.25, 0.0])
    sampler = CyclicParticipation(3, np.random.default_rng(0), p, cycle_length=20)
    states = np.array([sampler.sample() for _ in range(200)])
    # Active runs of round(C p) rounds (at least 1), inactive runs of C minus that.
    for n, active in enumerate([2, 5, 1]):
        runs = np.diff(np.flatnonzero(np.diff(states[:, n].astype(int)) != 0))
        assert set(runs[0::2]) | set(runs[1::2]) == {active, 20 - active}
    np.testing.assert_allclose(states.mean(axis=0), [0.1, 0.25, 0.05], atol=0.02)


def test_label_correlated_probabilities(federation):
    cfg = ParticipationConfig(kind="bernoulli", fraction=0.1, probability_model="label_correlated")
    p = client_probabilities(cfg, federation, seed=0)
    assert p.shape == (20,) and p.min() >= 0.02 and p.max() <= 1.0
    assert len(np.unique(p.round(6))) > 3  # heterogeneous
    explicit = ParticipationConfig(kind="bernoulli", probabilities=[0.5] * 20)
    assert (client_probabilities(explicit, federation, 0) == 0.5).all()
    with pytest.raises(ConfigError, match="19 values for 20 clients"):
        client_probabilities(
            ParticipationConfig(kind="bernoulli", probabilities=[0.5] * 19), federation, 0
        )


@pytest.mark.parametrize("kind", ["uniform", "bernoulli", "markov", "cyclic"])
def test_sampler_state_round_trip(federation, kind):
    cfg = ParticipationConfig(kind=kind, fraction=0.3, cycle_length=6)
    a = build_sampler(cfg, federation, seed=9)
    for _ in range(7):
        a.sample()
    state = a.state_dict()
    expected = [a.sample() for _ in range(10)]
    b = build_sampler(cfg, federation, seed=9)
    b.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(expected, [b.sample() for _ in range(10)]))


def test_history():
    history = ParticipationHistory(3)
    assert history.matrix.shape == (0, 3)
    history.record(torch.tensor([True, False, True]))
    history.record(torch.tensor([False, False, True]))
    assert history.num_rounds == 2 and history.counts().tolist() == [1, 0, 2]
    restored = ParticipationHistory(3)
    restored.load_state_dict(history.state_dict())
    assert torch.equal(restored.matrix, history.matrix)
    with pytest.raises(ValueError, match="bool of shape"):
        history.record(torch.tensor([1, 0, 1]))


def test_uniform_samples_at_least_one():
    assert UniformParticipation(30, np.random.default_rng(0), 0.001).sample().sum() == 1
