"""bench/bench_simulation.py --tiny: every method installed here runs the same small FL task
to the end and reports a round time, a peak memory and an accuracy; a method whose packages
are missing is recorded with the reason instead of failing the bench."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_simulation.py"


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.slow
def test_tiny_simulation_bench_runs_every_installed_method(tmp_path):
    methods = ["sequential", "vmap", "plain"]
    if _installed("flwr", "ray"):
        methods.append("flower")
    if _installed("pfl"):
        methods.append("pfl")
    out = tmp_path / "sim.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--methods", *methods,
                           "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env=env, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["task"]["rounds"] == 3 and data["environment"]["load_average_before"]
    [row] = data["rows"]
    assert (row["model"], row["per_round"], row["epochs"]) == ("mlp", 10, 1)
    for method in methods:
        result = row["methods"][method]
        assert "error" not in result, (method, result)
        assert result["round_s"] > 0 and result["updates_per_s"] > 0, method
        assert result["round_cpu_s"] > 0, method
        assert result["peak_rss_MB"] > 0, method
        assert 0.0 <= result["accuracy"] <= 1.0, method
    assert row["methods"]["sequential"]["speedup_vs_sequential"] == 1.0


@pytest.mark.slow
def test_a_method_whose_packages_are_missing_is_recorded_as_skipped(tmp_path):
    if _installed("pfl"):
        pytest.skip("pfl is installed here")
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--methods", "pfl",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["rows"][0]["methods"]["pfl"]
    assert "pfl" in result["skipped"]
