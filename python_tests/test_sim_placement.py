"""Where the simulator puts tensors, for every family of algorithms: the models and samples a
strategy receives and returns are on the run's device, the per-client scalars of a round and
the client weights on the CPU, and every fedkernels op a run calls runs its kernel on the
run's device. On the CPU these runs also check that no tensor depends on torch's default
device: under ``torch.device("meta")`` (standing in for a GPU as the default, as
test_default_device.py does for the public APIs) a tensor the simulator made without saying
where would hold no values and fail the run. The ``cuda`` entries run unchanged on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from sim_device_cases import (
    CASES,
    FedkernelsOpCounter,
    PlacementProbe,
    final_state,
    misplaced,
    simulation,
)

import fedkernels as fk
from fedkernels.sim.devices import resolve_device

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_strategies_see_models_on_the_device_and_scalars_on_the_host(name, device):
    case = CASES[name]
    sim = simulation(case, device)
    probe = PlacementProbe(sim.strategy, sim.device)
    with FedkernelsOpCounter() as ops:
        result = sim.run()
    assert probe.calls["aggregate"] == 2 and probe.calls["evaluate"] >= 2
    assert probe.problems == []
    assert ops.devices() == {sim.device.type}, ops.calls  # no kernel ran elsewhere
    missing = [op for op in case.ops if not any(n.startswith(op) for n in ops.names())]
    assert not missing, f"{name} did not call {missing} (it called {sorted(ops.names())})"
    assert result.summary["device"] == str(resolve_device(device))
    assert not result.summary.get("non_finite")


@pytest.mark.parametrize("name", list(CASES))
def test_no_tensor_depends_on_the_default_device(name):
    case = CASES[name]
    expected = simulation(case)
    expected_result = expected.run()
    with torch.device("meta"):
        sim = simulation(case)
        result = sim.run()
    state, want = final_state(sim), final_state(expected)
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert result.summary["test_accuracy"] == expected_result.summary["test_accuracy"]


def test_the_probe_and_the_counter_see_what_they_check():
    """The checks above can fail: a misplaced tensor is named, an op's device is counted."""
    meta = torch.zeros(2, device="meta")
    assert misplaced({"a": [torch.zeros(1), meta]}, torch.device("cpu"), "x") == [
        "x.a[1] on meta"]
    models = [{"w": torch.ones(3)}, {"w": torch.zeros(3)}]
    with FedkernelsOpCounter() as ops:
        fk.aggregate(models, [1.0, 3.0])
        fk.aggregate([{"w": t["w"].to("meta")} for t in models], [1.0, 3.0])
    assert ops.calls[("weighted_sum", "cpu")] == 1 and ops.calls[("weighted_sum", "meta")] == 1
