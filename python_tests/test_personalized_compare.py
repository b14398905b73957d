"""``fedkernels compare``'s personalized table (fedkernels/cli/compare.py): each method's
personalized accuracy, worst-10%, ECE and MCE from its runs' summaries, the global model for a
method without personal models, SuPerFed's oracle figure beside its validation-selected one."""

from __future__ import annotations

import json

import pytest

from fedkernels.cli import main
from fedkernels.cli.compare import markdown_table

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def test_personalized_columns(tmp_path, capsys):
    code = main([
        "compare", "--algorithms", "fedavg,fedper,superfed-mm:start_fraction=0.5", "--seeds", "0,1",
        "--set", "rounds=2", "--set", "partition.kind=pathological",
        "--set", "partition.num_clients=5", "--set", "model.hidden=8",
        "--set", "data.label_noise=pair", "--set", "data.noise_rate=0.2",
        "--out", str(tmp_path),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "compare.json").read_text())
    fedavg, fedper, superfed = data["entries"]
    for run in fedavg["runs"]:  # no personal models: the global model's figures
        s = run["summary"]
        assert not run["personal_models"]
        assert s["personalized_accuracy"] == s["client_accuracy_mean"]
        assert s["personalized_ece"] == s["client_ece_mean"]
        assert s["personalized_mce"] == s["client_mce_mean"]
    for entry in (fedper, superfed):
        assert all(run["personal_models"] for run in entry["runs"])
        values = [run["summary"]["personalized_ece"] for run in entry["runs"]]
        assert entry["mean"]["personalized_ece"] == pytest.approx(sum(values) / 2)
    assert all("personalized_accuracy_oracle" in r["summary"] for r in superfed["runs"])
    table = (tmp_path / "compare.md").read_text()
    assert table in printed
    assert "| fedavg (global model) |" in table and "| fedper |" in table
    personalized = table[table.index("Personalized (%"):]
    row = next(line for line in personalized.splitlines() if line.startswith("| superfed-mm:start"))
    mean, std = superfed["mean"], superfed["std"]
    expected = [f"{100 * mean[k]:.1f} ± {100 * std[k]:.1f}" for k in (
        "personalized_accuracy", "personalized_accuracy_worst10", "personalized_ece",
        "personalized_mce", "personalized_accuracy_oracle", "client_accuracy_mean")]
    assert row.split(" | ")[1:] == [*expected[:-1], expected[-1] + " |"]


def test_no_personalized_table_without_personal_models():
    entry = {"label": "fedavg", "runs": [{"personal_models": False}], "mean": {}, "std": {}}
    assert "Personalized" not in markdown_table([entry])
