"""Every fairness and participation strategy in a real (tiny) simulation: it trains, and a run resumed from a
checkpoint ends bitwise equal to an uninterrupted one (strategy state goes through
state_dict/load_state_dict)."""

from __future__ import annotations

import pytest
import torch

from fedkernels.algorithms import build_strategy
from fedkernels.sim import (
    ClientConfig,
    ExperimentConfig,
    ModelConfig,
    ParticipationConfig,
    PartitionConfig,
    Simulation,
)

STRATEGIES = [
    ("qffl", "full"), ("qfedavg", "full"), ("afl", "uniform"), ("term", "full"),
    ("propfair", "full"), ("gifair", "full"), ("delta-fl", "full"), ("fedmgda", "full"),
    ("vred", "full"), ("semi-vred", "full"), ("fedau", "bernoulli"),
    ("avg-participating", "bernoulli"), ("avg-all", "bernoulli"), ("known-p", "bernoulli"),
    ("mifa", "bernoulli"), ("fedvarp", "bernoulli"), ("aaggff-s", "full"),
    ("aaggff-d", "uniform"),
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds, kind, vmap):
    return ExperimentConfig(
        rounds=rounds, eval_every=4, checkpoint_every=1, vmap=vmap,
        partition=PartitionConfig(kind="dirichlet", num_clients=6, alpha=0.5),
        participation=ParticipationConfig(kind=kind, fraction=0.5),
        model=ModelConfig(name="mlp", hidden=[8]), client=ClientConfig(batch_size=32),
    )


@pytest.mark.parametrize("name, kind", STRATEGIES)
def test_resume_equals_uninterrupted(tmp_path, name, kind):
    vmap = name in ("propfair", "fedau")  # the vmap path's loss hook, too
    straight = Simulation(config(4, kind, vmap), build_strategy(name))
    result = straight.run()
    assert all(torch.isfinite(v).all() for v in straight.server.state.values())
    assert 0.0 <= result.summary["test_accuracy"] <= 1.0
    path = tmp_path / "ckpt.pt"
    Simulation(config(2, kind, vmap), build_strategy(name), checkpoint=path).run()
    resumed = Simulation(config(4, kind, vmap), build_strategy(name), checkpoint=path)
    resumed.run(resume=True)
    for key, value in straight.server.state.items():
        assert torch.equal(resumed.server.state[key], value), key
