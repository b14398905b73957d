"""The commands against what goes wrong around them: output folders they cannot write, two runs
into one folder, Ctrl-C in ``compare``, a data file changed under a resumed run, list flags with
spaces, misspelled algorithm names. Each case is one line on stderr, never a traceback."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest
from cli_process import (
    FAST,
    TIMEOUT_S,
    assert_one_line_error,
    assert_success,
    fedkernels,
    interrupt_when,
)

from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import ConfigError, DataConfig, from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

UNWRITABLE = Path("/sys/kernel")  # exists, and not even root can create a file in it
needs_sysfs = pytest.mark.skipif(not UNWRITABLE.is_dir(), reason="needs Linux's /sys")


def write_csv(path: Path, rows: int = 40, extra: str = "") -> Path:
    """A small two-site table whose labels and sites have spaces in them."""
    lines = ["blood pressure,x,diagnosis,site"]
    for i in range(rows):
        label = ("heart disease", "mild disease", "healthy", "healthy")[i % 4]
        lines.append(f"{100 + i},{i % 7},{label},{'north' if i % 2 else 'south'} site")
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


CSV_FLAGS = ["--data.name", "csv", "--data.label_column", "diagnosis",
             "--data.client_column", "site", "--partition.kind", "natural"]


# ---------------------------------------------------------------- list flags


@pytest.mark.slow
def test_list_values_keep_their_inner_spaces(tmp_path):
    config = from_dict(DataConfig, {"name": "csv", "path": "d.csv",
                                    "positive_labels": " heart disease , mild disease,",
                                    "ignore_columns": "blood pressure"})
    assert config.positive_labels == ["heart disease", "mild disease"]
    assert config.ignore_columns == ["blood pressure"]
    data = write_csv(tmp_path / "d.csv")
    out = tmp_path / "run"
    done = fedkernels("run", *CSV_FLAGS, "--data.path", str(data), "--rounds", "1",
                      "--data.positive_labels", "heart disease,mild disease",
                      "--data.ignore_columns", "blood pressure", "--out", str(out), *FAST)
    assert_success(done)
    prep = json.loads((out / "results.json").read_text())["data_preparation"]
    assert prep["labels"]["mapping"] == {"healthy": 0, "heart disease": 1, "mild disease": 1}
    assert prep["ignored_columns"] == ["blood pressure"]


# ---------------------------------------------------------------- output folders


@pytest.mark.slow
@needs_sysfs
def test_run_into_an_unwritable_folder_is_a_one_line_error():
    assert_one_line_error(fedkernels("run", "--rounds", "1", "--out", str(UNWRITABLE), *FAST),
                          f"--out {UNWRITABLE}", "cannot write")


SEALED = Path("/proc/1/fdinfo")  # Linux: even root may not look up a path under it


def _sealed() -> bool:
    try:
        (SEALED / "x").exists()
    except PermissionError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _sealed(), reason="needs a folder whose paths raise PermissionError")
@pytest.mark.parametrize("args", [
    ["run", "--out", "{d}/run"],
    ["run", "--data.name", "csv", "--data.path", "{d}/a.csv", "--out", "{tmp}/o"],
    ["run", "--config", "{d}/c.yaml", "--out", "{tmp}/o"],
    ["run", "--resume", "--out", "{d}/x"],
    ["compare", "--algorithms", "fedavg", "--seeds", "0", "--out", "{d}/cmp"],
])
def test_paths_that_cannot_be_looked_at_are_a_one_line_error(tmp_path, args):
    # Path.exists() and friends raise PermissionError (not False) under such a folder.
    args = [a.format(d=SEALED / "x", tmp=tmp_path) for a in args]
    fast = FAST if args[0] == "run" else ["--threads", "1"]
    assert_one_line_error(fedkernels(*args, *fast), "Permission denied", command=args[0])


@pytest.mark.slow
@pytest.mark.parametrize("flags, fragment", [
    (["--participation.kind", "cyclic", "--participation.cycle_length", "1" + "0" * 23],
     "participation.cycle_length: '1" + "0" * 23 + "' is beyond the 64-bit integer range"),
    (["--threads", "1" + "0" * 20], "--threads must be in [1, 1024]"),
    (["--data.name", "gaussian_mixture", "--data.num_samples", "100000000000"],
     "not enough memory"),
    (["--model.name", "mlp", "--model.hidden", "100000000000"], "not enough memory"),
])
def test_sizes_beyond_reason_are_a_one_line_error(tmp_path, flags, fragment):
    out = tmp_path / "o"
    assert_one_line_error(fedkernels("run", *FAST, *flags, "--rounds", "1", "--out", str(out)),
                          fragment)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
@needs_sysfs
def test_check_json_into_an_unwritable_folder_is_refused_before_the_checks():
    start = time.monotonic()
    done = fedkernels("check", "--quick", "--device", "cpu", "--json", str(UNWRITABLE / "x.json"))
    assert_one_line_error(done, "cannot write the JSON report", "x.json", command="check")
    assert not done.stdout  # no check ran
    assert time.monotonic() - start < TIMEOUT_S


@pytest.mark.slow
def test_compare_refuses_an_unusable_out_before_any_run(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    start = time.monotonic()
    done = fedkernels("compare", "--algorithms", "fedavg", "--seeds", "0", "--set",
                      "rounds=200", "--out", str(blocker / "sub"))
    assert_one_line_error(done, f"--out {blocker / 'sub'}: {blocker}", "not a folder",
                          command="compare")
    if UNWRITABLE.is_dir():
        done = fedkernels("compare", "--algorithms", "fedavg", "--seeds", "0", "--set",
                          "rounds=200", "--out", str(UNWRITABLE / "cmp"))
        assert_one_line_error(done, "cannot write", command="compare")
    assert time.monotonic() - start < 60  # refused up front, not after 200 rounds


@pytest.mark.slow
@pytest.mark.parametrize("flags, fragment", [
    (["--seeds", ","], "--seeds: no seed given"),
    (["--seeds", "0", "--threads", "-1"], "--threads must be in [1, 1024]"),
    (["--seeds", "0", "--threads", "0"], "--threads must be in [1, 1024]"),
])
def test_compare_flag_values_are_checked_up_front(tmp_path, flags, fragment):
    done = fedkernels("compare", "--algorithms", "fedavg", *flags, "--out", str(tmp_path / "c"))
    assert_one_line_error(done, fragment, command="compare")


@pytest.mark.slow
@pytest.mark.parametrize("algorithms, label", [("fedavg@A,fedprox@A", "A"),
                                               ("fedavg,fedavg", "fedavg")])
def test_compare_refuses_a_label_given_twice(tmp_path, algorithms, label):
    done = fedkernels("compare", "--algorithms", algorithms, "--seeds", "0", "--out",
                      str(tmp_path / "c"))
    assert_one_line_error(done, f"the label {label!r} is given twice", command="compare")


@pytest.mark.slow
def test_ctrl_c_in_compare_is_a_clean_message(tmp_path):
    out = tmp_path / "cmp"
    code, err = interrupt_when(
        ["compare", "--algorithms", "fedavg", "--seeds", "0", "--set", "rounds=100000", "--set",
         "model.name=logreg", "--threads", "1", "--out", str(out)],
        ready=out, settle_s=1.0)  # --out is created up front, once the command is under way
    assert code == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "interrupted; no table was written")


# ---------------------------------------------------------------- one folder, one run


@pytest.mark.slow
def test_a_second_run_into_a_busy_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with (out / "run.lock").open("a") as held:  # as a running fedkernels run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert_one_line_error(fedkernels("run", "--rounds", "1", "--out", str(out), *FAST),
                              "another run is using this folder")
    assert not (out / "config.json").exists()
    assert_success(fedkernels("run", "--rounds", "1", "--out", str(out), *FAST))


def test_checkpoint_temporary_file_has_a_name_of_its_own(tmp_path):
    """Two writers never share one temporary file: a name another writer holds (here a folder
    in its place) does not stop this one, and nothing is left behind."""
    checkpoint = tmp_path / "checkpoint.pt"
    (tmp_path / "checkpoint.pt.partial").mkdir()
    config = ExperimentConfig(rounds=2, data=DataConfig(name="gaussian_mixture", num_samples=200))
    Simulation(config, build_strategy("fedavg"), checkpoint=checkpoint).run()
    assert checkpoint.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.partial"]


# ---------------------------------------------------------------- resume and the data file


@pytest.mark.slow
def test_resume_refuses_a_changed_data_file_and_works_from_another_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    data = write_csv(work / "d.csv")
    out = tmp_path / "run"
    assert_success(fedkernels("run", *CSV_FLAGS, "--data.path", "d.csv", "--rounds", "2",
                              "--out", str(out), *FAST, cwd=work))
    saved = json.loads((out / "config.json").read_text())
    assert saved["data"]["path"] == str(data)  # absolute
    prep = json.loads((out / "results.json").read_text())["data_preparation"]
    assert prep["file_size"] == data.stat().st_size and len(prep["file_sha256"]) == 64
    # from another working folder, the same file: continues
    assert_success(fedkernels("run", "--resume", "--rounds", "3", "--out", str(out), *FAST,
                              cwd=tmp_path))
    # relabelled and appended rows: refused, naming the file
    text = data.read_text().replace("healthy", "heart disease", 3)
    data.write_text(text + "150,3,healthy,north site\n")
    assert_one_line_error(fedkernels("run", "--resume", "--rounds", "4", "--out", str(out), *FAST),
                          "cannot resume", str(data), "has changed")


def test_resume_takes_a_moved_data_file_at_its_new_place(tmp_path, capsys):
    """Moving the data (a renamed folder, another machine) must not strand a run: the file's
    new place is accepted when its size and SHA-256 are the checkpoint's."""
    from fedkernels.cli import main

    first = write_csv(tmp_path / "d.csv")
    out = tmp_path / "run"
    assert main(["run", *CSV_FLAGS, "--data.path", str(first), "--rounds", "1",
                 "--out", str(out), *FAST]) == 0
    moved = tmp_path / "moved" / "d.csv"
    moved.parent.mkdir()
    first.rename(moved)
    capsys.readouterr()
    assert main(["run", "--resume", "--rounds", "2", "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"data file {first} is gone" in err and "--data.path" in err
    other = write_csv(tmp_path / "other.csv", rows=44)
    assert main(["run", "--resume", "--rounds", "2", "--out", str(out), "--data.path",
                 str(other), *FAST]) == 2
    assert f"{other} is not the one the run read ({first})" in capsys.readouterr().err
    assert main(["run", "--resume", "--rounds", "2", "--out", str(out), "--data.path",
                 str(moved), *FAST]) == 0
    assert json.loads((out / "config.json").read_text())["data"]["path"] == str(moved)
    assert json.loads((out / "results.json").read_text())["summary"]["rounds_completed"] == 2


def test_csv_settings_without_data_name_csv_are_refused(tmp_path, capsys):
    """Without data.name=csv the file would be ignored and the run would train on digits."""
    from fedkernels.cli import main

    data = write_csv(tmp_path / "d.csv")
    out = tmp_path / "run"
    assert main(["run", "--data.path", str(data), "--rounds", "1", "--out", str(out),
                 *FAST]) == 2
    assert "data.path is a setting of CSV data, but data.name is 'digits': add --data.name csv" \
        in capsys.readouterr().err
    assert not out.exists()
    for setting in ({"label_column": "y"}, {"client_column": "site"}, {"delimiter": ";"},
                    {"standardize": False}, {"positive_labels": [1]}):
        with pytest.raises(ConfigError, match=f"data.{next(iter(setting))} is a setting of CSV"):
            DataConfig(name="synthetic", **setting)
    DataConfig(name="digits", label_column="label")  # the default value is no setting


def test_a_data_path_from_a_config_file_may_start_with_the_home_folder(tmp_path, monkeypatch):
    from fedkernels.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    write_csv(tmp_path / "d.csv")
    config = tmp_path / "exp.yaml"
    config.write_text("rounds: 1\ndata: {name: csv, path: ~/d.csv, label_column: diagnosis, "
                      "client_column: site}\npartition: {kind: natural}\n")
    out = tmp_path / "run"
    assert main(["run", "--config", str(config), "--out", str(out), *FAST]) == 0
    assert json.loads((out / "config.json").read_text())["data"]["path"] == str(tmp_path / "d.csv")


# ---------------------------------------------------------------- names and warnings


@pytest.mark.slow
def test_algorithm_names_ignore_case_and_misspellings_get_a_suggestion(tmp_path):
    out = tmp_path / "run"
    assert_success(fedkernels("run", "--algorithm", "FedAvg", "--rounds", "1", "--out", str(out),
                              *FAST))
    assert json.loads((out / "config.json").read_text())["algorithm"] == "fedavg"
    assert_one_line_error(fedkernels("run", "--algorithm", "fedavgg", "--rounds", "1", *FAST),
                          "unknown algorithm 'fedavgg'; did you mean fedavg?")
    assert_one_line_error(fedkernels("compare", "--algorithms", "fedproxx", "--seeds", "0",
                                     "--out", str(tmp_path / "c")),
                          "did you mean fedprox?", command="compare")


@pytest.mark.slow
def test_a_client_with_too_few_rows_is_named_by_its_value(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("x,label,site\n0,0,a\n1,1,b\n2,0,a\n3,1,b\n4,0,a\n5,1,b\n6,0,c\n")
    done = fedkernels("run", "--data.name", "csv", "--data.path", str(data),
                      "--data.client_column", "site", "--partition.kind", "natural",
                      "--rounds", "1", "--out", str(tmp_path / "run"), *FAST)
    assert_one_line_error(done, "client 'c' of column 'site' has 1", "partition.min_samples")


def test_a_client_column_read_as_a_feature_is_warned_about(tmp_path, capsys):
    """'client' is the natural partition's column by default; under iid it was silently
    one-hot encoded, the sites leaking into the inputs."""
    from fedkernels.cli import main

    data = tmp_path / "d.csv"
    data.write_text("x,label,client\n" + "".join(f"{i},{i % 2},{'ab'[i % 3 == 0]}\n"
                                                  for i in range(40)))
    csv = ["--data.name", "csv", "--data.path", str(data), "--rounds", "1", *FAST]
    assert main(["run", *csv, "--out", str(tmp_path / "iid")]) == 0
    err = capsys.readouterr().err
    assert "warning: column 'client' is read as a feature (partition.kind=iid" in err
    features = json.loads((tmp_path / "iid" / "results.json").read_text())[
        "data_preparation"]["features"]["feature_names"]
    assert "client=a" in features
    assert main(["run", *csv, "--data.client_column", "client",
                 "--out", str(tmp_path / "named")]) == 0
    assert main(["run", *csv, "--partition.kind", "natural", "--out", str(tmp_path / "n")]) == 0
    assert "read as a feature" not in capsys.readouterr().err


@pytest.mark.slow
def test_data_warnings_are_one_line_each(tmp_path):
    data = tmp_path / "d.csv"
    rows = "".join(f'{i},"{i % 5},5",{("yes", "Yes", "no")[i % 3]}\n' for i in range(30))
    data.write_text("x,rate,label\n" + rows)
    done = fedkernels("run", "--data.name", "csv", "--data.path", str(data), "--rounds", "1",
                      "--out", str(tmp_path / "run"), *FAST)
    assert_success(done)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("fedkernels run: warning: ") for line in lines)
    assert "'Yes', 'yes'" in lines[0] and "decimal comma" in lines[1]
    assert "hold a single class each, so no AUROC" in lines[2]
    assert os.path.exists(tmp_path / "run" / "results.json")
