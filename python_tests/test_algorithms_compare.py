"""``fedkernels compare``: argument parsing and a tiny end-to-end run (table, JSON, plot)."""

from __future__ import annotations

import json

import pytest

from fedkernels.cli import main
from fedkernels.cli.compare import parse_algorithm, split_algorithms

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_algorithm_specs():
    assert parse_algorithm("fedavg") == ("fedavg", {}, "fedavg")
    assert parse_algorithm("term:tilt=1@TERM") == ("term", {"tilt": "1"}, "TERM")
    assert parse_algorithm("vred:beta=0.5;clamp_negative=true")[1] == {
        "beta": "0.5", "clamp_negative": "true"}
    assert split_algorithms("fedavg,vred:beta=0.5,clamp_negative=true,afl") == [
        "fedavg", "vred:beta=0.5,clamp_negative=true", "afl"]


def test_compare_writes_table_json_and_plot(tmp_path, capsys):
    code = main([
        "compare", "--algorithms", "fedavg,semi-vred:beta=0.5@semi", "--seeds", "0,1",
        "--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=logreg",
        "--out", str(tmp_path),
    ])
    assert code == 0
    table = (tmp_path / "compare.md").read_text()
    assert "| fedavg |" in table and "| semi |" in table and "worst-10%" in table
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [e["label"] for e in data["entries"]] == ["fedavg", "semi"]
    assert len(data["entries"][1]["runs"]) == 2
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert main(["compare", "--algorithms", "nope", "--seeds", "0", "--out", str(tmp_path)]) == 2


def test_compare_flags_a_diverged_run(tmp_path):
    common = ["--seeds", "0", "--set", "rounds=1", "--set", "partition.num_clients=4",
              "--set", "model.name=logreg"]
    assert main(["compare", "--algorithms", "fedavg", "--set", "client.weight_decay=1e6",
                 *common, "--out", str(tmp_path / "bad")]) == 0
    entry = json.loads((tmp_path / "bad" / "compare.json").read_text())["entries"][0]
    assert entry["diverged_seeds"] == [0] and entry["runs"][0]["diverged"] is True
    assert "Diverged" in (tmp_path / "bad" / "compare.md").read_text()
    assert main(["compare", "--algorithms", "fedavg", *common, "--out", str(tmp_path / "ok")]) == 0
    entry = json.loads((tmp_path / "ok" / "compare.json").read_text())["entries"][0]
    assert entry["diverged_seeds"] == [] and "Diverged" not in (tmp_path / "ok" / "compare.md").read_text()


def test_compare_carries_a_runs_caveats(tmp_path):
    assert main(["compare", "--algorithms", "fedcvae:server_epochs=0@untrained,fedcvae",
                 "--seeds", "0", "--set", "rounds=1", "--set", "partition.num_clients=2",
                 "--set", "model.hidden=8", "--out", str(tmp_path)]) == 0
    untrained, trained = json.loads((tmp_path / "compare.json").read_text())["entries"]
    assert len(untrained["caveats"]) == 1 and "never trained" in untrained["caveats"][0]
    assert untrained["runs"][0]["caveats"] == untrained["caveats"] and trained["caveats"] == []
    table = (tmp_path / "compare.md").read_text()
    assert "Caveats: untrained: server_epochs = 0" in table and "fedcvae: server" not in table
