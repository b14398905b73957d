"""Reading a configuration tree from a YAML or JSON file (``--config``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedkernels.sim.config import ConfigError


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The configuration tree in a ``.yaml``/``.yml`` or ``.json`` file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError("YAML configs need PyYAML: pip install 'fedkernels[sim]'") from None
        try:
            tree = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: cannot parse: {err}") from None
    else:
        try:
            tree = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: cannot parse: {err}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return tree
