"""Loading the repository's scripts (experiments/, bench/) as modules, for tests of their helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str | None = None, register: bool = False) -> ModuleType:
    """Executes the script at ``path`` as a module named ``name`` (its file name by default).

    ``register=True`` puts it in ``sys.modules`` first, which dataclasses and pickling defined in
    the script need; the caller removes it when done.
    """
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
