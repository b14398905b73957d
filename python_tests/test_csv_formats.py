"""One table in the formats people export it in (a BOM, CRLF, cp1252, semicolons with decimal
commas, quoted fields holding separators and line breaks, a spreadsheet's trailing empty
columns) reads to the same features; the reader agrees with pandas.read_csv on well-formed
files; the encoder's statistics come from the fitting rows in the corner cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkernels.sim.data import load_csv
from fedkernels.sim.tabular import read_table

pd = pytest.importorskip("pandas")

# (site, age, bp, smoker, note, label): a note with a comma, one with a line break and a quote
ROWS = [
    ("Köln", "63.5", "145", "ja", "chest pain, mild", "1"),
    ("Köln", "41", "", "nein", 'said "no"', "0"),
    ("Zürich", "57.25", "130", "ja", "line one\nline two", "1"),
    ("Zürich", "38", "118", "?", "none", "0"),
    ("Köln", "70", "160", "nein", "none", "1"),
    ("Zürich", "45.75", "NA", "nein", "chest pain, mild", "0"),
]
HEADER = ("site", "age", "bp", "smoker", "note", "label")


def quote(field: str, sep: str) -> str:
    if any(ch in field for ch in (sep, '"', "\n")):
        return '"' + field.replace('"', '""') + '"'
    return field


def table_text(sep: str = ",", decimal: str = ".", newline: str = "\n", pad: int = 0) -> str:
    lines = [sep.join(HEADER) + sep * pad]
    for row in ROWS:
        fields = [v.replace(".", decimal) if i in (1, 2) else v for i, v in enumerate(row)]
        lines.append(sep.join(quote(f, sep) for f in fields) + sep * pad)
    return newline.join(lines) + newline


def load(path, **options):
    return load_csv(path, "label", "site", **options)


@pytest.fixture
def reference(tmp_path):
    path = tmp_path / "plain.csv"
    path.write_text(table_text(), encoding="utf-8")
    return load(path)


@pytest.mark.parametrize("name, data, options", [
    ("bom_crlf.csv", b"\xef\xbb\xbf" + table_text(newline="\r\n").encode("utf-8"), {}),
    ("excel_de.csv", table_text(";", ",", "\r\n").encode("cp1252"),
     {"delimiter": ";", "decimal": ",", "encoding": "cp1252"}),
    ("padded.csv", table_text(pad=2, newline="\r\n").encode("utf-8"), {}),
    ("tabs.tsv", table_text("\t").encode("utf-8"), {}),
])
def test_exported_formats_read_to_the_same_table(tmp_path, reference, name, data, options):
    path = tmp_path / name
    path.write_bytes(data)
    d = load(path, **options)
    torch.testing.assert_close(d.x, reference.x, rtol=0, atol=0)
    assert d.y.tolist() == reference.y.tolist() == [1, 0, 1, 0, 1, 0]
    assert d.groups.tolist() == reference.groups.tolist() == [0, 0, 1, 1, 0, 1]
    assert d.info["features"] == reference.info["features"]
    assert d.info["clients"]["mapping"] == {"Köln": 0, "Zürich": 1}
    assert reference.info["features"]["one_hot"]["note"]["levels"] == [
        "chest pain, mild", "line one\nline two", "none", 'said "no"']


def test_reader_agrees_with_pandas_on_well_formed_files(tmp_path):
    """pandas.read_csv (its C parser) is an independent reading of a well-formed file: every
    field and every column name must match (two columns at least: a line holding one empty
    field is a blank line to this reader)."""
    rng = np.random.default_rng(0)
    words = ["a", "b c", "d,e", 'say "hi"', "x\ny", "", "?", "3.5", "-0", "1e5", "Köln"]
    for trial in range(20):
        columns = [f"col {j}" for j in range(rng.integers(2, 6))]
        cells = [[str(rng.choice(words)) for _ in columns] for _ in range(rng.integers(1, 15))]
        path = tmp_path / f"t{trial}.csv"
        pd.DataFrame(cells, columns=columns).to_csv(path, index=False, lineterminator="\r\n")
        expected = pd.read_csv(path, dtype=str, keep_default_na=False)
        table = read_table(path)
        assert table.header == list(expected.columns)
        assert table.frame.values.tolist() == [[v.strip() for v in row]
                                               for row in expected.values.tolist()]


def test_feature_names_match_the_columns_whatever_the_fitting_rows(tmp_path):
    """A gap only in the non-fitting rows gets the median and no indicator; a column with no
    value in the fitting rows is a gap everywhere (0 and its indicator), not raw numbers."""
    path = tmp_path / "gaps.csv"
    path.write_text("a,b,c,label\n?,1,x,0\n?,2,y,1\n5,3,x,0\n7,?,z,1\n")
    d = load_csv(path, client_column=None)
    for fit in ([0, 1, 3], [0, 1], [2, 3], [0, 1, 2, 3]):
        fitted = d.fit_features(np.array(fit))
        names = fitted.info["features"]["feature_names"]
        assert fitted.x.shape == (4, len(names)), (fit, names)
    fitted = d.fit_features(np.array([0, 1]))
    f = fitted.info["features"]
    assert f["feature_names"] == ["a", "a (missing)", "b", "c=x", "c=y"]
    assert fitted.x[:, 0].tolist() == [0, 0, 0, 0] and fitted.x[:, 1].tolist() == [1, 1, 1, 1]
    assert "indicator" not in f["numeric"]["b"]  # b's gap is in a non-fitting row
    assert fitted.x[3, 2] == 0.0  # imputed with the fitting rows' median, standardised
    assert f["numeric"]["b"]["imputed_with_median"] == 1.5


def test_a_column_constant_on_the_fitting_rows_keeps_other_rows_small(tmp_path):
    """Centred only (its standard deviation is 0), and on the scale of the column's power of
    two: a value of 7e29 outside the fitting rows no longer enters the features as 7e29."""
    path = tmp_path / "const.csv"
    path.write_text("a,label\n5e29,0\n5e29,1\n7e29,0\n")
    fitted = load_csv(path, client_column=None).fit_features(np.array([0, 1]))
    assert fitted.x[:2, 0].tolist() == [0.0, 0.0]
    assert abs(float(fitted.x[2, 0])) < 2
    assert fitted.info["features"]["numeric"]["a"]["std"] == 0.0
