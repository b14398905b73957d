"""The simulator on a GPU (every test is marked ``cuda`` and skips without one): a GPU run agrees
with the CPU run of the same seed, repeats bitwise, reports its memory, and a checkpoint
resumes on the other device. Where tensors are and which kernels run is
test_sim_placement.py's ``cuda`` entries.

Tolerance of the agreement: both runs start from the same weights (built on the CPU) and draw
the same minibatches, lambdas and distillation orders (drawn on the CPU), and a CUDA run uses
IEEE float32 (no TF32), so they differ only by float32 rounding in a different order of
summation (cuBLAS's and the CUDA kernels' reductions against the CPU's): about 1e-7 relative
per operation. Over a few rounds of a few small SGD steps those differences are carried, not
amplified, so the global models agree to rtol = atol = 1e-4 (a thousand times the rounding,
far below the change one SGD step makes) and the test accuracies to one test sample."""

from __future__ import annotations

import pytest
import torch
from sim_device_cases import CASES, final_state, simulation

pytestmark = pytest.mark.cuda

# cases without draws on the device (dropout, device noise), whose runs must agree
AGREE = ["fedavg", "fedavg-vmap", "fedadam", "superfed-mm", "trimmed-mean", "fedgo", "apfl",
         "cnn-augment-vmap"]
# cases whose device draws come from seeded device generators: a GPU run repeats bitwise
REPEAT = ["fedavg", "superfed-mm", "dp", "fedevg", "cnn-augment-vmap", "fedgo"]
# strategies that keep model-sized state of their own through a checkpoint
RESUME = ["fedadam", "superfed-mm", "apfl", "fedgo", "fedevg"]


class Stop(Exception):
    """Ends a run after its second round (the checkpoint of that round is written)."""


def stop_after_round_two(record):
    if record["round"] == 2:
        raise Stop


@pytest.mark.parametrize("name", AGREE)
def test_gpu_and_cpu_runs_of_one_seed_agree(name):
    case = CASES[name]
    cpu, gpu = simulation(case, "cpu", rounds=3), simulation(case, "cuda", rounds=3)
    cpu_result, gpu_result = cpu.run(), gpu.run()
    want, got = final_state(cpu), final_state(gpu)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4, msg=key)
    tested = sum(c["num_test"] for c in cpu_result.clients)
    assert abs(gpu_result.summary["test_accuracy"]
               - cpu_result.summary["test_accuracy"]) <= 1.0 / tested + 1e-12


@pytest.mark.parametrize("name", REPEAT)
def test_a_gpu_run_repeats_bitwise(name):
    first, second = simulation(CASES[name], "cuda"), simulation(CASES[name], "cuda")
    first.run(), second.run()
    a, b = final_state(first), final_state(second)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("name", RESUME)
@pytest.mark.parametrize("before, after", [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_checkpoint_resumes_on_the_other_device(name, before, after, tmp_path):
    case = CASES[name]
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(Stop):
        simulation(case, before, rounds=3, checkpoint=path).run(on_round=stop_after_round_two)
    resumed = simulation(case, after, rounds=3, checkpoint=path)
    result = resumed.run(resume=True)
    assert [r["round"] for r in result.rounds] == [1, 2, 3]
    assert result.summary["device"].startswith(after)
    assert not result.summary.get("non_finite") and not result.summary.get("diverged")
    state = final_state(resumed)
    assert all(v.device.type == after for v in resumed.server.state.values())
    if name != "fedevg":  # FedEvg's SGLD noise is the device's own stream
        whole = simulation(case, before, rounds=3)
        whole.run()
        want = final_state(whole)
        for key in want:
            torch.testing.assert_close(state[key], want[key], rtol=1e-4, atol=1e-4, msg=key)


def test_a_gpu_run_reports_its_device_and_peak_memory():
    sim = simulation(CASES["fedavg"], "cuda")
    summary = sim.run().summary
    device = torch.device("cuda", torch.cuda.current_device())
    assert summary["device"] == str(device)
    assert summary["device_name"] == torch.cuda.get_device_name(device)
    total = torch.cuda.get_device_properties(device).total_memory
    assert 0 < summary["peak_memory_bytes"] <= total
    # the clients' samples live on the GPU for the whole run, so the peak holds them
    samples = sum(t.numel() * t.element_size() for c in sim.federation.clients
                  for t in (c.train_x, c.train_y, c.test_x, c.test_y))
    assert summary["peak_memory_bytes"] >= samples
