"""``fedkernels run`` as a new user meets it: flags (no abbreviations, a hint for a misspelled
one, help that shows one algorithm's options), values that make no sense (NaN, infinity), a CSV
without a client column, a missing optional package, and the documented examples of errors.

Each behaviour is checked once through the console script in a child process; variants run in
this process (the same code, without a child's start-up cost)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import typing
from pathlib import Path

import pytest
from cli_process import FAST, assert_one_line_error, assert_success, fedkernels

from fedkernels.algorithms.registry import build_strategy, registered, strategy_class
from fedkernels.cli import main
from fedkernels.sim.config import (
    SECTIONS,
    ClientConfig,
    ConfigError,
    ExperimentConfig,
    ParticipationConfig,
    field_types,
    from_dict,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, command: str = "run") -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedkernels {command}: error: "), err
    return lines[0]


# ---------------------------------------------------------------- flags


@pytest.mark.slow
def test_abbreviations_are_refused_with_the_closest_flag(tmp_path):
    done = fedkernels("run", "--round", "2", "--out", str(tmp_path / "x"), *FAST)
    assert_one_line_error(done, "unrecognized argument --round; did you mean --rounds?")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_misspelled_flag_names_the_closest_one():
    done = fedkernels("run", "--partition.alhpa", "0.3")
    assert_one_line_error(
        done, "unrecognized argument --partition.alhpa; did you mean --partition.alpha?"
    )
    assert "usage:" not in done.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fedprox.mo", "1"], "did you mean --fedprox.mu?"),  # hidden options are suggested
        (["--partition.alhpa=0.3"], "unrecognized argument --partition.alhpa; did you mean"),
        (["--seed", "1", "2"], "unexpected argument '2'"),
        (["--rounds"], "argument --rounds: expected one argument"),
        (["--no-progres"], "did you mean --no-progress?"),
    ],
)
def test_flag_errors_are_one_line(capsys, argv, message):
    assert main(["run", *argv]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("argv, message", [
    (["--data.name", "digts"], "data.name: 'digts' is not one of: digits, "),
    (["--participation.kind", "unifrom"], "; did you mean uniform?"),
    (["--algorithm", "fedprx"], "did you mean fedprox?"),
])
def test_misspelled_values_name_the_closest_one(capsys, argv, message):
    assert main(["run", *argv]) == 2
    assert message in one_line_error(capsys)


def test_a_flag_given_twice_keeps_its_last_value(capsys):
    """argparse's rule: the last value wins, and only that one is read (an earlier bad value is
    not an error, and an error names the value it is about)."""
    assert main(["run", "--rounds", "x", "--rounds", "3", "--vmap", "--vmap", "0",
                 "--print_config"]) == 0
    text = capsys.readouterr().out
    assert "rounds: 3" in text and "vmap: false" in text
    assert main(["run", "--rounds", "3", "--rounds", "x"]) == 2
    assert "rounds: expected an integer, got 'x'" in one_line_error(capsys)


@pytest.mark.parametrize("argv, hidden, vmap", [
    (["--model.hidden", "64,32", "--vmap"], [64, 32], True),
    (["--model.hidden", "[64, 32]", "--vmap", "1"], [64, 32], True),
    (["--model.hidden=48", "--vmap=no"], [48], False),
])
def test_lists_and_booleans_as_users_write_them(capsys, argv, hidden, vmap):
    assert main(["run", *argv, "--print_config"]) == 0
    text = capsys.readouterr().out
    assert f"hidden: {hidden}" in text.replace("\n", " ")
    assert ("vmap: true" in text) == vmap


def test_compare_refuses_abbreviations_too(capsys):
    assert main(["compare", "--algorithms", "fedavg", "--seed", "0"]) == 2
    assert "did you mean --seeds?" in one_line_error(capsys, "compare")


def normalized(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
def test_help_shows_the_chosen_algorithm_only_with_one_default_each():
    default = fedkernels("run", "--help")
    assert_success(default)
    text = normalized(default.stdout)
    assert "--partition.alpha" in text and "--client.lr" in text and "--rounds" in text
    assert "fedkernels run --algorithm NAME --help" in text
    assert "--fedprox.mu" not in default.stdout and "--fedevg." not in default.stdout
    assert len(default.stdout.splitlines()) < 271  # a dozen list the models' sizes; --version

    chosen = fedkernels("run", "--algorithm", "fedevg", "--help")
    assert_success(chosen)
    assert "--fedevg.server_beta_last" in chosen.stdout and "--fedprox.mu" not in chosen.stdout
    for help_text in (default.stdout, chosen.stdout):
        doubled = re.findall(r"\(default: [^()]*\) \(default:", normalized(help_text))
        assert not doubled, doubled


def test_every_algorithm_help_has_one_default_per_option(capsys):
    for name in registered():
        assert main(["run", "--algorithm", name, "--help"]) == 0
        text = normalized(capsys.readouterr().out)
        assert not re.findall(r"\(default: [^()]*\) \(default:", text), name
        config_class = strategy_class(name).config_class
        for f in dataclasses.fields(config_class) if config_class else []:
            assert f"--{name}.{f.name}" in text, (name, f.name)


def test_hidden_algorithm_options_still_work_from_a_config_file(tmp_path, capsys):
    config = tmp_path / "exp.yaml"
    config.write_text("algorithm: fedprox\nrounds: 1\n")
    out = tmp_path / "run"
    assert main(["run", "--config", str(config), "--fedprox.mu", "0.3", "--out", str(out),
                 *FAST]) == 0
    assert json.loads((out / "config.json").read_text())["algorithm_params"] == {"mu": 0.3}


def test_a_config_files_algorithm_settings_that_go_astray_are_named(tmp_path, capsys):
    out = ["--out", str(tmp_path / "run"), *FAST]
    # the parameters written as the flags spell them, a section of the algorithm's name
    section = tmp_path / "section.yaml"
    section.write_text("algorithm: fedprox\nfedprox: {mu: 0.1}\nrounds: 1\n")
    assert main(["run", "--config", str(section), *out]) == 2
    assert "unknown key fedprox; an algorithm's parameters go under algorithm_params" in \
        one_line_error(capsys)
    # --algorithm replacing the file's, whose parameters it was given
    params = tmp_path / "params.yaml"
    params.write_text("algorithm: fedprox\nalgorithm_params: {mu: 0.1}\nrounds: 1\n")
    assert main(["run", "--config", str(params), "--algorithm", "fedavg", *out]) == 2
    assert "--algorithm fedavg replaces the algorithm of" in one_line_error(capsys)
    assert main(["run", "--config", str(params), "--algorithm", "FedProx", *out]) == 0


# ---------------------------------------------------------------- values


@pytest.mark.slow
def test_non_finite_learning_rate_is_refused_naming_the_key(tmp_path):
    for value in ("inf", "nan"):
        done = fedkernels("run", "--client.lr", value, "--out", str(tmp_path / "x"), *FAST)
        assert_one_line_error(done, f"client.lr: expected a finite number, got '{value}'")
    assert not (tmp_path / "x").exists()


def float_fields(cls) -> list[str]:
    types = field_types(cls)
    floats = []
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        args = set(typing.get_args(tp))
        if tp is float or float in args or tp == list[float] or list[float] in args:
            floats.append(f.name)
    return floats


SECTION_FLOATS = [
    (section, name)
    for section in SECTIONS
    for name in float_fields(field_types(ExperimentConfig)[section])
]


@pytest.mark.parametrize("section, name", SECTION_FLOATS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan"), float("inf")])
def test_every_float_field_refuses_non_finite_values(section, name, value):
    with pytest.raises(ConfigError, match=rf"^{section}\.{name}(\[0\])?: expected a finite number"):
        tree = {section: {name: [value] if "probabilities" in name else value}}
        from_dict(ExperimentConfig, tree)


def test_every_algorithm_float_parameter_refuses_non_finite_values():
    checked = 0
    for algorithm in registered():
        config_class = strategy_class(algorithm).config_class
        for name in float_fields(config_class) if config_class else []:
            with pytest.raises(ConfigError, match=rf"^{algorithm}\.{name}: expected a finite"):
                build_strategy(algorithm, {name: "nan"})
            checked += 1
    assert checked > 20


def test_a_list_field_takes_one_number_from_a_file_as_the_flag_does():
    # YAML's 'hidden: 64' was "expected a list", where --model.hidden 64 is one
    config = from_dict(ExperimentConfig, {"model": {"hidden": 32},
                                          "data": {"name": "csv", "path": "x.csv",
                                                   "positive_labels": 1}})
    assert config.model.hidden == [32] and config.data.positive_labels == [1]
    with pytest.raises(ConfigError, match="model.hidden: expected a list, got True"):
        from_dict(ExperimentConfig, {"model": {"hidden": True}})


def test_python_configs_refuse_non_finite_values_too():
    with pytest.raises(ConfigError, match="client.lr must be a finite number"):
        ClientConfig(lr=math.inf)
    with pytest.raises(ConfigError, match="participation.probabilities must be a finite number"):
        ParticipationConfig(probabilities=[0.5, math.nan])


# ---------------------------------------------------------------- CSV without a client column


@pytest.fixture
def noclient_csv(tmp_path) -> Path:
    path = tmp_path / "noclient.csv"
    rows = ["a,b,y"] + [f"{(i * 7) % 11 / 3},{(i * 5) % 13 / 4},{i % 2}" for i in range(90)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.slow
def test_csv_without_client_column_runs_iid(tmp_path, noclient_csv):
    out = tmp_path / "run"
    done = fedkernels("run", "--data.name", "csv", "--data.path", str(noclient_csv),
                      "--data.label_column", "y", "--rounds", "1", "--out", str(out), *FAST)
    assert_success(done)
    assert len(json.loads((out / "results.json").read_text())["clients"]) == 3


def test_csv_without_client_column_dirichlet_and_natural(tmp_path, noclient_csv, capsys):
    data = ["--data.name", "csv", "--data.path", str(noclient_csv), "--data.label_column", "y"]
    out = tmp_path / "run"
    assert main(["run", *data, "--partition.kind", "dirichlet", "--partition.alpha", "5",
                 "--rounds", "1", "--out", str(out), *FAST]) == 0
    capsys.readouterr()
    # only the natural partition needs the column, and says so
    assert main(["run", *data, "--partition.kind", "natural", "--out", str(tmp_path / "n"),
                 *FAST]) == 2
    assert "client" in one_line_error(capsys)


def test_natural_partition_still_finds_a_column_named_client():
    config = from_dict(ExperimentConfig, {"data": {"name": "csv", "path": "x.csv"},
                                          "partition": {"kind": "natural"}})
    assert config.data.client_column == "client"
    iid = from_dict(ExperimentConfig, {"data": {"name": "csv", "path": "x.csv"}})
    assert iid.data.client_column is None


# ---------------------------------------------------------------- the sim extra

SITECUSTOMIZE = "import sys\nsys.modules[{name!r}] = None  # as if the package were absent\n"


@pytest.mark.slow
@pytest.mark.parametrize("module, extra_args", [("tqdm", []), ("yaml", ["--config", "exp.yaml"]),
                                                ("jsonargparse", [])])
def test_missing_sim_extra_names_the_install_command(tmp_path, module, extra_args):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(SITECUSTOMIZE.format(name=module))
    (tmp_path / "exp.yaml").write_text("rounds: 1\n")
    done = fedkernels("run", "--rounds", "1", "--out", str(tmp_path / "x"), "--threads", "1",
                      *extra_args, cwd=tmp_path, PYTHONPATH=str(blocker))
    named = "PyYAML" if module == "yaml" else module
    assert_one_line_error(done, 'pip install "fedkernels[sim]"', named)
    assert "Traceback" not in done.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "module, argv, hint",
    [
        ("tqdm", [], "--no-progress"),
        ("matplotlib", ["--no-progress"], "--no-plots"),
        ("sklearn", ["--no-progress", "--no-plots"], "digits"),
    ],
)
def test_each_missing_package_is_named_before_anything_is_written(
    tmp_path, capsys, monkeypatch, module, argv, hint
):
    monkeypatch.setitem(sys.modules, module, None)
    assert main(["run", "--rounds", "1", "--out", str(tmp_path / "x"), *argv]) == 2
    line = one_line_error(capsys)
    assert module in line and 'pip install "fedkernels[sim]"' in line and hint in line
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the documented examples


def documented_error_examples() -> list[tuple[list[str], str]]:
    """``$ fedkernels ...`` lines of docs/guide/cli.md's shell transcripts and the line after each."""
    lines = (ROOT / "docs" / "guide" / "cli.md").read_text().splitlines()
    return [
        (line[2:].split()[1:], lines[i + 1])
        for i, line in enumerate(lines)
        if line.startswith("$ fedkernels ") and "error" in lines[i + 1]
    ]


@pytest.mark.slow
def test_documented_error_examples_are_what_the_command_prints():
    examples = documented_error_examples()
    assert len(examples) >= 2
    for argv, expected in examples:
        done = fedkernels(*argv)
        assert done.returncode == 2 and done.stderr.strip() == expected, (argv, done.stderr)
