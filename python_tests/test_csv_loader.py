"""The CSV loader on tabular data as people have it: duplicate names, mixed label spellings,
text columns, gaps, and bad input that must be reported by row and column."""

from __future__ import annotations

import re
import warnings

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
    fails(write(tmp_path, "a,,label\n1,2,0\n"), "column 2 of the header has no name",
          "row 2 holds '2'")
    fails(write(tmp_path, ",a,label\n0,5,0\n1,6,1\n"), "column 1", "ignore_columns")
    fails(write(tmp_path, "a;b;label\n1;2;0\n"), "no column 'label'",
          "holds semicolons: pass --data.delimiter ';'")
    fails(write(tmp_path, "a,b\n1,0\n"), "no column 'label'", "columns: a, b")


def test_a_file_without_a_header_row_is_recognised(tmp_path):
    # UCI's processed.cleveland.data: numbers from the first row on.
    data = write(tmp_path, "63.0,1.0,1.0,145.0,0\n67.0,1.0,4.0,160.0,2\n", "cleveland.data")
    fails(data, "appears twice", "no header row")
    fails(write(tmp_path, "63,145,0\n67,160,2\n", "b.csv"), "no column 'label'", "no header row")
    # Columns named by numbers (pandas' default names) are a header all the same.
    d = load_csv(write(tmp_path, "0,1,2\n5,6,0\n7,8,1\n", "c.csv"), "2", None)
    assert d.y.tolist() == [0, 1]


def test_a_first_row_of_data_with_text_in_it_is_recognised_too(tmp_path):
    # UCI's adult.data: no header, text columns beside the numbers of the first row.
    adult = write(tmp_path, "39, State-gov, 77516, <=50K\n50, Self-emp, 83311, >50K\n"
                            "38, Private, 215646, <=50K\n", "adult.data")
    fails(adult, "no column 'income'", "no header row", "'39'", label_column="income")
    # a header naming columns by text is no such case
    message = fails(write(tmp_path, "age,work\n39,x\n50,y\n", "h.csv"), "no column 'label'")
    assert "no header row" not in message


def test_a_line_above_the_header_is_named(tmp_path):
    rows = "x,label\n1,0\n2,1\n"
    fails(write(tmp_path, "# exported 2024-05-01\n" + rows), "row 2", "2 fields",
          "'# exported 2024-05-01'", "title or a comment")
    fails(write(tmp_path, "sep=,\n" + rows, "excel.csv"), "row 1", "Excel's separator line")
    fails(write(tmp_path, "sep=;\nx;label\n1;0\n", "excel2.csv"), "Excel's separator line",
          "--data.delimiter ';'")


def test_spreadsheet_padding_is_dropped(tmp_path):
    # A spreadsheet export: unnamed empty columns after the data, rows padded with ",,".
    path = write(tmp_path, "x,y,label,,\r\n1,2,0,,\r\n3,4,1,,\r\n5,6,0,,,\r\n7,8,1,,\r\n")
    d = load_csv(path, client_column=None)
    assert d.x.shape == (4, 2) and d.y.tolist() == [0, 1, 0, 1]
    assert d.info["empty_unnamed_columns"] == [4, 5]
    # Only some rows padded: the others stop where the named columns do.
    mixed = write(tmp_path, "x,y,label,,\n1,2,0,,\n3,4,1\n5,6,0,\n", "mixed.csv")
    d = load_csv(mixed, client_column=None)
    assert d.x.shape == (3, 2)
    assert d.y.tolist() == [0, 1, 0] and d.info["empty_unnamed_columns"] == [4, 5]
    # a short row is still refused where a named column is missing
    fails(write(tmp_path, "x,y,label,,\n1,2,0,,\n3,4\n", "short.csv"), "row 3", "2 fields")
    fails(write(tmp_path, ",\n,\n", "b.csv"), "no column of the header has a name")
    fails(write(tmp_path, "x,label\n1,0,,7\n", "c.csv"), "row 2", "4 fields")


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


def test_distinct_numbers_stay_distinct_however_long_or_small(tmp_path):
    # Decimal.normalize() rounded to 28 digits and flushed 1e-999999999 to 0.
    long_a, long_b = "12345678901234567890123456789012345.5", "12345678901234567890123456789012346.5"
    path = write(tmp_path, f"x,label\n1,{long_a}\n2,{long_b}\n3,0\n4,1e-999999999\n5,0.0\n")
    d = load_csv(path, client_column=None)
    assert d.info["labels"]["mapping"] == {"0": 0, "1E-999999999": 1, long_a: 2, long_b: 3}
    assert d.y.tolist() == [2, 3, 0, 1, 0]


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


def test_label_map_classes_stay_within_the_map(tmp_path):
    # The model gets the largest class + 1 outputs: 1e11 of them do not fit in memory.
    path = write(tmp_path, "a,label\n1,no\n2,yes\n3,no\n")
    fails(path, "data.label_map: class 100000000000 of 'yes' is beyond the 2 values mapped",
          label_map="no=0,yes=100000000000")
    d = load_csv(path, client_column=None, label_map="no=1,yes=0")
    assert d.num_classes == 2


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
    # A nested list or a null is not a label value (it was read as the text '[1, 2]').
    fails(path, "not a label value", label_column="num", positive_labels=[[1, 2], 3])
    fails(path, "not a label value", label_column="num", positive_labels=[None])
    fails(path, "list of values", label_column="num", positive_labels="12")
    d = load_csv(path, "num", None, positive_labels=[np.int64(1), np.float32(2)])
    assert d.y.tolist() == [0, 1, 1, 0, 0, 0]


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


def test_client_mapping_is_recorded_only_where_the_partition_uses_it(tmp_path):
    lines = ["a,site,label"] + [f"{i},s{i % 3},{i % 2}" for i in range(60)]
    d = load_csv(write(tmp_path, "\n".join(lines) + "\n"), client_column="site")
    natural = build_federation(d, PartitionConfig(kind="natural"), 0.25, seed=1)
    assert natural.data_info["clients"]["mapping"] == {"s0": 0, "s1": 1, "s2": 2}
    iid = build_federation(d, PartitionConfig(kind="iid", num_clients=4), 0.25, seed=1)
    assert iid.data_info["clients"] == {"column": "site", "used": False, "partition": "iid"}
    assert "site" not in iid.data_info["features"]["feature_names"]


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


def test_numeric_levels_sort_by_value(tmp_path):
    """Levels that are numbers come in numeric order (9 before 10, exact for long ones), as
    labels do; scikit-learn's own category order would sort them as text."""
    rows = ["9", "10", "2", "9007199254740993", "9007199254740992", "b", "10.0"]
    text = "code,label\n" + "".join(f"{v},{i % 2}\n" for i, v in enumerate(rows))
    d = load_csv(write(tmp_path, text), client_column=None, categorical_columns=["code"])
    assert d.info["features"]["one_hot"]["code"]["levels"] == [
        "2", "9", "10", "9007199254740992", "9007199254740993", "b"]


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


@pytest.mark.parametrize("magnitude", [1e200, 1e-320, 4e307])
def test_numbers_of_any_finite_magnitude_standardise(tmp_path, magnitude):
    # The moments are taken over the values divided by a power of two near their peak:
    # squares of 1e200 overflowed (the column became 0, std Infinity in results.json) and
    # 1e-320 vanished (std 0, every value 0 after the float32 cast).
    values = [1.0, 2.0, -3.0, 4.0, 0.5]
    rows = "".join(f"{v * magnitude!r},{k % 2}\n" for k, v in enumerate(values))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or underflow on the way
        d = load_csv(write(tmp_path, "a,label\n" + rows), client_column=None)
    expected = (np.array(values) - np.mean(values)) / np.std(values)
    np.testing.assert_allclose(d.x[:, 0], expected, rtol=1e-5, atol=1e-6)
    stats = d.info["features"]["numeric"]["a"]
    assert np.isfinite(stats["std"]) and stats["std"] > 0


def test_value_beyond_float32_without_standardising_names_the_column(tmp_path):
    fails(write(tmp_path, "a,label\n1e39,0\n2,1\n"), "column 'a'", "1e+39", "float32",
          "data.standardize", standardize=False)


def test_quoted_field_after_a_space_is_quoted(tmp_path):
    d = load_csv(write(tmp_path, 'x, note, label\n0.1, "a, b", 0\n0.2, "c", 1\n'),
                 client_column=None)
    assert d.info["features"]["one_hot"]["note"]["levels"] == ["a, b", "c"]


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


# ---------------------------------------------------------------- audit regressions


def test_large_numeric_ids_stay_distinct(tmp_path):
    """Values are compared exactly: 17+ digit identifiers that one float cannot tell apart
    stay distinct clients, and each keeps its own spelling; 1, 1.0, 01, +1 are still one."""
    ids = ["9007199254740992", "9007199254740993", "123456789012345678", "123456789012345679"]
    rows = [f"{i},{ids[i % 4]},{i % 2}" for i in range(8)]
    d = load_csv(write(tmp_path, "x,site,label\n" + "\n".join(rows) + "\n"), client_column="site")
    assert list(d.info["clients"]["mapping"]) == sorted(ids, key=int)
    assert len(set(d.groups.tolist())) == 4
    same = write(tmp_path, "x,site,label\n1,1,0\n2,1.0,1\n3,01,0\n4,+1,1\n5,2.50,0\n6,2.5,1\n",
                 "same.csv")
    assert load_csv(same, client_column="site").info["clients"]["mapping"] == {"1": 0, "2.5": 1}
    labels = write(tmp_path, "x,label\n1,9007199254740992\n2,9007199254740993\n", "l.csv")
    assert load_csv(labels, client_column=None).num_classes == 2


@pytest.mark.parametrize("text, row", [
    ('"item 5,5,1\n"item 6",6,0\n"item 7",7,1\n', 3),  # unclosed: would swallow a row
    ('"pizza 12" large",5,1\n', 3),  # a quote inside a quoted field not doubled
    ('"open,5,1\n', 3),  # the file ends inside the quotes
])
def test_malformed_quoting_is_refused_naming_the_row(tmp_path, text, row):
    path = write(tmp_path, 'name,x,label\n"a",1,0\n' + text)
    fails(path, f"row {row}", "quoted field is not closed")


def test_quoted_fields_spanning_lines_keep_spreadsheet_row_numbers(tmp_path):
    path = write(tmp_path, 'note,x,label\n"multi\nline ""quoted""",1,0\n"a",2,1\n"b",13O,0\n')
    fails(path, "row 4", "'13O'")  # row 4 in a spreadsheet, line 5 of the file
    d = load_csv(write(tmp_path, 'note,x,label\n"multi\nline ""q""",1,0\n"b",2,1\n', "ok.csv"),
                 client_column=None)
    assert d.info["features"]["one_hot"]["note"]["levels"] == ["b", 'multi\nline "q"']


def test_semicolons_with_decimal_commas_name_the_delimiter_to_pass(tmp_path):
    fails(write(tmp_path, "age;bp;label\n71;118,7;0\n22;121,0;1\n"), "row 2", "2 fields",
          "split at commas, the header is one column", "pass --data.delimiter ';'")


# Spreadsheet exports of one table: comma-separated with '.' decimals, a European Excel's
# semicolons with decimal commas and '.' thousands, a tab-separated file, '|'.
_ROWS = [("71", "1234.5", "a b", "yes"), ("22", "-0.25", "c", "no"), ("35", "3", "a b", "no"),
         ("40", "", "c", "yes")]


def _table(sep: str, number=lambda v: v) -> str:
    lines = [sep.join(("age", "bp (mm, Hg)" if sep != "," else "bp", "kind", "label"))]
    lines += [sep.join((a, number(b), k, lab)) for a, b, k, lab in _ROWS]
    return "\n".join(lines) + "\n"


def _decimal_comma(v: str) -> str:
    whole, _, frac = v.partition(".")
    sign = "-" if whole.startswith("-") else ""
    whole = whole.lstrip("-")
    grouped = f"{int(whole):,}".replace(",", ".") if whole else ""
    return sign + grouped + ("," + frac if frac else "")


@pytest.mark.parametrize("name, text, options", [
    ("semi.csv", _table(";", _decimal_comma), {"delimiter": ";", "decimal": ","}),
    ("tabs.tsv", _table("\t"), {}),  # a .tsv file is tab-separated by default
    ("tabs.txt", _table("\t"), {"delimiter": "tab"}),
    ("pipes.csv", _table("|"), {"delimiter": "|"}),
    ("gz.tsv.gz", None, {}),
])
def test_other_delimiters_and_decimal_commas_read_the_same_table(tmp_path, name, text, options):
    reference = load_csv(write(tmp_path, _table(","), "ref.csv"), client_column=None)
    if text is None:  # a gzipped .tsv
        import gzip
        path = tmp_path / name
        path.write_bytes(gzip.compress(_table("\t").encode()))
    else:
        path = write(tmp_path, text, name)
    d = load_csv(path, client_column=None, **options)
    torch.testing.assert_close(d.x, reference.x)
    assert d.y.tolist() == reference.y.tolist()
    assert d.info["features"]["one_hot"] == reference.info["features"]["one_hot"]


def test_decimal_comma_rewrites_numbers_only(tmp_path):
    from fedkernels.sim.tabular import point_decimal
    cases = {"3,5": "3.5", "-0,25": "-0.25", ",5": ".5", "1.234,5": "1234.5",
             "1.234.567": "1234567", "12": "12", "1.5": "1.5", "01.02.2023": "01.02.2023",
             "a,b": "a,b", "5,": "5,", ",": ",", "1,2,3": "1,2,3", "12,5 %": "12,5 %"}
    for text, expected in cases.items():
        assert point_decimal(text) == expected, text
    # The header keeps its names as written, and a text column with commas stays text.
    path = write(tmp_path, "w;x,y;label\n1,5;a,b;0\n2,5;c;1\n", "h.csv")
    d = load_csv(path, client_column=None, delimiter=";", decimal=",")
    assert d.info["features"]["one_hot"]["x,y"]["levels"] == ["a,b", "c"]


@pytest.mark.parametrize("head, what", [(b"PK\x03\x04\x14\x00", "Excel .xlsx"),
                                        (b"\xd0\xcf\x11\xe0\xa1\xb1", "Excel .xls"),
                                        (b"PAR1\x15\x04", "Parquet")])
def test_a_workbook_or_binary_table_is_named_as_such(tmp_path, head, what):
    path = tmp_path / "table.csv"
    path.write_bytes(head + bytes(range(256)) * 4)
    fails(path, what, "export it as CSV")


def test_a_windows_excel_export_reads_with_its_encoding(tmp_path):
    """Semicolons, decimal commas and cp1252 text: what Excel's "CSV (semicolon delimited)"
    writes in a German or French Windows."""
    text = "Größe;Farbe;label\n1,5;grün;ja\n2,25;rot;nein\n3;grün;nein\n"
    path = tmp_path / "excel.csv"
    path.write_bytes(text.encode("cp1252"))
    message = fails(path, "not UTF-8", "--data.encoding", "cp1252", delimiter=";")
    assert "row 1" in message
    d = load_csv(path, "label", None, delimiter=";", decimal=",", encoding="cp1252")
    assert d.info["features"]["one_hot"]["Farbe"]["levels"] == ["grün", "rot"]
    assert d.y.tolist() == [0, 1, 1]  # sorted: 'ja' < 'nein'
    fails(path, "unknown text encoding", delimiter=";", encoding="klingon")
    with pytest.raises(ConfigError, match="unknown text encoding"):
        DataConfig(name="csv", path="x.csv", encoding="klingon")


def test_three_decimals_with_a_decimal_comma_are_not_called_thousands(tmp_path):
    """A European export's column of numbers, most with three decimals ('1,250', '0,346'):
    the hint names --data.decimal, which reads them, not thousands separators."""
    from fedkernels.sim.tabular import DataWarning

    values = ["1,250", "2,500", "0,125", "6,000", "7,5", "8,25"]
    rows = "".join(f"{v};{i % 2}\n" for i, v in enumerate(values * 2))
    with pytest.warns(DataWarning, match="decimal comma.*--data.decimal ,"):
        load_csv(write(tmp_path, "v;label\n" + rows), client_column=None, delimiter=";")
    leading_zero = "".join(f"0,{i:03d};{i % 2}\n" for i in range(60))
    message = fails(write(tmp_path, "v;label\n" + leading_zero, "z.csv"), "decimal comma",
                    "--data.decimal ,", delimiter=";")
    assert "thousands" not in message
    # Every value reads both ways: thousands first, the decimal comma named as the other reading
    both = "".join(f"{1 + i % 9},{i:03d};{i % 2}\n" for i in range(60))
    fails(write(tmp_path, "v;label\n" + both, "b.csv"), "thousands separators",
          "if ',' is their decimal mark instead, pass --data.decimal ,", delimiter=";")
    # one such value in a column of numbers: the error names the flag that reads it
    fails(write(tmp_path, "v;label\n3,5;0\n4;1\n5;0\n", "one.csv"), "row 2", "'3,5'",
          "--data.decimal ,", delimiter=";")


def test_delimiter_and_decimal_hints_and_settings(tmp_path):
    tabs = write(tmp_path, "a\tb\tlabel\n1\t2\t0\n3\t4\t1\n", "t.csv")
    fails(tabs, "holds tabs: pass --data.delimiter tab")
    many = "".join(f"{i},{i % 7};{i % 2}\n" for i in range(60))
    fails(write(tmp_path, "v;label\n" + many, "m.csv"), "pass --data.decimal ,",
          delimiter=";")
    fails(write(tmp_path, "a,label\n1,0\n2,1\n", "ok.csv"), "data.delimiter must be one of",
          delimiter=":")
    fails(write(tmp_path, "a,label\n1,0\n2,1\n", "ok2.csv"), "data.decimal must be",
          decimal=";")
    for bad in ({"delimiter": ":"}, {"decimal": ";"}):
        with pytest.raises(ConfigError, match="data.(delimiter|decimal)"):
            DataConfig(name="csv", path="x.csv", **bad)


def test_not_utf8_names_the_file_offset_and_row(tmp_path):
    rows = "".join(f"{i},{i % 2}\n" for i in range(5000))  # past the decoder's first chunk
    path = tmp_path / "late.csv"
    data = ("a,label\n" + rows).encode() + "M\xfcnchen,0\n".encode("latin-1")
    path.write_bytes(data)
    offset = data.index(b"\xfc")
    fails(path, "row 5002", f"byte {offset}", "not UTF-8")
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfa,label\n1,0\n\xfc,1\n")
    fails(bom, "row 3", "byte 15")  # the byte-order mark counted
    utf16 = tmp_path / "utf16.csv"
    utf16.write_bytes("a,label\n1,0\n".encode("utf-16"))
    fails(utf16, "UTF-16")


def test_gzip_compressed_file_is_read(tmp_path):
    import gzip

    path = tmp_path / "data.csv.gz"
    path.write_bytes(gzip.compress(b"a,label\n1,0\n2,1\n3,0\n"))
    assert load_csv(path, client_column=None).y.tolist() == [0, 1, 0]
    path.write_bytes(gzip.compress(b"a,label\n1,0\n")[:-4])
    fails(path, "gzip")


@pytest.mark.parametrize("module, name", [("bz2", "bzip2"), ("lzma", "xz")])
def test_bzip2_and_xz_compressed_files_are_read(tmp_path, module, name):
    # read as text before, they were 'not UTF-8' with advice on encodings
    compress = pytest.importorskip(module).compress
    text = b"a\tlabel\n1\t0\n2\t1\n3\t0\n"
    path = tmp_path / f"data.tsv.{'bz2' if module == 'bz2' else 'xz'}"  # a tab by default
    path.write_bytes(compress(text))
    assert load_csv(path, client_column=None).y.tolist() == [0, 1, 0]
    path.write_bytes(compress(text)[:-8])
    fails(path, f"damaged {name} file")


def test_a_zip_archive_names_the_files_to_unzip(tmp_path):
    """A data set's download, train.csv inside a .zip, is no workbook to export."""
    import io
    import zipfile

    def archive(*names):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for n in names:
                z.writestr(n, "a,label\n1,0\n")
        return buffer.getvalue()

    path = tmp_path / "download.zip"
    path.write_bytes(archive("train.csv", "test.csv"))
    message = fails(path, "a ZIP archive holding 'train.csv', 'test.csv'", "unzip it")
    assert "export it as CSV" not in message
    path.write_bytes(archive("xl/workbook.xml", "[Content_Types].xml"))
    fails(path, "Excel .xlsx", "export it as CSV")
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(64))
    fails(path, "zstd", "decompress it")


def test_numpy_arrays_point_to_dataset_from_tensors(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    fails(tmp_path / "x.npy", "a NumPy .npy array", "Dataset.from_tensors")
    np.savez(tmp_path / "d.npz", x=np.zeros((3, 2)), y=np.ones(3))
    fails(tmp_path / "d.npz", "a NumPy .npz archive (x.npy, y.npy)", "Dataset.from_tensors")


def test_unreadable_path_and_folder(tmp_path):
    fails(tmp_path, "is a folder")
    fails(tmp_path / "nope.csv", "no such file")
    fails("/proc/self/mem", "cannot read", "/proc/self/mem")


def test_label_map_with_one_class_is_refused(tmp_path):
    path = write(tmp_path, "x,label\n1,yes\n2,no\n3,yes\n")
    fails(path, "two classes", label_map="no=0,yes=0")


def test_labels_differing_only_in_case_are_kept_but_warned_about(tmp_path):
    from fedkernels.sim.tabular import DataWarning

    path = write(tmp_path, "x,label\n0, yes\n1,Yes\n2,YES\n3,no\n4,no\n")
    with pytest.warns(DataWarning, match="differ only in letter case.*'YES', 'Yes', 'yes'"):
        d = load_csv(path, client_column=None)
    assert d.num_classes == 4 and d.info["labels"]["case_variants"] == [["YES", "Yes", "yes"]]
    assert "data.label_map" in d.info["labels"]["warning"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a label_map settles it: no warning
        load_csv(path, client_column=None, label_map="yes=1,Yes=1,YES=1,no=0")


def test_adult_labels_with_a_final_period_are_warned_about_and_can_be_mapped(tmp_path):
    """UCI's adult.data writes '<=50K', adult.test '<=50K.': the two files stacked read as four
    classes. That is warned about, and a label_map may name values holding '='."""
    from fedkernels.sim.tabular import DataWarning

    labels = ["<=50K", ">50K", "<=50K.", ">50K.", "<=50K", ">50K"]
    path = write(tmp_path, "age,income\n" + "".join(f"{30 + i},{v}\n"
                                                     for i, v in enumerate(labels)))
    with pytest.warns(DataWarning, match=r"final '\.'.*'<=50K', '<=50K\.'; '>50K', '>50K\.'"):
        d = load_csv(path, "income", None)
    assert d.num_classes == 4
    d = load_csv(path, "income", None, label_map="<=50K=0,<=50K.=0,>50K=1,>50K.=1")
    assert d.y.tolist() == [0, 1, 0, 1, 0, 1]
    assert d.info["labels"]["mapping"] == {"<=50K": 0, "<=50K.": 0, ">50K": 1, ">50K.": 1}


@pytest.mark.parametrize("values, kind", [
    (["1,000", "1,137", "2,274", "12,411"], "thousands separators"),
    (["0,5", "1,5", "2,5", "3,5"], "a decimal comma"),
    (["0%", "5%", "10 %", "15%"], "a % sign"),
])
def test_numbers_written_for_a_locale_are_flagged(tmp_path, values, kind):
    from fedkernels.sim.tabular import DataWarning

    rows = "".join(f'"{v}",{i % 2}\n' for i, v in enumerate(values * 3))
    with pytest.warns(DataWarning, match=f"numbers written with {re.escape(kind)}"):
        d = load_csv(write(tmp_path, "v,label\n" + rows), client_column=None)
    assert "clean the column" in d.info["features"]["one_hot"]["v"]["warning"]
    many = "".join(f'"{i},{i % 1000:03d}",{i % 2}\n' for i in range(1, 201))
    message = fails(write(tmp_path, "v,label\n" + many, "many.csv"), "thousands separators",
                    "clean the column")
    assert "identifier" not in message
    few = write(tmp_path, 'v,label\n0.5,0\n1.5,1\n"3,5",0\n', "few.csv")
    fails(few, "row 4", "'3,5'", "decimal comma")
