"""The UCI Heart Disease data (Janosi, Steinbrunn, Pfisterer and Detrano, 1988; UCI Machine
Learning Repository, CC BY 4.0) in either of the two layouts people have it in.

- The repository's files ``processed.cleveland.data``, ``processed.hungarian.data``,
  ``processed.switzerland.data`` and ``processed.va.data``: comma separated, no header, ``?``
  for a missing value, 14 columns (:data:`COLUMNS`), categories written as codes (``4.0``).
- The merged table ``heart_disease_uci.csv``: a header ``id,age,sex,dataset,cp,...,num``, the
  site in ``dataset``, categories written as words (``asymptomatic``), ``thalch`` for
  ``thalach``, empty cells for missing values.

Both read to one table: the same features for the same patient, with the categories spelled as
the merged table spells them (:data:`CATEGORY_CODES`). The task is binary, heart disease present
(``num > 0``); each site is a client (``groups``, the natural partition); categories are one-hot
encoded and numeric columns imputed with missing indicators and standardised with statistics of
the training rows (:class:`fedkernels.sim.tabular.TableEncoder`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import ConfigError
from ..tabular import (
    DataWarning,
    Table,
    TableEncoder,
    client_codes,
    feature_columns,
    map_labels,
    missing_mask,
    read_table,
)

if TYPE_CHECKING:
    import pandas as pd

    from ..dataset import Dataset

# the 14 columns of the processed.*.data files, in their order
COLUMNS = ("age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalach", "exang",
           "oldpeak", "slope", "ca", "thal", "num")
NUMERIC = ("age", "trestbps", "chol", "thalach", "oldpeak", "ca")
LABEL = "num"
SITE = "site"
# the repository's file of each site -> the site as the merged table's `dataset` names it
SITE_FILES = {
    "processed.cleveland.data": "Cleveland",
    "processed.hungarian.data": "Hungary",
    "processed.switzerland.data": "Switzerland",
    "processed.va.data": "VA Long Beach",
}
MERGED_FILE = "heart_disease_uci.csv"
MERGED_HEADER = ("id", "age", "sex", "dataset", "cp", "trestbps", "chol", "fbs", "restecg",
                 "thalch", "exang", "oldpeak", "slope", "ca", "thal", "num")
# the merged table's names of columns the processed files name otherwise
MERGED_NAMES = {"thalch": "thalach", "dataset": SITE}
# each category's code in the processed files -> its word in the merged table (heart-disease.names)
CATEGORY_CODES = {
    "sex": {"0": "Female", "1": "Male"},
    "cp": {"1": "typical angina", "2": "atypical angina", "3": "non-anginal",
           "4": "asymptomatic"},
    "fbs": {"0": "FALSE", "1": "TRUE"},
    "restecg": {"0": "normal", "1": "st-t abnormality", "2": "lv hypertrophy"},
    "exang": {"0": "FALSE", "1": "TRUE"},
    "slope": {"1": "upsloping", "2": "flat", "3": "downsloping"},
    "thal": {"3": "normal", "6": "fixed defect", "7": "reversable defect"},
}
DISEASE_LEVELS = ("0", "1", "2", "3", "4")  # num: 0 no disease, 1-4 its grades
TASK = "heart disease present: num > 0"


def load_heart(root: str | Path) -> Dataset:
    """The patients of every site file in ``root`` (the four ``processed.*.data`` files, or
    any of them) or of ``heart_disease_uci.csv`` there; a folder holding both layouts is
    refused (they differ by a few patients, and which one a run read must not depend on what
    else lies in the folder). Every problem is a :class:`ConfigError` naming the file, the row
    and the column."""
    from ..dataset import Dataset

    root = Path(root).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.root: {root} is not a folder" if root.exists()
                          else f"data.root: no such folder: {root}")
    site_files = [name for name in SITE_FILES if (root / name).is_file()]
    merged = root / MERGED_FILE
    if site_files and merged.is_file():
        raise ConfigError(f"data.root {root} holds both layouts of the heart data ({MERGED_FILE} "
                          f"and {', '.join(site_files)}); keep one of them in the folder")
    if merged.is_file():
        patients, files = _read_merged(merged), [MERGED_FILE]
    elif site_files:
        patients, files = _read_site_files(root, site_files), site_files
        absent = [name for name in SITE_FILES if name not in site_files]
        if absent:
            warnings.warn(DataWarning(f"data.root {root} has no {', '.join(absent)}: the run has "
                                      f"{len(site_files)} of the 4 sites"), stacklevel=2)
    else:
        raise ConfigError(f"data.root {root} holds neither {MERGED_FILE} nor the UCI files "
                          f"{', '.join(SITE_FILES)} (the UCI Machine Learning Repository's "
                          "'Heart Disease' data set)")
    table = Table(root, patients, list(range(1, len(patients) + 1)), [])
    y, num_classes, labels = map_labels(table, LABEL, positive_labels=list(DISEASE_LEVELS[1:]))
    groups, sites = client_codes(table, SITE)
    features = [c for c in COLUMNS if c != LABEL]
    columns, dropped = feature_columns(table, features)
    encoder = TableEncoder(columns, standardize=True, dropped=dropped)
    x, encoded = encoder.encode()
    info: dict[str, Any] = {
        "files": [str(root / name) for name in files],
        "rows": len(patients),
        "task": TASK,
        "labels": labels,
        "clients": {"column": SITE, "mapping": sites},
        "features": encoded,
    }
    return Dataset(torch.from_numpy(x), torch.from_numpy(y), num_classes, groups,
                   name="heart", info=info, encoder=encoder)


def _read_merged(path: Path) -> pd.DataFrame:
    """The merged table, checked, as text in the processed files' column names plus ``site``."""
    table = read_table(path)
    names = {MERGED_NAMES.get(name, name): name for name in table.header}
    absent = [c for c in (*COLUMNS, SITE) if c not in names]
    if absent:
        spelled = {v: k for k, v in MERGED_NAMES.items()}
        raise ConfigError(f"{path}: no column {', '.join(repr(spelled.get(c, c)) for c in absent)}"
                          f" (the merged heart table's columns are {', '.join(MERGED_HEADER)}; "
                          f"this file has {', '.join(table.header)})")
    frame = table.frame.rename(columns=MERGED_NAMES)[[*COLUMNS, SITE]]
    words = {column: set(codes.values()) for column, codes in CATEGORY_CODES.items()}
    return _checked(frame, lambda r: table.where(r), words)


def _read_site_files(root: Path, names: list[str]) -> pd.DataFrame:
    """The processed files, each checked, as one table of text with the merged table's words
    for the categories and each file's site in ``site``."""
    import pandas as pd

    frames = []
    for name in names:
        path = root / name
        try:
            # the python engine pads a short row with NaN, the C engine with empty fields
            frame = pd.read_csv(path, header=None, dtype=str, keep_default_na=False,
                                na_filter=False, skip_blank_lines=False, encoding="ascii",
                                engine="python")
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: not a UCI processed heart file ({_first_line(err)})") \
                from None
        rows = frame.notna().any(axis=1).to_numpy()  # skip blank lines, keep line numbers
        frame = frame[rows]
        lines = np.flatnonzero(rows) + 1

        def where(r: int, path: Path = path, lines: np.ndarray = lines) -> str:
            return f"{path}, line {lines[r]}"

        if frame.shape[1] != len(COLUMNS) or frame.isna().any(axis=None):
            short = int(np.argmax(frame.isna().any(axis=1).to_numpy())) \
                if frame.isna().any(axis=None) else 0
            fields = int(frame.iloc[short].notna().sum())
            raise ConfigError(f"{where(short)}: {fields} fields, a UCI processed heart file has "
                              f"{len(COLUMNS)} ({', '.join(COLUMNS)})")
        frame = frame.apply(lambda column: column.str.strip())
        frame.columns = list(COLUMNS)
        frame = frame.reset_index(drop=True)
        frame = _checked(frame, where, {c: set(codes) for c, codes in CATEGORY_CODES.items()})
        for column, codes in CATEGORY_CODES.items():
            frame[column] = frame[column].map(lambda v, codes=codes: codes.get(v, v))
        frame[SITE] = SITE_FILES[name]
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def _checked(frame: pd.DataFrame, where, categories: dict[str, set[str]]) -> pd.DataFrame:
    """``frame`` (text) with every present numeric value a number, every present category one
    of ``categories[column]`` (codes are compared as numbers: ``4.0`` is ``4``; words without
    regard to letter case) and written as listed there, and ``num`` one of 0..4."""
    import pandas as pd

    frame = frame.copy()
    if SITE in frame:
        gaps = missing_mask(frame[SITE])
        if gaps.any():
            r = int(np.argmax(gaps))
            raise ConfigError(f"{where(r)}: the site (column 'dataset') is missing; every "
                              "patient needs one")
    for column in [*NUMERIC, *categories, LABEL]:
        raw = frame[column]
        gaps = missing_mask(raw)
        if column in NUMERIC:
            bad = ~gaps & pd.to_numeric(raw, errors="coerce").isna().to_numpy()
            expected = "a number"
        else:
            known = DISEASE_LEVELS if column == LABEL else sorted(categories[column])
            spelled = {_spelling(v): v for v in known}
            mapped = raw.map(lambda v, spelled=spelled: spelled.get(_spelling(v)))
            bad = (gaps & (column == LABEL)) | (~gaps & mapped.isna().to_numpy())
            frame[column] = mapped.where(~gaps, raw)
            expected = f"one of {', '.join(repr(v) for v in known)}"
        if bad.any():
            r = int(np.argmax(bad))
            raise ConfigError(f"{where(r)}: column {column!r} value {raw.iloc[r]!r} is not "
                              f"{expected}")
    return frame


def _spelling(value: str) -> str:
    """One spelling of a code or word: numbers without a fractional zero (``4.0`` -> ``4``),
    words in lower case."""
    try:
        number = float(value)
    except ValueError:
        return value.strip().casefold()
    return str(int(number)) if number.is_integer() else str(number)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
