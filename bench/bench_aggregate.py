"""Benchmark of fedkernels.aggregate against what FL code writes instead.

    python bench/bench_aggregate.py                 # CPU, the full table
    python bench/bench_aggregate.py --device cuda   # on a GPU machine
    python bench/bench_aggregate.py --quick         # K=10 only, fewer repeats
    python bench/bench_aggregate.py --tiny          # seconds: a smoke test of the script
    python bench/bench_aggregate.py --save          # also update bench/results/<device>.json
    python bench/bench_aggregate.py --check         # exit 1 if a ratio regressed > 20 %

Results go to a new file under bench/results/runs/ (see harness/results.py); only --save
touches the committed table. Each (model, dtype, K) block is timed in rounds, every method once per round,
so that the load of a shared machine falls on all methods alike. --check compares this run's
ratios (each baseline's time over the fused op's, and the fused op's bandwidth over the read
probe) with the committed run for this device, never absolute times.

Each row is one way of computing sum_k w_k x_k over K client models:

  fused        fedkernels.aggregate(clients, w)               (allocates the result; on the
               CPU from the output pool, fedkernels.ops.output_pool, which reuses the blocks
               of dropped results)
  fused out=   fedkernels.aggregate(clients, w, out=result)   (into a preallocated model)
  no pool      the op's out= overload into results from torch.empty: the allocating call as
               it was before the pool, first-touch page faults and all
  huge pages   the op's out= overload into fresh results, those of 2 MiB or more each in its
               own anonymous mapping advised MADV_HUGEPAGE (one page fault per 2 MiB rather
               than per 4 KiB): an alternative to the pool, measured, not adopted

  The three allocating calls above run as a server's rounds do: the previous result (the
  global model) is still alive while the next one is computed, and is dropped after it.
  op out=      fedkernels.ops.weighted_sum_out on the clients' tensors already in one list,
               into a preallocated model: the op alone, without aggregate's layout checks
  loop         per tensor: sum(w_k * x_k), the Python loop of most FL frameworks
  foreach      out = _foreach_mul(x_0, w_0); K-1 x _foreach_add_(out, x_k, alpha=w_k)
  stack        per tensor: (torch.stack(x_k) * w).sum(0), as FedLab and FL-bench do
  flat mv      torch.mv on the clients already flattened into one [K, P] tensor (GEMV)
  reference    fedkernels.ops.reference.aggregate_reference (fp32 accumulation, per tensor)

The minimum traffic of the op is (K + 1) * P elements (read every client once, write once);
GB/s is that traffic over the median time; "% read" compares it with the read probe measured
again right before the block (``read_probe_GBps`` in each row; a shared host's bandwidth moves
within a run), "% copy" with the copy probe of the run's start. "extra MB" is the peak memory
one call allocates beyond its inputs, result included ("x out" in units of one result); on the
CPU it is measured in a child process. "vs fused" is each method's time over the fused op's (higher = slower).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile

import torch

import fedkernels

from harness.cli import (
    add_check_arguments,
    add_clock_argument,
    add_output_arguments,
    at_least,
    check_output_arguments,
    fail,
    resolve_device,
)
from harness.machine import environment
from harness.memory import exact_cpu_memory_accounting, minor_faults, peak_extra_memory
from harness.model_shapes import cnn_shapes, lora_shapes, resnet18_shapes, transformer_shapes
from harness.probes import MIN_PROBE_BYTES, ReadProbe, bandwidth_probes, print_probes
from harness.regression_check import check_against_committed, require_committed
from harness.results import write_results
from harness.timing import interleaved_medians, use_cpu_clock

MODELS = {"resnet18": resnet18_shapes, "transformer": transformer_shapes,
          "lora": lambda: list(lora_shapes().values()), "cnn": cnn_shapes}
# --tiny: a few small, odd-sized tensors (a smoke test of the script, not a measurement)
TINY_SHAPES = [(64, 33), (33,), (7, 3, 3), ()]


def empty_huge(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in its own anonymous mapping advised for huge pages."""
    nbytes = max(torch.Size(shape).numel() * dtype.itemsize, 1)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=torch.Size(shape).numel()).view(shape)


def huge_page_results(like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [empty_huge(t.shape, t.dtype) if t.numel() * t.element_size() >= 2 << 20
            else torch.empty_like(t) for t in like]


def make_clients(shapes, num_clients, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    clients = []
    for _ in range(num_clients):
        clients.append([torch.randn(s, generator=gen).to(device=device, dtype=dtype)
                        for s in shapes])
    return clients


def huge_pages(listed, weights, like, device):
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return fedkernels.ops.weighted_sum(listed, weights, (), 1.0, False)
    results = huge_page_results(like)
    fedkernels.ops.weighted_sum_out(listed, weights, (), 1.0, False, out=results)
    return results


def no_pool(listed, weights, like):
    results = [torch.empty_like(t) for t in like]
    fedkernels.ops.weighted_sum_out(listed, weights, (), 1.0, False, out=results)
    return results


def keeping_previous(fn):
    """fn as a server calls it every round: its previous result stays alive until the next
    one is computed. The previous result is returned, so the timing frees it after the clock."""
    held = []

    def call():
        held.append(fn())
        return held.pop(0) if len(held) > 1 else None

    return call


def methods(clients, weights, device):
    w_list = weights.tolist()
    w_dev = weights.to(device=device, dtype=torch.float32)
    num_clients = len(clients)
    dtype = clients[0][0].dtype
    out = [torch.empty_like(t) for t in clients[0]]

    def loop():
        return [sum(w_list[k] * clients[k][t] for k in range(num_clients))
                for t in range(len(clients[0]))]

    def foreach():
        acc = torch._foreach_mul(clients[0], w_list[0])
        for k in range(1, num_clients):
            torch._foreach_add_(acc, clients[k], alpha=w_list[k])
        return acc

    def stack():
        res = []
        for t in range(len(clients[0])):
            xs = torch.stack([c[t] for c in clients])
            w = w_dev.to(dtype).view(-1, *([1] * (xs.dim() - 1)))
            res.append((xs * w).sum(0))
        return res

    listed = [t for c in clients for t in c]
    flat = torch.stack([torch.cat([t.reshape(-1) for t in c]) for c in clients])
    w_flat = w_dev.to(dtype)

    return {
        "fused": keeping_previous(lambda: fedkernels.aggregate(clients, weights)),
        "fused out=": lambda: fedkernels.aggregate(clients, weights, out=out),
        "no pool": keeping_previous(lambda: no_pool(listed, weights, clients[0])),
        "huge pages": keeping_previous(lambda: huge_pages(listed, weights, clients[0], device)),
        "op out=": lambda: fedkernels.ops.weighted_sum_out(listed, weights, (), 1.0, False, out=out),
        "loop": loop,
        "foreach": foreach,
        "stack": stack,
        "flat mv": lambda: torch.mv(flat.t(), w_flat),
        "reference": lambda: fedkernels.ops.reference.aggregate_reference(clients, weights),
    }, flat


# The methods of every block, in the order methods() builds them.
METHODS = ("fused", "fused out=", "no pool", "huge pages", "op out=", "loop", "foreach", "stack",
           "flat mv", "reference")


def configs(args):
    """Yields (model, dtype name, K, shapes, numel, element size, the methods) per table block."""
    device = torch.device(args.device)
    for model in args.models:
        shapes = TINY_SHAPES if model == "tiny" else MODELS[model]()
        numel = sum(torch.Size(s).numel() for s in shapes)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for num_clients in args.clients:
                clients = make_clients(shapes, num_clients, dtype, device)
                weights = torch.rand(num_clients, generator=torch.Generator().manual_seed(1),
                                     dtype=torch.float64)
                fns, _ = methods(clients, weights, device)
                fns = {k: v for k, v in fns.items() if k not in args.skip}
                yield model, dtype_name, num_clients, shapes, numel, clients[0][0].element_size(), fns
                del clients, fns


class FaultCounter:
    """A method that counts the minor page faults of its calls (the first touches of fresh
    result pages, which the timing cannot separate from the work) over the interleaved rounds,
    where the other methods' allocations shape what the allocator hands out."""

    def __init__(self, fn):
        self.fn, self.calls, self.faults = fn, 0, 0

    def __call__(self):
        start = minor_faults()
        result = self.fn()
        self.faults += minor_faults() - start
        self.calls += 1
        return result

    def per_call(self) -> float:
        return self.faults / max(self.calls, 1)


def measure_memory(args) -> dict[str, int | None]:
    device = torch.device(args.device)
    memory = {}
    for model, dtype_name, num_clients, _, _, _, fns in configs(args):
        for name, fn in fns.items():
            fn()  # first touch of preallocated outputs is not the call's own memory
            # the pool's idle blocks are resident already: count the result as a first call does
            fedkernels.release_output_pool()
            memory[f"{model}/{dtype_name}/{num_clients}/{name}"] = peak_extra_memory(fn, device)
    return memory


def memory_in_child(argv: list[str]) -> dict[str, int | None]:
    """CPU peak memory is measured in a separate process whose allocator is set up for exact
    accounting (which would distort the timings of this one)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "memory.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory-out", path],
                       check=True)
        with open(path) as f:
            return json.load(f)


def markdown_table(rows: list[dict]) -> str:
    """One line per (model, dtype, K): the fused op's time (allocating its result, and into a
    preallocated ``out=``), bandwidth and memory, and how many times slower each alternative
    (allocating its result) is than the allocating fused call."""
    others = ["loop", "foreach", "stack", "flat mv", "reference"]
    lines = [
        "| model | dtype | K | fused ms | out= ms | out= GB/s | out= % read probe | "
        "extra mem (outputs) | " + " | ".join(f"{o} ×" for o in others) + " | op out= ms | "
        "op out= % copy probe | foreach ÷ op out= |",
        "|" + "---|" * (11 + len(others)),
    ]
    blocks: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        blocks.setdefault((r["model"], r["dtype"], r["K"]), {})[r["method"]] = r
    for (model, dtype, k), by in blocks.items():
        f, o = by.get("fused"), by.get("fused out=")
        if f is None or o is None:
            continue
        mem = "" if f["extra_in_outputs"] is None else f"{f['extra_in_outputs']:.2f}"
        cells = [f"{by[m]['time_vs_fused']:.1f}" if m in by else "" for m in others]
        op, each = by.get("op out="), by.get("foreach")
        cells += ["", "", ""] if op is None else [
            f"{op['median_ms']:.3f}", f"{op['pct_copy_probe']:.0f}",
            "" if each is None else f"{each['median_ms'] / op['median_ms']:.1f}"]
        lines.append(f"| {model} | {dtype} | {k} | {f['median_ms']:.2f} | {o['median_ms']:.2f} | "
                     f"{o['GBps']:.1f} | {o['pct_read_probe']:.0f} | {mem} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


# The alternatives whose time over the fused op's --check compares (our own out= variant is
# not a baseline).
BASELINES = ("loop", "foreach", "stack", "flat mv", "reference")


def ratios(payload: dict) -> dict[str, float]:
    """The run's ratios, each higher-is-better: how many times slower each baseline is than
    the allocating fused call, and the fused calls' bandwidth as a fraction of the read probe."""
    found = {}
    for r in payload.get("rows", []):
        case = f"{r['model']}/{r['dtype']}/K={r['K']}"
        if r["method"] in BASELINES and r.get("time_vs_fused"):
            found[f"{case}: {r['method']} time / fused time"] = r["time_vs_fused"]
        elif r["method"] in ("fused", "fused out=") and r.get("pct_read_probe"):
            found[f"{case}: {r['method']} GB/s / read probe"] = r["pct_read_probe"] / 100
    return found


def run(args, argv: list[str]) -> dict:
    device = torch.device(args.device)
    probes = bandwidth_probes(device, args.probe_bytes)
    print_probes(device, probes)
    probe = ReadProbe(device, args.probe_bytes)
    env = environment(device)
    memory = memory_in_child(argv) if device.type == "cpu" else measure_memory(args)
    load_at_start = os.getloadavg()
    header = (f"{'model':<12}{'dtype':<10}{'K':>4}  {'method':<12}{'ms':>9}{'GB/s':>8}"
              f"{'% read':>8}{'% copy':>8}{'extra MB':>10}{'x out':>7}{'vs fused':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for model, dtype_name, num_clients, shapes, numel, esize, fns in configs(args):
        traffic = (num_clients + 1) * numel * esize
        out_bytes = numel * esize
        read = probe.read_gbps()
        print(f"# read probe {read:.1f} GB/s", flush=True)
        counted = {name: FaultCounter(fn) for name, fn in fns.items()}
        for fn in counted.values():  # warm-up: first-use faults are not a round's
            for _ in range(2):
                fn()
            fn.calls = fn.faults = 0
        times = interleaved_medians(counted, device, repeats=args.repeats, warmup=0)
        faults = {name: c.per_call() for name, c in counted.items()} if device.type == "cpu" else {}
        for name in fns:
            t = times[name]
            mem = memory.get(f"{model}/{dtype_name}/{num_clients}/{name}")
            gbps = traffic / t / 1e9
            row = {
                "model": model, "tensors": len(shapes), "params": numel,
                "dtype": dtype_name, "K": num_clients, "method": name,
                "median_ms": t * 1e3, "GBps": gbps,
                "read_probe_GBps": read,
                "pct_read_probe": 100 * gbps / read,
                "pct_copy_probe": 100 * gbps / probes["copy_GBps"],
                "extra_MB": None if mem is None else mem / 1e6,
                "extra_in_outputs": None if mem is None else mem / out_bytes,
                "time_vs_fused": t / times["fused"] if "fused" in times else None,
                "minor_faults_per_call": faults.get(name),
            }
            rows.append(row)
            mem_mb = "" if mem is None else f"{mem / 1e6:.0f}"
            mem_x = "" if mem is None else f"{mem / out_bytes:.2f}"
            speed = "" if row["time_vs_fused"] is None else f"{row['time_vs_fused']:.2f}"
            print(f"{model:<12}{dtype_name:<10}{num_clients:>4}  {name:<12}"
                  f"{t * 1e3:>9.2f}{gbps:>8.1f}{row['pct_read_probe']:>8.0f}"
                  f"{row['pct_copy_probe']:>8.0f}{mem_mb:>10}{mem_x:>7}{speed:>9}",
                  flush=True)
    env["load_average"] = {"start": [round(x, 2) for x in load_at_start],
                           "end": [round(x, 2) for x in os.getloadavg()]}
    payload = {"environment": env, "probes": probes, "rows": rows,
               "command": "python bench/bench_aggregate.py " + " ".join(argv)}
    path = write_results("aggregate", device, payload, save=args.save, out=args.out)
    print(f"# wrote {path}\n")
    print(markdown_table(rows))
    return payload


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=["resnet18", "transformer"], choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--clients", nargs="+", type=at_least(1), default=[2, 10, 50])
    parser.add_argument("--repeats", type=at_least(1), default=7)
    # every ratio is over the allocating fused call, so it cannot be left out
    parser.add_argument("--skip", nargs="*", default=[], choices=[m for m in METHODS if m != "fused"],
                        help="methods to leave out")
    parser.add_argument("--quick", action="store_true", help="K=10 only, 3 repeats")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model, K=2, fp32, 1 repeat, small probe: checks the script runs")
    parser.add_argument("--probe-bytes", type=at_least(MIN_PROBE_BYTES), default=1 << 30,
                        help="size of the bandwidth probes' buffers")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    add_clock_argument(parser)
    add_output_arguments(parser)
    add_check_arguments(parser)
    parser.add_argument("--memory-out", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    check_output_arguments(args)
    if args.check and not args.memory_out:
        require_committed("aggregate", device)
    use_cpu_clock(args.clock)
    if args.threads is not None:
        if args.threads < 1:
            fail(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.quick:
        args.clients, args.repeats = [10], 3
    if args.tiny:
        args.models, args.dtypes, args.clients, args.repeats = ["tiny"], ["float32"], [2], 1
        args.probe_bytes = min(args.probe_bytes, 1 << 23)
    if args.memory_out:
        exact_cpu_memory_accounting()
        with open(args.memory_out, "w") as f:
            json.dump(measure_memory(args), f)
        return
    payload = run(args, argv)
    if args.check:
        sys.exit(check_against_committed("aggregate", torch.device(args.device), payload, ratios,
                                         args.tolerance, recheck=True))


if __name__ == "__main__":
    main()
