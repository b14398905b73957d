"""``fedkernels run`` and the files of a run folder: damaged files on ``--resume``, output
folders that are files or hold a run, and the command printed after Ctrl-C. Every case runs the
console script in a child process, as a user would."""

from __future__ import annotations

import json
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from cli_process import (
    FAST,
    TIMEOUT_S,
    assert_one_line_error,
    assert_success,
    child_env,
    fedkernels,
    interrupt_when,
)

from fedkernels.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished two-round run (config.json, checkpoint.pt, results.json)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert_success(fedkernels("run", "--rounds", "2", "--out", str(out), *FAST))
    return out


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def damage_empty(path: Path) -> None:
    path.write_bytes(b"")


def damage_garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)


def damage_foreign_pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"format": 1, "hello": object}))


def damage_tensor(path: Path) -> None:
    torch.save(torch.zeros(3), path)


def damage_list(path: Path) -> None:
    path.write_text("[1, 2, 3]\n")


def damage_bad_value(path: Path) -> None:
    tree = json.loads(path.read_text())
    tree["client"]["lr"] = "fast"
    path.write_text(json.dumps(tree))


DAMAGES = [
    ("checkpoint.pt", damage_truncate, "truncated, corrupt"),
    ("checkpoint.pt", damage_empty, "truncated, corrupt"),
    ("checkpoint.pt", damage_garbage, "truncated, corrupt"),
    ("checkpoint.pt", damage_foreign_pickle, "truncated, corrupt"),
    ("checkpoint.pt", damage_tensor, "not a mapping"),
    ("config.json", damage_truncate, "empty or damaged"),
    ("config.json", damage_empty, "empty or damaged"),
    ("config.json", damage_garbage, "empty or damaged"),
    ("config.json", damage_list, "does not hold a configuration mapping"),
    ("config.json", damage_bad_value, "client.lr: expected a number"),
]


def damaged_copy(tmp_path, finished_run, name, damage) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    damage(out / name)
    return out, {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("name, damage, fragment", [DAMAGES[0], DAMAGES[6]])
def test_damaged_file_on_resume_is_a_one_line_error(tmp_path, finished_run, name, damage, fragment):
    out, before = damaged_copy(tmp_path, finished_run, name, damage)
    done = fedkernels("run", "--resume", "--rounds", "3", "--out", str(out), *FAST)
    assert_one_line_error(done, "cannot resume", str(out / name), fragment)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("name, damage, fragment", DAMAGES)
def test_every_damage_on_resume_is_a_one_line_error(
    tmp_path, finished_run, capsys, name, damage, fragment
):
    """The same, in this process, for every kind of damage (a child process each is slow)."""
    out, before = damaged_copy(tmp_path, finished_run, name, damage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a warning would be a second line
        code = main(["run", "--resume", "--rounds", "3", "--out", str(out), *FAST])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not caught, [str(w.message) for w in caught]
    assert err.startswith(f"fedkernels run: error: cannot resume: {out / name}") and fragment in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_out_naming_a_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "results.txt"
    path.write_text("keep me\n")
    assert_one_line_error(
        fedkernels("run", "--out", str(path), *FAST), f"--out {path} exists and is not a folder"
    )
    assert main(["run", "--out", str(path / "sub"), *FAST]) == 2
    assert f"--out {path / 'sub'}: {path} exists and is not a folder" in capsys.readouterr().err
    assert path.read_text() == "keep me\n"


@pytest.mark.slow
def test_a_folder_holding_a_run_is_replaced_only_with_overwrite(tmp_path, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "curves.png").write_bytes(b"old plot")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    done = fedkernels("run", "--rounds", "1", "--out", str(out), *FAST)
    assert_one_line_error(done, f"--out {out} already holds a run", "--resume", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    assert main(["run", "--resume", "--overwrite", "--out", str(out), *FAST]) == 2

    leftovers = [out / f"{name}.4242-0badf00d.partial"  # of writers killed mid-write
                 for name in ("config.json", "checkpoint.pt", "results.json")]
    for path in leftovers:
        path.write_bytes(b"half")
    assert_success(fedkernels("run", "--rounds", "1", "--out", str(out), "--overwrite", *FAST))
    assert not any(path.exists() for path in leftovers)
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1]
    assert not (out / "curves.png").exists()  # the old run's plot went with it (--no-plots)
    # a folder with only a config.json (a run stopped before its first checkpoint) is reused
    (out / "results.json").unlink()
    (out / "checkpoint.pt").unlink()
    assert main(["run", "--rounds", "1", "--out", str(out), *FAST]) == 0


def test_a_hand_written_config_json_in_the_folder_is_not_written_over(tmp_path, capsys):
    """`--config config.json --out .`: the run's own config.json would replace the user's."""
    mine = tmp_path / "config.json"
    mine.write_text('{"rounds": 1, "partition": {"num_clients": 2}}')
    before = mine.read_bytes()
    assert main(["run", "--config", str(mine), "--out", str(tmp_path), *FAST]) == 2
    assert "holds a config.json that is not a run's" in capsys.readouterr().err
    assert mine.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json"]
    assert main(["run", "--config", str(mine), "--out", str(tmp_path / "run"), *FAST]) == 0
    # a run's own config.json (a run stopped before its first checkpoint) is no such file
    shutil.copy(tmp_path / "run" / "config.json", mine)
    assert main(["run", "--rounds", "1", "--out", str(tmp_path), *FAST]) == 0


@pytest.mark.slow
def test_a_run_that_ends_while_another_sets_up_is_not_replaced(tmp_path, finished_run):
    # The folder check runs twice: before the (possibly long) setup, and again once the
    # folder is locked, where a run that ended in between has left its results.
    from fedkernels.cli.run import run_experiment
    from fedkernels.sim import ExperimentConfig, ModelConfig, PartitionConfig
    from fedkernels.sim.config import ConfigError

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    config = ExperimentConfig(rounds=1, model=ModelConfig(name="logreg"),
                              partition=PartitionConfig(num_clients=2))
    with pytest.raises(ConfigError, match="already holds a run"):
        run_experiment(config, out, progress=False, plots=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path):
    out = tmp_path / "my run"  # a space: the printed command must quote it
    args = ["run", "--rounds", "100000", "--out", str(out), "--threads", "1", "--no-plots",
            "--model.name", "logreg", "--partition.num_clients", "2"]
    code, err = interrupt_when(args, ready=out / "checkpoint.pt")
    assert code == 130, err
    last = err.strip().splitlines()[-1]
    prefix = "interrupted; continue with: "
    assert last.startswith(prefix), err
    command = shlex.split(last[len(prefix):])
    assert command == ["fedkernels", "run", "--resume", "--out", str(out), "--threads", "1",
                       "--no-plots"]
    # the printed command works (with --rounds to end soon)
    reached = torch.load(out / "checkpoint.pt", weights_only=True)["next_round"]
    done = fedkernels(*command[1:], "--rounds", str(reached + 1), "--no-progress")
    assert_success(done)
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["rounds_completed"] == reached + 1


@pytest.mark.slow
def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """A job scheduler, ``timeout`` or ``kill`` sends SIGTERM: the run ends as after Ctrl-C,
    with the command that continues it, and leaves no temporary file or lock behind."""
    out = tmp_path / "run"
    args = ["run", "--rounds", "100000", "--out", str(out), "--threads", "1", "--no-plots",
            "--no-progress", "--model.name", "logreg", "--partition.num_clients", "2"]
    code, err = interrupt_when(args, ready=out / "checkpoint.pt", settle_s=0.5,
                               sig=signal.SIGTERM)
    assert code == 143, err
    assert err.strip().splitlines()[-1].startswith("terminated; continue with: fedkernels run "
                                                   "--resume --out"), err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.json"]
    # what a writer killed outright (SIGKILL) leaves is removed by the next run in the folder
    leftover = out / "checkpoint.pt.4242-0badf00d.partial"
    leftover.write_bytes(b"half")
    reached = torch.load(out / "checkpoint.pt", weights_only=True)["next_round"]
    assert main(["run", "--resume", "--out", str(out), "--rounds", str(reached + 1),
                 "--threads", "1", "--no-plots", "--no-progress"]) == 0
    assert not leftover.exists()


# Ctrl-C pressed over and over while checkpoints are written: every write either lands whole or
# leaves the previous checkpoint, and the interpreter exits normally (a writer left unfinished by
# the interrupt once aborted it at exit, finishing into a closed file)
_INTERRUPTED_SAVES = """
import gc, random, signal, sys
from fedkernels.algorithms import build_strategy
from fedkernels.sim import ExperimentConfig, ModelConfig, PartitionConfig, Simulation

def config():
    return ExperimentConfig(rounds=1, model=ModelConfig(name="mlp", hidden=[64]),
                            partition=PartitionConfig(num_clients=2))

sim = Simulation(config(), build_strategy("fedavg"), checkpoint=sys.argv[1])
sim.run()

def press(*_):
    raise KeyboardInterrupt

random.seed(0)
signal.signal(signal.SIGALRM, press)
landed = interrupted = 0
while landed + interrupted < 400:
    try:
        signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-5, 2e-3))
        sim.save_checkpoint()
        signal.setitimer(signal.ITIMER_REAL, 0)
        landed += 1
    except KeyboardInterrupt:
        interrupted += 1
signal.setitimer(signal.ITIMER_REAL, 0)
signal.signal(signal.SIGALRM, signal.SIG_IGN)
gc.collect()
Simulation(config(), build_strategy("fedavg"), checkpoint=sys.argv[1]).load_checkpoint()
print(landed, interrupted)
"""


@pytest.mark.slow
def test_ctrl_c_inside_checkpoint_writes_never_aborts_the_interpreter(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_SAVES, str(tmp_path / "checkpoint.pt")],
        env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    landed, interrupted = map(int, done.stdout.split())
    assert interrupted > 0, done.stdout  # the timer did reach the writes
