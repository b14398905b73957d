"""The shape of an op benchmark that times cases against a read probe (bench_distill.py,
bench_distill_kl.py, bench_energy.py, bench_sgld.py, bench_subnormals.py): its flags, the
probes measured at the start, a fused op timed against the PyTorch expression it replaces, and
the run written, and with ``--check`` compared, at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from .cli import (
    add_check_arguments,
    add_output_arguments,
    at_least,
    check_output_arguments,
    resolve_device,
)
from .machine import environment
from .probes import MIN_PROBE_BYTES, ReadProbe, bandwidth_probes
from .regression_check import check_against_committed, require_committed
from .results import write_results
from .timing import timed_calls


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
