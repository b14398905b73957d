"""Timing, memory and bandwidth-probe helpers shared by the benchmarks in bench/.

Every benchmark reports a median over repeats, the effective bandwidth over the op's minimum
traffic, that bandwidth as a fraction of probes measured in the same run (a large ``sum`` for
read bandwidth, a large ``copy_``), and the peak memory the call allocates beyond its inputs.

Where results go: every run writes a new file ``bench/results/runs/<time>-<device>-<name>.json``
(git-ignored; a CPU ``<device>`` names the model and the fedkernels CPU build, as in
``cpu-amd-epyc-avx512``), so a quick or partial run never replaces the committed table; ``--save`` also
merges the run into the committed ``bench/results/<device>.json``, and ``--out FILE`` writes the
run to FILE instead of ``runs/``. A ``--device`` that this machine cannot run is a one-line error
(exit status 2) before any work.

Noise: the machines these run on are shared, so every case is timed in rounds, each round
timing the case and all its baselines once (:func:`interleaved_medians`): a burst of load hits
them all alike, and their ratios stay meaningful even when absolute times move. ``--check``
runs the benchmark afresh and compares those ratios (never absolute times) with the committed
results for this device (:func:`check_against_committed`): exit status 1 when one regressed by
more than ``--tolerance`` (20 % by default), 2 when there is nothing to compare with. A ratio
flagged by the run is timed again before it counts: the script runs once more in a fresh
process (same arguments; it writes no results) and a ratio is reported as regressed only when
the better of its two fresh values is still worse by more than the tolerance. One burst of load
on a shared machine then no longer fails a check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
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


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``. A count of 0 (repeats, clients,
    probe bytes) would otherwise surface after minutes of work as a ZeroDivisionError or an
    empty median; as a type it is argparse's one-line error, exit status 2, before any."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _finite_number(text: str, ok, bound: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return value


def non_negative_fraction(text: str) -> float:
    """An argparse type: a finite float >= 0 (``--tolerance``)."""
    return _finite_number(text, lambda v: v >= 0, ">= 0")


def positive_number(text: str) -> float:
    """An argparse type: a finite float > 0 (a time limit, a memory bound)."""
    return _finite_number(text, lambda v: v > 0, "> 0")


# The smallest --probe-bytes: one float32 (a 0-byte probe divides by a zero time).
MIN_PROBE_BYTES = 4


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
    if getattr(args, "check", False) and args.save:
        fail("--check compares a fresh run with the committed results, which --save would "
             "replace first; run them separately")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The clock of CPU timings: wall time by default. ``use_cpu_clock("process")`` switches to the
# CPU time of this process, which leaves out the time other processes held the cores: on a
# machine shared with other work, a sample then measures this process's work rather than its
# turn in the queue. It sums over threads, so use it with one torch thread.
_CPU_CLOCK: Callable[[], float] = time.perf_counter
CPU_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def use_cpu_clock(name: str) -> None:
    global _CPU_CLOCK
    _CPU_CLOCK = CPU_CLOCKS[name]


def cpu_clock() -> float:
    """The current reading of the CPU timings' clock (see use_cpu_clock)."""
    return _CPU_CLOCK()


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=sorted(CPU_CLOCKS), default="wall",
                        help="clock of CPU timings: wall (default) or process (this process's "
                             "CPU time: leaves out other work on a shared machine; use with one "
                             "torch thread)")


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Time of one ``fn()`` call in seconds (CUDA: measured with events, synchronized; CPU:
    the clock chosen with use_cpu_clock, wall time by default)."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = _CPU_CLOCK()
    result = fn()
    elapsed = _CPU_CLOCK() - t0
    # Freed after the clock: a caller keeps what a call returns, and handing a large result's
    # pages back to the system (munmap) is not part of the call.
    del result
    return elapsed


def minor_faults() -> int:
    """Minor page faults of this process so far: first touches of fresh pages, which the
    kernel zeroes one 4 KiB page at a time (~2 us each in the 2-core VMs here)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median_time(fn: Callable[[], object], device: torch.device, repeats: int = 7,
                warmup: int = 2) -> float:
    """Median of ``repeats`` :func:`timed` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def timed_calls(fn: Callable[[], object], device: torch.device, number: int) -> float:
    """Seconds per call of ``number`` back-to-back ``fn()`` calls (CUDA: events, synchronized)."""
    if number == 1:
        return timed(fn, device)

    def calls():
        for _ in range(number):
            fn()

    return timed(calls, device) / number


def fused_versus_torch(fused: Callable[[], object], torch_fn: Callable[[], object],
                       device: torch.device, repeats: int, calls: int, nbytes: int,
                       read_gbps: float) -> dict:
    """A fused op against the PyTorch expression it replaces, after two warm-up calls each:
    ``repeats`` interleaved rounds, each timing ``calls`` back-to-back calls of both (many calls
    per timing for small cases, so that the clock's resolution and a call's own jitter do not
    decide the ratio). Returns a results row's timing fields: median microseconds per call,
    the median of per-round ratios, and each side's bandwidth for ``nbytes`` of minimum
    traffic, the fused op's also as a fraction of ``read_gbps``."""
    fns = {"fused": fused, "torch": torch_fn}
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(timed_calls(fn, device, calls))
    t_fused, t_torch = statistics.median(times["fused"]), statistics.median(times["torch"])
    return {
        "calls_per_timing": calls,
        "fused_us": 1e6 * t_fused, "torch_us": 1e6 * t_torch,
        "speedup_median_of_ratios": statistics.median(
            t / u for t, u in zip(times["torch"], times["fused"])),
        "min_traffic_bytes": nbytes,
        "fused_GBps": nbytes / t_fused / 1e9,
        "read_probe_GBps": read_gbps,
        "fused_fraction_of_read_probe": nbytes / t_fused / 1e9 / read_gbps,
        "torch_GBps": nbytes / t_torch / 1e9,
    }


def fused_versus_torch_line(row: dict) -> str:
    """The printed end of a :func:`fused_versus_torch` row."""
    return (f"fused {row['fused_us']:9.1f} us torch {row['torch_us']:9.1f} us  "
            f"x{row['speedup_median_of_ratios']:5.2f}  {row['fused_GBps']:6.1f} GB/s "
            f"({100 * row['fused_fraction_of_read_probe']:.0f}% of read at "
            f"{row['read_probe_GBps']:.1f} GB/s)")


def fused_versus_torch_ratios(payload: dict, case: Callable[[dict], str]) -> dict[str, float]:
    """--check's ratios of :func:`fused_versus_torch` rows, each higher-is-better; ``case``
    names a row."""
    found = {}
    for r in payload.get("rows", []):
        found[f"{case(r)}: torch time / fused time"] = r.get("speedup_median_of_ratios")
        found[f"{case(r)}: fused GB/s / read probe"] = r.get("fused_fraction_of_read_probe")
    return found


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device,
                        repeats: int = 7, warmup: int = 1,
                        sample_s: float = 2e-3) -> dict[str, float]:
    """Median seconds per call of every function, timed in ``repeats`` rounds. Each round
    times each function once, starting from a different one each round, so that noise on a
    shared machine falls on a case and its baselines alike. Fast functions are called several
    times per sample (enough for about ``sample_s``), so a sample is not just timer jitter."""
    number = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        once = timed(fn, device)
        if once < sample_s:  # the fastest of a few calls: one slow call must not decide
            once = min(once, *(timed(fn, device) for _ in range(2)))
        number[name] = max(1, min(10_000, int(sample_s / max(once, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timed_calls(fns[name], device, number[name]))
    return {name: statistics.median(times) for name, times in samples.items()}


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


def bandwidth_probes(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Read (``sum``) and copy (``copy_``, counted as read + write) bandwidth in GB/s on
    buffers larger than any cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = median_time(lambda: src.sum(), device, repeats=9)
    copy = median_time(lambda: dst.copy_(src), device, repeats=9)
    return {"read_GBps": nbytes / read / 1e9, "copy_GBps": 2 * nbytes / copy / 1e9,
            "probe_bytes": nbytes}


class ReadProbe:
    """The read probe again right before each case: ``sum`` over a buffer larger than any
    cache, the median of a few calls. The host of a shared machine speeds up and slows down
    within a run (the probe measured at the start read 24-33 GB/s between runs minutes apart
    on the CI-class machine), so a case's fraction of the probe is taken against the probe
    measured next to it. Not between the case's own calls: a probe there flushes the caches,
    and small cases would then be timed cold while the benches time every op warm."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def read_gbps(self, repeats: int = 5) -> float:
        return self.nbytes / median_time(lambda: self.src.sum(), self.device, repeats) / 1e9


def print_probes(device: torch.device, probes: dict[str, float]) -> None:
    """The machine and its bandwidth probes, first thing in every run's output."""
    env = environment(device)
    print(f"# {env['device']}  torch {env['torch']}  threads {env['threads']}  "
          f"cpu build {env['fedkernels_cpu_build']}")
    print(f"# probes: read {probes['read_GBps']:.1f} GB/s (sum of "
          f"{probes['probe_bytes'] / 2**20:.0f} MiB), copy {probes['copy_GBps']:.1f} GB/s",
          flush=True)


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
        # The build in the name: one model name covers CPUs with and without AVX-512 (AMD
        # EPYC of two generations here), and their results must not overwrite each other.
        import fedkernels

        name = f"cpu-{name}-{fedkernels.ops.native.cpu_capability}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_identity() -> dict[str, str]:
    """The CPU's family, model and stepping (/proc/cpuinfo) and its last-level cache size
    (sysfs), where the system tells them. Virtual machines report generic model names
    ("AMD EPYC", "Intel(R) Xeon(R) Processor") that cover several generations of CPU, so the
    results file a device name picks can hold another CPU's run."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model", "stepping") and key not in found:
                    found[key] = value.strip()
                if not line.strip() and found:  # the first processor's block only
                    break
    except OSError:
        pass
    cache = "/sys/devices/system/cpu/cpu0/cache"
    try:
        levels = []
        for index in (n for n in os.listdir(cache) if n.startswith("index")):
            with open(os.path.join(cache, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(cache, index, "size")) as f:
                levels.append((level, f.read().strip()))
        if levels:
            found["last-level cache"] = max(levels)[1]
    except (OSError, ValueError):
        pass
    return {key.replace("cpu ", ""): value for key, value in found.items()}


def environment(device: torch.device) -> dict:
    import fedkernels

    env = {
        "device": device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "fedkernels_cpu_build": fedkernels.ops.native.cpu_capability,
    }
    if device.type == "cpu":
        identity = cpu_identity()
        if identity:
            env["cpu"] = identity
    if device.type == "cpu" and _CPU_CLOCK is not time.perf_counter:
        env["cpu_clock"] = next(n for n, c in CPU_CLOCKS.items() if c is _CPU_CLOCK)
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
    Returns the paths written, joined by " and ". A --check confirmation run (RECHECK_ENV)
    writes nothing."""
    if os.environ.get(RECHECK_ENV):
        return "nothing (a run confirming --check's flags)"
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


def memory_in_child(script: str, *child_args: object, timeout: float = 900) -> int:
    """The peak memory that ``script --child-memory *child_args``, run in a fresh process,
    prints as its last line (so that one case's allocations never count in another's)."""
    out = subprocess.run([sys.executable, os.path.abspath(script), "--child-memory",
                          *map(str, child_args)], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def write_peer_results(path: str, payload: dict, table: str) -> None:
    """Writes a framework comparison's results JSON (bench_fedlab.py, bench_fedml.py,
    bench_nvflare.py) and prints its markdown table and where it went."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print()
    print(table)
    print(f"\nwritten: {path}")


def add_peer_arguments(parser: argparse.ArgumentParser, results: str) -> None:
    """The arguments of the comparisons with a framework's own aggregation on K = 10 and 100
    ResNet-18-sized clients (bench_fedlab.py, bench_fedml.py); ``results`` names the default
    results file."""
    parser.add_argument("--quick", action="store_true", help="K = 10 only, 3 repeats")
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--threads", type=at_least(1), help="torch threads (default: torch's)")
    parser.add_argument("--out", metavar="FILE", help=f"results JSON (default {results})")
    parser.add_argument("--child-memory", nargs=2, metavar=("K", "IMPL"), help=argparse.SUPPRESS)


def peer_table(title: str, peer: str, rows: list[dict], read_gbps: float) -> str:
    """The markdown table of a framework comparison: ``rows`` hold ``K``, ``<peer>_ms``,
    ``fedkernels_ms``, ``speedup``, ``fedkernels_GBps``, ``max_abs_diff`` and, unless the
    memory children were skipped, ``<peer>_peak_MB`` and ``fedkernels_peak_MB``."""
    name = {"fedlab": "FedLab", "fedml": "FedML"}.get(peer, peer)
    lines = [title, "",
             f"| K | {name} ms | fedkernels ms | speed-up | {name} peak | fedkernels peak "
             "| fedkernels GB/s (% of read probe) | max abs diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = [f"{r[f'{i}_peak_MB']:.0f} MB" if f"{i}_peak_MB" in r else "-"
               for i in (peer, "fedkernels")]
        lines.append(
            f"| {r['K']} | {r[f'{peer}_ms']:.1f} | {r['fedkernels_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {mem[0]} | {mem[1]} | {r['fedkernels_GBps']:.1f} "
            f"({100 * r['fedkernels_GBps'] / read_gbps:.0f} %) | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def add_case_arguments(parser: argparse.ArgumentParser, tiny_help: str,
                       cpu_only: bool = False) -> None:
    """The arguments of the op benchmarks that time cases against a read probe: --device,
    --repeats, --probe-bytes, --tiny, the output flags and --check. A cpu_only script (one that
    times something only CPUs have) accepts --device cpu alone."""
    parser.add_argument("--device", default="cpu", choices=["cpu"] if cpu_only else None)
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--probe-bytes", type=at_least(MIN_PROBE_BYTES), default=1 << 28)
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
    add_output_arguments(parser)
    add_check_arguments(parser)


def start_case_run(parser: argparse.ArgumentParser, name: str) -> tuple[
        argparse.Namespace, torch.device, dict, ReadProbe]:
    """Parses and checks the arguments of add_case_arguments (and the script's own), with
    --check makes sure there is a committed run ``name`` to compare with, shrinks a --tiny run
    to one repeat and a small probe, and measures and prints the bandwidth probes. Returns
    (args, device, probes, a ReadProbe to measure again before each case); the script then
    picks its --tiny sizes."""
    args = parser.parse_args()
    device = resolve_device(args.device)
    check_output_arguments(args)
    if args.check:
        require_committed(name, device)
    if args.tiny:
        args.repeats = 1
        args.probe_bytes = min(args.probe_bytes, 1 << 23)
    probes = bandwidth_probes(device, args.probe_bytes)
    print(f"probes: read {probes['read_GBps']:.1f} GB/s, copy {probes['copy_GBps']:.1f} GB/s")
    return args, device, probes, ReadProbe(device, args.probe_bytes)


def rows_by_classes(args: argparse.Namespace, ns: tuple[int, ...], cs: tuple[int, ...],
                    max_elements: int):
    """(N, C, calls) of a benchmark over N rows of C logits: every pair of the grid up to
    max_elements values, or (8, 5) for --tiny; calls is how many calls one timing sample makes
    (up to 200, fewer as the case grows past 2^22 values)."""
    ns, cs = ((8,), (5,)) if args.tiny else (ns, cs)
    for n in ns:
        for c in cs:
            if n * c <= max_elements:
                yield n, c, max(1, min(200, (1 << 22) // (n * c)))


def finish_case_run(name: str, device: torch.device, args: argparse.Namespace, probes: dict,
                    rows: list, ratios: Callable[[dict], dict[str, float]]) -> None:
    """Writes an op benchmark's fp32 run (``name``: its key in the results file) as
    write_results does, and with --check exits with check_against_committed's status."""
    payload = {"environment": environment(device), "probes": probes, "rows": rows,
               "dtype": "float32", "repeats": args.repeats}
    print("wrote", write_results(name, device, payload, save=args.save, out=args.out))
    if args.check:
        sys.exit(check_against_committed(name, device, payload, ratios, args.tolerance,
                                         recheck=True))


# ---------------------------------------------------------------- --check


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="run afresh and compare the ratios (speed-ups over the baselines, "
                             "fractions of the bandwidth probe) with the committed "
                             "bench/results/<device>.json; exit status 1 when one regressed")
    parser.add_argument("--tolerance", type=non_negative_fraction, default=0.2,
                        help="--check flags a ratio that got worse by more than this fraction "
                             "(default 0.2: 20%%)")


def committed_path(device: torch.device) -> str:
    return os.path.join(RESULTS_DIR, device_name(device) + ".json")


def _committed_run(name: str, path: str) -> dict | None:
    try:
        with open(path) as f:
            committed = json.load(f).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return committed if isinstance(committed, dict) else None


def _missing_committed(name: str, device: torch.device, path: str) -> str:
    return (f"no committed {name!r} results for {device_name(device)} in {path}; "
            "run once with --save to record them")


def require_committed(name: str, device: torch.device, path: str | None = None) -> None:
    """--check's precondition, tested before the run rather than after it: a committed run
    ``name`` for this device, or the one-line error (exit status 2) that the comparison would
    give minutes later."""
    path = path or committed_path(device)
    if _committed_run(name, path) is None:
        fail("--check: " + _missing_committed(name, device, path))


def _setting_differences(committed: dict, fresh: dict) -> list[str]:
    """What differs between the committed run and this one that moves ratios by itself: the
    CPU behind one device name, the thread count (a loop's time over a two-thread op's), the
    clock, the torch version, the size of the read probe. Settings the committed run did not
    record are not compared."""
    old, new = committed.get("environment") or {}, fresh.get("environment") or {}
    notes = []
    if old.get("cpu") and new.get("cpu") and old["cpu"] != new["cpu"]:
        def described(cpu: dict) -> str:
            return ", ".join(f"{key} {value}" for key, value in sorted(cpu.items()))

        notes.append(f"another CPU behind the name {new.get('device', '')!r}: "
                     f"{described(old['cpu'])} in the committed run, {described(new['cpu'])} "
                     "in this one")
    for key, what in (("threads", "torch threads"), ("torch", "torch")):
        if key in old and key in new and old[key] != new[key]:
            notes.append(f"{what} {old[key]} in the committed run, {new[key]} in this one")
    if old and new:
        clocks = old.get("cpu_clock", "wall"), new.get("cpu_clock", "wall")
        if clocks[0] != clocks[1]:
            notes.append(f"{clocks[0]} clock in the committed run, {clocks[1]} in this one")
    # a probe that fits in a cache reads faster: every fraction of it moves (--probe-bytes)
    sizes = [(run.get("probes") or {}).get("probe_bytes") for run in (committed, fresh)]
    if None not in sizes and sizes[0] != sizes[1]:
        notes.append(f"a read probe of {sizes[0] / 2**20:g} MiB in the committed run, "
                     f"{sizes[1] / 2**20:g} MiB in this one")
    return notes


def ratio_regressions(committed: dict[str, float], fresh: dict[str, float],
                      tolerance: float = 0.2) -> tuple[list[tuple[str, float, float, float]],
                                                       list[str]]:
    """Compares two sets of named ratios, each oriented so that higher is better (how many
    times faster than a baseline, or what fraction of the bandwidth probe). A ratio regressed
    when the committed value is more than ``1 + tolerance`` times the fresh one: with the
    default 0.2, a case that took 1.0x a baseline's time now takes more than 1.2x.

    Returns ``(regressions, compared)``: ``(name, committed, fresh, committed / fresh)`` for
    each regressed ratio (worst first), and the names found in both sets. Names in only one
    set (a case the run did not include) are not compared; non-positive or non-finite values
    are skipped."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    compared, regressions = [], []
    for name in sorted(set(committed) & set(fresh)):
        old, new = committed[name], fresh[name]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (old, new)):
            continue
        compared.append(name)
        if old / new > 1 + tolerance:
            regressions.append((name, old, new, old / new))
    regressions.sort(key=lambda item: -item[3])
    return regressions, compared


# Set in the environment of a run that confirms --check's flags (rerun_ratios): the file to
# which that run writes its fresh ratios instead of checking them.
RECHECK_ENV = "FEDKERNELS_BENCH_RECHECK_TO"


def rerun_ratios() -> dict[str, float] | None:
    """Runs this benchmark script once more, in a fresh process with the same arguments, and
    returns its fresh ratios (None if that run failed, or if no script is running: a main()
    called from other code)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script or not sys.argv or os.path.abspath(sys.argv[0]) != os.path.abspath(script):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratios.json")
        env = dict(os.environ, **{RECHECK_ENV: out})
        proc = subprocess.run([sys.executable, *sys.argv], env=env, stdout=subprocess.DEVNULL)
        if proc.returncode != 0 or not os.path.exists(out):
            return None
        with open(out) as f:
            return json.load(f)


def check_against_committed(name: str, device: torch.device, fresh_payload: dict,
                            ratios: Callable[[dict], dict[str, float]],
                            tolerance: float = 0.2, path: str | None = None,
                            recheck: bool = False) -> int:
    """Prints the comparison of ``fresh_payload``'s ratios with the committed run ``name`` of
    this device and returns the exit status: 0 (no regression), 1 (some ratio regressed by
    more than ``tolerance``), 2 (no committed run, or no ratio in common). With ``recheck``
    (the benchmark scripts' own call), flagged ratios are timed again by a second run of the
    script (rerun_ratios) and count only if the better of the two values still regressed.
    In that second run this only writes its ratios to the file RECHECK_ENV names."""
    recheck_to = os.environ.get(RECHECK_ENV)
    if recheck and recheck_to:
        with open(recheck_to, "w") as f:
            json.dump(ratios(fresh_payload), f)
        return 0
    path = path or committed_path(device)
    committed = _committed_run(name, path)
    if committed is None:
        print("check: " + _missing_committed(name, device, path), file=sys.stderr)
        return 2
    regressions, compared = ratio_regressions(ratios(committed), ratios(fresh_payload), tolerance)
    when = committed.get("environment", {}).get("date", "?")
    if not compared:
        print(f"check: the committed {name!r} run ({when}) has no case in common with this run",
              file=sys.stderr)
        return 2
    print(f"# check: {len(compared)} ratios compared with the committed run of {when} "
          f"(higher is better; flagged when more than {tolerance:.0%} worse)")
    for note in _setting_differences(committed, fresh_payload):
        print(f"# check: not like for like: {note}; a ratio may move for that reason alone")
    if regressions and recheck:
        print(f"# check: {len(regressions)} flagged; timing them again in a second run",
              flush=True)
        again = rerun_ratios()
        if again is None:
            print("# check: no second run (it failed, or this is not a script run); "
                  "reporting the first run's flags")
        else:
            best = {key: max(new, again.get(key, new)) for key, _, new, _ in regressions}
            regressions, _ = ratio_regressions(ratios(committed), best, tolerance)
            cleared = len(best) - len(regressions)
            print(f"# check: {cleared} of {len(best)} flagged ratios did not regress in the "
                  "second run (the better of the two values is compared)")
    for key, old, new, factor in regressions:
        print(f"REGRESSED  {key}: {old:.3g} -> {new:.3g} ({factor:.2f}x worse)")
    if regressions:
        print(f"# check: {len(regressions)} of {len(compared)} ratios regressed")
        return 1
    print("# check: no ratio regressed")
    return 0
