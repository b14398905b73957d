"""What a run writes beside its numbers: rounds counted from 1 everywhere, the code that made
it (fedkernels version, git commit), a config.json of the fields that apply, and per-round
metrics as CSV (and TensorBoard events when asked)."""

from __future__ import annotations

import csv
import json

import pytest

from fedkernels.cli import main
from fedkernels.sim.config import (
    ConfigError,
    ExperimentConfig,
    applicable_dict,
    from_dict,
    unread_settings,
)
from fedkernels.sim.provenance import package_version

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--model.name", "logreg", "--partition.num_clients", "3", "--no-progress"]


def run(tmp_path, *argv: str, name: str = "run"):
    out = tmp_path / name
    assert main(["run", "--rounds", "3", "--out", str(out), *FAST, *argv]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_rounds_are_numbered_from_one_in_results_and_plots(tmp_path):
    import matplotlib.pyplot as plt

    from fedkernels.sim.plots import curves_figure
    from fedkernels.sim.results import RunResult

    out, results = run(tmp_path, "--no-plots", "--eval_every", "2")
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    # eval_every 2: rounds 2 and 3 (the last) are evaluated, as their numbers say
    assert [r["round"] for r in results["rounds"] if "test_accuracy" in r] == [2, 3]
    fig = curves_figure(RunResult(**{k: results[k] for k in
                                     ("config", "dataset", "rounds", "clients", "summary")}))
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [2, 3]
    plt.close(fig)


def test_environment_names_the_code_that_made_the_run(tmp_path):
    _, results = run(tmp_path, "--no-plots")
    env = results["environment"]
    assert env["fedkernels"] == package_version() and env["torch"]
    # the tests run from a git checkout: its commit, and whether tracked files were changed
    commit = env["git_commit"]
    assert commit is None or (len(commit) == 40 and isinstance(env["git_dirty"], bool))


def test_config_json_lists_only_the_fields_that_apply(tmp_path):
    out, results = run(tmp_path, "--no-plots")
    saved = json.loads((out / "config.json").read_text())
    assert saved == results["config"]
    data = saved["data"]
    assert data["name"] == "digits"
    for field in ("path", "delimiter", "label_column", "alpha", "beta", "max_samples",
                  "num_features", "root", "noise_rate"):
        assert field not in data, field
    assert "alpha" not in saved["partition"] and "classes_per_client" not in saved["partition"]
    assert saved["model"] == {"name": "logreg"}
    assert set(saved["server"]) == {"optimizer", "lr"}
    assert saved["attack"] == {"kind": "none"}
    assert saved["client"]["steps"] is None and saved["client"]["epochs"] == 1
    # read back, the defaults fill what was left out: the same configuration
    assert from_dict(ExperimentConfig, saved) == from_dict(ExperimentConfig, {
        "rounds": 3, "model": {"name": "logreg"}, "partition": {"num_clients": 3}})


@pytest.mark.parametrize("tree", [
    {},
    {"data": {"name": "synthetic", "alpha": 0.5}, "partition": {"kind": "natural"}},
    {"data": {"name": "csv", "path": "x.csv", "label_column": "y"},
     "partition": {"kind": "dirichlet", "alpha": 0.3}},
    {"participation": {"kind": "markov", "probability_model": "label_correlated",
                       "min_probability": 0.1}},
    {"client": {"steps": 5}, "server": {"optimizer": "fedadam", "beta1": 0.8}},
    {"model": {"name": "resnet18", "norm": "group", "groups": 4}},
    {"attack": {"kind": "gaussian", "std": 2.0}, "dp": {"adaptive": True, "clip_lr": 0.1}},
])
def test_the_applicable_fields_give_the_configuration_back(tree):
    config = from_dict(ExperimentConfig, tree)
    assert from_dict(ExperimentConfig, applicable_dict(config)) == config


@pytest.mark.parametrize("tree, message", [
    ({"model": {"name": "logreg", "hidden": [64, 64]}},
     "model.hidden is not a setting of model.name=logreg"),
    ({"model": {"name": "cnn", "hidden": [8]}}, "model.hidden is not a setting of model.name=cnn"),
    ({"model": {"name": "mlp", "channels": [4, 4]}},
     "model.channels is not a setting of model.name=mlp"),
    ({"data": {"name": "digits", "separation": 3.0}},
     "data.separation is read only with data.name=gaussian_mixture"),
    ({"data": {"name": "gaussian_mixture", "max_samples": 100}},
     "data.max_samples is read only with data.name=synthetic"),
])
def test_a_model_or_data_option_the_choice_does_not_read_is_refused(tree, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(ExperimentConfig, tree)


@pytest.mark.parametrize("tree, message", [
    ({"partition": {"alpha": 0.3}}, "partition.alpha is read only with partition.kind=dirichlet"),
    ({"participation": {"kind": "full", "fraction": 0.5}}, "participation.fraction is read only"),
    ({"participation": {"kind": "uniform", "markov_delta": 0.2}},
     "participation.markov_delta is read only with participation.kind=markov"),
    ({"server": {"momentum": 0.5}}, "server.momentum is read only with server.optimizer fedavgm"),
    ({"client": {"steps": 3, "epochs": 2}}, "client.epochs is read only with client.steps unset"),
    ({"attack": {"std": 3.0}}, "attack.std is read only with attack.kind=gaussian"),
    ({"dp": {"clip": 1.0, "clip_lr": 0.5}}, "dp.clip_lr is read only with dp.adaptive"),
])
def test_a_setting_its_sections_switch_leaves_unread_is_named(tree, message):
    # not refused: a sweep over partition.kind keeps its partition.alpha for the dirichlet runs
    config = from_dict(ExperimentConfig, tree)
    (sentence,) = unread_settings(config, tree)
    assert sentence.startswith(message) and sentence.endswith("so it has no effect")
    assert unread_settings(config, {}) == []


def test_the_command_line_warns_of_an_unread_setting_and_resumes_past_it(tmp_path, capsys):
    out, _ = run(tmp_path, "--no-plots", "--rounds", "2", "--partition.alpha", "0.3")
    assert ("fedkernels run: warning: partition.alpha is read only with partition.kind=dirichlet"
            in capsys.readouterr().err)
    assert "alpha" not in json.loads((out / "config.json").read_text())["partition"]
    # the checkpoint holds alpha 0.3, config.json nothing: the same run, so it continues
    assert main(["run", "--resume", "--rounds", "3", "--out", str(out), "--no-progress",
                 "--no-plots"]) == 0, capsys.readouterr().err


def test_the_inapplicable_model_option_of_the_issue_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["run", "--model.hidden", "64,64", "--model.name", "logreg", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedkernels run: error: model.hidden is not a setting of model.name=logreg")
    assert not out.exists()


def test_an_old_checkpoint_counted_from_zero_resumes_counted_from_one(tmp_path):
    import torch

    out, _ = run(tmp_path, "--no-plots", "--rounds", "2")
    checkpoint = out / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=True)
    state["records"] = [{**r, "round": r["round"] - 1} for r in state["records"]]
    torch.save(state, checkpoint)
    assert main(["run", "--resume", "--rounds", "3", "--out", str(out), "--no-progress",
                 "--no-plots"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_metrics_csv_holds_every_round_of_results_json(tmp_path):
    out, results = run(tmp_path, "--no-plots", "--eval_every", "2")
    rows = read_csv(out / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [1, 2, 3]
    header = list(rows[0])
    assert header[0] == "round" and "test_accuracy" in header and "train_loss" in header
    for row, record in zip(rows, results["rounds"]):
        for key, value in record.items():
            if isinstance(value, float):
                assert float(row[key]) == pytest.approx(value), key
            elif isinstance(value, list):
                assert row[key] == ";".join(map(str, value)), key
            else:
                assert row[key] == ("" if value is None else str(value)), key
    # round 1 was not evaluated (eval_every 2): its evaluation cells are empty
    assert rows[0]["test_accuracy"] == "" and float(rows[1]["test_accuracy"]) > 0


def test_metrics_csv_cells():
    from fedkernels.sim.round_logs import metrics_csv

    text = metrics_csv([{"round": 1, "non_finite": ["a", "b"], "skipped": "too few"},
                        {"round": 2, "test_accuracy": 0.5, "x": None}])
    assert text.splitlines() == ["round,non_finite,skipped,test_accuracy,x",
                                 "1,a;b,too few,,", "2,,,0.5,"]


def test_log_tensorboard_without_the_package_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out = tmp_path / "x"
    assert main(["run", "--log", "tensorboard", "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fedkernels run: error: --log tensorboard needs the tensorboard package: "
                   'pip install "fedkernels[tensorboard]"')
    assert not out.exists()


def test_log_tensorboard_writes_each_rounds_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, results = run(tmp_path, "--no-plots", "--log", "tensorboard")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    accuracy = events.Scalars("test_accuracy")
    assert [e.step for e in accuracy] == [1, 2, 3]
    assert accuracy[-1].value == pytest.approx(results["rounds"][-1]["test_accuracy"])
