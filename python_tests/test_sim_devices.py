"""Choosing the simulator's device (``device`` / ``--device``), the settings of a GPU run, and
what a run reports about its device. The machine's GPU is hidden by monkeypatching
``torch.cuda.is_available`` where a test needs none, so these run unchanged on a GPU machine."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from cli_process import fedkernels
from sim_device_cases import CASES, simulation

from fedkernels.cli import main
from fedkernels.ops import native
from fedkernels.sim import ConfigError, ExperimentConfig, from_dict
from fedkernels.sim.client import batch_indices
from fedkernels.sim.devices import (
    DeviceWarning,
    device_name,
    format_bytes,
    peak_memory_bytes,
    reproducible_numerics,
    resolve_device,
)
from fedkernels.sim.progress import round_progress

FAST = ["--data.name", "gaussian_mixture", "--data.num_samples", "200",
        "--partition.num_clients", "3", "--model.name", "logreg", "--rounds", "1",
        "--no-progress", "--no-plots"]
NO_GPU = "device=cuda: no CUDA device is visible (torch.cuda.is_available() is False)"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu_without_kernels(monkeypatch):
    """A machine with one GPU on which fedkernels was built without its CUDA kernels."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(native, "cuda_available", False)


# ---------------------------------------------------------------- the device field


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", "auto"])
def test_device_names_are_accepted_on_any_machine(name):
    assert ExperimentConfig(device=name).device == name
    assert from_dict(ExperimentConfig, {"device": name}).device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:-1", "mps", "", 0])
def test_other_device_names_are_refused(name):
    with pytest.raises(ConfigError, match="device must be cpu, cuda, cuda:N or auto"):
        ExperimentConfig(device=name)


def test_the_cpu_is_the_default():
    assert ExperimentConfig().device == "cpu"
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_a_gpu_is_refused_in_one_sentence(no_gpu):
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError) as err:
            resolve_device(name)
        message = str(err.value)
        assert message.startswith(f"device={name}: no CUDA device is visible")
        assert "\n" not in message and "device=auto" in message


def test_a_missing_gpu_index_and_missing_kernels_are_named(one_gpu_without_kernels, monkeypatch):
    with pytest.raises(ConfigError, match=r"device=cuda:1: 1 CUDA device is visible \(cuda:0\)"):
        resolve_device("cuda:1")
    with pytest.raises(ConfigError, match="built without its CUDA kernels"):
        resolve_device("cuda")
    monkeypatch.setattr(native, "cuda_available", True)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)


def test_auto_without_a_gpu_falls_back_to_the_cpu_and_says_so(no_gpu):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_device("auto") == torch.device("cpu")
    assert [str(w.message) for w in caught if w.category is DeviceWarning] == [
        "device=auto runs on the CPU: no CUDA device is visible (torch.cuda.is_available() "
        "is False)"]


def test_a_simulation_on_cuda_without_a_gpu_stops_before_loading_data(no_gpu, monkeypatch):
    import fedkernels.sim.run as run

    monkeypatch.setattr(run, "load_dataset", lambda *a, **k: pytest.fail("data was loaded"))
    with pytest.raises(ConfigError, match=NO_GPU.replace("(", r"\(").replace(")", r"\)")):
        simulation(CASES["fedavg"], device="cuda")


# ---------------------------------------------------------------- the command line


def test_run_device_cuda_without_a_gpu_is_one_line_exit_2(no_gpu, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"fedkernels run: error: {NO_GPU}; use device=cpu, or "
                                "device=auto to take a GPU only where there is one"]
    assert not out.exists()  # refused before anything was written


def test_run_device_auto_without_a_gpu_runs_on_the_cpu_saying_so_once(no_gpu, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *FAST, "--device", "auto", "--out", str(out)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "device=auto" in line]
    assert notes == ["fedkernels run: warning: device=auto runs on the CPU: no CUDA device is "
                     "visible (torch.cuda.is_available() is False)"]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["device"] == "auto" and results["summary"]["device"] == "cpu"


@pytest.mark.slow
def test_run_device_cuda_with_no_visible_gpu_in_a_child_process(tmp_path):
    """The installed command, with every GPU hidden from it (CUDA_VISIBLE_DEVICES='')."""
    done = fedkernels("run", *FAST, "--device", "cuda", "--out", str(tmp_path / "run"),
                      CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"fedkernels run: error: {NO_GPU}; use device=cpu, or device=auto to take a GPU only "
        "where there is one"]


# ---------------------------------------------------------------- a run's device


def test_results_record_the_device_its_memory_and_each_rounds_time():
    result = simulation(CASES["fedavg"]).run()
    summary = result.summary
    assert summary["device"] == "cpu" and summary["device_name"] == device_name(
        torch.device("cpu"))
    assert summary["peak_memory_bytes"] >= 10 * 2**20  # the process: interpreter and torch
    assert all(r["wall_time_s"] > 0 for r in result.rounds)
    assert all(r["wall_time_s"] >= r["time_client"] + r["time_aggregate"] for r in result.rounds)


def test_clients_samples_move_to_the_device_once_and_indices_follow():
    sim = simulation(CASES["fedavg"])
    fed = sim.federation.to(torch.device("meta"))
    for c in fed.clients:
        assert {t.device.type for t in (c.train_x, c.train_y, c.test_x, c.test_y)} == {"meta"}
        assert isinstance(c.train_index, np.ndarray)
    assert sim.federation.clients[0].train_x.device.type == "cpu"  # a copy: the run's stay
    plan = [np.array([3, 1]), np.array([0]), np.array([2, 4, 5])]
    pieces = batch_indices(plan, torch.device("meta"))
    assert [p.device.type for p in pieces] == ["meta"] * 3
    assert [tuple(p.shape) for p in pieces] == [(2,), (1,), (3,)]
    assert [p.tolist() for p in batch_indices(plan, torch.device("cpu"))] == [
        r.tolist() for r in plan]


def test_a_user_model_is_copied_to_the_device_not_moved():
    model = torch.nn.Linear(12, 3)
    case = CASES["fedavg"]
    sim = simulation(case, model=model)
    assert sim.server.state["weight"] is not model.weight
    assert torch.equal(sim.server.state["weight"], model.weight.detach())


def test_gpu_settings_apply_within_the_block_and_are_restored():
    """What a CUDA run sets (the flags exist in CPU builds of torch too); the CPU changes
    nothing."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    has_precision = hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv")

    def flags():
        precision = ((matmul.fp32_precision, cudnn.conv.fp32_precision) if has_precision
                     else (matmul.allow_tf32, cudnn.allow_tf32))
        return cudnn.deterministic, cudnn.benchmark, precision

    before = flags()
    with reproducible_numerics(torch.device("cpu")):
        assert flags() == before
    cudnn.benchmark = True
    try:
        with reproducible_numerics(torch.device("cuda", 0)):
            deterministic, benchmark, precision = flags()
            assert deterministic and not benchmark
            assert precision == (("ieee", "ieee") if has_precision else (False, False))
        assert flags() == (before[0], True, before[2])
    finally:
        cudnn.benchmark = before[1]


def test_memory_sizes_read_well():
    assert format_bytes(300 * 2**20) == "300 MiB"
    assert format_bytes(3 * 2**30 // 2) == "1.50 GiB"
    assert peak_memory_bytes(torch.device("cpu")) > 0


def test_progress_bar_shows_rate_time_left_accuracy_and_memory(capsys):
    sim = simulation(CASES["fedavg"], rounds=3)
    with round_progress(sim) as report:
        sim.run(on_round=report)
    err = capsys.readouterr().err
    assert "3/3" in err and ("round/s" in err or "s/round" in err)
    assert "acc=" in err and ("MiB" in err or "GiB" in err) and "mem=" in err
    with round_progress(sim, enabled=False) as report:
        report({"round": 0})
    assert capsys.readouterr().err == ""
