"""The ``fedkernels run`` command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedkernels.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


FAST = [
    "--model.name",
    "logreg",
    "--client.lr",
    "0.2",
    "--partition.num_clients",
    "5",
    "--no-progress",
]


def read(path):
    return json.loads(path.read_text())


def without_times(records):
    return [{k: v for k, v in r.items() if not (k.startswith("time") or k == "wall_time_s")}
            for r in records]


def test_run_writes_results_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--rounds",
                "3",
                "--out",
                str(out),
                *FAST,
                "--algorithm",
                "fedprox",
                "--fedprox.mu",
                "0.1",
            ]
        )
        == 0
    )
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "checkpoint.pt",
        "results.json",
        "metrics.csv",
        "curves.png",
        "curves.pdf",
        "client_accuracy.png",
        "client_accuracy.pdf",
    }
    results = read(out / "results.json")
    assert results["config"]["algorithm"] == "fedprox" and results["config"][
        "algorithm_params"
    ] == {"mu": 0.1}
    assert results["config"]["rounds"] == 3 and results["dataset"] == "digits"
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    for key in (
        "test_accuracy",
        "test_loss",
        "client_accuracy_mean",
        "client_accuracy_worst10",
        "client_accuracy_best10",
        "client_accuracy_std",
        "client_accuracy_gini",
        "time_client",
        "time_aggregate",
    ):
        assert key in results["rounds"][-1], key
    assert len(results["clients"]) == 5 and "test_accuracy" in results["clients"][0]
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "test accuracy" in capsys.readouterr().out


def test_yaml_config_and_flag_override(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(
        "rounds: 4\nseed: 3\npartition: {kind: dirichlet, alpha: 0.5, num_clients: 6}\n"
        "participation: {kind: uniform, fraction: 0.5}\nmodel: {name: logreg}\n"
        "server: {optimizer: fedavgm, lr: 1.0}\n"
    )
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--config",
                str(config),
                "--rounds",
                "2",
                "--out",
                str(out),
                "--no-progress",
                "--no-plots",
            ]
        )
        == 0
    )
    saved = read(out / "config.json")
    assert saved["rounds"] == 2 and saved["seed"] == 3 and saved["partition"]["alpha"] == 0.5
    assert saved["server"]["optimizer"] == "fedavgm"
    assert all(r["participants"] == 3 for r in read(out / "results.json")["rounds"])


def test_resume_equals_uninterrupted(tmp_path):
    args = [
        *FAST,
        "--no-plots",
        "--participation.kind",
        "bernoulli",
        "--participation.fraction",
        "0.6",
        "--client.momentum",
        "0.5",
        "--server.optimizer",
        "fedadam",
    ]
    assert main(["run", "--rounds", "4", "--out", str(tmp_path / "full"), *args]) == 0
    assert main(["run", "--rounds", "2", "--out", str(tmp_path / "part"), *args]) == 0
    assert (
        main(
            [
                "run",
                "--resume",
                "--rounds",
                "4",
                "--out",
                str(tmp_path / "part"),
                "--no-progress",
                "--no-plots",
            ]
        )
        == 0
    )
    full, part = read(tmp_path / "full" / "results.json"), read(tmp_path / "part" / "results.json")
    assert without_times(part["rounds"]) == without_times(full["rounds"])
    assert part["clients"] == full["clients"]
    assert part["summary"]["test_accuracy"] == full["summary"]["test_accuracy"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--partition.alpha", "x"], "partition.alpha: expected a number"),
        (["--algorithm", "nope"], "unknown algorithm 'nope'"),
        (["--fedprox.mu", "0.1"], "parameter of fedprox, but the algorithm is fedavg"),
        (["--participation.kind", "sometimes"], "is not one of"),
        (["--data.name", "csv"], "needs data.path"),
        (["--data.name", "csv", "--data.path", "/nonexistent.csv"], "no such file"),
        (["--config", "/nonexistent.yaml"], "no such file"),
        (["--resume"], "cannot resume: no config.json"),
        (["--vmap", "--model.batch_norm"], "BatchNorm"),
        (["--partition.kind", "natural"], "needs a data set with its own clients"),
        (["--threads", "0"], "--threads must be in [1, 1024]"),
    ],
)
def test_invalid_input_is_a_usage_error(tmp_path, capsys, argv, message):
    assert main(["run", "--out", str(tmp_path / "x"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_config_files(tmp_path, capsys):
    for name, text, message in [
        ("bad.yaml", "rounds: [1,\n", "cannot parse"),
        ("bad.json", "{rounds: 1}", "cannot parse"),
        ("list.yaml", "- 1\n", "top level must be a mapping"),
        ("key.json", '{"rounds": 2, "model": {"width": 3}}', "unknown key model.width"),
        # not read as JSON, whose parser's complaint said nothing of the format
        ("exp.toml", "rounds = 2\n", "a .toml file; --config reads YAML (.yaml, .yml) or JSON"),
        ("exp", "rounds: 2\n", "read as JSON: a YAML file needs the .yaml or .yml suffix"),
    ]:
        path = tmp_path / name
        path.write_text(text)
        assert main(["run", "--config", str(path), "--no-progress"]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_command_line_process_exit_codes(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "fedkernels.cli", "run", "--rounds", "-1"],
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode == 2
        and "rounds must be >= 1" in bad.stderr
        and "Traceback" not in bad.stderr
    )
    unknown = subprocess.run(
        [sys.executable, "-m", "fedkernels.cli", "run", "--no-such-flag"],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 2 and "unrecognized argument --no-such-flag" in unknown.stderr


@pytest.mark.parametrize("name, text", [
    ("EXP.YAML", "rounds: 3\nseed: 2\n"),
    ("exp.Yml", "rounds: 3\nseed: 2\n"),
    ("bom.json", "\ufeff" + '{"rounds": 3, "seed": 2}'),
    ("bom.yaml", "\ufeffrounds: 3\nseed: 2\n"),
])
def test_config_file_suffix_case_and_byte_order_mark(tmp_path, name, text):
    from fedkernels.cli.config_file import load_config_file

    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert load_config_file(path) == {"rounds": 3, "seed": 2}
