"""The UCI Heart Disease data in both layouts people have it in: the repository's four
processed.<site>.data files (no header, codes, '?') and the merged heart_disease_uci.csv (a
header, words, empty cells). The same 16 patients are written in both, with the publisher's
exact header and spellings, and must read to the same features."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedkernels.sim.config import ConfigError, DataConfig, PartitionConfig, from_dict
from fedkernels.sim.data import load_dataset, stratified_split
from fedkernels.sim.datasets.heart import load_heart
from fedkernels.sim.federation import build_federation, stratified_split_client
from fedkernels.sim.tabular import DataWarning

pytest.importorskip("pandas")

# processed.<site>.data: age, sex, cp, trestbps, chol, fbs, restecg, thalach, exang, oldpeak,
# slope, ca, thal, num. Cleveland's file writes 63.0, Hungary's 29 (as the repository's do).
UCI = {
    "processed.cleveland.data": [
        "63.0,1.0,1.0,145.0,233.0,1.0,2.0,150.0,0.0,2.3,3.0,0.0,6.0,0",
        "28.0,1.0,2.0,130.0,132.0,0.0,2.0,185.0,0.0,0.0,?,?,?,0",
        "67.0,1.0,4.0,160.0,286.0,0.0,2.0,108.0,1.0,1.5,2.0,3.0,3.0,2",
        "43.0,1.0,4.0,132.0,247.0,1.0,2.0,143.0,1.0,0.1,2.0,?,7.0,1",
    ],
    "processed.hungarian.data": [
        "29,1,2,120,243,0,0,160,0,0,?,?,?,0",
        "48,0,2,?,308,0,1,?,?,2,1,?,?,0",
        "31,1,4,120,270,0,0,153,1,1.5,2,?,?,1",
        "54,1,4,140,?,0,0,118,1,0,?,?,?,1",
    ],
    "processed.switzerland.data": [
        "38,1,3,100,0,?,0,179,0,-1.1,1,?,?,0",
        "34,0,2,115,0,?,0,154,0,0.2,1,?,?,0",
        "32,1,1,95,0,?,0,127,0,.7,1,?,?,1",
        "69,1,4,?,0,0,1,?,?,?,?,?,7,3",
    ],
    "processed.va.data": [
        "44,1,4,130,209,0,1,127,0,0,?,?,?,0",
        "55,1,3,?,?,0,1,?,?,?,?,?,?,0",
        "63,1,4,140,260,0,1,112,1,3,2,?,?,2",
        "69,1,4,?,?,1,0,?,?,?,?,?,?,2",
    ],
}
MERGED = """\
id,age,sex,dataset,cp,trestbps,chol,fbs,restecg,thalch,exang,oldpeak,slope,ca,thal,num
1,63,Male,Cleveland,typical angina,145,233,TRUE,lv hypertrophy,150,FALSE,2.3,downsloping,0,fixed defect,0
304,28,Male,Cleveland,atypical angina,130,132,FALSE,lv hypertrophy,185,FALSE,0,,,,0
2,67,Male,Cleveland,asymptomatic,160,286,FALSE,lv hypertrophy,108,TRUE,1.5,flat,3,normal,2
193,43,Male,Cleveland,asymptomatic,132,247,TRUE,lv hypertrophy,143,TRUE,0.1,flat,,reversable defect,1
305,29,Male,Hungary,atypical angina,120,243,FALSE,normal,160,FALSE,0,,,,0
394,48,Female,Hungary,atypical angina,,308,FALSE,st-t abnormality,,,2,upsloping,,,0
492,31,Male,Hungary,asymptomatic,120,270,FALSE,normal,153,TRUE,1.5,flat,,,1
548,54,Male,Hungary,asymptomatic,140,,FALSE,normal,118,TRUE,0,,,,1
604,38,Male,Switzerland,non-anginal,100,0,,normal,179,FALSE,-1.1,upsloping,,,0
605,34,Female,Switzerland,atypical angina,115,0,,normal,154,FALSE,0.2,upsloping,,,0
598,32,Male,Switzerland,typical angina,95,0,,normal,127,FALSE,0.7,upsloping,,,1
715,69,Male,Switzerland,asymptomatic,,0,FALSE,st-t abnormality,,,,,,reversable defect,3
722,44,Male,VA Long Beach,asymptomatic,130,209,FALSE,st-t abnormality,127,FALSE,0,,,,0
902,55,Male,VA Long Beach,non-anginal,,,FALSE,st-t abnormality,,,,,,,0
721,63,Male,VA Long Beach,asymptomatic,140,260,FALSE,st-t abnormality,112,TRUE,3,flat,,,2
876,69,Male,VA Long Beach,asymptomatic,,,TRUE,normal,,,,,,,2
"""
DISEASE = [0, 0, 1, 1] * 4  # num > 0
SITES = {"Cleveland": 0, "Hungary": 1, "Switzerland": 2, "VA Long Beach": 3}


def write_uci(folder: Path, files=UCI, newline="\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
        (folder / name).write_bytes((newline.join(lines) + newline).encode())
    return folder


def write_merged(folder: Path, text: str = MERGED) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "heart_disease_uci.csv").write_text(text)
    return folder


def test_both_layouts_give_the_same_patients_the_same_features(tmp_path):
    uci = load_heart(write_uci(tmp_path / "uci", newline="\r\n"))
    merged = load_heart(write_merged(tmp_path / "merged"))
    assert uci.info["features"]["feature_names"] == merged.info["features"]["feature_names"]
    torch.testing.assert_close(uci.x, merged.x, rtol=0, atol=0)
    assert uci.y.tolist() == merged.y.tolist() == DISEASE
    assert uci.groups.tolist() == merged.groups.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert uci.info["clients"]["mapping"] == merged.info["clients"]["mapping"] == SITES
    # and on the statistics of any training rows
    train = np.array([0, 2, 3, 5, 6, 8, 10, 11, 12, 14])
    torch.testing.assert_close(uci.fit_features(train).x, merged.fit_features(train).x,
                               rtol=0, atol=0)


def test_categories_are_one_hot_and_numbers_imputed_and_standardised(tmp_path):
    d = load_heart(write_merged(tmp_path))
    f = d.info["features"]
    assert d.num_classes == 2 and d.info["task"] == "heart disease present: num > 0"
    assert d.info["labels"]["mapping"] == {"0": 0, "1": 1, "2": 1, "3": 1}
    assert set(f["one_hot"]) == {"sex", "cp", "fbs", "restecg", "exang", "slope", "thal"}
    assert set(f["standardized"]) == {"age", "trestbps", "chol", "thalach", "oldpeak", "ca"}
    assert f["one_hot"]["cp"]["levels"] == ["asymptomatic", "atypical angina", "non-anginal",
                                            "typical angina"]
    assert f["one_hot"]["thal"]["levels"] == ["fixed defect", "missing", "normal",
                                              "reversable defect"]
    names = f["feature_names"]
    first = dict(zip(names, d.x[0].tolist()))  # 63, Male, typical angina, ..., fixed defect
    assert first["sex=Male"] == 1 and first["sex=Female"] == 0
    assert first["cp=typical angina"] == 1 and first["thal=fixed defect"] == 1
    assert first["fbs=TRUE"] == 1 and first["exang=FALSE"] == 1
    assert first["trestbps (missing)"] == 0
    ages = np.array([63, 28, 67, 43, 29, 48, 31, 54, 38, 34, 32, 69, 44, 55, 63, 69], float)
    torch.testing.assert_close(d.x[:, names.index("age")].double(),
                               torch.from_numpy((ages - ages.mean()) / ages.std()),
                               rtol=0, atol=1e-6)
    assert f["numeric"]["trestbps"]["missing"] == 4
    assert d.x[5, names.index("trestbps (missing)")] == 1


def test_dataset_option_and_config(tmp_path):
    root = write_uci(tmp_path)
    config = from_dict(DataConfig, {"name": "heart", "root": str(root)})
    d = load_dataset(config, 10, 0)
    assert d.name == "heart" and d.num_samples == 16
    assert stratified_split(config) is True
    assert stratified_split(from_dict(DataConfig, {"name": "heart", "root": "x",
                                                   "stratify": "false"})) is False
    assert stratified_split(DataConfig()) is False
    with pytest.raises(ConfigError, match="data.name=heart needs data.root"):
        DataConfig(name="heart")


def test_some_of_the_site_files_read_with_a_warning(tmp_path):
    root = write_uci(tmp_path, {k: v for k, v in UCI.items() if "va" not in k})
    with pytest.warns(DataWarning, match="no processed.va.data: the run has 3 of the 4 sites"):
        d = load_heart(root)
    assert d.info["clients"]["mapping"] == {"Cleveland": 0, "Hungary": 1, "Switzerland": 2}


@pytest.mark.parametrize("files, merged, words", [
    ({}, None, ["holds neither heart_disease_uci.csv nor the UCI files"]),
    (UCI, MERGED, ["holds both layouts", "keep one"]),
    ({"processed.va.data": UCI["processed.va.data"][:2] + ["44,1,4,130,209,0,1,127,0,0,?,?,0"]},
     None, ["processed.va.data, line 3", "13 fields", "has 14"]),
    ({"processed.va.data": ["44,1,5,130,209,0,1,127,0,0,?,?,?,0"]}, None,
     ["line 1", "column 'cp' value '5'", "one of '1', '2', '3', '4'"]),
    ({"processed.va.data": ["44,1,4,130,209,0,1,127,0,0,?,?,?,?"]}, None,
     ["line 1", "column 'num' value '?'"]),
    ({"processed.va.data": ["44,1,4,13O,209,0,1,127,0,0,?,?,?,0"]}, None,
     ["column 'trestbps' value '13O' is not a number"]),
    ({"processed.va.data": ["age,sex,cp"]}, None, ["3 fields"]),
    ({}, MERGED.replace("typical angina,145", "typ. angina,145"), ["heart_disease_uci.csv, row 2",
                                                                 "'typ. angina'"]),
    ({}, MERGED.replace(",dataset,", ",hospital,"), ["no column 'dataset'", "this file has id"]),
    ({}, MERGED.replace(",Hungary,", ",,", 1), ["row 6", "site", "missing"]),
])
def test_damaged_files_are_named_by_file_row_and_column(tmp_path, files, merged, words):
    if files:
        write_uci(tmp_path, files)
    if merged is not None:
        write_merged(tmp_path, merged)
    with pytest.raises(ConfigError) as info:
        load_heart(tmp_path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_merged_words_are_read_regardless_of_case(tmp_path):
    d = load_heart(write_merged(tmp_path, MERGED.replace("Male,Cleveland,typical angina",
                                                         "male,Cleveland,Typical Angina", 1)))
    assert d.info["features"]["one_hot"]["sex"]["levels"] == ["Female", "Male"]


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        load_heart(tmp_path / "nope")


# ---------------------------------------------------------------- stratified test splits


def test_stratified_split_keeps_both_classes_in_every_test_split():
    labels = np.array([0] * 30 + [1] * 2 + [0] * 3 + [1] * 3 + [2])
    rng = np.random.default_rng(0)
    rows = np.arange(len(labels))
    for seed in range(20):
        train, test = stratified_split_client(rows, labels, 0.2, np.random.default_rng(seed))
        assert np.array_equal(np.sort(np.concatenate([train, test])), rows)
        assert set(labels[test]) == {0, 1}  # class 2 has one row: it trains
        assert set(labels[train]) == {0, 1, 2}
    # per class: round(0.2 * n_c) in [1, n_c - 1]
    train, test = stratified_split_client(rows[:32], labels, 0.2, rng)
    assert np.bincount(labels[test]).tolist() == [6, 1]
    one_row_classes = np.array([0, 1])
    train, test = stratified_split_client(np.arange(2), one_row_classes, 0.2, rng)
    assert len(train) == 1 and len(test) == 1  # the plain split's rule


def test_heart_test_splits_are_stratified_and_auroc_coverage_is_said(tmp_path):
    d = load_heart(write_merged(tmp_path))
    natural = PartitionConfig(kind="natural")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fed = build_federation(d, natural, 0.2, seed=0, stratify=True)
    for client in fed.clients:
        assert sorted(client.test_y.tolist()) == [0, 1]
    assert fed.data_info["test_split"] == "stratified by label"
    # the plain split draws two test rows of four: some test splits hold one class
    with pytest.warns(DataWarning, match=r"clients 1, 2 hold a single class each.*cover 2 of "
                                         r"4 clients.*data.stratify true"):
        fed = build_federation(d, natural, 0.5, seed=1)
    assert fed.data_info["single_class_test_clients"] == [1, 2]
    # one test row of four: no client has an AUROC, no statistic over clients, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fed = build_federation(d, natural, 0.2, seed=0)
    assert fed.data_info["single_class_test_clients"] == [0, 1, 2, 3]


def test_every_statistic_over_clients_says_how_many_it_covers():
    from fedkernels.sim.metrics import ClientEvaluation, evaluation_metrics

    evaluation = ClientEvaluation(
        loss=torch.ones(4, dtype=torch.float64), accuracy=torch.tensor([0.5, 1.0, 0.75, 1.0]),
        count=torch.tensor([4.0, 2.0, 4.0, 2.0]),
        auroc=torch.tensor([0.9, float("nan"), 0.6, float("nan")], dtype=torch.float64),
        auroc_pooled=0.8, ece=torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64),
        mce=torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), calibration_pooled=(0.2, 0.4))
    m = evaluation_metrics(evaluation)
    assert m["client_accuracy_clients"] == 4 and m["client_ece_clients"] == 4
    assert m["client_auroc_clients"] == 2 and m["client_auroc_excluded"] == [1, 3]
    assert m["client_auroc_mean"] == pytest.approx(0.75) and m["client_auroc_min"] == 0.6


@pytest.mark.slow
def test_heart_runs_from_the_command_line(tmp_path):
    root = write_uci(tmp_path / "heart")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    command = ["fedkernels", "run", "--data.name", "heart", "--data.root", str(root),
               "--model.name", "logreg", "--partition.kind", "natural", "--rounds", "2",
               "--threads", "1", "--no-progress", "--no-plots", "--out", str(tmp_path / "run")]
    try:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"fedkernels run did not finish in 300 s:\n{err.stdout}\n{err.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "client AUROC mean" in done.stdout and "over 4 of 4 clients" in done.stdout
    import json

    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["summary"]["client_auroc_clients"] == 4
    assert results["summary"]["client_auroc_excluded"] == []
    assert results["data_preparation"]["test_split"] == "stratified by label"
