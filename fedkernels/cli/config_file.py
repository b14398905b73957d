"""Reading a configuration tree from a YAML or JSON file (``--config``).

A configuration is a small tree, and what is read is bounded before anything else looks at it:
the file's size (:data:`MAX_BYTES`), and the tree's size once YAML aliases are counted as the
copies they stand for (:data:`MAX_VALUES` values, :data:`MAX_DEPTH` levels). A few hundred
bytes of nested aliases describe billions of values; later code that walks or prints the tree
(checks, error messages, the saved configuration) would take that much memory and time.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from fedkernels.sim.config import ConfigError

from .parsing import SIM_EXTRA_INSTALL

MAX_BYTES = 1 << 20  # a configuration file is a few kilobytes; a labels map of a big data set fits
MAX_VALUES = 100_000  # every mapping, list and scalar, aliases expanded
MAX_DEPTH = 64


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a configuration file, or None when it is a regular file
    or a pipe (``--config <(...)``; read up to the size bound like a file), following links."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"--config: no such file: {path}"
    except OSError as err:
        return f"--config: {path}: {err.strerror or err}"
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(mode) else
            "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    return f"--config: {path} is {kind}; give the path of a YAML or JSON file"


def _read_bounded(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES // 1024} KiB; a configuration file "
                          "is a few kilobytes (is it the right file?)")
    return data.decode("utf-8-sig")  # a byte order mark is not part of it


def check_tree_size(tree: Any, where: str) -> None:
    """Refuses a tree of more than :data:`MAX_VALUES` values or :data:`MAX_DEPTH` levels,
    counting a value held in several places (YAML aliases) once per place, and a tree that
    holds itself. Each distinct container is visited once (its expanded size remembered), so
    this costs the size of the file, not of the expansion."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_ids: set[int] = set()

    def visit(node: Any) -> tuple[int, int]:  # (values, depth), aliases expanded
        if not isinstance(node, (dict, list, tuple)):
            return 1, 0
        key = id(node)
        if key in sizes:
            return sizes[key], depths[key]
        if key in open_ids:
            raise ConfigError(f"{where}: a YAML alias refers to a mapping or list that holds it; "
                              "a configuration must be a finite tree")
        open_ids.add(key)
        children = [v for kv in node.items() for v in kv] if isinstance(node, dict) else node
        total, deepest = 1, 0
        for child in children:
            n, d = visit(child)
            total += n
            deepest = max(deepest, d + 1)
            if total > MAX_VALUES:
                raise ConfigError(f"{where}: the configuration holds more than {MAX_VALUES} "
                                  "values (YAML aliases count once per use); a configuration "
                                  "is a small tree")
            if deepest > MAX_DEPTH:
                raise ConfigError(f"{where}: the configuration is nested more than {MAX_DEPTH} "
                                  "levels deep")
        open_ids.discard(key)
        sizes[key], depths[key] = total, deepest
        return total, deepest

    try:
        visit(tree)
    except RecursionError:
        raise ConfigError(f"{where}: the configuration is nested too deeply") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The configuration tree in a ``.yaml``/``.yml`` or ``.json`` file (any other name is
    read as JSON)."""
    path = Path(path)
    problem = _not_a_file(path)
    if problem is not None:
        raise ConfigError(problem)
    try:
        text = _read_bounded(path)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    suffix = path.suffix.lower()
    if suffix in (".toml", ".ini", ".cfg"):
        # read as JSON, such a file only failed with a JSON parser's complaint
        raise ConfigError(f"{path}: a {suffix} file; --config reads YAML (.yaml, .yml) or JSON "
                          "(.json): write the same tree in one of them")
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"YAML configuration files need PyYAML, from the sim extra: {SIM_EXTRA_INSTALL}"
            ) from None
        try:
            tree = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: cannot parse: {_yaml_problem(err)}") from None
        except RecursionError:
            raise ConfigError(f"{path}: cannot parse: nested too deeply") from None
    else:
        try:
            tree = json.loads(text)
        except json.JSONDecodeError as err:
            hint = ("" if suffix == ".json" else
                    " (read as JSON: a YAML file needs the .yaml or .yml suffix)")
            raise ConfigError(f"{path}: cannot parse: {err}{hint}") from None
        except RecursionError:
            raise ConfigError(f"{path}: cannot parse: nested too deeply") from None
    check_tree_size(tree, str(path))
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return tree


def _yaml_problem(err: Exception) -> str:
    """PyYAML's several-line message as ``problem (line L, column C)``."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem is None:
        return " ".join(str(err).split())
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"

