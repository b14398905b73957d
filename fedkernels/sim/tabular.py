"""Tabular data as people have it: a CSV file with text columns, gaps and a label to map.

:func:`read_table` reads and checks the file (header, duplicate names, ragged rows) into a
pandas DataFrame of text; :func:`map_labels` turns the label column into classes ``0..C-1``;
:func:`client_codes` numbers the client column; :func:`feature_columns` decides, on the whole
file, which feature columns are numeric and which categorical; :class:`TableEncoder` turns those
columns into a float matrix with a scikit-learn ``ColumnTransformer`` (``SimpleImputer`` with
missing indicators, ``StandardScaler``, ``OneHotEncoder``) fitted on the rows it is told are
training rows, so that no test row leaks into the features.

Rules (documented in ``docs/guide/data.md``):

- fields are separated by a comma, or by the ``data.delimiter`` given (``;``, tab, ``|``; a
  tab by default for a ``.tsv`` file); with ``data.decimal`` ``,`` numbers are read with a
  decimal comma and ``.`` thousands separators (``1.234,5``), as spreadsheets in those
  locales write them;
- a field is missing when, stripped of spaces, it is one of ``MISSING_MARKERS`` (any case);
- a feature is a number when ``pandas.to_numeric`` reads it and it is finite; labels, clients
  and categories compare numbers exactly: ``1``, ``1.0``, ``01`` and ``+1`` are the same value,
  and 17-digit identifiers stay distinct;
- a feature column is numeric when every present value is a number, categorical when every
  present value is text or when it is listed in ``categorical_columns``; a column with both
  is an error naming a row and the column;
- numeric gaps get the training median and a 0/1 indicator column; categorical gaps are a level
  of their own, ``missing``; levels seen only outside the training rows encode as all zeros.
"""

from __future__ import annotations

import codecs
import csv
import io
import math
import numbers
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedkernels.aggregate import FLOAT32_MAX

from .config import CSV_DECIMAL_MARKS, CSV_DELIMITERS, ConfigError, known_encoding

if TYPE_CHECKING:  # pandas and scikit-learn (the sim extra) are imported where a table is read
    import pandas as pd

MISSING_MARKERS = ("", "?", "na", "n/a", "nan", "null")
MISSING_LEVEL = "missing"
# An automatically detected text column with more distinct values than this (and than half
# its present values) looks like an identifier or free text, not a category.
MAX_AUTO_LEVELS = 50

# Each separator's name in messages.
_DELIMITER_NAMES = {",": "commas", ";": "semicolons", "\t": "tabs", "|": "'|'"}
_DELIMITER_FLAGS = {",": "','", ";": "';'", "\t": "tab", "|": "'|'"}


def field_separator(setting: str | None, path: str | Path) -> str:
    """The character data.delimiter names (``None``: a tab for a ``.tsv`` file, compressed or
    not, else a comma)."""
    if setting is None:
        name = Path(path).name.lower()
        return "\t" if name.endswith((".tsv", ".tsv.gz", ".tsv.bz2", ".tsv.xz")) else ","
    if setting not in CSV_DELIMITERS:
        raise ConfigError(f"data.delimiter must be one of ',', ';', 'tab' or '|', got {setting!r}")
    return CSV_DELIMITERS[setting]


# A number with a decimal comma and optional '.' thousands separators: 3,5  -0,25  1.234,5
# 1.234.567 (and 1.234, the thousands separator alone). Plain digits match too (unchanged).
_DECIMAL_COMMA_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:\.\d{3})+|\d*)(?:,\d+)?")


def point_decimal(text: str) -> str:
    """``text`` with a decimal comma number rewritten as float() reads it (``1.234,5`` ->
    ``1234.5``); anything else unchanged."""
    if ("," in text or "." in text) and any(ch.isdigit() for ch in text) and \
            _DECIMAL_COMMA_NUMBER.fullmatch(text):
        return text.replace(".", "").replace(",", ".")
    return text


def is_missing(text: str) -> bool:
    return text.strip().lower() in MISSING_MARKERS


def missing_mask(column: pd.Series) -> np.ndarray:
    """:func:`is_missing` of every field of a column of stripped text."""
    return column.str.lower().isin(MISSING_MARKERS).to_numpy()


def as_number(text: str) -> float | None:
    """The finite number ``text`` spells, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def exact_number(text: str) -> Decimal | None:
    """The number ``text`` spells, exactly (a float would merge 9007199254740992 and
    9007199254740993), or None when it is not a number by :func:`as_number`'s rule."""
    if as_number(text) is None:
        return None
    return Decimal(text.strip())


def canonical(text: str) -> str:
    """One spelling per value: numbers as ``1`` or ``0.5`` (so ``1``, ``1.0``, ``01`` and
    ``+1`` are one value, and distinct numbers always stay distinct), text stripped of
    surrounding spaces."""
    text = text.strip()
    value = exact_number(text)
    if value is None:
        return text
    # Trailing zeros dropped by hand: Decimal.normalize() rounds to 28 digits and flushes
    # tiny numbers (1e-999999999) to 0 under the default context.
    sign, digits, exponent = value.as_tuple()
    digits = list(digits)
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
        exponent += 1
    if digits == [0]:
        return "0"
    value = Decimal((sign, tuple(digits), exponent))
    if exponent < -_MAX_FRACTION_DIGITS:  # written out, 1e-999999 would be a megabyte
        return format(value, "E")
    return format(value, "f")


_MAX_FRACTION_DIGITS = 400  # more than any float's (5e-324 has 324)


def canonical_column(column: pd.Series) -> list[str]:
    """:func:`canonical` of every field (worked out once per distinct spelling)."""
    import pandas as pd

    spelled = {text: canonical(text) for text in pd.unique(column)}
    return [spelled[text] for text in column]


# The order of labels, clients and levels (not LabelEncoder's or OneHotEncoder's own, which
# sort text: 10 before 9), exact for numbers.
def _sort_key(value: str) -> tuple:
    number = exact_number(value)
    return (0, number, "") if number is not None else (1, 0, value)


# Numbers as spreadsheets in some locales write them, which float() does not read:
# 1,234 or 1.234.567 (thousands separators), 3,5 (decimal comma), 12% or 12,5 %.
# A first group of 0 is no thousands: 0,125 has a decimal comma.
_LOCALE_NUMBERS = (
    ("thousands separators",
     re.compile(r"[+-]?[1-9]\d{0,2}(?:([,.' ])\d{3})(?:\1\d{3})*(?:[.,]\d+)?")),
    ("a decimal comma", re.compile(r"[+-]?\d*,\d+")),
    ("a % sign", re.compile(r"[+-]?(?:\d+(?:[.,]\d*)?|[.,]\d+)\s*%")),
)


def locale_number(text: str) -> str | None:
    """How ``text`` writes a number that float() does not read (``"a decimal comma"``), or
    None when it does not look like a number."""
    for what, pattern in _LOCALE_NUMBERS:
        if pattern.fullmatch(text.strip()):
            return what
    return None


def _locale_hint(texts: Sequence[str]) -> str:
    """A note for a text column most of whose values look like numbers written with
    thousands separators, decimal commas or a % sign (empty otherwise)."""
    # each distinct spelling once (in order of first appearance, for the example), with how
    # often it occurs: a column has far fewer levels than rows
    spellings = Counter(texts)
    found = [(k, t) for t in spellings if (k := locale_number(t)) is not None]
    if sum(spellings[t] for _, t in found) * 2 <= len(texts):
        return ""
    counts = Counter()
    for k, t in found:
        counts[k] += spellings[t]
    kind = max(sorted(counts), key=counts.get)
    # 1,250 reads as thousands or as a decimal comma; beside 7,5 or 0,125, whose comma can only
    # be a decimal one, it is a decimal comma too when that reading makes every value a number
    # (as in a European spreadsheet's column of numbers with three decimals, most of them)
    decimal_reading = all(as_number(point_decimal(t.strip())) is not None
                          for k, t in found if k != "a % sign")
    if "a decimal comma" in counts and decimal_reading:
        kind = "a decimal comma"
    example = next(t for k, t in found if k == kind)
    if kind == "a decimal comma":
        return (f"its values look like numbers written with {kind} (e.g. {example!r}), which "
                f"are read as text; {_DECIMAL_FLAG}, or clean the column ('.' as the decimal "
                "point)")
    either = (f"; if ',' is their decimal mark instead, {_DECIMAL_FLAG}"
              if kind == "thousands separators" and "," in example and decimal_reading else "")
    return (f"its values look like numbers written with {kind} (e.g. {example!r}), which are "
            "read as text; clean the column (plain digits, '.' as the decimal point, no "
            f"separators or % sign) to read it as numbers{either}")


_DECIMAL_FLAG = ("pass --data.decimal , (data.decimal: ',') to read numbers with a decimal "
                 "comma")


@dataclass
class Table:
    """A CSV file's rows as text (``frame``: one column per header name, fields stripped), with
    each row's number as a spreadsheet shows it (the header is row 1; a quoted field spanning
    lines is still one row), and the field separator it was read with."""

    path: Path
    frame: pd.DataFrame
    row_numbers: list[int]
    empty_unnamed_columns: list[int]  # dropped (1-based)
    delimiter: str = ","

    @property
    def header(self) -> list[str]:
        return list(self.frame.columns)

    @property
    def num_rows(self) -> int:
        return len(self.frame)

    def column(self, name: str) -> pd.Series:
        return self.frame[name]

    def where(self, r: int) -> str:
        """``path, row N``: row numbers count the header as row 1, as a spreadsheet does."""
        return f"{self.path}, row {self.row_numbers[r]}"


GZIP_MAGIC = b"\x1f\x8b"
# Files people pass for a table that are not text, by their first bytes.
_NOT_TEXT = (
    (b"PK\x03\x04", "a ZIP archive (an Excel .xlsx or OpenDocument .ods workbook is one)"),
    (b"\xd0\xcf\x11\xe0", "an old Office file (an Excel .xls workbook)"),
    (b"PAR1", "a Parquet file"),
    (b"\x89HDF", "an HDF5 file"),
    (b"ARROW1", "an Arrow/Feather file"),
    (b"SQLite format 3\x00", "an SQLite database"),
)
# Arrays, which have no column names to read: Dataset.from_tensors takes them from Python.
_ARRAYS_HINT = ("not a text table; load it in Python and pass it as "
                "fedkernels.sim.Dataset.from_tensors(x, y, groups) to Simulation(dataset=...), "
                "or write it as a CSV file with a header row")
UTF8_BOM = b"\xef\xbb\xbf"
# Compressed files read as they are (the Python library of each), by their first bytes.
_COMPRESSED = {GZIP_MAGIC: ("gzip", "gzip"), b"BZh": ("bzip2", "bz2"),
               b"\xfd7zXZ\x00": ("xz", "lzma")}
# Compressed files and archives not read here.
_ARCHIVES = (
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
)


def _refuse_zip(path: Path, data: bytes) -> None:
    """A ZIP file: a workbook to export as CSV, or an archive (a data set's download) holding
    the CSV file to pass instead."""
    import zipfile

    try:
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # the generic message for a ZIP file follows
    if "xl/workbook.xml" in names or "content.xml" in names:
        return
    if names and all(n.endswith(".npy") for n in names):
        raise ConfigError(f"{path}: a NumPy .npz archive ({', '.join(names[:5])}), "
                          f"{_ARRAYS_HINT}")
    shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    raise ConfigError(f"{path}: a ZIP archive holding {shown or 'nothing'}, not a text table; "
                      "unzip it and pass the CSV file inside as data.path")


def _read_text(path: Path, encoding: str = "utf-8") -> str:
    """The file as text: UTF-8 with or without a byte-order mark (or ``encoding``, such as
    ``cp1252``, the Windows Excel's), compressed with gzip, bzip2 or xz or not."""
    if not known_encoding(encoding):
        raise ConfigError(f"data.encoding: unknown text encoding {encoding!r} (e.g. utf-8, "
                          "cp1252, latin-1)")
    codec = codecs.lookup(encoding).name
    if path.is_dir():
        raise ConfigError(f"data.path: {path} is a folder, not a file")
    if not path.exists():
        raise ConfigError(f"data.path: no such file: {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"data.path: cannot read {path}: {err.strerror or err}") from None
    where = "byte"
    for magic, (name, module) in _COMPRESSED.items():
        if data.startswith(magic):
            import importlib

            try:
                data = importlib.import_module(module).decompress(data)
            except ImportError:  # a Python built without the library
                raise ConfigError(f"{path}: {name}-compressed, and this Python has no "
                                  f"{module} module to read it; decompress it first") from None
            except Exception as err:  # each library reports damage with its own types
                raise ConfigError(f"{path}: a damaged {name} file ({err})") from None
            where = "byte of the decompressed data"
            break
    for magic, what in _ARCHIVES:
        if data.startswith(magic):
            raise ConfigError(f"{path}: {what}; decompress it and pass the CSV file inside")
    if data.startswith(b"\x93NUMPY"):
        raise ConfigError(f"{path}: a NumPy .npy array, {_ARRAYS_HINT}")
    if data.startswith(b"PK\x03\x04"):
        _refuse_zip(path, data)
    for magic, what in _NOT_TEXT:
        if data.startswith(magic):
            raise ConfigError(f"{path}: {what}, not a text table; export it as CSV (UTF-8) first")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{path}: UTF-16 text; save it as UTF-8 (CSV UTF-8 in a spreadsheet)")
    skip = len(UTF8_BOM) if codec == "utf-8" and data.startswith(UTF8_BOM) else 0
    try:
        return data[skip:].decode(codec)
    except UnicodeDecodeError as err:
        offset = skip + err.start
        prefix = data[skip:offset].decode(codec)
        complete = list(csv.reader(io.StringIO(prefix, newline=""), skipinitialspace=True))
        # the bad byte is in the last, unfinished record, or starts the next one
        row = len(complete) + (not prefix or prefix.endswith(("\n", "\r")))
        fix = ("save the file as UTF-8, or name its encoding with --data.encoding (cp1252 for "
               "a Windows Excel export, latin-1)" if codec == "utf-8" else
               "name the file's encoding with --data.encoding")
        shown = "UTF-8" if codec == "utf-8" else codec
        raise ConfigError(f"{path}, row {row}: not {shown} text ({err.reason} at {where} "
                          f"{offset}: {data[offset:offset + 1]!r}); {fix}") from None


def _csv_problem(err: csv.Error) -> str:
    text = str(err)
    if "expected after" in text or "unexpected end of data" in text:
        return ("a quoted field is not closed where it should be: it must end with '\"' right "
                "before a comma or the end of the line, and a '\"' inside it is written twice "
                "('\"\"')")
    return f"cannot be read as CSV ({text})"


def _separator_hint(header: list[str], delimiter: str, rows: Sequence[list[str]] = (),
                    wider_row: bool = False) -> str:
    """For a header that reads as one column, the separator it seems to use instead (or, next
    to a row of more fields, ``wider_row``, the title or comment line it may be)."""
    if len(header) == 1:
        found = [d for d in _DELIMITER_NAMES if d != delimiter and d in header[0]]
        if found:
            other = max(found, key=header[0].count)
            return (f" (split at {_DELIMITER_NAMES[delimiter]}, the header is one column, "
                    f"but it holds {_DELIMITER_NAMES[other]}: pass --data.delimiter "
                    f"{_DELIMITER_FLAGS[other]})")
        if wider_row:
            return (f"; the first row, {header[0]!r}, is one field: if it is a title or a "
                    "comment above the header row, remove it")
    return _no_header_hint(header, rows)


def _no_header_hint(header: list[str], rows: Sequence[list[str]] = ()) -> str:
    """A first row that reads as data: likely the file has no header row (UCI's
    ``processed.*.data`` files and ``adult.data``, for two): all numbers, or a number over a
    column of numbers (a column's name is text: ``age``, not ``39``)."""
    if header and all(as_number(name) is not None for name in header):
        return ("; the first row is all numbers, so the file seems to have no header row: add "
                "one naming the columns")
    sample = [row for row in rows[:200] if len(row) == len(header)]
    for j, name in enumerate(header):
        values = [row[j] for row in sample if not is_missing(row[j])]
        if as_number(name) is not None and values and \
                all(as_number(v) is not None for v in values):
            return (f"; the first row holds numbers where column names belong (e.g. {name!r} "
                    f"over column {j + 1}'s numbers), so the file seems to have no header row: "
                    "add one naming the columns")
    return ""


def read_table(path: str | Path, delimiter: str | None = None, decimal: str = ".",
               encoding: str = "utf-8") -> Table:
    """Reads a delimited file with a header row (``delimiter``: a data.delimiter setting, see
    :func:`field_separator`; ``decimal``: ``"."``, or ``","`` to read ``1.234,5`` as 1234.5;
    ``encoding``: the file's text encoding); every problem is a :class:`ConfigError` naming
    the row (and column) at fault. Malformed quoting is refused rather than read as a field
    that swallows the following rows. A leading ``~`` is the home folder, as in a shell (a
    path from a configuration file is not expanded by one)."""
    path = Path(path).expanduser()
    separator = field_separator(delimiter, path)
    if decimal not in CSV_DECIMAL_MARKS:
        raise ConfigError(f"data.decimal must be '.' or ',', got {decimal!r}")
    import pandas as pd

    # Tokenised by the csv module in strict mode, not pandas.read_csv: its C engine reads an
    # unclosed quote into the next row without a word and pads a short row with empty fields;
    # its python engine names no row for a quoting error, and with the on_bad_lines callable
    # that a spreadsheet's padded rows need, it drops a malformed row silently.
    # skipinitialspace: a quoted field after ", " is still quoted (spaces around fields go)
    reader = csv.reader(io.StringIO(_read_text(path, encoding), newline=""), strict=True,
                        skipinitialspace=True, delimiter=separator)
    rows, numbers = [], []
    number = 0  # the spreadsheet row of the record being read
    try:
        for number, record in enumerate(reader, start=1):
            if record and not (len(record) == 1 and not record[0].strip()):
                fields = [field.strip() for field in record]
                if decimal == "," and rows:  # the header's names stay as written
                    fields = [point_decimal(field) for field in fields]
                rows.append(fields)
                numbers.append(number)
    except csv.Error as err:
        raise ConfigError(f"{path}, row {number + 1}: {_csv_problem(err)}") from None
    if not rows:
        raise ConfigError(f"{path}: the file is empty; it needs a header row and at least one "
                          "data row")
    excel = re.fullmatch(r"sep=(.)", separator.join(rows[0]), re.IGNORECASE)
    if excel:  # a line Excel reads (and some exports write) to learn the separator
        mark = excel.group(1)
        flag = f" and pass --data.delimiter {_DELIMITER_FLAGS[mark]}" if \
            mark != separator and mark in _DELIMITER_FLAGS else ""
        raise ConfigError(f"{path}, row 1: {excel.group(0)!r} is Excel's separator line, not a "
                          f"header row: remove it{flag}")
    header, body, body_numbers = rows[0], rows[1:], numbers[1:]
    if not body:
        raise ConfigError(f"{path}: needs a header row and at least one data row")
    for i, (row, number) in enumerate(zip(body, body_numbers)):
        if len(row) > len(header) and not any(row[len(header):]):
            body[i] = row = row[:len(header)]  # trailing empty fields, as spreadsheets pad rows
        elif len(row) < len(header) and not any(header[len(row):]):
            # a row that stops before the header's trailing unnamed columns: they are empty
            body[i] = row = row + [""] * (len(header) - len(row))
        if len(row) != len(header):
            raise ConfigError(f"{path}, row {number}: {len(row)} fields, the header has "
                              f"{len(header)}"
                              f"{_separator_hint(header, separator, wider_row=len(row) > len(header))}")
    # Columns without a name: empty ones (a spreadsheet's trailing ",,") are dropped; one
    # holding values cannot be named in a setting, so it is refused.
    unnamed = [j for j, name in enumerate(header) if not name]
    for j in unnamed:
        r = next((r for r, row in enumerate(body) if row[j]), None)
        if r is not None:
            raise ConfigError(
                f"{path}: column {j + 1} of the header has no name, but row {body_numbers[r]} "
                f"holds {body[r][j]!r} there; name the column in the header (a row index, as "
                "DataFrame.to_csv writes by default, then goes in data.ignore_columns)")
    if unnamed:
        keep = [j for j, name in enumerate(header) if name]
        if not keep:
            raise ConfigError(f"{path}: no column of the header has a name")
        header = [header[j] for j in keep]
        body = [[row[j] for j in keep] for row in body]
    seen: dict[str, int] = {}
    for j, name in enumerate(header, start=1):
        if name in seen:
            raise ConfigError(f"{path}: column {name!r} appears twice in the header (columns "
                              f"{seen[name]} and {j}); every column needs its own name"
                              f"{_no_header_hint(header, body)}")
        seen[name] = j
    frame = pd.DataFrame(body, columns=header, dtype=object)
    return Table(path, frame, body_numbers, [j + 1 for j in unnamed], separator)


def require_columns(table: Table, names: dict[str, str | None]) -> None:
    """Each ``names[option] = column`` must be in the header."""
    for option, column in names.items():
        if column is not None and column not in table.header:
            raise ConfigError(f"{table.path}: no column {column!r} for {option} (columns: "
                              f"{', '.join(table.header)})"
                              f"{_separator_hint(table.header, table.delimiter, _first_rows(table))}")


def _first_rows(table: Table, count: int = 200) -> list[list[str]]:
    return table.frame.head(count).values.tolist()


# ---------------------------------------------------------------- labels and clients


def parse_label_map(text: str) -> dict[str, int]:
    """``"a=0,b=1"`` -> ``{"a": 0, "b": 1}`` (keys in :func:`canonical` form). The class follows
    the last ``=``, so a value may hold one: ``"<=50K=0"`` maps ``<=50K``."""
    mapping: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.rpartition("=")
        if not sep or not key.strip():
            raise ConfigError(f"data.label_map: {item.strip()!r} is not VALUE=CLASS "
                              "(expected e.g. 'benign=0,malignant=1')")
        try:
            cls = int(value.strip())
        except ValueError:
            cls = -1
        if cls < 0:
            raise ConfigError(f"data.label_map: class of {key.strip()!r} must be an integer "
                              f">= 0, got {value.strip()!r}")
        if canonical(key) in mapping:
            raise ConfigError(f"data.label_map: {key.strip()!r} is given twice")
        mapping[canonical(key)] = cls
    # The model gets the largest class + 1 outputs: numbers beyond the map's size would only
    # add empty classes (and 1e11 of them do not fit in memory).
    for key, cls in mapping.items():
        if cls >= len(mapping):
            raise ConfigError(f"data.label_map: class {cls} of {key!r} is beyond the "
                              f"{len(mapping)} values mapped; number the classes from 0 to "
                              f"{len(mapping) - 1} at most")
    return mapping


def map_labels(
    table: Table,
    column: str,
    label_map: str | None = None,
    positive_labels: Sequence[Any] | None = None,
) -> tuple[np.ndarray, int, dict[str, Any]]:
    """The label column as classes: ``(y, num_classes, info)``.

    Labels are read as text and put in :func:`canonical` form. Then ``label_map`` maps each
    value to its class; or ``positive_labels`` makes those values class 1 and every other
    value class 0; or, by default, the distinct values in sorted order (numerically when they
    are numbers) become ``0..C-1``. Without a ``label_map``, a column that mixes numbers and
    text is an error naming a row: which class ``yes`` is next to ``1`` is not ours to guess.
    """
    if label_map is not None and positive_labels is not None:
        raise ConfigError("data.label_map and data.positive_labels both given; choose one")
    raw = table.column(column).tolist()
    gaps = missing_mask(table.column(column))
    if gaps.any():
        r = int(np.argmax(gaps))
        raise ConfigError(f"{table.where(r)}: the label (column {column!r}) is missing "
                          f"({raw[r]!r}); every row needs a label")
    values = canonical_column(table.column(column))
    info: dict[str, Any] = {"column": column}
    if label_map is not None:
        mapping = parse_label_map(label_map)
        for r, v in enumerate(values):
            if v not in mapping:
                raise ConfigError(f"{table.where(r)}: label {raw[r]!r} (column {column!r}) is "
                                  f"not in data.label_map (values: {', '.join(mapping)})")
        y = np.array([mapping[v] for v in values], dtype=np.int64)
        if len(set(y.tolist())) < 2:
            raise ConfigError(f"data.label_map puts every row of column {column!r} in class "
                              f"{y[0]}; two classes are needed")
        info.update(rule="label_map", mapping=mapping)
        num_classes = max(mapping.values()) + 1
    else:
        numeric = [as_number(v) is not None for v in values]
        if any(numeric) and not all(numeric):
            few_numbers = sum(numeric) * 2 < len(numeric)
            r = numeric.index(True) if few_numbers else numeric.index(False)
            other = numeric.index(not numeric[r])
            kind, rest = ("a number", "text") if numeric[r] else ("text", "numbers")
            raise ConfigError(
                f"{table.where(r)}: label {raw[r]!r} (column {column!r}) is {kind}, but other "
                f"labels are {rest} (e.g. row {table.row_numbers[other]}: "
                f"{raw[other]!r}); give data.label_map to say which class each value is "
                "(e.g. 'no=0,0=0,yes=1,1=1')")
        if positive_labels is not None:
            if isinstance(positive_labels, (str, bytes)):
                raise ConfigError(f"data.positive_labels must be a list of values, not the text "
                                  f"{positive_labels!r} (e.g. [{positive_labels!r}])")
            positive = []
            for item in positive_labels:
                if isinstance(item, bool):
                    raise ConfigError(f"data.positive_labels: {item!r} is a boolean (quote it "
                                      "in YAML: 'yes')")
                if not isinstance(item, (str, numbers.Real)):
                    raise ConfigError(f"data.positive_labels: {item!r} is not a label value "
                                      "(give a flat list of values, e.g. [1, 2, 'yes'])")
                positive.append(canonical(str(item)))
            if not positive:
                raise ConfigError("data.positive_labels is empty")
            y = np.array([v in positive for v in values], dtype=np.int64)
            if y.all() or not y.any():
                which = "every" if y.all() else "no"
                raise ConfigError(f"data.positive_labels {','.join(positive)} matches {which} "
                                  f"row of column {column!r} (values: "
                                  f"{', '.join(sorted(set(values), key=_sort_key)[:20])}); "
                                  "two classes are needed")
            distinct = sorted(set(values), key=_sort_key)
            mapping = {v: int(v in positive) for v in distinct}
            info.update(rule="positive_labels", mapping=mapping,
                        positive_values_absent=[p for p in positive if p not in mapping])
            num_classes = 2
        else:
            distinct = sorted(set(values), key=_sort_key)
            if len(distinct) < 2:
                raise ConfigError(f"{table.path}: the label column {column!r} has one value "
                                  f"({distinct[0]!r}); two classes are needed")
            mapping = {v: i for i, v in enumerate(distinct)}
            y = np.array([mapping[v] for v in values], dtype=np.int64)
            info.update(rule="sorted values", mapping=mapping)
            num_classes = len(distinct)
    if label_map is None:
        _warn_case_variants(values, mapping, column, info)
    info["class_counts"] = np.bincount(y, minlength=num_classes).tolist()
    return y, num_classes, info


class DataWarning(UserWarning):
    """Something in the file that is read as it is written but is likely a mistake."""


def _warn_case_variants(values: list[str], mapping: dict[str, int], column: str,
                        info: dict[str, Any]) -> None:
    """Labels spelled alike but for letter case (``yes``, ``Yes``), inner spaces or a final
    period (``>50K`` and ``>50K.``, as UCI's adult.data and adult.test write them) in different
    classes are kept apart (guessing is not ours), but recorded in ``info`` and warned about."""
    spellings: dict[str, list[str]] = {}
    for v in sorted(set(values)):
        spellings.setdefault(" ".join(v.casefold().rstrip(".").split()), []).append(v)
    groups = [g for g in spellings.values() if len({mapping[v] for v in g}) > 1]
    if not groups:
        return
    shown = "; ".join(", ".join(repr(v) for v in g) for g in groups)
    example = ",".join(f"{v}={mapping[groups[0][0]]}" for v in groups[0])
    message = (f"labels of column {column!r} that differ only in letter case, spaces or a "
               f"final '.' are different classes ({shown}); give data.label_map to merge them "
               f"(e.g. '{example},...')")
    info.update(case_variants=groups, warning=message)
    warnings.warn(DataWarning(message), stacklevel=3)


def client_codes(table: Table, column: str) -> tuple[np.ndarray, dict[str, int]]:
    """The client column as ``0..N-1`` (sorted values, numerically where they are numbers)."""
    gaps = missing_mask(table.column(column))
    if gaps.any():
        r = int(np.argmax(gaps))
        raise ConfigError(f"{table.where(r)}: the client (column {column!r}) is missing "
                          f"({table.column(column).iloc[r]!r}); every row needs one for the "
                          "natural partition")
    values = canonical_column(table.column(column))
    mapping = {v: i for i, v in enumerate(sorted(set(values), key=_sort_key))}
    return np.array([mapping[v] for v in values], dtype=np.int64), mapping


# ---------------------------------------------------------------- features


@dataclass
class Column:
    """One feature column: ``numbers`` (float64, NaN where missing) for a numeric column,
    ``levels`` (canonical text, None where missing) for a categorical one."""

    name: str
    kind: str  # "numeric" or "categorical"
    numbers: np.ndarray | None = None
    levels: list[str | None] | None = None
    forced: bool = False  # categorical because the user listed it
    note: str = ""  # a warning about the column, recorded in the encoding's info

    @property
    def missing(self) -> np.ndarray:
        if self.numbers is not None:
            return np.isnan(self.numbers)
        return np.array([v is None for v in self.levels], dtype=bool)


def _levels(raw: pd.Series, gaps: np.ndarray) -> list[str | None]:
    return [None if gap else level for gap, level in zip(gaps, canonical_column(raw))]


def feature_columns(
    table: Table,
    names: list[str],
    categorical: Sequence[str] = (),
) -> tuple[list[Column], dict[str, str]]:
    """Reads and types the feature columns; returns them and the dropped ones (with why)."""
    import pandas as pd

    columns, dropped = [], {}
    for name in names:
        raw = table.column(name)
        gaps = missing_mask(raw)
        if gaps.all():
            dropped[name] = "no value in any row"
            continue
        if name in categorical:
            columns.append(Column(name, "categorical", levels=_levels(raw, gaps), forced=True))
            continue
        values = pd.to_numeric(raw.where(~gaps), errors="coerce").to_numpy(dtype=np.float64)
        is_number = ~gaps & np.isfinite(values)
        is_text = ~gaps & ~is_number
        if not is_text.any():
            columns.append(Column(name, "numeric", numbers=np.where(is_number, values, np.nan)))
            continue
        if is_number.any():
            text_rows, number_rows = np.flatnonzero(is_text), np.flatnonzero(is_number)
            infinite = np.flatnonzero(is_text & np.isinf(values))  # inf, 1e400, ...
            if infinite.size:
                r = int(infinite[0])
                raise ConfigError(f"{table.where(r)}: column {name!r} value {raw.iloc[r]!r} is "
                                  "not a finite number")
            if len(text_rows) <= len(number_rows):
                r, e = int(text_rows[0]), int(number_rows[0])
                kind = locale_number(raw.iloc[r])
                written = f" (a number written with {kind}?)" if kind else ""
                fix = ("correct the value, leave it empty or write '?' for a missing one, or "
                       "list the column in data.categorical_columns")
                if kind == "a decimal comma":
                    fix = f"{_DECIMAL_FLAG}; or {fix}"
                raise ConfigError(
                    f"{table.where(r)}: column {name!r} value {raw.iloc[r]!r} is not a number"
                    f"{written}, but the column's other values are numbers (e.g. row "
                    f"{table.row_numbers[e]}: {raw.iloc[e]!r}); {fix}")
            r, e = int(number_rows[0]), int(text_rows[0])
            raise ConfigError(
                f"{table.where(r)}: column {name!r} value {raw.iloc[r]!r} is a number, but the "
                f"column's other values are text (e.g. row {table.row_numbers[e]}: "
                f"{raw.iloc[e]!r}); list the column in data.categorical_columns to read every "
                "value as a category")
        levels = _levels(raw, gaps)
        present = int((~gaps).sum())
        distinct = len(set(levels) - {None})
        hint = _locale_hint(raw[~gaps].tolist())
        if distinct > MAX_AUTO_LEVELS and distinct * 2 > present:
            if hint:
                raise ConfigError(f"{table.path}: column {name!r} is text with {distinct} "
                                  f"different values in {present} rows: {hint}")
            raise ConfigError(
                f"{table.path}: column {name!r} is text with {distinct} different values in "
                f"{present} rows, an identifier or free text rather than a category; list "
                "it in data.ignore_columns (or in data.categorical_columns to one-hot encode it "
                "anyway)")
        note = ""
        if hint:
            note = f"column {name!r} is one-hot encoded as text, but {hint}"
            warnings.warn(DataWarning(note), stacklevel=2)
        columns.append(Column(name, "categorical", levels=levels, note=note))
    return columns, dropped


class TableEncoder:
    """Turns feature columns into a float matrix, with every statistic fitted on given rows.

    One scikit-learn pipeline per column, in the columns' order, joined by a
    ``ColumnTransformer`` fitted on the fitting rows. Numeric column: with ``standardize``,
    ``(v - mean) / std`` with the fitting rows' mean and standard deviation of the present
    values (``StandardScaler``, which skips gaps; a constant column is only centred), taken
    over the values divided by a power of two near their peak (:func:`_unit`) so that values
    of any finite magnitude standardise; then gaps take the median of the fitting rows'
    values, plus a 0/1 column ``name (missing)`` when the fitting rows have gaps
    (``SimpleImputer(add_indicator=True)``; a column the fitting rows never fill is a gap in
    every row). Categorical column: one 0/1 column per level the fitting rows hold
    (``missing`` being a level of its own), in sorted order; a value the fitting rows never
    hold encodes as all zeros (``OneHotEncoder(handle_unknown="ignore")``).
    """

    def __init__(self, columns: list[Column], standardize: bool = True,
                 dropped: dict[str, str] | None = None):
        self.columns = columns
        self.standardize = standardize
        self.dropped = dict(dropped or {})
        self.num_rows = len(columns[0].missing) if columns else 0

    def encode(self, fit_rows: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """``(x, info)``: the ``[rows, features]`` float32 matrix and what was done, fitted on
        ``fit_rows`` (all rows when None)."""
        import pandas as pd
        from sklearn.compose import ColumnTransformer

        if not self.columns:
            raise ConfigError("no feature columns left (every feature column is empty or "
                              "ignored)")
        n = self.num_rows
        fit = np.zeros(n, dtype=bool)
        fit[np.arange(n) if fit_rows is None else np.asarray(fit_rows, dtype=np.int64)] = True
        frame, steps, units = {}, [], {}
        for j, col in enumerate(self.columns):
            key = f"c{j}"  # a column's name may hold what scikit-learn refuses in a step name
            if col.kind == "numeric":
                values = col.numbers
                if not (fit & ~col.missing).any():
                    values = np.full(n, np.nan)
                elif not self.standardize:
                    self._check_float32_range(col)
                else:
                    units[key] = _unit(values[fit & ~col.missing])
                    values = values / units[key]
                frame[key] = values
                steps.append((key, self._numeric_pipeline(key in units), [key]))
            else:
                tokens = [MISSING_LEVEL if v is None else v for v in col.levels]
                frame[key] = pd.Series(tokens, dtype=object)
                steps.append((key, _one_hot(tokens, fit), [key]))
        frame = pd.DataFrame(frame)
        joined = ColumnTransformer(steps, sparse_threshold=0.0).fit(frame[fit])
        x = joined.transform(frame)
        info = self._describe(joined, fit, units)
        return x.astype(np.float32), info

    @staticmethod
    def _numeric_pipeline(standardize: bool):
        from sklearn.impute import SimpleImputer
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        impute = SimpleImputer(strategy="median", add_indicator=True, keep_empty_features=True)
        return make_pipeline(StandardScaler(), impute) if standardize else make_pipeline(impute)

    @staticmethod
    def _check_float32_range(col: Column) -> None:
        big = np.flatnonzero(np.abs(col.numbers) > FLOAT32_MAX)
        if big.size:
            raise ConfigError(
                f"column {col.name!r}: the value {col.numbers[big[0]]:.6g} is beyond the "
                f"float32 range of the features (|x| <= {FLOAT32_MAX:.4g}); standardize the "
                "column (data.standardize) or rescale it")

    def _describe(self, joined, fit: np.ndarray, units: dict[str, float]) -> dict[str, Any]:
        """What the fitted ``joined`` transformer does, column by column, with the feature
        names (``name``, ``name (missing)``, ``name=level``); ``units`` holds the power of two
        each standardised column was divided by."""
        info: dict[str, Any] = {"fitted_on_rows": int(fit.sum()), "numeric": {}, "one_hot": {}}
        if self.dropped:
            info["dropped"] = dict(self.dropped)
        names = []
        for j, col in enumerate(self.columns):
            step = joined.named_transformers_[f"c{j}"]
            gaps = col.missing
            if col.kind == "numeric":
                impute = step.steps[-1][1]
                entry: dict[str, Any] = {"missing": int(gaps.sum()),
                                         "missing_in_fit_rows": int((gaps & fit).sum())}
                median = float(impute.statistics_[0])
                if f"c{j}" in units:  # standardised: back to the column's own units
                    unit = units[f"c{j}"]
                    scaler = step.steps[0][1]
                    mean, std = float(scaler.mean_[0]), math.sqrt(float(scaler.var_[0]))
                    median = (median * float(scaler.scale_[0]) + mean) * unit
                    entry.update(mean=mean * unit, std=std * unit)
                elif self.standardize:  # no value in the fitting rows: nothing to scale by
                    entry.update(mean=0.0, std=0.0)
                if gaps.any():
                    entry["imputed_with_median"] = median
                names.append(col.name)
                if len(impute.indicator_.features_):  # the fitting rows have gaps
                    names.append(f"{col.name} (missing)")
                    entry["indicator"] = f"{col.name} (missing)"
                info["numeric"][col.name] = entry
            else:
                levels = list(step.categories_[0])
                names.extend(f"{col.name}={level}" for level in levels)
                known = set(levels)
                unseen = sum((MISSING_LEVEL if v is None else v) not in known for v in col.levels)
                info["one_hot"][col.name] = {
                    "levels": levels,
                    "missing": int(gaps.sum()),
                    "values_unseen_in_fit_rows": int(unseen),
                    "why": "listed in data.categorical_columns" if col.forced else "text values",
                }
                if col.note:
                    info["one_hot"][col.name]["warning"] = col.note
        info["standardized"] = sorted(info["numeric"]) if self.standardize else []
        info["feature_names"] = names
        return info


def _unit(values: np.ndarray) -> float:
    """A power of two within a factor 2 of the values' largest magnitude (1 when there is
    none): the values divided by it lie in [-2, 2], where squares neither overflow (1e200)
    nor vanish into subnormals (1e-320). Kept beside scikit-learn's scalers, which take a
    scale under 10 machine epsilons for zero and leave such a column unscaled."""
    peak = float(np.max(np.abs(values))) if values.size else 0.0
    if not (peak > 0 and math.isfinite(peak)):
        return 1.0
    return math.ldexp(1.0, math.frexp(peak)[1] - 1)


def _one_hot(tokens: list[str], fit: np.ndarray):
    """A one-hot encoder whose levels are those of the fitting rows, sorted as
    :func:`canonical` values sort (numerically where they are numbers: 9 before 10)."""
    from sklearn.preprocessing import OneHotEncoder

    seen = sorted({t for t, f in zip(tokens, fit) if f}, key=_sort_key)
    return OneHotEncoder(categories=[seen], handle_unknown="ignore", sparse_output=False,
                         dtype=np.float64)
