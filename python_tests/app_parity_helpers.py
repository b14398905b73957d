"""Shared by the tests of fedkernels.apps (python_tests/test_apps_*.py): the seed methods'
small configurations, the in-process reference runs (``fedkernels run``'s Simulation, also with
given clients' replies lost) and the comparison of two results."""

from __future__ import annotations

import json
from typing import Any

# Small runs of the seed methods, in the run config's spelling (digits, a 16-unit MLP).
BASE = {"partition.num_clients": 3, "rounds": 2, "model.hidden": "16"}
SEED_METHODS = {
    "superfed-mm": {"algorithm": "superfed-mm", "rounds": 3, "superfed-mm.start_fraction": 0.34},
    "superfed-lm": {"algorithm": "superfed-lm", "rounds": 3, "superfed-lm.start_fraction": 0.34,
                    "superfed-lm.local_init": "copy_global"},
    "aaggff-s": {"algorithm": "aaggff-s"},
    "aaggff-d": {"algorithm": "aaggff-d", "partition.num_clients": 5, "rounds": 3,
                 "participation.kind": "uniform", "participation.fraction": 0.6},
    "fedau": {"algorithm": "fedau", "partition.num_clients": 5, "rounds": 4,
              "participation.kind": "bernoulli", "participation.fraction": 0.5},
    "fedgo": {"algorithm": "fedgo", "data.server_fraction": 0.3, "fedgo.disc_epochs": 1,
              "fedgo.server_epochs": 1},
    "fedgo-gan": {"algorithm": "fedgo", "data.server_fraction": 0.3, "fedgo.disc_epochs": 1,
                  "fedgo.server_epochs": 1, "fedgo.generator": "gan", "fedgo.gan_steps": 10},
    "fedevg": {"algorithm": "fedevg", "fedevg.spc": 3},
}

# What differs between two runs of the same experiment: times and the process's memory.
VOLATILE = ("wall_time_s", "peak_memory_bytes")


def run_config(name: str, **extra: Any) -> dict[str, Any]:
    return {**BASE, **SEED_METHODS[name], **extra}


def comparable(result) -> dict[str, Any]:
    """A result's rounds and summary without the times, through JSON (as results.json)."""
    data = result.to_dict() if hasattr(result, "to_dict") else result

    def strip(d):
        return {k: v for k, v in d.items() if not k.startswith("time") and k not in VOLATILE}

    return json.loads(json.dumps({"rounds": [strip(r) for r in data["rounds"]],
                                  "summary": strip(data["summary"]),
                                  "clients": data["clients"]}))


def assert_same_metrics(got, want) -> None:
    """Equal, value for value (bitwise: floats compare exactly), naming the first difference."""
    a, b = comparable(got), comparable(want)
    for t, (x, y) in enumerate(zip(a["rounds"], b["rounds"])):
        for key in sorted(set(x) | set(y)):
            assert x.get(key) == y.get(key), f"round {t} {key}: {x.get(key)!r} vs {y.get(key)!r}"
    assert len(a["rounds"]) == len(b["rounds"])
    for key in sorted(set(a["summary"]) | set(b["summary"])):
        assert a["summary"].get(key) == b["summary"].get(key), (
            f"summary {key}: {a['summary'].get(key)!r} vs {b['summary'].get(key)!r}")
    assert a["clients"] == b["clients"]


def simulate(run_config: dict[str, Any], lost: dict[int, set[int]] | None = None):
    """``fedkernels run``'s result for the run config, played by Simulation in this process;
    ``lost`` maps a round (0-based) to clients whose replies never reach the server in it
    (they are not trained there: for a client that keeps nothing between rounds, the same as
    training it and dropping the update, for its random streams are its own)."""
    from fedkernels.algorithms import build_strategy
    from fedkernels.apps.flower import app_settings
    from fedkernels.sim.run import Simulation

    config = app_settings(run_config).experiment
    sim = Simulation(config, build_strategy(config.algorithm, config.algorithm_params))
    if not lost:
        return sim.run()
    for t in range(config.rounds):
        plan = sim.open_round(t)
        ids = [k for k in plan.participants if k not in lost.get(t, set())]
        clients = [sim.federation.clients[k] for k in ids]
        updates, losses = [], None
        if ids:
            if sim.strategy.wants_global_loss:
                losses = sim.global_losses(plan.global_state, clients)
            updates, _ = sim._train(plan.global_state, clients, t, ids)
        sim.close_round(plan, ids, updates, losses)
        sim.records.append(sim.finish_round(plan))
        sim.next_round = t + 1
    return sim.result()
