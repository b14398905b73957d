"""The package's layers as the code imports them: every import inside ``fedkernels`` points down
(ops, public APIs, framework-neutral rules, simulator, algorithms, entry points, apps), the
integrations never import the simulator or the algorithms, nothing below the apps imports
them, ``import fedkernels`` loads neither the self-check nor an optional dependency, and the
former module paths still import."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fedkernels"

# Bottom up. A module may import modules of its own layer or below.
LAYERS = [
    {"ops"},
    {"memory_footprints", "model_layout", "aggregate", "client_set", "robust", "privacy",
     "private", "selfcheck"},
    {"rules"},
    {"sim"},
    {"algorithms"},
    {"cli", "integrations"},
    {"apps"},  # algorithms as other frameworks' apps: on the simulator and the integrations
]
LAYER_OF = {top: level for level, names in enumerate(LAYERS) for top in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` that names a fedkernels module,
    relative imports resolved; ``from X import y`` also yields ``X.y`` (y may be a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out.append((node.lineno, source))
            out += [(node.lineno, f"{source}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in out if m == "fedkernels" or m.startswith("fedkernels.")]


def top_level(module: str) -> str | None:
    """The package-level part that decides a module's layer (``fedkernels.sim.run`` -> sim)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYER_OF else None


def sources(under: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_scan_sees_relative_and_absolute_imports():
    """The scanner is not vacuous: it resolves both kinds of import it must judge."""
    found = dict((m, line) for line, m in imported_modules(
        PACKAGE / "integrations" / "flower" / "weighting_strategies.py"))
    assert "fedkernels.rules.server_optimizers.ServerSGD" in found
    robust = {m for _, m in imported_modules(PACKAGE / "robust.py")}
    assert "fedkernels.client_set.ClientSet" in robust  # from .client_set import ClientSet


def test_integrations_never_import_the_simulator_or_the_algorithms():
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{line} imports {m}"
        for p in sources(PACKAGE / "integrations")
        for line, m in imported_modules(p)
        if top_level(m) in ("sim", "algorithms")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_apps_are_the_top_layer():
    """The apps (Flower ServerApp/ClientApp of an algorithm) use the simulator, the
    algorithms and the Flower integration's records; no other layer uses them."""
    assert LAYER_OF["apps"] > max(LAYER_OF[n] for n in ("cli", "integrations", "algorithms"))
    imported = {top_level(m) for p in sources(PACKAGE / "apps") for _, m in imported_modules(p)}
    assert {"sim", "algorithms", "integrations"} <= imported


def test_imports_point_down_the_layers():
    offenders = []
    for p in sources():
        own = top_level(module_name(p))
        if own is None:  # fedkernels/__init__.py: re-exports only
            continue
        for line, m in imported_modules(p):
            other = top_level(m)
            if other is not None and LAYER_OF[other] > LAYER_OF[own]:
                offenders.append(f"{p.relative_to(PACKAGE.parent)}:{line} ({own}) imports "
                                 f"{m} ({other}, a higher layer)")
    assert not offenders, "\n".join(offenders)


OPTIONAL = ("sklearn", "matplotlib", "flwr", "nvflare", "fedml", "fedlab", "scipy", "pandas",
            "dp_accounting", "jsonargparse", "yaml", "tqdm", "hypothesis")


@pytest.mark.slow
def test_import_fedkernels_stays_light():
    """``import fedkernels`` (in a fresh interpreter, after torch and NumPy) loads no optional
    package and none of the self-check, simulator, algorithms, CLI or integrations."""
    code = textwrap.dedent("""
        import json, sys
        import numpy, torch
        before = set(sys.modules)
        import fedkernels
        print(json.dumps(sorted(set(sys.modules) - before)))
        print(fedkernels.check.__module__)  # loaded on first use
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.splitlines()[0])
    assert "fedkernels.aggregate" in loaded  # the snapshot saw fedkernels' own modules
    heavy = [m for m in loaded if m.split(".")[0] in OPTIONAL or m in (
        "fedkernels.selfcheck", "fedkernels.sim", "fedkernels.algorithms", "fedkernels.cli",
        "fedkernels.integrations", "fedkernels.rules", "fedkernels.apps")]
    assert not heavy, heavy
    assert out.stdout.splitlines()[1] == "fedkernels.selfcheck"


def test_former_module_paths_still_import():
    """The paths the modules had before the privacy/ and integrations/flower/ packages: the
    same objects, not copies, and a DeprecationWarning naming the new home."""
    import sys

    import fedkernels
    from fedkernels.privacy import mechanism

    sys.modules.pop("fedkernels.private", None)
    with pytest.warns(DeprecationWarning, match="fedkernels.privacy.mechanism"):
        private = importlib.import_module("fedkernels.private")
    assert private.private_aggregate is mechanism.private_aggregate
    assert fedkernels.private is private
    assert fedkernels.check is importlib.import_module("fedkernels.selfcheck").check
    pytest.importorskip("flwr")
    pairs = {
        "fedkernels.integrations.flower_robust": ("Krum", "robust"),
        "fedkernels.integrations.flower_legacy": ("QFedAvg", "legacy"),
        "fedkernels.integrations.flower_legacy_robust": (
            "DifferentialPrivacyServerSideFixedClipping", "legacy_central_dp"),
    }
    for old, (name, new) in pairs.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
            module = importlib.import_module(old)
        home = importlib.import_module(f"fedkernels.integrations.flower.{new}")
        assert getattr(module, name) is getattr(home, name)
        assert set(module.__all__) <= set(dir(module))
