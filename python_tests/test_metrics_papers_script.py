"""experiments/fairness_papers.py: hyperparameters are tuned on rows carved out of the clients'
training splits only, and the script's method specs are what ``fedkernels compare`` reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from script_modules import load_script

from fedkernels.cli.compare import parse_algorithm
from fedkernels.sim.config import ExperimentConfig, from_dict
from fedkernels.sim.data import load_dataset
from fedkernels.sim.federation import build_federation

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "fairness_papers.py"


@pytest.fixture(scope="module")
def papers():
    yield load_script(SCRIPT, register=True)
    sys.modules.pop("fairness_papers", None)


def _rows(x: torch.Tensor) -> set[bytes]:
    return {row.numpy().tobytes() for row in x}


def test_validation_rows_are_training_rows_only(papers):
    tree = {"data": {"name": "digits"}, "model": {"name": "logreg"},
            "partition": {"kind": "dirichlet", "alpha": 0.3, "num_clients": 12}}
    dataset = papers.validation_dataset(tree, seed=1)
    config = from_dict(ExperimentConfig, {**tree, "seed": 1})
    federation = build_federation(load_dataset(config.data, 12, 1), config.partition,
                                  config.data.test_fraction, 1)
    train = _rows(torch.cat([c.train_x for c in federation.clients]))
    test = _rows(torch.cat([c.test_x for c in federation.clients]))
    rows = _rows(dataset.x)
    assert rows <= train and not rows & (test - train)
    kept = [c for c in federation.clients if c.num_train >= 2]
    assert len(dataset.x) == sum(c.num_train for c in kept)
    assert sorted(set(dataset.groups.tolist())) == list(range(len(kept)))


def test_method_specs_round_trip_through_compare(papers):
    for spec in papers.EXPERIMENTS.values():
        for label, name, params, grid in spec["methods"] + spec.get("long", []):
            text = papers.spec_text(label, name, params)
            assert parse_algorithm(text) == (name, {k: str(v) for k, v in params.items()}, label)
            for key, values in grid.items():
                assert values and key in {**params, key: None}


def test_tuning_results_replace_the_defaults(papers):
    spec = papers.EXPERIMENTS["semivred"]
    tree, methods = papers.apply_tuning(spec, {"lr": 0.02, "params": {"VRed": {"beta": 0.1}}})
    assert tree["client"]["lr"] == 0.02 and spec["tree"]["client"]["lr"] == 0.05
    assert dict((m[0], m[2]) for m in methods)["VRed"] == {"beta": 0.1}
    assert dict((m[0], m[2]) for m in methods)["Semi-VRed"] == {"beta": 0.5}


def test_paired_differences_seed_by_seed(papers):
    def entry(label, values):
        return {"label": label, "runs": [
            {"seed": seed, "summary": {"test_accuracy": a, "client_accuracy_mean": a,
                                       "client_accuracy_worst10": w}}
            for seed, (a, w) in values.items()]}

    base = entry("A", {0: (0.90, 0.50), 1: (0.80, 0.40)})
    # seeds listed in another order: the differences must still be matched by seed
    other = entry("B", {1: (0.85, 0.40), 0: (0.89, 0.60)})
    text = papers.paired_differences([base, other], "pooled")
    row = next(line for line in text.splitlines() if line.startswith("| B |"))
    # pooled: +5 and -1 points -> mean +2.0, sample std 4.24, t(1) = 12.706: half-width
    # 12.706 * 4.243 / sqrt(2) = 38.1; ahead on 1 seed, behind on 1
    assert "+2.0 ± 4.2 [-36.1, +40.1] (1/1)" in row
    # worst-10%: +10 and 0 -> +5.0 ± 7.1 [-58.5, +68.5], ahead on 1, behind on none
    assert row.endswith("+5.0 ± 7.1 [-58.5, +68.5] (1/0) |")
    flipped = papers.paired_differences([base, other], "pooled", base=1)
    assert "| A | -2.0 ± 4.2 [-40.1, +36.1] (1/1)" in flipped
    # an interval that excludes 0 is bold; one that holds it is not
    base = entry("A", {0: (0.90, 0.50), 1: (0.80, 0.40), 2: (0.70, 0.30)})
    third = entry("C", {0: (0.95, 0.55), 1: (0.85, 0.35), 2: (0.751, 0.35)})
    row = next(line for line in papers.paired_differences([base, third], "pooled").splitlines()
               if line.startswith("| C |"))
    assert "| **+5.0 ± 0.1 [+4.9, +5.2]** (3/0) |" in row
    assert row.endswith("| +1.7 ± 5.8 [-12.7, +16.0] (2/1) |")


def test_validation_rows_follow_a_stratified_split(papers):
    # a stratified run (heart's default) holds out other test rows than a plain split: the
    # tuning must carve its validation rows out of the run's own training rows
    tree = {"data": {"name": "digits", "stratify": True}, "model": {"name": "logreg"},
            "partition": {"kind": "dirichlet", "alpha": 0.3, "num_clients": 12}}
    dataset = papers.validation_dataset(tree, seed=2)
    config = from_dict(ExperimentConfig, {**tree, "seed": 2})
    federation = build_federation(load_dataset(config.data, 12, 2), config.partition,
                                  config.data.test_fraction, 2, stratify=True)
    test = _rows(torch.cat([c.test_x for c in federation.clients]))
    train = _rows(torch.cat([c.train_x for c in federation.clients]))
    assert _rows(dataset.x) <= train and not _rows(dataset.x) & (test - train)


def test_a_learning_rate_at_the_grid_edge_extends_the_grid(papers, monkeypatch, tmp_path):
    # validation score peaks at lr = 1: the grid {0.01, 0.03, 0.1} must grow upwards
    import math

    monkeypatch.setattr(papers, "validation_dataset", lambda tree, seed: None)
    monkeypatch.setattr(papers, "validation_score",
                        lambda tree, dataset, name, params, criterion, seed:
                        -abs(math.log(tree["client"]["lr"])))
    monkeypatch.setattr(papers, "TUNING_DIR", tmp_path)
    spec = {"tree": {"client": {"lr": 0.1}}, "criterion": "fair", "lr_grid": [0.03, 0.01, 0.1],
            "methods": [("FedAvg", "fedavg", {}, {})]}
    result = papers.tune("edge", spec)
    assert result["lr_grid"] == [0.01, 0.03, 0.1, 0.333, 1.11, 3.7]
    assert result["lr"] == 1.11
    # an interior best leaves the grid as written
    spec["lr_grid"] = [0.3, 1.0, 3.0]
    assert papers.tune("inside", spec)["lr_grid"] == [0.3, 1.0, 3.0]
