"""Loads the native libraries: the op schemas, the CPU kernels built for the best instruction
set this CPU supports, and the CUDA kernels when they were built.

FEDKERNELS_CPU_CAPABILITY=default|avx2|avx512 forces one CPU build (tests use it to compare
the builds); otherwise torch's own choice (which honours ATEN_CPU_CAPABILITY) is followed.
"""

from __future__ import annotations

import glob
import os

import torch

# the libraries are built into the package folder, one level up
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ORDER = ("avx512", "avx2", "default")
_BUILD_HINT = (
    "fedkernels' native ops are not built. From the source folder run:\n"
    "    pip install --no-build-isolation -e .\n"
    "(with torch already installed; see README.md)."
)

cpu_capability: str = ""
cuda_available: bool = False


def _library(name: str) -> str | None:
    found = sorted(glob.glob(os.path.join(_PACKAGE_DIR, f"{name}.*so")))
    return found[0] if found else None


def _supported_capabilities() -> list[str]:
    torch_choice = torch.backends.cpu.get_cpu_capability().lower()
    if torch_choice.startswith("avx512"):
        return ["avx512", "avx2", "default"]
    if torch_choice.startswith("avx2"):
        return ["avx2", "default"]
    return ["default"]


def load() -> None:
    global cpu_capability, cuda_available
    schemas = _library("_C")
    if schemas is None:
        raise ImportError(_BUILD_HINT)
    torch.ops.load_library(schemas)

    forced = os.environ.get("FEDKERNELS_CPU_CAPABILITY", "").lower()
    if forced:
        if forced not in _ORDER:
            raise ImportError(f"FEDKERNELS_CPU_CAPABILITY must be one of {_ORDER}, not {forced!r}")
        if forced not in _supported_capabilities():
            # torch's capability is the limit, and ATEN_CPU_CAPABILITY lowers it on a CPU that
            # has the instructions: "this CPU does not support it" would send one looking for
            # a hardware problem
            torch_cap = torch.backends.cpu.get_cpu_capability()
            aten = os.environ.get("ATEN_CPU_CAPABILITY", "")
            why = (f"torch runs at CPU capability {torch_cap}"
                   + (f" (ATEN_CPU_CAPABILITY={aten})" if aten else ": this CPU lacks it"))
            raise ImportError(f"FEDKERNELS_CPU_CAPABILITY={forced} needs a CPU capability of "
                              f"at least {forced.upper()}, but {why}")
        candidates = [forced]
    else:
        candidates = _supported_capabilities()
    for cap in candidates:
        path = _library(f"_cpu_{cap}")
        if path is not None:
            torch.ops.load_library(path)
            cpu_capability = cap
            break
    else:
        raise ImportError(f"no CPU kernel library ({', '.join(candidates)}) was found. " + _BUILD_HINT)

    cuda = _library("_cuda")
    if cuda is not None and torch.version.cuda is not None:
        torch.ops.load_library(cuda)
        cuda_available = True


def refuse_jit_trace(op: str) -> None:
    """Raises under ``torch.jit.trace`` for an op that writes into a list of tensors (``out=``,
    in place). The tracer records such a call with its list built inside the graph and then
    drops it as dead code: the traced module returns its ``out``/``base`` tensors unwritten,
    with no error. ``torch.compile`` and ``torch.export`` record these ops correctly."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"fedkernels.{op}: torch.jit.trace does not record ops that write into a list of "
            "tensors (out=, in place): the traced module would return them unwritten; use "
            "torch.compile or torch.export, or the allocating call")
