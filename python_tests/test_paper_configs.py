"""The configurations of the papers' tables in ``configs/`` and ``fedkernels run --smoke``.

Every file parses and validates as ``fedkernels run --config FILE`` reads it (fast); every file
runs end to end with ``--smoke`` (slow: tiny files in the publisher's format stand in for the
data sets that need a download, MNIST-1D is generated). ``--smoke`` itself: what it shrinks,
that it has tiny files for every file-based data set, and that a bad key still fails with the
CLI's one-line error before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fedkernels.algorithms.registry import build_strategy, strategy_class
from fedkernels.cli import main
from fedkernels.cli.config_file import load_config_file
from fedkernels.sim.config import (
    DATASET_OPTIONS,
    FILE_DATASETS,
    DataConfig,
    ExperimentConfig,
    from_dict,
)
from fedkernels.sim.data import load_dataset
from fedkernels.sim.smoke import DATA_FOLDER, smoke_config, write_tiny_dataset

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PAPER_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
STAND_INS = sorted((CONFIGS / "mnist1d").glob("*.yaml"))
ALL_CONFIGS = PAPER_CONFIGS + STAND_INS
# the algorithm families of the papers: each has a table's configuration and a stand-in
FAMILIES = {"superfed-mm", "aaggff-s", "aaggff-d", "fedau", "fedgo", "fedevg", "vred", "semi-vred"}
RUN_FLAGS = ["--threads", "1", "--no-progress", "--no-plots"]


def config_id(path: Path) -> str:
    return str(path.relative_to(CONFIGS))


def checked(path: Path) -> ExperimentConfig:
    """The configuration of ``path`` as ``fedkernels run --config`` checks it."""
    config = from_dict(ExperimentConfig, load_config_file(path))
    build_strategy(config.algorithm, config.algorithm_params)
    return config


def test_every_family_has_a_table_and_a_stand_in():
    tables = {checked(p).algorithm for p in PAPER_CONFIGS}
    stand_ins = {checked(p).algorithm for p in STAND_INS}
    assert FAMILIES <= tables and FAMILIES <= stand_ins
    assert sorted(stand_in_target(p) for p in STAND_INS) == PAPER_CONFIGS


def stand_in_target(path: Path) -> Path:
    """The table's configuration a stand-in's first line names (``../NAME.yaml``)."""
    return CONFIGS / path.read_text().split("../", 1)[1].split()[0]


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=config_id)
def test_a_table_config_parses_cites_its_table_and_reads_the_publishers_files(path):
    config = checked(path)
    header = path.read_text().split("\nalgorithm:")[0]
    assert "Table" in header.splitlines()[0] + header.splitlines()[1], \
        "the first lines name the paper's table"
    assert header.count("%") >= 1, "the comments give the paper's numbers"
    assert config.data.name in (*FILE_DATASETS, "heart")
    assert config.data.root and not Path(config.data.root).is_absolute(), \
        "data.root is a folder the user fills (relative to where the command runs)"


@pytest.mark.parametrize("path", STAND_INS, ids=config_id)
def test_a_stand_in_parses_and_needs_no_download(path):
    config = checked(path)
    assert config.data.name == "mnist1d" and config.data.root is None
    assert path.read_text().startswith("# MNIST-1D stand-in for ../")
    target = stand_in_target(path)
    assert target.is_file() and checked(target).algorithm == config.algorithm


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", ALL_CONFIGS, ids=config_id)
def test_every_config_runs_with_smoke(path, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--config", str(path), "--smoke", "--out", str(out), *RUN_FLAGS]) == 0, \
        capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["rounds_completed"] == 2
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == checked(path).algorithm
    # config.json lists the fields that apply: root only for the publishers' data sets
    if saved["data"].get("root") is not None:  # the tiny files, inside the run's folder
        assert Path(saved["data"]["root"]) == (out / DATA_FOLDER).resolve()


def test_a_bad_key_fails_with_the_one_line_error_before_anything_is_written(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    text = (CONFIGS / "fedau_cifar10.yaml").read_text()
    bad.write_text(text.replace("  batch_size: 16", "  batch_sise: 16"))
    out = tmp_path / "run"
    assert main(["run", "--config", str(bad), "--smoke", "--out", str(out), *RUN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedkernels run: error: unknown key "
                                                   "client.batch_sise")
    assert not out.exists()


def test_smoke_lowers_every_size_and_keeps_every_choice(tmp_path):
    path = CONFIGS / "fedgo_cifar10.yaml"
    config = checked(path)
    small = smoke_config(config, tmp_path / "data", strategy_class(config.algorithm).config_class)
    assert (small.rounds, small.eval_every, small.checkpoint_every) == (2, 1, 1)
    assert small.partition.num_clients == 4 and small.partition.kind == "dirichlet"
    assert small.partition.alpha == 1.0
    assert small.participation.kind == "uniform" and small.participation.fraction == 0.5
    assert (small.client.steps, small.client.batch_size) == (2, 8)
    assert small.model == config.model and small.algorithm == config.algorithm
    params = small.algorithm_params
    assert (params["gan_steps"], params["disc_epochs"], params["server_epochs"]) == (2, 1, 1)
    assert params["disc_arch"] == "cnn" and params["generator"] == "wgan_gp"
    assert small.data.root == str((tmp_path / "data").resolve()) and small.data.server_fraction == 0.5
    assert (tmp_path / "data" / "cifar-10-batches-py" / "test_batch").is_file()


def test_smoke_keeps_enough_clients_to_cover_a_pathological_partition(tmp_path):
    config = checked(CONFIGS / "superfed_mm_mnist.yaml")
    small = smoke_config(config, tmp_path)
    assert small.partition.num_clients == 5  # 10 classes, 2 each
    assert small.algorithm_params == config.algorithm_params  # no algorithm class: untouched


def test_smoke_drops_probabilities_and_shrinks_models_and_generated_data(tmp_path):
    config = from_dict(ExperimentConfig, {
        "data": {"name": "mnist1d", "num_samples": 20000},
        "partition": {"num_clients": 10},
        "participation": {"kind": "bernoulli", "fraction": 0.1, "probabilities": [0.3] * 10},
        "model": {"name": "mlp", "hidden": [256, 256]},
        "client": {"epochs": 5, "batch_size": 4},
        "algorithm": "fedevg", "algorithm_params": {"energy_model": "resnet10"},
    })
    small = smoke_config(config, tmp_path, strategy_class("fedevg").config_class)
    assert small.data.num_samples == 400 and small.data.root is None
    assert small.participation.probabilities is None and small.participation.fraction == 0.5
    assert small.model.hidden == [8] and small.client.batch_size == 4
    # FedEvg's hidden belongs to its MLP energy model, refused with the ResNet-10: kept
    assert small.algorithm_params["spc"] == 1 and "hidden" not in small.algorithm_params
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", [*FILE_DATASETS, "heart"])
def test_smoke_has_tiny_files_for_every_file_based_data_set(name, tmp_path):
    options = {"root": str(tmp_path)}
    if name in DATASET_OPTIONS["official_split"]:
        options["official_split"] = True
    data = DataConfig(name=name, **options)
    classes = write_tiny_dataset(dataclasses.asdict(data), tmp_path)
    dataset = load_dataset(data, num_clients=4, seed=0)
    assert len(dataset.y) > 0
    if classes is not None:
        assert dataset.num_classes == classes
    else:  # LEAF's writers and the heart sites: one client each
        assert dataset.groups is not None and len(set(np.asarray(dataset.groups).tolist())) == 4


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_smoke_run_has_a_folder_of_its_own_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = str(CONFIGS / "mnist1d" / "aaggff_d.yaml")
    assert main(["run", "--config", config, "--smoke", *RUN_FLAGS]) == 0, capsys.readouterr().err
    out = tmp_path / "runs" / "aaggff-d-mnist1d-seed0-smoke"  # never a full run's folder
    assert (out / "results.json").is_file() and not (tmp_path / "runs" / out.name[:-6]).exists()
    first = json.loads((out / "results.json").read_text())["summary"]["test_accuracy"]
    assert main(["run", "--resume", "--out", str(out), "--smoke", *RUN_FLAGS]) == 0, \
        capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["summary"]["test_accuracy"] == first
