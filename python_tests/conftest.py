"""Shared fixtures and helpers of the fedkernels test suite.

CUDA tests carry ``@pytest.mark.cuda`` (or use the ``DEVICES`` parametrization, whose CUDA
entry carries it) and are skipped when no GPU is visible; on a GPU machine they run unchanged
and compare the CUDA op with the pure-PyTorch reference and with the CPU op.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

import fedkernels  # noqa: F401  (registers the ops)

# every phase of every test has a time limit (time_limit.py)
pytest_plugins = ["time_limit"]

HAS_CUDA = torch.cuda.is_available()

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HALF_DTYPES = [torch.float16, torch.bfloat16]

# Every device test runs on the CPU, and on CUDA where a GPU is visible.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def cpu_builds() -> list[str]:
    """The CPU builds that tests run and compare: every build this CPU supports, or only the one
    FEDKERNELS_CPU_CAPABILITY forces (a tree that has that one library alone, such as the
    sanitizer build of .ci/sanitize.sh)."""
    from fedkernels.ops import native

    forced = os.environ.get("FEDKERNELS_CPU_CAPABILITY", "").lower()
    return [forced] if forced else native._supported_capabilities()


def run_in_cpu_build(script: str, capability: str, threads: int = 2, timeout: float = 300) -> None:
    """Runs ``script`` in a fresh process on the CPU build ``capability`` with ``threads``
    threads; it prints ``OK <build>``, or ``SKIP <why>`` to skip the test. Skips where this CPU
    lacks the build, or FEDKERNELS_CPU_CAPABILITY forces another. A fresh process: the build is
    chosen at import, and per-thread state a script sets (the subnormal mode) cannot leak into
    other tests."""
    from fedkernels.ops import native

    if capability not in native._supported_capabilities():
        pytest.skip(f"this CPU does not support the {capability} build")
    if capability not in cpu_builds():
        pytest.skip(f"FEDKERNELS_CPU_CAPABILITY forces another build than {capability}")
    env = dict(os.environ, FEDKERNELS_CPU_CAPABILITY=capability, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.split() == ["OK", capability], proc.stdout


# Property tests run their full example counts in the whole suite and FAST_EXAMPLES in the
# fast tier: `-m "not slow"`, or FEDKERNELS_TEST_TIER=fast whatever the marker expression.
FAST_EXAMPLES = 10
_fast_tier = False


def property_examples(full: int) -> int:
    """Hypothesis ``max_examples`` for a property test: ``full`` in the whole suite, at most
    FAST_EXAMPLES in the fast tier. Evaluated when the test module is imported, after
    pytest_configure has chosen the tier."""
    return min(full, FAST_EXAMPLES) if _fast_tier else full


def pytest_configure(config):
    global _fast_tier
    tier = os.environ.get("FEDKERNELS_TEST_TIER", "")
    if tier not in ("", "fast", "full"):
        raise pytest.UsageError(f"FEDKERNELS_TEST_TIER must be fast or full, not {tier!r}")
    _fast_tier = tier == "fast" or (not tier and "not slow" in (config.option.markexpr or ""))
    try:
        from hypothesis import settings
    except ImportError:
        return
    # property tests that name no max_examples of their own
    settings.register_profile("fast", max_examples=FAST_EXAMPLES)
    settings.load_profile("fast" if _fast_tier else "default")


# Flower calls gc.collect() for every ArrayRecord it empties, and a full collection walks every
# tracked object. What is alive after collection (torch, the imported frameworks, the test
# items) and what a test file leaves behind (caches, module fixtures' results) stays alive
# for the session: the collector stops walking it (gc.freeze), so a collection costs what the
# current test file created.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()
    return result


# Files whose tests start Flower's simulation engine (Ray), Flower deployments, NVFlare's
# simulator or the examples: with pytest-xdist's `-n N --dist loadgroup` they run one at a
# time on one worker, as these frameworks take machine-wide resources (Ray's session folder,
# ports NVFlare picks by closing a bound socket) and each keeps two cores busy on its own.
FRAMEWORK_ENGINE_FILES = frozenset({
    "test_apps_flower_engines.py", "test_examples.py", "test_flower_secagg_deployment.py",
    "test_integrations_flower_deployment.py", "test_nvflare_simulator.py",
})


def pytest_collection_modifyitems(config, items):
    engines = pytest.mark.xdist_group("framework_engines")
    for item in items:
        if item.path.name in FRAMEWORK_ENGINE_FILES:
            item.add_marker(engines)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- tolerances


def tolerances(dtype: torch.dtype, num_clients: int = 1) -> dict:
    """Native vs reference: same client order and accumulate dtype, so they differ only by
    rounding (FMA contraction, the final cast). Half types: one rounding of the output."""
    grow = max(1.0, math.sqrt(num_clients))
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12 * grow)
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5 * grow)
    if dtype == torch.float16:
        return dict(rtol=2e-3, atol=1e-3 * grow)
    return dict(rtol=1.6e-2, atol=1e-2 * grow)  # bfloat16


def assert_close(actual, expected, dtype=None, num_clients=1):
    """Compares tensors, lists of tensors or dicts of tensors: structure, dtypes, devices and
    values (integer tensors exactly)."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"expected a dict, got {type(actual).__name__}"
        assert list(actual.keys()) == list(expected.keys())
        for key in expected:
            assert_close(actual[key], expected[key], dtype, num_clients)
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"expected a list, got {type(actual).__name__}"
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, dtype, num_clients)
        return
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not expected.is_floating_point():
        assert torch.equal(actual.cpu(), expected.cpu())
        return
    tol = tolerances(dtype or expected.dtype, num_clients)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **tol)


def bitwise_equal(a, b) -> bool:
    """Same structure, dtypes, shapes and bytes (so NaN == NaN and -0.0 != 0.0)."""
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


def to_device(model, device):
    if isinstance(model, Mapping):
        return {k: v.to(device) for k, v in model.items()}
    if isinstance(model, (list, tuple)):
        return [to_device(m, device) for m in model]
    return model.to(device)


def clone(model):
    if isinstance(model, Mapping):
        return {k: v.clone() for k, v in model.items()}
    if isinstance(model, (list, tuple)):
        return [clone(m) for m in model]
    return model.clone()


# ---------------------------------------------------------------- inputs


# Odd shapes on purpose: 0-d, empty, 1, 31 (shorter than a vector), a vector tail, 2-D.
ODD_SHAPES = [(), (0,), (1,), (31,), (3, 0), (5, 7), (2, 3, 4), (129,)]


def randn(shape, dtype, generator, device="cpu"):
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).to(device)


def make_clients_list(num_clients, shapes, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [[randn(s, dtype, g, device) for s in shapes] for _ in range(num_clients)]


def make_weights(num_clients, seed=0):
    g = torch.Generator().manual_seed(seed + 1000)
    return (torch.rand(num_clients, generator=g, dtype=torch.float64) + 0.1).tolist()


def make_state_dicts(num_clients, dtype, seed=0, device="cpu"):
    shapes = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "fc.weight": (5, 36),
              "fc.bias": (5,), "scalar": ()}
    g = torch.Generator().manual_seed(seed)
    return [{k: randn(s, dtype, g, device) for k, s in shapes.items()}
            for _ in range(num_clients)]


class SmallNet(torch.nn.Module):
    """An ordinary model whose state_dict mixes float parameters, float buffers and BatchNorm's
    int64 ``num_batches_tracked``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 4 * 4, 3)
        self.bn1d = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.bn1d(self.fc(x.flatten(1)))


def trained_state_dicts(num_clients, seed=0):
    """K clients of SmallNet, each after a different number of training-mode forward passes
    (so running stats and num_batches_tracked differ) and perturbed parameters."""
    torch.manual_seed(seed)
    states = []
    for k in range(num_clients):
        net = SmallNet()
        net.train()
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * torch.randn_like(p))
            for _ in range(k + 1):
                net(torch.randn(4, 1, 6, 6))
        states.append({n: t.detach().clone() for n, t in net.state_dict().items()})
    return states


def slow_after_first(values):
    """Parameter values of a side-by-side test: the first runs in both tiers, the others only
    in the whole suite (marked slow)."""
    values = list(values)
    return values[:1] + [pytest.param(value, marks=pytest.mark.slow) for value in values[1:]]


@pytest.fixture
def one_thread():
    """Tiny models train on one thread: intra-op threads only add synchronisation, and stall
    badly when the machine is busy. Use with ``pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cuda_device():
    if not HAS_CUDA:
        pytest.skip("no CUDA GPU visible")
    return torch.device("cuda")


def copy_bench(tmp_path) -> Path:
    """bench/*.py and the package bench/harness/ copied into tmp_path/bench with an empty
    results/ folder, so that a benchmark script run there writes its results there (the
    harness finds results/ beside itself), never into the repository's bench/results/."""
    bench = Path(__file__).resolve().parent.parent / "bench"
    folder = Path(tmp_path) / "bench"
    folder.mkdir()
    for script in bench.glob("*.py"):
        shutil.copy(script, folder)
    shutil.copytree(bench / "harness", folder / "harness",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "results").mkdir()
    return folder
