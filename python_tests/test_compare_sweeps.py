"""``fedkernels compare`` on finished runs (folders and globs, seeds grouped by configuration)
and on sweeps it runs itself (run's flags, --sweep over any key, --seeds ranges, a folder per
run, --resume and --overwrite, compare.json with each run's configuration and environment)."""

from __future__ import annotations

import json

import pytest

from fedkernels.cli import main
from fedkernels.cli.compare import group_labels, parse_seeds, parse_sweep, split_values
from fedkernels.sim.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--rounds", "1", "--model.name", "logreg", "--partition.num_clients", "3"]


def test_seeds_take_ranges_and_lists():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2, 5") == [0, 2, 5]
    assert parse_seeds("0-2,7,1") == [0, 1, 2, 7]
    for text, message in [("x", "expected seeds and ranges"), ("3-1", "runs backwards"),
                          (",", "no seed given"), ("-1", "expected seeds")]:
        with pytest.raises(ConfigError, match=message):
            parse_seeds(text)


def test_sweep_values():
    assert split_values("0.01,0.05") == ["0.01", "0.05"]
    assert split_values("[64,64],[128]") == ["64,64", "128"]
    assert parse_sweep(["client.lr=0.01,0.05", "--algorithm=fedavg,fedprox"]) == [
        ("client.lr", ["0.01", "0.05"]), ("algorithm", ["fedavg", "fedprox"])]
    for items, message in [(["client.lr"], "expected KEY=VALUE"), (["client.lr="], "expected"),
                           (["seed=0,1"], "give the seeds with --seeds"),
                           (["a=1", "a=2"], "given twice"), (["a=1,1"], "a value is given twice")]:
        with pytest.raises(ConfigError, match=message):
            parse_sweep(items)


def test_labels_name_what_sets_a_configuration_apart():
    base = {"algorithm": "fedavg", "algorithm_params": {}, "seed": 0,
            "client": {"lr": 0.1}, "partition": {"kind": "iid"}}
    prox = {**base, "algorithm": "fedprox", "algorithm_params": {"mu": 0.01}}
    assert group_labels([base, prox]) == ["fedavg", "fedprox"]
    slow = {**base, "client": {"lr": 0.05}}
    assert group_labels([base, slow]) == ["client.lr=0.1", "client.lr=0.05"]
    strong = {**prox, "algorithm_params": {"mu": 1.0}}
    assert group_labels([base, prox, strong]) == [
        "fedavg", "fedprox, fedprox.mu=0.01", "fedprox, fedprox.mu=1.0"]
    assert group_labels([base]) == ["fedavg"]


def finished_run(tmp_path, name, *argv):
    out = tmp_path / name
    assert main(["run", *TINY, "--out", str(out), "--no-progress", "--no-plots", *argv]) == 0
    return out


@pytest.mark.slow
def test_finished_runs_are_grouped_by_configuration(tmp_path, capsys):
    runs = tmp_path / "runs"
    for seed in (0, 1):
        finished_run(runs, f"avg-{seed}", "--seed", str(seed))
        finished_run(runs, f"prox-{seed}", "--seed", str(seed), "--algorithm", "fedprox")
    out = tmp_path / "cmp"
    # a folder, and a glob the shell did not expand
    assert main(["compare", str(runs / "avg-0"), str(runs / "avg-1"), str(runs / "prox-*"),
                 "--out", str(out), "--no-plots"]) == 0
    data = json.loads((out / "compare.json").read_text())
    assert [e["label"] for e in data["entries"]] == ["fedavg", "fedprox"]
    for entry in data["entries"]:
        assert [r["seed"] for r in entry["runs"]] == [0, 1]
        run = entry["runs"][0]
        assert run["config"]["algorithm"] == entry["label"] and run["environment"]["fedkernels"]
        assert run["path"].endswith({"fedavg": "avg-0", "fedprox": "prox-0"}[entry["label"]])
        assert run["curve"][0][0] == 1
    assert "| fedprox |" in capsys.readouterr().out
    # a folder holding runs below it: the same four
    again = tmp_path / "again"
    assert main(["compare", str(runs), "--out", str(again), "--no-plots"]) == 0
    assert json.loads((again / "compare.json").read_text())["entries"] == data["entries"]
    # taken: refused without --overwrite, which replaces only the table (never the runs)
    assert main(["compare", str(runs), "--out", str(again), "--no-plots"]) == 2
    assert "already holds a comparison" in capsys.readouterr().err
    assert main(["compare", str(runs), "--out", str(again), "--no-plots", "--overwrite"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["{runs}/nothing"], "no such run folder"),
    (["{runs}/none-*"], "matches no folder"),
    (["{runs}/a", "{runs}/b"], "two runs of one configuration with seed 0"),
    (["{runs}/a", "--seeds", "0-1"], "finished runs bring their own"),
    (["{runs}/a", "--sweep", "client.lr=0.1,0.2"], "not both"),
    ([], "nothing to compare"),
])
def test_finished_run_mistakes_are_one_line(tmp_path, capsys, argv, message):
    runs = tmp_path / "runs"
    finished_run(runs, "a")
    finished_run(runs, "b")
    capsys.readouterr()
    argv = [a.format(runs=runs) for a in argv]
    assert main(["compare", *argv, "--out", str(tmp_path / "c"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedkernels compare: error: ") and message in err, err
    assert "\n" not in err


@pytest.mark.slow
def test_a_sweep_runs_each_combination_in_its_own_folder_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["compare", *TINY, "--sweep", "algorithm=fedavg,fedprox", "--sweep",
            "client.lr=0.05,0.2", "--fedprox.mu", "0.5", "--seeds", "0-1", "--out", str(out),
            "--no-plots"]
    assert main(argv) == 0
    data = json.loads((out / "compare.json").read_text())
    labels = [e["label"] for e in data["entries"]]
    assert labels == ["fedavg, client.lr=0.05", "fedavg, client.lr=0.2",
                      "fedprox, client.lr=0.05", "fedprox, client.lr=0.2"]
    assert data["sweep"] == [["algorithm", ["fedavg", "fedprox"]], ["client.lr", ["0.05", "0.2"]]]
    folders = sorted(p.name for p in (out / "runs").iterdir())
    assert len(folders) == 8 and "fedprox_client.lr=0.2-seed1" in folders
    for entry in data["entries"]:
        for run in entry["runs"]:
            config = json.loads((tmp_path / run["path"] / "config.json").read_text())
            assert config == run["config"]
            assert run["environment"]["torch"]
            # the algorithm's flag went to its own runs only
            assert run["config"]["algorithm_params"] == (
                {"mu": 0.5} if entry["label"].startswith("fedprox") else {})
    # taken: refused; --resume reuses every finished run without running it again
    assert main(argv) == 2
    assert "--resume to keep its finished runs" in capsys.readouterr().err
    results = out / "runs" / "fedavg_client.lr=0.05-seed0" / "results.json"
    before = results.stat().st_mtime_ns
    (out / "runs" / "fedprox_client.lr=0.2-seed1" / "results.json").unlink()  # stopped late
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert err.count("(finished before)") == 7 and err.count("(continued)") == 1
    assert results.stat().st_mtime_ns == before
    # a changed configuration is not mixed with the finished runs
    assert main([*argv[:-1], "--rounds", "2", "--no-plots", "--resume"]) == 2
    assert "holds a run of another configuration" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert results.stat().st_mtime_ns != before


def test_sweep_mistakes_are_caught_before_any_run(tmp_path, capsys):
    out = tmp_path / "never"
    for argv, message in [
        (["--sweep", "algorithm=fedavg", "--fedprox.mu", "0.1"],
         "--fedprox.mu is a parameter of fedprox, which none of the runs uses"),
        (["--sweep", "algorithm=fedavg,fedproxx"], "did you mean fedprox?"),
        (["--sweep", "clients.lr=0.1"], "not a key of the configuration; did you mean client.lr?"),
        (["--sweep", "client.lr=0.1,-1"], "client.lr must be > 0"),
        (["--sweep", "model.hidden=[8,8]"], "model.hidden is not a setting of model.name=logreg"),
        (["--seed", "0"], "did you mean --seeds?"),
        (["--algorithms", "fedavg", "--sweep", "client.lr=0.1"], "--algorithms"),
    ]:
        assert main(["compare", *TINY, *argv, "--out", str(out)]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not out.exists()


def test_a_sweep_of_list_values_and_algorithm_parameters(tmp_path):
    out = tmp_path / "s"
    assert main(["compare", "--rounds", "1", "--partition.num_clients", "3",
                 "--sweep", "model.hidden=[8,8],[16]", "--sweep", "algorithm=fedprox",
                 "--sweep", "fedprox.mu=0.1,1", "--seeds", "0", "--out", str(out),
                 "--no-plots", "--no-progress"]) == 0
    entries = json.loads((out / "compare.json").read_text())["entries"]
    assert [e["label"] for e in entries] == [
        "model.hidden=8,8, fedprox, fedprox.mu=0.1", "model.hidden=8,8, fedprox, fedprox.mu=1",
        "model.hidden=16, fedprox, fedprox.mu=0.1", "model.hidden=16, fedprox, fedprox.mu=1"]
    assert entries[0]["runs"][0]["config"]["model"]["hidden"] == [8, 8]
