"""What the command line does before any experiment: --help and --version without importing
torch, the saved algorithm options that help reads, --print_config, and a default output
folder that never collides with an earlier run's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import assert_success, fedkernels

from fedkernels.cli import main, version_line
from fedkernels.cli.algorithm_options import ENTRY_POINT_GROUP, live, saved
from fedkernels.sim.provenance import package_version

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--model.name", "logreg", "--partition.num_clients", "3", "--rounds", "1",
        "--no-progress", "--no-plots"]
NO_TORCH = "import sys\nsys.modules['torch'] = None  # importing torch now fails\n"


def test_saved_algorithm_options_are_the_algorithms_own():
    # after changing an algorithm's parameters: python -m fedkernels.cli.algorithm_options
    assert saved() == live(sorted(saved())), "run: python -m fedkernels.cli.algorithm_options"
    assert set(saved()) == set(live())  # every built-in algorithm, no other


def test_the_entry_point_group_is_the_registrys():
    from fedkernels.algorithms.registry import ENTRY_POINT_GROUP as REGISTRY_GROUP

    assert ENTRY_POINT_GROUP == REGISTRY_GROUP


def test_help_from_the_saved_options_is_the_help_from_the_algorithms(capsys):
    from fedkernels.cli.run import build_parser

    for algorithm in ("fedavg", "fedprox", "fedevg", "krum"):
        assert build_parser(algorithm, help_only=True).format_help() == \
            build_parser(algorithm).format_help(), algorithm


@pytest.mark.slow
def test_help_and_version_answer_without_torch(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_TORCH)
    for argv in (["run", "--help"], ["run", "--algorithm", "FedProx", "--help"], ["--help"],
                 ["--version"], ["compare", "--help"]):
        done = fedkernels(*argv, PYTHONPATH=str(blocker))
        assert_success(done)
        assert "Traceback" not in done.stderr
    assert "--fedprox.mu" in fedkernels("run", "--algorithm", "fedprox", "--help",
                                        PYTHONPATH=str(blocker)).stdout


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["run", "--help"], ["run", "--algorithm", "fedprox", "--help"],
                                  ["compare", "--help"], ["run", "--version"]])
def test_help_imports_neither_torch_nor_numpy(argv):
    # python -m fedkernels.cli as the console script: the modules it imported, from importtime
    # (compare's tables import numpy; torch is what costs seconds)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "fedkernels.cli", *argv],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "fedkernels.cli.flags" in imported or argv[-1] == "--version"
    heavy = ("torch",) if argv[0] == "compare" else ("torch", "numpy")
    assert not {m for m in imported if m.split(".")[0] in heavy}


def test_version(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == version_line()
    assert re.fullmatch(rf"fedkernels {re.escape(package_version())}"
                        r"( \(git [0-9a-f]{12}(, modified)?\))?", line), line


def test_print_config_is_a_config_file_for_the_same_run(tmp_path, capsys):
    argv = ["--algorithm", "FedProx", "--fedprox.mu", "0.3", "--model.name", "cnn",
            "--server.optimizer", "fedadam", "--partition.alpha", "0.2"]
    assert main(["run", *argv, "--print_config"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "alpha" not in text  # an iid partition's: warned about, not printed
    assert "partition.alpha is read only with partition.kind=dirichlet" in captured.err
    assert "algorithm_params: {mu: 0.3}" in text and "hidden" not in text
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    assert main(["run", "--config", str(path), "--print_config"]) == 0
    assert capsys.readouterr().out == text
    # and nothing was written
    assert not (tmp_path / "runs").exists()
    out = tmp_path / "run"
    assert main(["run", "--config", str(path), "--out", str(out), *FAST]) == 0
    saved_config = json.loads((out / "config.json").read_text())
    assert saved_config["algorithm_params"] == {"mu": 0.3}
    assert saved_config["server"]["optimizer"] == "fedadam"


def test_the_default_output_folder_never_collides(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for _ in range(3):
        assert main(["run", *FAST]) == 0, capsys.readouterr().err
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [
        "fedavg-digits-seed0", "fedavg-digits-seed0-2", "fedavg-digits-seed0-3"]
    assert "-> runs/fedavg-digits-seed0-3/results.json" in capsys.readouterr().out
    # --overwrite without --out replaces the default folder, as it did
    assert main(["run", *FAST, "--overwrite"]) == 0
    assert len(list(runs.iterdir())) == 3
