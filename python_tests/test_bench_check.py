"""The benchmarks' --check mode: it compares ratios (speed-ups over baselines, fractions of the
bandwidth probe), never absolute times, of a fresh run with the committed results of the same
device, and flags a ratio that got more than 20 % worse (exit status 1). The comparison is
tested on synthetic results; one end-to-end run checks the exit status of the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_aggregate
import bench_cost_curve
import bench_subnormals
import pytest
import torch
from conftest import copy_bench

from harness import timing
from harness.machine import cpu_identity, device_name
from harness.regression_check import check_against_committed, ratio_regressions

# ------------------------------------------------------------------ the comparison


def test_equal_ratios_pass():
    ratios = {"a: loop time / fused time": 2.0, "b: fused GB/s / read probe": 0.9}
    regressions, compared = ratio_regressions(ratios, dict(ratios))
    assert regressions == [] and compared == sorted(ratios)


def test_more_than_20_percent_worse_is_flagged():
    committed = {"x": 2.0, "y": 2.0, "z": 2.0, "w": 1.0}
    fresh = {"x": 1.6, "y": 1.74, "z": 3.0, "w": 0.5}  # 1.25x and 2x worse; 1.15x; better
    regressions, compared = ratio_regressions(committed, fresh)
    assert [r[0] for r in regressions] == ["w", "x"]  # worst first
    name, old, new, factor = regressions[1]
    assert (old, new) == (2.0, 1.6) and factor == pytest.approx(1.25)
    assert compared == ["w", "x", "y", "z"]


def test_the_tolerance_is_a_parameter():
    committed, fresh = {"x": 2.0}, {"x": 1.74}
    assert ratio_regressions(committed, fresh, 0.2)[0] == []
    assert [r[0] for r in ratio_regressions(committed, fresh, 0.1)[0]] == ["x"]
    with pytest.raises(ValueError, match="tolerance"):
        ratio_regressions(committed, fresh, -0.1)


def test_absolute_times_do_not_matter():
    """The whole machine twice as slow: every time doubles, no ratio moves."""

    def payload(scale):
        rows = []
        for method, ms in [("fused", 10.0), ("fused out=", 8.0), ("loop", 30.0),
                           ("foreach", 20.0)]:
            rows.append({"model": "m", "dtype": "float32", "K": 10, "method": method,
                         "median_ms": ms * scale, "time_vs_fused": ms / 10.0,
                         "pct_read_probe": 80.0})
        return {"rows": rows}

    regressions, compared = ratio_regressions(bench_aggregate.ratios(payload(1.0)),
                                              bench_aggregate.ratios(payload(2.0)))
    assert regressions == [] and len(compared) == 4


def test_cases_in_one_run_only_are_not_compared():
    regressions, compared = ratio_regressions({"a": 1.0, "gone": 5.0},
                                              {"a": 1.0, "new": 0.1})
    assert regressions == [] and compared == ["a"]


def test_unusable_values_are_skipped():
    regressions, compared = ratio_regressions(
        {"zero": 0.0, "nan": float("nan"), "none": None, "ok": 1.0},
        {"zero": 1.0, "nan": 1.0, "none": 1.0, "ok": 0.1})
    assert compared == ["ok"] and [r[0] for r in regressions] == ["ok"]


# ------------------------------------------------------------------ against a committed file


def _aggregate_payload(fused_ms: float, loop_ms: float, pct: float) -> dict:
    return {"environment": {"date": "2026-01-01T00:00:00+00:00"}, "rows": [
        {"model": "resnet18", "dtype": "float32", "K": 10, "method": "fused",
         "median_ms": fused_ms, "time_vs_fused": 1.0, "pct_read_probe": pct},
        {"model": "resnet18", "dtype": "float32", "K": 10, "method": "loop",
         "median_ms": loop_ms, "time_vs_fused": loop_ms / fused_ms, "pct_read_probe": 10.0},
    ]}


def test_a_cpu_results_file_names_the_cpu_build(monkeypatch):
    # One model name covers CPUs with and without AVX-512: their runs must not share a file.
    import fedkernels

    monkeypatch.setattr(fedkernels.ops.native, "cpu_capability", "avx512")
    assert device_name(torch.device("cpu")).endswith("-avx512")
    monkeypatch.setattr(fedkernels.ops.native, "cpu_capability", "avx2")
    assert device_name(torch.device("cpu")).endswith("-avx2")


def test_a_timed_calls_result_is_freed_after_the_clock(monkeypatch):
    events = []

    class Result:
        def __del__(self):
            events.append("freed")

    ticks = iter(range(100))

    def clock():
        events.append("clock")
        return next(ticks)

    monkeypatch.setattr(timing, "_CPU_CLOCK", clock)

    assert timing.timed(Result, torch.device("cpu")) == 1
    assert events == ["clock", "clock", "freed"]


def test_check_against_a_committed_file(tmp_path, capsys):
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"aggregate": _aggregate_payload(10.0, 30.0, 90.0),
                                "other": {"rows": []}}))
    cpu = torch.device("cpu")

    def check(fresh, name="aggregate", where=path):
        return check_against_committed(name, cpu, fresh, bench_aggregate.ratios, 0.2,
                                       path=str(where))

    assert check(_aggregate_payload(20.0, 60.0, 90.0)) == 0  # twice slower, same ratios
    assert "no ratio regressed" in capsys.readouterr().out

    assert check(_aggregate_payload(10.0, 20.0, 90.0)) == 1  # loop only 2x: was 3x
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "resnet18/float32/K=10: loop time / fused time" in out
    assert "1.50x worse" in out

    assert check(_aggregate_payload(10.0, 30.0, 60.0)) == 1  # bandwidth 60 % of the probe: was 90
    assert "fused GB/s / read probe" in capsys.readouterr().out

    assert check(_aggregate_payload(10.0, 30.0, 90.0), name="cost_curve") == 2
    assert "no committed 'cost_curve' results" in capsys.readouterr().err
    assert check(_aggregate_payload(10.0, 30.0, 90.0), where=tmp_path / "missing.json") == 2
    assert check({"rows": []}) == 2
    assert "no case in common" in capsys.readouterr().err


def test_cost_curve_ratios():
    rows = []
    for numel in (10 ** 4, 10 ** 7):
        for method, ms in [("fused", 1.0), ("fused out=", 0.9), ("op only", 0.5),
                           ("loop", 3.0), ("foreach", 2.0)]:
            rows.append({"section": "sweep", "dtype": "bfloat16", "K": 10, "P": numel,
                         "method": method, "median_ms": ms, "time_vs_fused": ms,
                         "pct_read_probe": 70.0})
    payload = {
        "probes": {"read_GBps": 20.0},
        "rows": rows,
        "stream": [{"dtype": "float32", "K": 100, "P": 10 ** 7, "add_GBps": 15.0},
                   {"dtype": "float32", "K": 100, "P": 10 ** 4, "add_GBps": 1.0}],
        "distributed": [{"world": 2, "P": 10 ** 7, "one process_ms": 30.0,
                         "all_reduce_aggregate_ms": 60.0}],
    }
    found = bench_cost_curve.ratios(payload)
    assert found["sweep/bfloat16/K=10/P=10000: loop time / fused time"] == 3.0
    assert found["sweep/bfloat16/K=10/P=10000000: foreach time / fused time"] == 2.0
    # bandwidth ratios only where a call is bandwidth, not per-call overhead
    assert found["sweep/bfloat16/K=10/P=10000000: fused out= GB/s / read probe"] == 0.7
    assert not any("P=10000: fused" in k and "probe" in k for k in found)
    assert found["stream/float32/K=100/P=10000000: add GB/s / read probe"] == 0.75
    assert len([k for k in found if k.startswith("stream/")]) == 1
    assert found["distributed/world=2/P=10000000: one process time / all_reduce_aggregate "
                 "time"] == 0.5
    assert not any("op only" in k for k in found)  # our own op is not a baseline


def test_subnormal_ratios_name_the_input_sizes():
    """A --tiny run of bench_subnormals.py times small inputs, where the fused op's fixed cost
    sets the ratios: its --check had compared them with the committed full-size run under the
    same names and reported regressions of up to 66x. The sizes are now in the names; rows
    recorded before the sizes were are the full sizes."""

    def row(op, inputs=None):
        r = {"op": op, "mode": "ieee", "fused_subnormal_over_normal": 1.0,
             "speedup_on_subnormal": 20.0}
        return r if inputs is None else dict(r, inputs=inputs)

    tiny, full = bench_subnormals.input_sizes(True), bench_subnormals.input_sizes(False)
    assert set(tiny) == set(full) == set(bench_subnormals.cases(True))
    assert all(tiny[op] != full[op] for op in tiny)
    ratios = bench_subnormals.ratios
    committed = ratios({"rows": [row("aggregate")]})  # an older run: no sizes
    assert not set(committed) & set(ratios({"rows": [row("aggregate", tiny["aggregate"])]}))
    assert set(committed) == set(ratios({"rows": [row("aggregate", full["aggregate"])]}))
    assert all(full["aggregate"] in name for name in committed)


def test_check_says_when_the_settings_differ(tmp_path, capsys):
    """A run with --threads 1, --clock process or another torch compared with a committed
    two-thread wall-clock run: the ratios move for that reason alone, and the check says so."""

    committed = _aggregate_payload(10.0, 30.0, 90.0)
    committed["environment"].update(threads=2, torch="2.13.0")
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"aggregate": committed}))

    def check(**env):
        fresh = _aggregate_payload(10.0, 30.0, 90.0)
        fresh["environment"].update({"threads": 2, "torch": "2.13.0", **env})
        status = check_against_committed("aggregate", torch.device("cpu"), fresh,
                                         bench_aggregate.ratios, 0.2, path=str(path))
        return status, [ln for ln in capsys.readouterr().out.splitlines()
                        if "not like for like" in ln]

    assert check() == (0, [])
    status, notes = check(threads=1, cpu_clock="process", torch="2.14.0")
    assert status == 0 and len(notes) == 3
    assert "torch threads 2 in the committed run, 1 in this one" in notes[0]
    assert "torch 2.13.0 in the committed run, 2.14.0 in this one" in notes[1]
    assert "wall clock in the committed run, process in this one" in notes[2]

    # --tiny's 8 MiB probe, in a cache, against the committed run's 1 GiB one
    committed["probes"] = {"probe_bytes": 1 << 30}
    path.write_text(json.dumps({"aggregate": committed}))
    fresh = _aggregate_payload(10.0, 30.0, 90.0)
    fresh["probes"] = {"probe_bytes": 1 << 23}
    assert check_against_committed("aggregate", torch.device("cpu"), fresh,
                                   bench_aggregate.ratios, 0.2, path=str(path)) == 0
    assert ("not like for like: a read probe of 1024 MiB in the committed run, 8 MiB in this "
            "one") in capsys.readouterr().out


def test_check_says_when_another_cpu_ran_under_the_same_name(tmp_path, capsys):
    """Virtual machines report generic model names ("AMD EPYC") that cover several CPU
    generations, so one results file can hold another CPU's run: the check names the
    difference. A committed run without the CPU's identity is not compared."""

    path = tmp_path / "device.json"

    def check(old_cpu, new_cpu):
        committed = _aggregate_payload(10.0, 30.0, 90.0)
        if old_cpu:
            committed["environment"]["cpu"] = old_cpu
        path.write_text(json.dumps({"aggregate": committed}))
        fresh = _aggregate_payload(10.0, 30.0, 90.0)
        fresh["environment"].update(device="cpu-amd-epyc-avx512", cpu=new_cpu)
        status = check_against_committed("aggregate", torch.device("cpu"), fresh,
                                         bench_aggregate.ratios, 0.2, path=str(path))
        return status, [ln for ln in capsys.readouterr().out.splitlines()
                        if "not like for like" in ln]

    zen4 = {"family": "25", "model": "17", "stepping": "1", "last-level cache": "32768K"}
    zen3 = {"family": "25", "model": "1", "stepping": "1", "last-level cache": "32768K"}
    assert check(zen4, dict(zen4)) == (0, [])
    assert check(None, zen4) == (0, [])
    status, notes = check(zen3, zen4)
    assert status == 0 and len(notes) == 1
    assert "another CPU behind the name 'cpu-amd-epyc-avx512'" in notes[0]
    assert "model 1, stepping 1 in the committed run" in notes[0]
    assert "model 17, stepping 1 in this one" in notes[0]


def test_cpu_identity_reads_this_machine():
    identity = cpu_identity()
    if Path("/proc/cpuinfo").exists():
        assert identity.get("family") and identity.get("model")
    assert all(isinstance(v, str) and v for v in identity.values())


# ------------------------------------------------------------------ the script


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.slow
def test_check_exit_status_of_the_script(tmp_path):
    """bench_aggregate.py --tiny --check against committed ratios no run can reach: exit 1,
    naming the ratios; --check with --save is refused (exit 2) before any work."""

    folder = copy_bench(tmp_path)
    committed = {"rows": [
        {"model": "tiny", "dtype": "float32", "K": 2, "method": m, "median_ms": 1.0,
         "time_vs_fused": 1e9 if m != "fused" else 1.0, "pct_read_probe": 1e9}
        for m in ("fused", "fused out=", "loop", "foreach")]}
    path = folder / "results" / f"{device_name(torch.device('cpu'))}.json"
    path.write_text(json.dumps({"aggregate": committed}))
    run = subprocess.run([sys.executable, str(folder / "bench_aggregate.py"), "--tiny",
                          "--check", "--out", str(tmp_path / "fresh.json")],
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=folder)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "REGRESSED  tiny/float32/K=2: loop time / fused time" in run.stdout
    assert "REGRESSED  tiny/float32/K=2: fused GB/s / read probe" in run.stdout
    assert json.loads(path.read_text()) == {"aggregate": committed}  # never rewritten

    refused = subprocess.run([sys.executable, str(folder / "bench_aggregate.py"), "--tiny",
                              "--check", "--save"], capture_output=True, text=True, timeout=120,
                             env=_env(), cwd=folder)
    assert refused.returncode == 2 and "--check" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script,key,row,flagged", [
    ("bench_sgld.py", "sgld_compose_step",
     {"K": 2, "M": 3, "speedup_median_of_ratios": 1e9, "fused_fraction_of_read_probe": 1e9,
      "inplace_fraction_of_read_probe": 1e9},
     ["K=2 M=3: torch time / fused time", "K=2 M=3: fused GB/s / read probe",
      "K=2 M=3: in-place GB/s / read probe"]),
    ("bench_distill.py", "ensemble_pseudo_labels",
     {"K": 2, "N": 8, "C": 5, "weighting": "entropy", "speedup_median_of_ratios": 1e9,
      "fused_fraction_of_read_probe": 1e9},
     ["K=2 N=8 C=5 entropy: torch time / fused time",
      "K=2 N=8 C=5 entropy: fused GB/s / read probe"]),
])
def test_check_of_the_op_benchmarks(tmp_path, script, key, row, flagged):
    """bench_sgld.py and bench_distill.py --tiny --check against a committed case with ratios
    no run can reach: exit 1 and every ratio of that case named; against a committed run with
    no case in common: exit 2."""

    folder = copy_bench(tmp_path)
    committed = folder / "results" / f"{device_name(torch.device('cpu'))}.json"

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(folder / script), "--tiny", "--check",
                               "--out", str(tmp_path / "fresh.json")], capture_output=True,
                              text=True, timeout=300, env=_env(), cwd=folder)

    committed.write_text(json.dumps({key: {"rows": [row]}}))
    run = check()
    assert run.returncode == 1, run.stdout + run.stderr
    for name in flagged:
        assert f"REGRESSED  {name}" in run.stdout, run.stdout

    other = dict(row, K=99)
    committed.write_text(json.dumps({key: {"rows": [other]}}))
    run = check()
    assert run.returncode == 2 and "no case in common" in run.stderr, run.stdout + run.stderr


_FAKE_BENCH = """
import json, os, sys
import torch
from harness.regression_check import check_against_committed
from harness.results import RECHECK_ENV
values = json.loads(sys.argv[1])
fresh = values["second" if os.environ.get(RECHECK_ENV) else "first"]
sys.exit(check_against_committed("fake", torch.device("cpu"), {"ratios": fresh},
                                 lambda payload: payload["ratios"], 0.2, path=sys.argv[2],
                                 recheck=True))
"""


@pytest.mark.slow
@pytest.mark.parametrize("first,second,status,regressed", [
    ({"a": 0.5, "b": 0.5, "c": 1.0}, {"a": 1.0, "b": 0.5, "c": 0.1}, 1, ["b"]),
    ({"a": 0.5, "b": 1.0}, {"a": 0.95, "b": 0.1}, 0, []),  # c: not flagged, so not timed again
    ({"a": 0.5}, {"a": 0.6}, 1, ["a"]),  # the better value, 0.6, is still 1.67x worse
])
def test_flagged_ratios_are_timed_again(tmp_path, first, second, status, regressed):
    """A ratio the run flags counts only when a second run of the script (same arguments, a
    fresh process) also finds it worse: the better of its two values is compared. Ratios the
    first run did not flag are not looked at again."""
    folder = copy_bench(tmp_path)
    (folder / "fake_bench.py").write_text(_FAKE_BENCH)
    committed = tmp_path / "committed.json"
    committed.write_text(json.dumps({"fake": {"ratios": {"a": 1.0, "b": 1.0, "c": 1.0},
                                              "environment": {"date": "then"}}}))
    run = subprocess.run([sys.executable, str(folder / "fake_bench.py"),
                          json.dumps({"first": first, "second": second}), str(committed)],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=folder)
    assert run.returncode == status, run.stdout + run.stderr
    assert [line.split()[1].rstrip(":") for line in run.stdout.splitlines()
            if line.startswith("REGRESSED")] == regressed, run.stdout
    assert "timing them again in a second run" in run.stdout
