"""Reading a configuration tree from a YAML or JSON file (``--config``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedkernels.sim.config import ConfigError

from .parsing import SIM_EXTRA_INSTALL


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The configuration tree in a ``.yaml``/``.yml`` or ``.json`` file (any other name is
    read as JSON)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte order mark is not part of it
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
    else:
        try:
            tree = json.loads(text)
        except json.JSONDecodeError as err:
            hint = ("" if suffix == ".json" else
                    " (read as JSON: a YAML file needs the .yaml or .yml suffix)")
            raise ConfigError(f"{path}: cannot parse: {err}{hint}") from None
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
