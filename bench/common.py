"""Timing, memory and bandwidth-probe helpers shared by the benchmarks in bench/.

Every benchmark reports a median over repeats, the effective bandwidth over the op's minimum
traffic, that bandwidth as a fraction of probes measured in the same run (a large ``sum`` for
read bandwidth, a large ``copy_``), and the peak memory the call allocates beyond its inputs.

Where results go: every run writes a new file ``bench/results/runs/<time>-<device>-<name>.json``
(git-ignored), so a quick or partial run never replaces the committed table; ``--save`` also
merges the run into the committed ``bench/results/<device>.json``, and ``--out FILE`` writes the
run to FILE instead of ``runs/``. A ``--device`` that this machine cannot run is a one-line error
(exit status 2) before any work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS_DIR = os.path.join(RESULTS_DIR, "runs")


def fail(message: str) -> None:
    """One line on stderr naming the script, exit status 2 (no traceback)."""
    print(f"{os.path.basename(sys.argv[0]) or 'bench'}: error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_device(text: str) -> torch.device:
    """``--device`` as a torch device this machine can run the fused ops on, or a one-line
    error: an unknown device, CUDA without a visible GPU, or without fedkernels' CUDA kernels."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        fail(f"--device {text!r} is not a device name (use cpu or cuda)")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {text!r}: the benchmarks run on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            fail(f"--device {text} but no CUDA GPU is visible to torch (torch {torch.__version__}, "
                 f"{build}); run on a GPU machine or use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            fail(f"--device {text}: only {torch.cuda.device_count()} GPU(s) visible")
        from fedkernels.ops import native

        if not native.cuda_available:
            fail(f"--device {text} but fedkernels' CUDA kernels are not built; rebuild with "
                 "FEDKERNELS_CUDA=1 pip install --no-build-isolation -e .")
    return device


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--save`` and ``--out``: see the module docstring."""
    parser.add_argument("--save", action="store_true",
                        help="also merge the results into the committed "
                             "bench/results/<device>.json")
    parser.add_argument("--out", metavar="FILE",
                        help="write the results JSON to FILE instead of a new file under "
                             "bench/results/runs/")


def check_output_arguments(args: argparse.Namespace) -> None:
    if args.out and os.path.isdir(args.out):
        fail(f"--out {args.out!r} is a directory; give a file name")


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


def _merge_into(path: str, name: str, payload: dict) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[name] = payload
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def new_run_path(label: str, suffix: str = ".json") -> str:
    """A path under bench/results/runs/ that no earlier run used: ``<UTC time>-<label>``."""
    os.makedirs(RUNS_DIR, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(RUNS_DIR, f"{stamp}-{label}{suffix}")
    count = 2
    while os.path.exists(path):
        path = os.path.join(RUNS_DIR, f"{stamp}-{label}-{count}{suffix}")
        count += 1
    return path


def write_results(name: str, device: torch.device, payload: dict, save: bool = False,
                  out: str | None = None) -> str:
    """Writes ``{name: payload}`` to ``out``, or to a new file under bench/results/runs/; with
    ``save`` also merges it under key ``name`` into the committed bench/results/<device>.json.
    Returns the paths written, joined by " and "."""
    written = []
    if out:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        path = out
    else:
        path = new_run_path(f"{device_name(device)}-{name}")
    with open(path, "w") as f:
        json.dump({name: payload}, f, indent=1)
        f.write("\n")
    written.append(path)
    if save:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        committed = os.path.join(RESULTS_DIR, device_name(device) + ".json")
        _merge_into(committed, name, payload)
        written.append(committed)
    return " and ".join(written)
