"""Tests of the installation self-check (``fedkernels check`` / ``fedkernels.check()``): it passes
on this build, covers every op of the library, and fails loudly for a broken op, an op without a
check, or bad arguments."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedkernels
from fedkernels import selfcheck
from fedkernels.cli import check as check_cli
from fedkernels.cli import main as cli_main

DTYPE_NAMES = {"float32", "float64", "float16", "bfloat16"}


def _child_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _drop_last_client(updates, weights, base, scale, delta):
    """A broken weighted_sum: forgets the last client."""
    k = weights.numel()
    n = len(updates) // k
    return torch.ops.fedkernels.weighted_sum(updates[: (k - 1) * n], weights[:-1], base, scale,
                                             delta)


def test_every_library_op_has_a_check():
    library = selfcheck.library_ops()
    assert "weighted_sum.out" in library and "sgld_compose_step_" in library
    assert set(library) == set(selfcheck.CHECKS)


def test_check_passes_on_this_build(tmp_path):
    out = io.StringIO()
    path = tmp_path / "report.json"
    report = fedkernels.check(quick=True, json_path=path, file=out)
    text = out.getvalue()
    assert report["ok"], text
    assert "result: PASS" in text
    ops = {r["op"] for r in report["ops"]}
    assert set(selfcheck.library_ops()) <= ops and selfcheck.API_NAME in ops
    for name in selfcheck.library_ops():
        rows = [r for r in report["ops"] if r["op"] == name and r["device"] == "cpu"]
        assert {r["dtype"] for r in rows} == DTYPE_NAMES
        assert all(r["status"] == "pass" for r in rows), rows
    env = report["environment"]
    assert env["cpu_build"]["loaded"] == fedkernels.ops.native.cpu_capability
    assert env["torch"] == torch.__version__ and env["python"]
    assert env["cuda"]["gpu_visible"] == torch.cuda.is_available()
    assert report["bandwidth"] == []  # quick
    written = json.loads(path.read_text())
    assert written["ok"] is True and len(written["ops"]) == len(report["ops"])


@pytest.mark.slow
def test_cli_passes_and_writes_json(tmp_path):
    path = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fedkernels.cli", "check", "--quick", "--json", str(path)],
        capture_output=True, text=True, timeout=600, env=_child_env(), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: PASS" in proc.stdout
    assert "cpu kernels" in proc.stdout and "cuda kernels" in proc.stdout
    assert json.loads(path.read_text())["ok"] is True


def test_broken_op_fails():
    out = io.StringIO()
    report = fedkernels.check(quick=True, ops={"weighted_sum": _drop_last_client}, file=out)
    assert not report["ok"]
    failed = {(r["op"], r["dtype"]) for r in report["ops"] if r["status"] != "pass"}
    assert failed == {("weighted_sum", d) for d in DTYPE_NAMES}
    assert "result: FAIL" in out.getvalue()
    assert "weighted_sum on cpu float32: plain" in out.getvalue()


def test_slightly_wrong_op_fails_in_fp32():
    def off_by_a_little(global_params, local_params, lam):
        return [t * (1 + 1e-3) for t in torch.ops.fedkernels.mix_endpoints(
            global_params, local_params, lam)]

    report = fedkernels.check(quick=True, ops={"mix_endpoints": off_by_a_little}, verbose=False)
    status = {r["dtype"]: r["status"] for r in report["ops"] if r["op"] == "mix_endpoints"}
    assert status["float32"] == "fail" and status["float64"] == "fail"


def test_crashing_op_is_a_failure_with_its_message():
    def crashes(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    report = fedkernels.check(quick=True, ops={"sgld_step_": crashes}, verbose=False)
    rows = [r for r in report["ops"] if r["op"] == "sgld_step_"]
    assert all(r["status"] == "fail" and "kernel exploded" in r["detail"] for r in rows)
    assert not report["ok"]


def test_nondeterministic_op_fails():
    """Within tolerance of the reference, but not bitwise the same when run again."""
    calls = []

    def op(logits, labels):
        calls.append(1)
        energy = torch.ops.fedkernels.energy_from_logits(logits, labels)
        # the check calls the op twice per run (with and without labels), and runs twice:
        # the second run gets values one ulp up
        second_run = (len(calls) - 1) // 2 % 2 == 1
        return torch.nextafter(energy, torch.full_like(energy, float("inf"))) if second_run \
            else energy

    report = fedkernels.check(quick=True, ops={"energy_from_logits": op}, verbose=False)
    details = [r["detail"] for r in report["ops"]
               if r["op"] == "energy_from_logits" and r["dtype"] == "float64"]
    assert details == ["conditional: not bitwise the same on a second run"]


def test_op_without_a_check_fails(monkeypatch):
    real = selfcheck.library_ops
    monkeypatch.setattr(selfcheck, "library_ops", lambda: real() + ["brand_new_op"])
    report = fedkernels.check(quick=True, verbose=False)
    rows = [r for r in report["ops"] if r["op"] == "brand_new_op"]
    assert rows and all(r["detail"] == "no self-check exists for this op" for r in rows)
    assert not report["ok"]


def test_cli_exit_status_is_nonzero_for_a_broken_op(monkeypatch, capsys):
    real = selfcheck.native_op
    monkeypatch.setattr(
        selfcheck, "native_op",
        lambda name: _drop_last_client if name == "weighted_sum" else real(name))
    assert cli_main(["check", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "result: FAIL" in out and "weighted_sum" in out


def test_bad_arguments_fail_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown op 'weighted_summ'"):
        fedkernels.check(ops={"weighted_summ": _drop_last_client}, verbose=False)
    with pytest.raises(TypeError, match=r"ops\['weighted_sum'\] must be callable"):
        fedkernels.check(ops={"weighted_sum": 3}, verbose=False)
    with pytest.raises(ValueError, match="does not exist"):
        fedkernels.check(json_path=tmp_path / "missing" / "r.json", verbose=False)
    with pytest.raises(ValueError, match="is a directory"):
        fedkernels.check(json_path=tmp_path, verbose=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile' is a file, not a folder"):
        fedkernels.check(json_path=tmp_path / "afile" / "r.json", verbose=False)
    with pytest.raises(ValueError, match="'tpu' is not"):
        fedkernels.check(devices=["tpu"], verbose=False)
    with pytest.raises(TypeError, match="quick"):
        fedkernels.check(quick="yes", verbose=False)
    assert check_cli.main(["--quick", "--json", str(tmp_path / "missing" / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_an_output_left_unwritten_is_named_as_nan():
    """An out= op that writes nothing leaves the check's NaN fill; the other values differ by
    0, and the failure had read "max abs error 0"."""
    report = fedkernels.check(quick=True, ops={"weighted_sum.out": lambda *a, **k: None},
                              verbose=False)
    details = {r["detail"] for r in report["ops"] if r["op"] == "weighted_sum.out"}
    assert details == {"delta, out=[0]: 35 NaN where the reference has a number (of 35 values)"}
    assert not any("max abs error 0 " in r["detail"] for r in report["ops"])


def test_the_json_report_is_strict_json(tmp_path):
    """A failure's infinite error (shapes that differ) is null in the file: Infinity is not
    JSON, and strict parsers refused the whole report."""
    path = tmp_path / "report.json"
    report = fedkernels.check(quick=True, json_path=path, verbose=False,
                              ops={"weighted_sum": lambda *a, **k: [torch.zeros(1)]})
    assert any(r["max_abs_error"] == float("inf") for r in report["ops"])

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    written = json.loads(path.read_text(), parse_constant=refuse)
    rows = [r for r in written["ops"] if r["op"] == "weighted_sum"]
    assert rows and all(r["max_abs_error"] is None and r["status"] == "fail" for r in rows)


def test_devices_given_as_one_name_or_repeated():
    # "cpu" had been read as the devices 'c', 'p', 'u'; ["cpu", "cpu"] ran every check twice
    once = fedkernels.check(quick=True, devices=["cpu"], verbose=False)
    for devices in ("cpu", ["cpu", "cpu"]):
        report = fedkernels.check(quick=True, devices=devices, verbose=False)
        assert len(report["ops"]) == len(once["ops"]) and report["ok"]


def test_the_reason_names_aten_cpu_capability_only_where_torch_applied_it(monkeypatch):
    torch_cap = torch.backends.cpu.get_cpu_capability()
    monkeypatch.delenv("FEDKERNELS_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", torch_cap.lower())
    assert selfcheck.cpu_build_info()["reason"].endswith(
        f"(set by ATEN_CPU_CAPABILITY={torch_cap.lower()})")
    # torch warns and ignores a value it does not know: the capability is not "set by" it
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "bogus")
    assert selfcheck.cpu_build_info()["reason"].endswith(
        "(torch did not apply ATEN_CPU_CAPABILITY=bogus)")


@pytest.mark.slow
def test_a_forced_build_above_aten_cpu_capability_names_it():
    """FEDKERNELS_CPU_CAPABILITY=avx2 under ATEN_CPU_CAPABILITY=default, on a CPU with AVX2:
    the import error says that torch's capability was lowered, not that the CPU lacks it."""
    from fedkernels.ops import native

    if "avx2" not in native._supported_capabilities():
        pytest.skip("this CPU does not support the avx2 build")
    env = dict(_child_env(), ATEN_CPU_CAPABILITY="default", FEDKERNELS_CPU_CAPABILITY="avx2")
    proc = subprocess.run([sys.executable, "-c", "import fedkernels"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert ("ImportError: FEDKERNELS_CPU_CAPABILITY=avx2 needs a CPU capability of at least "
            "AVX2, but torch runs at CPU capability DEFAULT (ATEN_CPU_CAPABILITY=default)"
            in proc.stderr), proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_requested_without_a_gpu(capsys):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        fedkernels.check(devices=["cuda"], verbose=False)
    assert check_cli.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err


def test_bandwidth_probe_reports_both_numbers():
    result = selfcheck.bandwidth_probe("cpu", budget_s=0.5, client_bytes=1 << 20, num_clients=3)
    assert result["status"] == "measured" and result["repeats"] >= 3
    assert result["read_probe_GBps"] > 0 and result["weighted_sum_GBps"] > 0
    assert result["pct_of_probe"] == pytest.approx(
        100 * result["weighted_sum_GBps"] / result["read_probe_GBps"])
    text = selfcheck.format_report({
        "ok": True, "environment": selfcheck.environment(), "ops": [
            {"op": "weighted_sum", "device": "cpu", "dtype": "float32", "status": "pass",
             "max_abs_error": 0.0, "detail": ""}],
        "bandwidth": [result], "problems": []})
    assert "% of the probe" in text


@pytest.mark.cuda
def test_check_passes_on_cuda():
    report = fedkernels.check(quick=True, devices=["cuda"], verbose=False)
    failures = [r for r in report["ops"] if r["status"] != "pass"]
    assert report["ok"], failures
    assert report["environment"]["cuda"]["kernels_loaded"]
