"""experiments/mnist1d_evidence.py's bookkeeping: the grid every table's rates came from (as
recorded in the committed JSON), the rates chosen at an end of it, and the count of test
samples per client, which builds the clients without training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_modules import load_script

from fedkernels.sim.dataset import Dataset

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "mnist1d_evidence.py"


@pytest.fixture(scope="module")
def evidence():
    return load_script(SCRIPT)


def test_a_table_that_reuses_rates_records_the_grid_they_came_from(evidence):
    assert evidence.grid_of("fedau-markov") == evidence.PLAIN_GRID
    assert evidence.grid_of("superfed-noise") == evidence.LR_GRID
    assert evidence.grid_of("fedevg-a1") == evidence.ADAM_GRID
    results = json.loads((ROOT / "experiments" / "mnist1d_evidence.json").read_text())
    for name, entry in results["tables"].items():
        assert entry["grid"] == evidence.grid_of(name), name
        assert entry.get("lrs_from") == evidence.TABLES[name].get("lrs_from"), name
        for label, lr in entry["lr"].items():
            assert any(abs(lr - g) < 1e-12 for g in entry["grid"]), (name, label, lr)


def test_grid_edges_names_the_rates_at_either_end(evidence):
    results = {"tables": {"fedgo": {"lr": {"a": 0.01, "b": 0.03, "c": 0.1}},
                          "fedau-cyclic": {"lr": {"a": 0.3, "b": 1.0}}}}
    assert evidence.grid_edges(results, "fedgo") == {"a": "bottom", "c": "top"}
    assert evidence.grid_edges(results, "fedau-cyclic") == {"b": "top"}
    assert evidence.grid_edges(results, "fedevg-a1") == {}


def test_client_test_sizes_counts_each_clients_test_rows(evidence, monkeypatch):
    # 1000 rows split evenly over 4 clients: 250 each, of which test_fraction are test rows
    x = torch.randn(1000, 40)
    y = torch.arange(1000) % 10
    pool = Dataset.from_tensors(x, y, num_classes=10)
    tree = {"rounds": 1, "data": {"name": "mnist1d", "num_samples": 1000, "test_fraction": 0.1},
            "partition": {"kind": "iid", "num_clients": 4},
            "participation": {"kind": "full"}, "model": {"name": "mnist1d_cnn"}}
    monkeypatch.setitem(evidence.TABLES, "tiny", {"tree": tree})
    monkeypatch.setattr(evidence, "dataset_for", lambda _tree: pool)
    rows = evidence.client_test_sizes("tiny", [0, 1])
    assert [r["seed"] for r in rows] == [0, 1]
    for r in rows:
        assert r["clients"] == 4
        assert r["min"] <= r["median"] <= r["max"]
        assert 4 * r["min"] <= 100 <= 4 * r["max"]
        assert r["under_50"] == 4
    monkeypatch.setitem(tree["data"], "test_fraction", 0.4)
    assert all(r["under_50"] == 0 and r["min"] >= 50
               for r in evidence.client_test_sizes("tiny", [0]))
    text = evidence.client_test_sizes_report(["tiny"], [0])
    assert "| tiny | 4 |" in text
