"""FEMNIST and Shakespeare in the JSON layout of the LEAF benchmark.

LEAF writes ``train/*.json`` and ``test/*.json``; each file holds ``users`` (names),
``num_samples`` (one count per user) and ``user_data`` ``{user: {"x": [...], "y": [...]}}``.
Every user (a writer, a speaking role) is one natural client: ``groups`` numbers the users in
sorted order, and a user's test rows (the publisher's split) are marked ``official_test``.

FEMNIST: ``x`` is 784 floats in [0, 1] (a 28x28 image, row by row), ``y`` the class in 0..61
(digits, capitals, lowercase letters). Shakespeare: ``x`` is a line of 80 characters and ``y``
the character after it; both become indices into LEAF's 80-character vocabulary
(:data:`LEAF_CHARACTERS`), so rows are int64 tokens ``[n, 80]`` and labels the next token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..dataset import Dataset
from .assemble import from_parts
from .files import MissingFiles, data_error, root_folder

# The characters of LEAF's Shakespeare model, in its order: a character's index is its token.
LEAF_CHARACTERS = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]"
                   "abcdefghijklmnopqrstuvwxyz}")
FEMNIST_CLASSES = 62
FEMNIST_PIXELS = 28 * 28
SEQUENCE_LENGTH = 80
REQUIRED_KEYS = ("users", "num_samples", "user_data")


def leaf_folder(root: Path, name: str) -> Path:
    """The folder with LEAF's ``train/`` (and ``test/``) for data set ``name``."""
    for candidate in (root / name / "data", root / name, root / "data", root):
        if (candidate / "train").is_dir():
            return candidate
    places = ", ".join(str(p) for p in (root / name / "data", root / name, root / "data", root))
    raise MissingFiles(f"no LEAF train/ folder of JSON files in {places}")


def read_json_files(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise MissingFiles(f"{folder} holds no .json files")
    out = []
    for path in files:
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as err:
            raise data_error(path, f"cannot be read ({err})") from None
        except json.JSONDecodeError as err:
            raise data_error(path, f"is not valid JSON (line {err.lineno}, column {err.colno}: "
                                   f"{err.msg})") from None
        if not isinstance(content, dict):
            raise data_error(path, f"holds a JSON {type(content).__name__}, not LEAF's object")
        missing = [k for k in REQUIRED_KEYS if k not in content]
        if missing:
            raise data_error(path, f"has no {missing[0]!r} (LEAF's files hold users, "
                                   "num_samples and user_data)")
        out.append((path, content))
    return out


def user_samples(path: Path, content: dict[str, Any]) -> list[tuple[str, list, list]]:
    """``(user, x, y)`` of each user of one LEAF file, checked against ``num_samples``."""
    users, counts, data = content["users"], content["num_samples"], content["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts):
        raise data_error(path, "'users' and 'num_samples' must be lists of the same length")
    if not isinstance(data, dict):
        raise data_error(path, "'user_data' must map each user to its x and y")
    out = []
    for user, count in zip(users, counts):
        record = data.get(user)
        if not isinstance(record, dict) or "x" not in record or "y" not in record:
            raise data_error(path, f"user {user!r} has no x and y in 'user_data'")
        x, y = record["x"], record["y"]
        if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y):
            raise data_error(path, f"user {user!r}: x and y must be lists of the same length")
        if len(x) != count:
            raise data_error(path, f"user {user!r} has {len(x)} samples, 'num_samples' says "
                                   f"{count}")
        out.append((str(user), x, y))
    return out


def load_leaf(name: str, root: str | Path) -> Dataset:
    """``femnist`` or ``shakespeare``: every user's training rows, then every user's test
    rows (``test/`` may be absent)."""
    folder = leaf_folder(root_folder(root), name)
    convert = _femnist_rows if name == "femnist" else _shakespeare_rows
    collected: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for part in ("train", "test"):
        if part == "test" and not (folder / part).is_dir():
            continue
        for path, content in read_json_files(folder / part):
            for user, x, y in user_samples(path, content):
                if x:
                    rows, labels = convert(path, user, x, y)
                    collected.setdefault(part, []).append((user, rows, labels))
    if "train" not in collected:
        raise data_error(folder / "train", "its files hold no samples")
    users = sorted({user for records in collected.values() for user, _, _ in records})
    number = {user: k for k, user in enumerate(users)}
    parts, groups = [], []
    for part, records in collected.items():
        parts.append((part, np.concatenate([r for _, r, _ in records]),
                      np.concatenate([lab for _, _, lab in records])))
        groups.append(np.concatenate([np.full(len(lab), number[u]) for u, _, lab in records]))
    if name == "femnist":
        return from_parts("femnist", parts, FEMNIST_CLASSES, source=folder,
                          image_shape=(1, 28, 28), groups=np.concatenate(groups),
                          users=len(users))
    return from_parts("shakespeare", parts, len(LEAF_CHARACTERS), source=folder,
                      groups=np.concatenate(groups), vocab_size=len(LEAF_CHARACTERS),
                      users=len(users), vocabulary=LEAF_CHARACTERS)


def _femnist_rows(path: Path, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    try:
        rows = np.asarray(x, dtype=np.float32)
        labels = np.asarray(y, dtype=np.float64)
    except (ValueError, TypeError):
        raise data_error(path, f"user {user!r}: x must be lists of {FEMNIST_PIXELS} numbers "
                               "and y numbers") from None
    if rows.shape != (len(x), FEMNIST_PIXELS):
        raise data_error(path, f"user {user!r}: each x must be {FEMNIST_PIXELS} numbers (a "
                               "28x28 image)")
    if not np.isfinite(rows).all() or rows.min() < 0 or rows.max() > 1:
        raise data_error(path, f"user {user!r}: pixel values must lie in [0, 1]")
    if labels.ndim != 1 or not np.isin(labels, np.arange(FEMNIST_CLASSES)).all():
        raise data_error(path, f"user {user!r}: labels must be integers in 0..{FEMNIST_CLASSES - 1}")
    return rows, labels.astype(np.int64)


def _token_table() -> np.ndarray:
    table = np.full(128, -1, dtype=np.int64)
    for index, char in enumerate(LEAF_CHARACTERS):
        table[ord(char)] = index
    return table


TOKENS = _token_table()


def _tokens(path: Path, user: str, texts: list, length: int, what: str) -> np.ndarray:
    """``[n, length]`` indices of ``texts`` (strings of ``length`` characters)."""
    if not all(isinstance(t, str) and len(t) == length for t in texts):
        raise data_error(path, f"user {user!r}: each {what} must be a string of {length} "
                               "characters")
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    indices = np.where(codes < 128, TOKENS[np.minimum(codes, 127)], -1)
    if (indices < 0).any():
        bad = chr(int(codes[np.flatnonzero(indices < 0)[0]]))
        raise data_error(path, f"user {user!r}: character {bad!r} is not in LEAF's "
                               f"{len(LEAF_CHARACTERS)}-character vocabulary")
    return indices.reshape(len(texts), length)


def _shakespeare_rows(path: Path, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    return (_tokens(path, user, x, SEQUENCE_LENGTH, "x"),
            _tokens(path, user, y, 1, "y").reshape(-1))
