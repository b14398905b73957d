"""Timing, memory and bandwidth-probe helpers shared by the benchmarks in bench/.

Every benchmark reports a median over repeats, the effective bandwidth over the op's minimum
traffic, that bandwidth as a fraction of probes measured in the same run (a large ``sum`` for
read bandwidth, a large ``copy_``), and the peak memory the call allocates beyond its inputs.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one ``fn()`` call in seconds (CUDA: measured with events, synchronized)."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], device: torch.device, repeats: int = 7,
                warmup: int = 2) -> float:
    """Median of ``repeats`` :func:`timed` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def exact_cpu_memory_accounting() -> None:
    """Make glibc serve every allocation over 128 KiB with its own mmap and return it on free,
    so the resident set measures what a call allocates (glibc's adaptive threshold would
    otherwise recycle freed heap pages and hide allocations from the peak). It also makes
    allocating code slower (fresh pages every call), so call it only in a process that
    measures memory, not time."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it disables the adaptation
    except (OSError, AttributeError):
        pass


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one ``fn()`` call beyond what was resident before,
    counting its result. CUDA: the caching allocator's peak; CPU: the process's peak resident
    set (reset through /proc/self/clear_refs; see exact_cpu_memory_accounting), None where
    Linux does not allow that."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return peak
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    before = _rss_bytes("VmRSS")
    result = fn()
    peak = _rss_bytes("VmHWM") - before
    del result
    return max(peak, 0)


def bandwidth_probes(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Read (``sum``) and copy (``copy_``, counted as read + write) bandwidth in GB/s on
    buffers larger than any cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = median_time(lambda: src.sum(), device, repeats=9)
    copy = median_time(lambda: dst.copy_(src), device, repeats=9)
    return {"read_GBps": nbytes / read / 1e9, "copy_GBps": 2 * nbytes / copy / 1e9,
            "probe_bytes": nbytes}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        name = "cpu-" + name
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(device: torch.device) -> dict:
    import fedkernels

    env = {
        "device": device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "fedkernels_cpu_build": fedkernels.ops.native.cpu_capability,
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def write_results(name: str, device: torch.device, payload: dict) -> str:
    """Merges ``payload`` under key ``name`` into bench/results/<device>.json."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, device_name(device) + ".json")
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[name] = payload
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return path
