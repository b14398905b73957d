"""FedML's ``FedMLAggOperator.agg`` (FedAvg, torch backend) against fedkernels' drop-in
(``fedkernels.integrations.fedml``) on K state_dicts of ResNet-18's shapes (62 float32
parameter tensors, 11.69 M values, 46.8 MB, and an int64 ``num_batches_tracked`` per
BatchNorm), K = 10 and 100, sample-count weights.

FedML's code is its own, from the installed wheel (``pip install --no-deps fedml==0.9.6``),
loaded by ``bench/harness/fedml_files.py`` without running ``fedml/__init__`` (the script
exits with status 2 when the files are not there). Every client is a distinct dict (4.7 GB at K = 100):
both implementations take one tensor across all K clients at a time, so a list that repeated
a few dicts would read the repeats from cache, faster than memory allows.

Both implementations write their result into client 0's dict. Each call therefore gets its
own shallow copy of the list whose client 0 entry holds a fresh copy of client 0's dict (the
dict only: the same tensors, which FedAvg does not modify), made before the clock starts, so
the timed work is the aggregation alone. Time: the median of interleaved repeats (FedML, ours,
FedML, ours, ...) in this process; the result is freed after the clock stops. The two results
are compared once per K (the same keys and dtypes, and values within fp32 rounding: FedML
rounds each of its K products and sums in float32). Peak memory: each (K, implementation) in
a fresh child process, as in bench/bench_fedlab.py (see harness/memory.py). Effective bandwidth:
(K + 1) model sizes over the time, and its ratio to a read-bandwidth probe (a large ``sum``)
measured at the start of the same run.

    python bench/bench_fedml.py            # writes bench/results/fedml-<cpu>.json
    python bench/bench_fedml.py --quick    # K = 10 only, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import OrderedDict
from types import SimpleNamespace

import torch

from harness import fedml_files
from harness.cli import check_output_arguments, fail
from harness.machine import device_name, environment
from harness.memory import exact_cpu_memory_accounting, memory_in_child, peak_extra_memory
from harness.model_shapes import resnet18_shapes
from harness.peer_comparisons import add_peer_arguments, peer_table, write_peer_results
from harness.probes import bandwidth_probes
from harness.results import RESULTS_DIR
from harness.timing import timed

IMPLS = ("fedml", "fedkernels")
ARGS = SimpleNamespace(federated_optimizer="FedAvg")  # FedML's args: torch backend by default
CPU = torch.device("cpu")


def model_layout() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(key, shape, dtype) of the state_dict: ResNet-18's parameter shapes in order, each
    BatchNorm (the two 1-D tensors after a convolution) followed by its int64
    ``num_batches_tracked`` scalar, as in a torch state_dict."""
    layout = []
    shapes = resnet18_shapes()
    conv = bn = 0
    i = 0
    while i < len(shapes):
        shape = shapes[i]
        if len(shape) == 4:
            layout.append((f"conv{conv}.weight", shape, torch.float32))
            conv += 1
            if i + 2 < len(shapes) and len(shapes[i + 1]) == len(shapes[i + 2]) == 1:
                layout += [(f"bn{bn}.weight", shapes[i + 1], torch.float32),
                           (f"bn{bn}.bias", shapes[i + 2], torch.float32),
                           (f"bn{bn}.num_batches_tracked", (), torch.int64)]
                bn += 1
                i += 2
        else:
            layout.append((f"fc.{'weight' if len(shape) == 2 else 'bias'}", shape, torch.float32))
        i += 1
    return layout


LAYOUT = model_layout()
P = sum(int(torch.Size(s).numel()) for _, s, d in LAYOUT if d == torch.float32)
MODEL_BYTES = sum(int(torch.Size(s).numel()) * (4 if d == torch.float32 else 8)
                  for _, s, d in LAYOUT)


def build_inputs(k: int, seed: int = 0) -> list[tuple[int, OrderedDict]]:
    """K (sample count, state_dict) pairs, K distinct dicts."""
    g = torch.Generator().manual_seed(seed)
    distinct = []
    for c in range(k):
        distinct.append(OrderedDict(
            (key, torch.randn(shape, generator=g) if dtype == torch.float32
             else torch.tensor(100 * (c + 1), dtype=dtype))
            for key, shape, dtype in LAYOUT))
    return [(100 + 7 * i, d) for i, d in enumerate(distinct)]  # sample counts


def call_list(clients: list) -> list:
    """What one call gets: a new list, client 0's dict copied (not its tensors)."""
    n0, d0 = clients[0]
    return [(n0, OrderedDict(d0)), *clients[1:]]


def agg(impl: str, fedml_module):
    if impl == "fedml":
        return fedml_module.FedMLAggOperator.agg
    from fedkernels.integrations.fedml import FedMLAggOperator

    return FedMLAggOperator.agg


def compare(theirs: OrderedDict, ours: OrderedDict, k: int) -> tuple[float, bool]:
    """Max abs difference of the two results, and whether they agree: the same keys in the
    same order, the same dtypes, and every entry within (2K + 4) float32 roundings of the
    larger of 1 and FedML's largest magnitude in that entry."""
    if list(theirs) != list(ours):
        return float("inf"), False
    err, agree = 0.0, True
    eps = torch.finfo(torch.float32).eps
    for key, t in theirs.items():
        o = ours[key]
        if t.dtype != o.dtype or t.shape != o.shape:
            return float("inf"), False
        diff = float((t.double() - o.double()).abs().max())
        err = max(err, diff)
        agree &= diff <= (2 * k + 4) * eps * max(1.0, float(t.abs().max()))
    return err, agree


def child_memory(k: int, impl: str) -> int:
    exact_cpu_memory_accounting()
    clients = build_inputs(k)
    with fedml_files.loaded() as module:
        fn = agg(impl, module)
        fn(ARGS, call_list(clients))
        peak = peak_extra_memory(lambda: fn(ARGS, call_list(clients)), CPU)
    return -1 if peak is None else int(peak)


def measure_memory(k: int, impl: str) -> int:
    return memory_in_child(__file__, k, impl, "--threads", torch.get_num_threads())


def measure_time(k: int, repeats: int, fedml_module) -> tuple[dict[str, float], float, bool]:
    clients = build_inputs(k)
    fns = {impl: agg(impl, fedml_module) for impl in IMPLS}
    # warm-up, and agreement
    results = {impl: fns[impl](ARGS, call_list(clients)) for impl in IMPLS}
    err, agree = compare(results["fedml"], results["fedkernels"], k)
    del results
    times = {impl: [] for impl in IMPLS}
    for _ in range(repeats):
        for impl in IMPLS:
            data = call_list(clients)  # before the clock: the timed work is the aggregation
            times[impl].append(timed(lambda fn=fns[impl], data=data: fn(ARGS, data), CPU))
            del data
    return {impl: statistics.median(ts) for impl, ts in times.items()}, err, agree


def markdown_table(rows: list[dict], env: dict) -> str:
    title = (
        f"FedML FedMLAggOperator.agg (FedAvg), K ResNet-18-shaped float32 state_dicts; "
        f"{env['device']}, {env['threads']} threads, torch {env['torch']}, fedml "
        f"{env['fedml']}, {env['date'][:10]}; read probe {env['probes']['read_GBps']:.1f} GB/s")
    return peer_table(title, "fedml", rows, env["probes"]["read_GBps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, "bench/results/fedml-<device>.json")
    args = parser.parse_args()
    check_output_arguments(args)  # an --out folder: refused now, not after the run
    root = fedml_files.fedml_root()
    if root is None:
        fail(f"FedML's aggregation files were not found: {fedml_files.MISSING}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_memory:
        print(child_memory(int(args.child_memory[0]), args.child_memory[1]))
        return

    env = environment(CPU)
    env["fedml"] = fedml_files.fedml_version()
    env["probes"] = bandwidth_probes(CPU)
    env["load_average_at_start"] = os.getloadavg()
    ks = (10,) if args.quick else (10, 100)
    repeats = 3 if args.quick else args.repeats
    rows = []
    with fedml_files.loaded(root) as fedml_module:
        for k in ks:
            t, err, agree = measure_time(k, repeats, fedml_module)
            if not agree:
                print(f"bench_fedml.py: FedML's and fedkernels' results differ at K = {k} "
                      f"(max abs difference {err:.3g}), beyond fp32 rounding", file=sys.stderr)
                sys.exit(1)
            gbps = (k + 1) * MODEL_BYTES / t["fedkernels"] / 1e9
            row = {"K": k, "repeats": repeats, "fedml_ms": 1e3 * t["fedml"],
                   "fedkernels_ms": 1e3 * t["fedkernels"],
                   "speedup": t["fedml"] / t["fedkernels"],
                   "fedml_GBps": (k + 1) * MODEL_BYTES / t["fedml"] / 1e9,
                   "fedkernels_GBps": gbps,
                   "fedkernels_fraction_of_read_probe": gbps / env["probes"]["read_GBps"],
                   "max_abs_diff": err, "agree": agree}
            if not args.no_memory:
                for impl in IMPLS:
                    row[f"{impl}_peak_MB"] = measure_memory(k, impl) / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    payload = {"environment": env,
               "model": f"resnet18-shaped state_dict ({len(LAYOUT)} tensors: P = {P} float32 "
                        f"and {sum(d == torch.int64 for *_, d in LAYOUT)} int64 "
                        "num_batches_tracked)",
               "optimizer": ARGS.federated_optimizer, "rows": rows}
    path = args.out or os.path.join(RESULTS_DIR, f"fedml-{device_name(CPU)}.json")
    write_peer_results(path, payload, markdown_table(rows, env))


if __name__ == "__main__":
    main()
