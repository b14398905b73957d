"""The peak memory one call allocates beyond its inputs: the CUDA caching allocator's peak, or
on the CPU the process's peak resident set, measured where needed in a fresh child process so
that one case's allocations never count in another's; and the glibc settings that make the
resident set measure what a call allocates.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable

import torch

from .timing import synchronize


def minor_faults() -> int:
    """Minor page faults of this process so far: first touches of fresh pages, which the
    kernel zeroes one 4 KiB page at a time, a cost a call pays on top of its own work."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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


def release_freed_memory() -> None:
    """Hands freed heap memory back to the system (glibc's ``malloc_trim``; a no-op elsewhere).
    Once glibc has freed a large block it serves blocks up to that size from its heap, whose
    freed pages it keeps: a run through many multi-GiB cases would otherwise hold the largest
    case's memory to its end."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
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


def memory_in_child(script: str, *child_args: object, timeout: float = 900) -> int:
    """The peak memory that ``script --child-memory *child_args``, run in a fresh process,
    prints as its last line (so that one case's allocations never count in another's)."""
    out = subprocess.run([sys.executable, os.path.abspath(script), "--child-memory",
                          *map(str, child_args)], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1])
