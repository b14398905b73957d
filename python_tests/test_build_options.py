"""setup.py's choice of the CUDA library, on machines this one is not: torch patched in a
subprocess to look like a CUDA build, with or without GPUs, before setup.py runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

# Runs setup.py as pip would up to the extension list (`--name` builds nothing), with torch
# made a CUDA build that sees `gpus` GPUs and whose nvcc is found; prints the extensions' names.
_DRIVER = """
import runpy, sys
import setuptools, torch
from torch.utils import cpp_extension

torch.version.cuda = "13.0"
cpp_extension.CUDA_HOME = "/usr/local/cuda"
torch.cuda.device_count = lambda: {gpus}
names = []
setuptools.setup = lambda **kw: names.extend(e.name for e in kw.get("ext_modules", []))
sys.argv = ["setup.py", "--name"]
runpy.run_path("setup.py", run_name="__main__")
print("EXTENSIONS", " ".join(names))
"""


def _setup(gpus: int, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("FEDKERNELS_CUDA", "TORCH_CUDA_ARCH_LIST", "FEDKERNELS_SANITIZE",
                         "FEDKERNELS_CPU_ISAS", "FEDKERNELS_BUILD_ONLY")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", _DRIVER.format(gpus=gpus)], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=120)


def _extensions(proc: subprocess.CompletedProcess) -> list[str]:
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("EXTENSIONS")]
    assert proc.returncode == 0 and line, proc.stderr[-2000:]
    return line[0].split()[1:]


def test_no_gpu_and_no_arch_list_builds_the_cpu_kernels_only():
    """PyPI's torch is a CUDA build: on a machine with nvcc and no GPU, torch's extension
    builder failed with an IndexError while choosing architectures, and so did the install."""
    proc = _setup(gpus=0)
    assert "fedkernels._cuda" not in _extensions(proc)
    assert "fedkernels._C" in _extensions(proc)
    assert "no GPU is visible and TORCH_CUDA_ARCH_LIST is not set" in proc.stderr


@pytest.mark.parametrize("gpus, env", [(1, {}), (0, {"TORCH_CUDA_ARCH_LIST": "9.0"}),
                                       (0, {"TORCH_CUDA_ARCH_LIST": "9.0",
                                            "FEDKERNELS_CUDA": "1"})])
def test_a_gpu_or_an_arch_list_builds_the_cuda_kernels(gpus, env):
    assert "fedkernels._cuda" in _extensions(_setup(gpus=gpus, **env))


def test_forced_cuda_without_a_gpu_asks_for_the_arch_list():
    proc = _setup(gpus=0, FEDKERNELS_CUDA="1")
    assert proc.returncode != 0
    assert "set TORCH_CUDA_ARCH_LIST" in proc.stderr


def test_cuda_off_builds_none():
    assert "fedkernels._cuda" not in _extensions(_setup(gpus=1, FEDKERNELS_CUDA="0"))


def test_a_sanitizer_build_is_the_one_cpu_library_asked_for_and_no_cuda():
    """FEDKERNELS_SANITIZE (.ci/sanitize.sh) builds the schemas and the one CPU build it is
    given, without the default fallback, and no CUDA library even where one could be built."""
    names = _extensions(_setup(gpus=1, FEDKERNELS_SANITIZE="address,undefined",
                               FEDKERNELS_CPU_ISAS="avx2"))
    assert names == ["fedkernels._C", "fedkernels._cpu_avx2"]


def test_a_normal_build_needs_the_default_cpu_library():
    proc = _setup(gpus=0, FEDKERNELS_CPU_ISAS="avx2")
    assert proc.returncode != 0
    assert "must list 'default'" in proc.stderr


def test_build_only_compiles_the_libraries_it_lists():
    """FEDKERNELS_BUILD_ONLY=_cuda (.ci/cuda_compile.sh in CI) leaves the CPU libraries be."""
    assert _extensions(_setup(gpus=1, FEDKERNELS_BUILD_ONLY="_cuda")) == ["fedkernels._cuda"]
    assert _extensions(_setup(gpus=0, FEDKERNELS_BUILD_ONLY="_C, _cpu_default")) == [
        "fedkernels._C", "fedkernels._cpu_default"]


def test_build_only_refuses_a_library_the_build_would_not_compile():
    proc = _setup(gpus=0, FEDKERNELS_BUILD_ONLY="_cuda")
    assert proc.returncode != 0
    assert "FEDKERNELS_BUILD_ONLY lists ['_cuda']" in proc.stderr
