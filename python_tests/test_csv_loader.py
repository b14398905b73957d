"""The CSV loader on tabular data as people have it: duplicate names, mixed label spellings,
text columns, gaps, and bad input that must be reported by row and column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkernels.sim.config import ConfigError, DataConfig, ExperimentConfig, PartitionConfig, from_dict
from fedkernels.sim.data import load_csv, load_dataset
from fedkernels.sim.federation import build_federation


def write(tmp_path, text: str, name: str = "data.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def fails(path, *words, **options):
    options.setdefault("client_column", None)
    with pytest.raises(ConfigError) as info:
        load_csv(path, **options)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


# ---------------------------------------------------------------- header


def test_duplicate_column_names_are_an_error(tmp_path):
    path = write(tmp_path, "age,bp,age,label\n1,2,3,0\n4,5,6,1\n")
    fails(path, "'age'", "twice", "columns 1 and 3")


def test_header_problems(tmp_path):
    fails(write(tmp_path, ""), "empty")
    fails(write(tmp_path, "\n\n"), "empty")
    fails(write(tmp_path, "a,label\n"), "at least one data row")
    fails(write(tmp_path, "a,,label\n1,2,0\n"), "column 2 of the header has no name")
    fails(write(tmp_path, "a;b;label\n1;2;0\n"), "no column 'label'", "only commas")
    fails(write(tmp_path, "a,b\n1,0\n"), "no column 'label'", "columns: a, b")


def test_ragged_row_names_the_row(tmp_path):
    fails(write(tmp_path, "a,b,label\n1,2,0\n3,1\n5,6,1\n"), "row 3", "2 fields", "header has 3")
    fails(write(tmp_path, "a,b,label\n1,2,0\n3,4,1,9\n"), "row 3", "4 fields")


def test_byte_order_mark_blank_lines_quotes_and_spaces(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes('\ufeffcity,size,label\n"Paris, FR", 3 ,yes\n\nLyon,4, no \n\n'.encode())
    d = load_csv(path, client_column=None)
    assert d.num_samples == 2 and d.info["labels"]["mapping"] == {"no": 0, "yes": 1}
    assert d.info["features"]["one_hot"]["city"]["levels"] == ["Lyon", "Paris, FR"]


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("a,label\nM\xfcnchen,0\nBonn,1\n".encode("latin-1"))
    fails(path, "not UTF-8")


# ---------------------------------------------------------------- labels


def test_numeric_labels_are_one_class_however_spelled(tmp_path):
    """1, "1", 1.0 and 01 are the same class (labels are read as text, numbers normalised)."""
    path = write(tmp_path, 'x,label\n1,1\n2,"1"\n3,1.0\n4,01\n5,0\n6,0.0\n7,2\n')
    d = load_csv(path, client_column=None)
    assert d.num_classes == 3 and d.y.tolist() == [1, 1, 1, 1, 0, 0, 2]
    assert d.info["labels"]["mapping"] == {"0": 0, "1": 1, "2": 2}
    assert d.info["labels"]["class_counts"] == [2, 4, 1]


def test_numeric_labels_sort_by_value(tmp_path):
    d = load_csv(write(tmp_path, "x,label\n1,10\n2,9\n3,-1\n"), client_column=None)
    assert d.info["labels"]["mapping"] == {"-1": 0, "9": 1, "10": 2}


def test_labels_mixing_numbers_and_text_are_an_error_naming_the_row(tmp_path):
    path = write(tmp_path, 'x,label\n1,1\n2,"1"\n3,yes\n4,0\n')
    fails(path, "row 4", "'yes'", "text", "numbers", "data.label_map")
    mostly_text = write(tmp_path, "x,label\n1,yes\n2,no\n3,1\n4,no\n", "b.csv")
    fails(mostly_text, "row 4", "'1'", "a number", "text")
    d = load_csv(path, client_column=None, label_map="0=0,no=0,1=1,yes=1")
    assert d.y.tolist() == [1, 1, 1, 0] and d.num_classes == 2


def test_label_map(tmp_path):
    path = write(tmp_path, "x,label\n1,benign\n2,malignant\n3,benign\n4,unknown\n")
    fails(path, "row 5", "'unknown'", "not in data.label_map", label_map="benign=0,malignant=1")
    d = load_csv(path, client_column=None, label_map="benign=0, malignant=1, unknown=2")
    assert d.y.tolist() == [0, 1, 0, 2] and d.num_classes == 3
    for bad, words in [("benign", ["not VALUE=CLASS"]), ("a=x", ["integer"]),
                       ("a=-1", ["integer"]), ("a=0,a=1", ["twice"])]:
        fails(path, *words, label_map=bad)
    fails(path, "choose one", label_map="benign=0", positive_labels=["benign"])


def test_positive_labels_binarise(tmp_path):
    path = write(tmp_path, "x,num\n1,0\n2,1\n3,2\n4,4.0\n5,0\n6,3\n")
    d = load_csv(path, "num", None, positive_labels=["1", "2", "3", "4"])
    assert d.y.tolist() == [0, 1, 1, 1, 0, 1] and d.num_classes == 2
    assert d.info["labels"]["mapping"] == {"0": 0, "1": 1, "2": 1, "3": 1, "4": 1}
    d = load_csv(path, "num", None, positive_labels=[1, 2.0, 7])  # YAML numbers work too
    assert d.y.tolist() == [0, 1, 1, 0, 0, 0]
    assert d.info["labels"]["positive_values_absent"] == ["7"]
    fails(path, "matches no row", label_column="num", positive_labels=["9"])
    fails(path, "matches every row", label_column="num", positive_labels=list("012345"))
    fails(path, "boolean", label_column="num", positive_labels=[True])


def test_missing_or_single_label(tmp_path):
    fails(write(tmp_path, "x,label\n1,0\n2,?\n3,1\n"), "row 3", "label", "missing")
    fails(write(tmp_path, "x,label\n1,0\n2,0\n", "b.csv"), "one value", "'0'")


def test_client_column(tmp_path):
    path = write(tmp_path, "x,site,label\n1,b,0\n2, a ,1\n3,b,1\n4,?,0\n")
    fails(path, "row 5", "client", "missing", client_column="site")
    d = load_csv(write(tmp_path, "x,site,label\n1,10,0\n2,9.0,1\n3,10,1\n", "b.csv"),
                 client_column="site")
    assert d.groups.tolist() == [1, 0, 1] and d.info["clients"]["mapping"] == {"9": 0, "10": 1}


# ---------------------------------------------------------------- features


def test_text_columns_are_one_hot_with_a_missing_level(tmp_path):
    path = write(tmp_path, "sex,cp,label\nmale,typical,0\nfemale,?,1\nmale,atypical,1\n"
                           ",typical,0\n")
    d = load_csv(path, client_column=None, standardize=False)
    names = d.info["features"]["feature_names"]
    assert names == ["sex=female", "sex=male", "sex=missing", "cp=atypical", "cp=missing",
                     "cp=typical"]
    assert d.x.tolist() == [[0, 1, 0, 0, 0, 1], [1, 0, 0, 0, 1, 0], [0, 1, 0, 1, 0, 0],
                            [0, 0, 1, 0, 0, 1]]
    assert d.info["features"]["one_hot"]["cp"]["missing"] == 1


@pytest.mark.parametrize("marker", ["", "?", "NA", "na", "N/A", "nan", "NaN", "null", " ? "])
def test_missing_markers(tmp_path, marker):
    path = write(tmp_path, f"a,label\n1,0\n{marker},1\n3,0\n7,1\n")
    d = load_csv(path, client_column=None, standardize=False)
    assert d.info["features"]["feature_names"] == ["a", "a (missing)"]
    assert d.x[:, 0].tolist() == [1, 3, 3, 7]  # the median of 1, 3, 7
    assert d.x[:, 1].tolist() == [0, 1, 0, 0]
    assert d.info["features"]["numeric"]["a"]["imputed_with_median"] == 3.0


def test_statistics_come_from_the_training_rows_only(tmp_path):
    """Median, mean, std and levels are fitted on the rows given to fit_features: an extreme
    test value, a test-only gap or a test-only level changes none of them."""
    rows = ["a,c,label", "1,x,0", "2,y,1", "?,x,0", "3,y,1", "1000,z,0", "?,?,1"]
    d = load_csv(write(tmp_path, "\n".join(rows) + "\n"), client_column=None)
    train = np.array([0, 1, 2, 3])  # rows 4 and 5 are test rows
    fitted = d.fit_features(train)
    f = fitted.info["features"]
    observed = np.array([1.0, 2.0, 3.0])
    assert f["fitted_on_rows"] == 4
    assert f["numeric"]["a"]["imputed_with_median"] == 2.0
    assert f["numeric"]["a"]["mean"] == pytest.approx(observed.mean())
    assert f["numeric"]["a"]["std"] == pytest.approx(observed.std())
    assert f["one_hot"]["c"]["levels"] == ["x", "y"]  # z and the gap only occur in test rows
    assert f["one_hot"]["c"]["values_unseen_in_fit_rows"] == 2
    a = fitted.x[:, 0].double()
    torch.testing.assert_close(a[[0, 1, 3]].mean(), torch.tensor(0.0, dtype=torch.float64),
                               atol=1e-6, rtol=0)
    assert float(a[4]) == pytest.approx((1000 - 2) / observed.std(), rel=1e-5)
    assert fitted.info["features"]["feature_names"] == ["a", "a (missing)", "c=x", "c=y"]
    assert fitted.x[4, 2:].tolist() == [0.0, 0.0]  # level z: all zeros
    # the provisional encoding (every row) differs: it would have leaked the test rows
    assert d.info["features"]["numeric"]["a"]["mean"] != f["numeric"]["a"]["mean"]


def test_federation_fits_on_the_union_of_training_splits(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["a,b,site,label"] + [
        f"{rng.normal(10 * (i % 3), 1):.3f},{'?' if i % 7 == 0 else rng.integers(0, 5)},"
        f"s{i % 3},{i % 2}"
        for i in range(60)
    ]
    d = load_csv(write(tmp_path, "\n".join(lines) + "\n"), client_column="site")
    fed = build_federation(d, PartitionConfig(kind="natural"), 0.25, seed=1)
    train_rows = np.concatenate([c.train_index for c in fed.clients])
    assert fed.data_info["features"]["fitted_on_rows"] == len(train_rows) < 60
    train_x = torch.cat([c.train_x for c in fed.clients]).double()
    torch.testing.assert_close(train_x[:, 0].mean(), torch.tensor(0.0, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(train_x[:, 0].std(unbiased=False),
                               torch.tensor(1.0, dtype=torch.float64), atol=1e-5, rtol=0)
    assert torch.equal(fed.clients[0].test_x, d.fit_features(train_rows).x[
        torch.from_numpy(fed.clients[0].test_index)])


def test_categorical_and_ignored_columns(tmp_path):
    path = write(tmp_path, "id,cp,age,label\n101,1,50,0\n102,4,61,1\n103,2.0,45,1\n104,1,?,0\n")
    d = load_csv(path, client_column=None, categorical_columns=["cp"], ignore_columns=["id"])
    assert d.info["features"]["feature_names"] == ["cp=1", "cp=2", "cp=4", "age", "age (missing)"]
    assert d.info["features"]["one_hot"]["cp"]["why"] == "listed in data.categorical_columns"
    assert d.info["ignored_columns"] == ["id"]
    fails(path, "data.categorical_columns", "'nope'", categorical_columns=["nope"])
    fails(path, "data.ignore_columns", "'label'", ignore_columns=["label"])
    fails(path, "both", categorical_columns=["cp"], ignore_columns=["cp"])
    fails(path, "no feature columns", ignore_columns=["id", "cp", "age"])


def test_empty_column_is_dropped_and_reported(tmp_path):
    d = load_csv(write(tmp_path, "a,empty,label\n1,,0\n2,?,1\n"), client_column=None)
    assert d.info["features"]["dropped"] == {"empty": "no value in any row"}
    assert d.num_features == 1


def test_constant_column_is_centred_not_divided_by_zero(tmp_path):
    d = load_csv(write(tmp_path, "a,b,label\n5,1,0\n5,2,1\n5,3,1\n"), client_column=None)
    assert d.x[:, 0].tolist() == [0.0, 0.0, 0.0]
    assert d.info["features"]["numeric"]["a"]["std"] == 0.0


def test_standardize_off_keeps_the_numbers(tmp_path):
    d = load_csv(write(tmp_path, "a,label\n1.5,0\n-2,1\n"), client_column=None,
                 standardize=False)
    assert d.x[:, 0].tolist() == [1.5, -2.0] and d.info["features"]["standardized"] == []


# ---------------------------------------------------------------- bad values


def test_text_in_a_numeric_column_names_row_and_column(tmp_path):
    path = write(tmp_path, "age,bp,label\n50,120,0\n61,13O,1\n45,110,1\n")
    fails(path, "row 3", "column 'bp'", "'13O'", "not a number", "data.categorical_columns")
    d = load_csv(path, client_column=None, categorical_columns=["bp"])
    assert "bp=13O" in d.info["features"]["feature_names"]


def test_number_in_a_text_column_names_row_and_column(tmp_path):
    path = write(tmp_path, "sex,label\nmale,0\nfemale,1\n1,1\nmale,0\n")
    fails(path, "row 4", "column 'sex'", "'1'", "is a number", "data.categorical_columns")


def test_infinite_value(tmp_path):
    fails(write(tmp_path, "a,label\n1,0\ninf,1\n2,0\n"), "row 3", "'a'", "not a finite number")


def test_number_too_large_for_a_float(tmp_path):
    fails(write(tmp_path, "a,label\n1,0\n1e400,1\n2,0\n"), "row 3", "'a'", "'1e400'",
          "not a finite number")


def test_every_feature_column_empty_names_the_file_and_columns(tmp_path):
    fails(write(tmp_path, "a,b,label\n,?,0\nNA,,1\n"), "data.csv", "'a', 'b'", "empty")


def test_identifier_column(tmp_path):
    rows = ["name,a,label"] + [f"patient{i},{i},{i % 2}" for i in range(80)]
    path = write(tmp_path, "\n".join(rows) + "\n")
    fails(path, "'name'", "80 different values", "data.ignore_columns")
    assert load_csv(path, client_column=None, ignore_columns=["name"]).num_features == 1


# ---------------------------------------------------------------- configuration


def test_config_fields_from_the_command_line_and_yaml(tmp_path):
    path = write(tmp_path, "x,site,num\n1,a,0\n2,a,3\n3,b,1\n4,b,0\n")
    cli = from_dict(ExperimentConfig, {"data": {
        "name": "csv", "path": str(path), "label_column": "num", "client_column": "site",
        "positive_labels": "1,2,3,4", "categorical_columns": "x", "standardize": "false"}})
    assert cli.data.positive_labels == ["1", "2", "3", "4"]
    d = load_dataset(cli.data, 2, 0)
    assert d.y.tolist() == [0, 1, 1, 0] and d.info["features"]["standardized"] == []
    yaml_like = from_dict(DataConfig, {"name": "csv", "path": str(path), "label_column": "num",
                                       "positive_labels": [1, 2, 3, 4],
                                       "label_map": None, "client_column": "site"})
    assert load_dataset(yaml_like, 2, 0).y.tolist() == [0, 1, 1, 0]
