"""FedLab's ``Aggregators.fedavg_aggregate`` against fedkernels' drop-in
(``fedkernels.integrations.fedlab``) on K serialized ResNet-18-sized parameter vectors
(11.69 M float32 values, 46.8 MB each), K = 10 and 100, sample-count weights.

Every vector is distinct (4.7 GB at K = 100; FedLab stacks all K, a K·P copy plus the
weighted K·P product, so a K = 100 run needs about 15 GB): the fused op reads one tile of
every vector before the next tile, so repeated vectors would be read from cache. Time: the
median of interleaved repeats (FedLab, ours, FedLab, ours, ...) in this process. Peak memory:
each (K, implementation) in a fresh child process, the peak resident set of one call beyond
what was resident before it (inputs built, one warm-up call, glibc set to return freed memory,
see harness/memory.py), result included. Effective bandwidth: (K + 1) vector sizes over the
time, and its ratio to a read-bandwidth probe (a large ``sum``).

    python bench/bench_fedlab.py            # writes bench/results/fedlab-<cpu>.json
    python bench/bench_fedlab.py --quick    # K = 10 only, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from harness.cli import check_output_arguments
from harness.machine import device_name, environment
from harness.memory import exact_cpu_memory_accounting, memory_in_child, peak_extra_memory
from harness.model_shapes import resnet18_shapes
from harness.peer_comparisons import add_peer_arguments, peer_table, write_peer_results
from harness.probes import bandwidth_probes
from harness.results import RESULTS_DIR

IMPLS = ("fedlab", "fedkernels")
P = sum(int(torch.Size(s).numel()) for s in resnet18_shapes())


def fedavg(impl: str):
    if impl == "fedlab":
        from fedlab.utils.aggregator import Aggregators
    else:
        from fedkernels.integrations.fedlab import Aggregators
    return Aggregators.fedavg_aggregate


def build_inputs(k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(P, generator=g) for _ in range(k)]
    weights = [float(100 + 7 * i) for i in range(k)]  # sample counts
    return vectors, weights


def child_memory(k: int, impl: str) -> int:
    exact_cpu_memory_accounting()
    vectors, weights = build_inputs(k)
    fn = fedavg(impl)
    fn(vectors, weights)
    peak = peak_extra_memory(lambda: fn(vectors, weights), torch.device("cpu"))
    return -1 if peak is None else int(peak)


def measure_memory(k: int, impl: str) -> int:
    return memory_in_child(__file__, k, impl, "--threads", torch.get_num_threads())


def measure_time(k: int, repeats: int) -> tuple[dict[str, float], float]:
    vectors, weights = build_inputs(k)
    fns = {impl: fedavg(impl) for impl in IMPLS}
    results = {impl: fns[impl](vectors, weights) for impl in IMPLS}  # warm-up, and agreement
    err = float((results["fedlab"].double() - results["fedkernels"].double()).abs().max())
    del results
    times = {impl: [] for impl in IMPLS}
    for _ in range(repeats):
        for impl in IMPLS:
            t0 = time.perf_counter()
            out = fns[impl](vectors, weights)
            times[impl].append(time.perf_counter() - t0)
            del out
    return {impl: statistics.median(ts) for impl, ts in times.items()}, err


def markdown_table(rows: list[dict], env: dict) -> str:
    title = (
        f"FedLab Aggregators.fedavg_aggregate, K serialized ResNet-18-sized float32 vectors; "
        f"{env['device']}, {env['threads']} threads, torch {env['torch']}, fedlab "
        f"{env['fedlab']}, {env['date'][:10]}; read probe {env['probes']['read_GBps']:.1f} GB/s")
    return peer_table(title, "fedlab", rows, env["probes"]["read_GBps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, "bench/results/fedlab-<device>.json")
    args = parser.parse_args()
    check_output_arguments(args)  # an --out folder: refused now, not after the run
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_memory:
        print(child_memory(int(args.child_memory[0]), args.child_memory[1]))
        return
    import fedlab

    cpu = torch.device("cpu")
    env = environment(cpu)
    env["fedlab"] = fedlab.__version__
    env["probes"] = bandwidth_probes(cpu)
    env["load_average_at_start"] = os.getloadavg()
    ks = (10,) if args.quick else (10, 100)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for k in ks:
        t, err = measure_time(k, repeats)
        row = {"K": k, "repeats": repeats, "fedlab_ms": 1e3 * t["fedlab"],
               "fedkernels_ms": 1e3 * t["fedkernels"], "speedup": t["fedlab"] / t["fedkernels"],
               "fedkernels_GBps": (k + 1) * 4 * P / t["fedkernels"] / 1e9, "max_abs_diff": err}
        if not args.no_memory:
            for impl in IMPLS:
                row[f"{impl}_peak_MB"] = measure_memory(k, impl) / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    payload = {"environment": env, "model": f"resnet18-sized flat vectors (P = {P} float32)",
               "rows": rows}
    path = args.out or os.path.join(RESULTS_DIR, f"fedlab-{device_name(cpu)}.json")
    write_peer_results(path, payload, markdown_table(rows, env))


if __name__ == "__main__":
    main()
