"""Where a simulation computes (``device`` of the configuration), and what a run reports about
that device.

- :func:`resolve_device`: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` as a ``torch.device``;
  ``cuda`` without a visible GPU is a :class:`~fedkernels.sim.config.ConfigError`, ``auto``
  takes the CPU then and says so once (a :class:`DeviceWarning`).
- :func:`reproducible_numerics`: the backend settings of a run on a GPU: float32 matmuls and
  convolutions in IEEE float32 (no TF32), cuDNN's deterministic algorithms and no cuDNN
  benchmarking, set for the duration of the block and restored after it
  (``docs/guide/gpu.md`` says why).
- :func:`synchronize`, :func:`peak_memory_bytes`, :func:`reset_peak_memory`,
  :func:`device_name`: what the round timings, the progress bar and ``results.json`` need.

The placement rule of the simulator: model-sized tensors (the global model, the clients'
models, data rows, logits, per-sample values, a strategy's per-client models) live on the run's
device; per-client scalars of a round (weights, sample counts, losses, participant ids, the
participation history) are small host-side values and stay float64/int64 tensors on the CPU,
where the ops take them (weights, ``lam``, log-weights) and the rules read them with NumPy.
"""

from __future__ import annotations

import contextlib
import platform
import resource
import sys
import warnings
from collections.abc import Iterator

import torch

from .config import ConfigError, check_device_name


class DeviceWarning(UserWarning):
    """The run's device is not the one asked for (``auto`` without a GPU)."""


def resolve_device(name: str) -> torch.device:
    """The device ``name`` asks for, with its index (``cuda`` is the current CUDA device).

    ``cuda``/``cuda:N`` needs a visible GPU, the N-th one to exist and fedkernels' CUDA
    kernels to be built, else :class:`ConfigError` says which; ``auto`` is ``cuda`` when all of
    that holds and the CPU otherwise, which a :class:`DeviceWarning` says."""
    check_device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    problem = _cuda_problem(name)
    if name == "auto":
        if problem is None:
            return torch.device("cuda", torch.cuda.current_device())
        warnings.warn(DeviceWarning(f"device=auto runs on the CPU: {problem}"), stacklevel=2)
        return torch.device("cpu")
    if problem is not None:
        raise ConfigError(f"device={name}: {problem}; use device=cpu, or device=auto to take a "
                          "GPU only where there is one")
    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device() if device.index is None
                        else device.index)


def _cuda_problem(name: str) -> str | None:
    """Why ``name`` (cuda, cuda:N or auto) cannot run on a GPU here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    count = torch.cuda.device_count()
    index = torch.device(name).index if name.startswith("cuda:") else None
    if index is not None and index >= count:
        return ("1 CUDA device is visible (cuda:0)" if count == 1 else
                f"{count} CUDA devices are visible (cuda:0 to cuda:{count - 1})")
    from fedkernels.ops import native

    if not native.cuda_available:
        return ("fedkernels was built without its CUDA kernels (rebuild on this machine with "
                "FEDKERNELS_CUDA=1 pip install --no-build-isolation -e .)")
    return None


def _set_fp32_precision(matmul: str, convolution: str) -> tuple[str, str]:
    """Sets the float32 precision of CUDA matmuls and cuDNN convolutions (``ieee`` or ``tf32``)
    and returns the previous values, through the ``fp32_precision`` settings where torch has
    them (its older ``allow_tf32`` flags warn there)."""
    matmul_backend, conv_backend = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul_backend, "fp32_precision") and hasattr(conv_backend, "conv"):
        before = (matmul_backend.fp32_precision, conv_backend.conv.fp32_precision)
        matmul_backend.fp32_precision = matmul
        conv_backend.conv.fp32_precision = convolution
        return before
    before = ("tf32" if matmul_backend.allow_tf32 else "ieee",
              "tf32" if conv_backend.allow_tf32 else "ieee")
    matmul_backend.allow_tf32 = matmul == "tf32"
    conv_backend.allow_tf32 = convolution == "tf32"
    return before


@contextlib.contextmanager
def reproducible_numerics(device: torch.device) -> Iterator[None]:
    """On a CUDA device: IEEE float32 matmuls and convolutions (no TF32), cuDNN's deterministic
    algorithms, no cuDNN benchmarking, within the block; the previous settings come back
    after it. On the CPU: nothing changes."""
    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    flags = (cudnn.deterministic, cudnn.benchmark)
    precision = _set_fp32_precision("ieee", "ieee")
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = flags
        _set_fp32_precision(*precision)


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a GPU computes asynchronously: a clock read without
    this would time the launches, not the work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Starts the device's peak-memory count anew (CUDA); the CPU's peak resident set size of
    the process cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most memory torch's tensors held on the device since :func:`reset_peak_memory`
    (``torch.cuda.max_memory_allocated``). CPU: the peak resident set size of the whole process
    (interpreter, libraries and data included)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (``platform.processor()`` where the system does
    not list it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def format_bytes(count: int) -> str:
    """``312 MiB``, ``1.50 GiB``: a memory size for people."""
    if count < 1 << 30:
        return f"{count / (1 << 20):.0f} MiB"
    return f"{count / (1 << 30):.2f} GiB"
