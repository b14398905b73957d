"""FedML's aggregation code, loaded from the installed wheel's files without ``import fedml``.

``import fedml`` runs FedML's ``__init__``, which imports many of its declared dependencies;
an install made with ``pip install --no-deps fedml==0.9.6`` lacks them. The aggregation needs
only two of FedML's files (``core/common/ml_engine_backend.py`` and
``ml/aggregator/agg_operator.py``): :func:`loaded` executes just those, under their own module
names, below empty parent packages registered in ``sys.modules`` (where
``fedkernels.integrations.fedml`` finds them when it hands a case to FedML's code), and puts
``sys.modules`` back as it was on exit.

Used by ``python_tests/test_fedml_aggregator.py`` and ``bench/bench_fedml.py``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ["fedml", "fedml.core", "fedml.core.common", "fedml.ml", "fedml.ml.aggregator"]
FILES = {"fedml.core.common.ml_engine_backend": "core/common/ml_engine_backend.py",
         "fedml.ml.aggregator.agg_operator": "ml/aggregator/agg_operator.py"}
MISSING = "fedml 0.9.6's files are not installed (pip install --no-deps fedml==0.9.6)"


def fedml_root() -> Path | None:
    """The installed ``fedml`` package folder, if it holds both files; None otherwise."""
    try:
        spec = importlib.util.find_spec("fedml")  # finds the package without running it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    return root if all((root / f).is_file() for f in FILES.values()) else None


def fedml_version() -> str | None:
    """The installed FedML distribution's version (its metadata; ``fedml.__version__`` would
    need FedML's ``__init__``)."""
    try:
        return importlib.metadata.version("fedml")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def loaded(root: Path | None = None) -> Iterator[types.ModuleType]:
    """FedML's ``fedml.ml.aggregator.agg_operator`` module for the ``with`` block, loaded from
    ``root`` (default: :func:`fedml_root`). Raises ``FileNotFoundError`` (with :data:`MISSING`)
    when the files are not installed."""
    root = root or fedml_root()
    if root is None:
        raise FileNotFoundError(MISSING)
    names = PACKAGES + list(FILES)
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    try:
        for name in PACKAGES:
            package = types.ModuleType(name)
            package.__path__ = [str(root / Path(*name.split(".")[1:]))]
            sys.modules[name] = package
        for name, rel in FILES.items():
            spec = importlib.util.spec_from_file_location(name, root / rel)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        yield sys.modules["fedml.ml.aggregator.agg_operator"]
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
