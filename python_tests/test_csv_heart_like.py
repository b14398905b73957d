"""A multi-site clinical table with text columns and gaps (the shape of the UCI Heart Disease
data, made up by experiments/make_heart_like_csv.py) runs from the command line with no preparation by
the user, and results.json says what the loader did."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300


def generator():
    return load_script(ROOT / "experiments" / "make_heart_like_csv.py")


def read_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_generator_is_deterministic_and_heart_shaped(tmp_path):
    make = generator()
    a = make.write_heart_like_csv(tmp_path / "a.csv", seed=0)
    b = make.write_heart_like_csv(tmp_path / "b.csv", seed=0)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != make.write_heart_like_csv(tmp_path / "c.csv", seed=1).read_bytes()
    rows = read_rows(a)
    assert len(rows) == 920 and list(rows[0]) == make.COLUMNS
    sites = {r["site"] for r in rows}
    assert sites == {"cleveland", "hungarian", "switzerland", "va"}
    assert {r["num"] for r in rows} == {"0", "1", "2", "3", "4"}
    rate = {s: sum(r["num"] != "0" for r in rows if r["site"] == s)
            / sum(r["site"] == s for r in rows) for s in sites}
    assert rate["switzerland"] > 0.8 > rate["va"] > 0.6 > rate["cleveland"] > rate["hungarian"]
    gaps = {s: sum(r["chol"] in ("", "?", "NA", "nan") for r in rows if r["site"] == s)
            for s in sites}
    assert gaps["switzerland"] > 80 and gaps["cleveland"] < 10  # site-specific missingness
    markers = {r[c] for r in rows for c in r if r[c] in ("", "?", "NA", "nan")}
    assert markers == {"", "?", "NA", "nan"}
    assert {r["sex"] for r in rows} == {"male", "female"}


@pytest.mark.slow
def test_heart_like_table_runs_from_the_command_line(tmp_path):
    data = generator().write_heart_like_csv(tmp_path / "heart.csv", rows=160, seed=2)
    out = tmp_path / "run"
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    command = [
        "fedkernels", "run", "--data.name", "csv", "--data.path", str(data),
        "--data.label_column", "num", "--data.positive_labels", "1,2,3,4",
        "--data.client_column", "site", "--partition.kind", "natural",
        # small and quick: the command above is the whole of what a user types
        "--rounds", "3", "--model.name", "logreg", "--threads", "1",
        "--no-progress", "--no-plots", "--out", str(out),
    ]
    try:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"fedkernels run did not finish in {RUN_TIMEOUT_S} s; output so far:\n"
                    f"{err.stdout}\n{err.stderr}")
    if done.returncode != 0:
        pytest.fail(f"fedkernels run exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    results = json.loads((out / "results.json").read_text())
    assert len(results["clients"]) == 4
    assert 0.0 <= results["summary"]["test_accuracy"] <= 1.0
    prep = results["data_preparation"]
    assert prep["labels"]["rule"] == "positive_labels"
    assert prep["labels"]["mapping"] == {"0": 0, "1": 1, "2": 1, "3": 1, "4": 1}
    assert prep["clients"]["mapping"] == {"cleveland": 0, "hungarian": 1, "switzerland": 2,
                                          "va": 3}
    features = prep["features"]
    assert set(features["one_hot"]) == {"sex", "cp", "restecg", "exang", "slope", "thal"}
    assert "missing" in features["one_hot"]["thal"]["levels"]
    assert features["numeric"]["chol"]["missing"] > 0
    assert features["numeric"]["chol"]["indicator"] == "chol (missing)"
    assert set(features["standardized"]) == {"age", "trestbps", "chol", "fbs", "thalach",
                                             "oldpeak", "ca"}
    assert features["fitted_on_rows"] == sum(c["num_train"] for c in results["clients"])
