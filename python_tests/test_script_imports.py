"""Every script under bench/ and experiments/ imports: a helper renamed or moved in the
package, or in bench/harness, fails here rather than when someone next runs the script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "experiments").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_imports(script, monkeypatch):
    # a script runs with its own folder first on sys.path
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location(f"script_{script.parent.name}_{script.stem}",
                                                  script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
