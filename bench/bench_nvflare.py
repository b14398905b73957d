"""One NVFlare aggregation round: NVFlare's ``InTimeAccumulateWeightedAggregator`` against
fedkernels' drop-in of the same name (``fedkernels.integrations.nvflare``).

A round is what the ScatterAndGather workflow does with the aggregator: K ``accept`` calls, one
per client's WEIGHT_DIFF DXO (with NUM_STEPS_CURRENT_ROUND and an aggregation weight), then one
``aggregate``. The model is ResNet-18-sized (62 float32 tensors, 11.69 M values, 46.8 MB),
K = 4 and 20 clients with distinct arrays, sent as NumPy arrays (what NumPy jobs and NVFlare's
own tests send) and as torch tensors (PyTorch jobs).

Time: the median of interleaved repeats (NVFlare, ours, NVFlare, ours, ...) in this process.
Peak memory: each (K, input, implementation) in a fresh child process, the peak resident set of
one round beyond what was resident before it (contributions built, one warm-up round done, glibc
set to return freed memory, see harness/memory.py). Effective bandwidth: the minimum traffic of
the round, (K + 1) model sizes, over the time, and its ratio to a read-bandwidth probe (a large
``sum``) measured in the same run.

    python bench/bench_nvflare.py            # writes bench/results/nvflare-<cpu>.json
    python bench/bench_nvflare.py --quick    # K = 4 only, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import numpy as np
import torch

from harness.cli import at_least, check_output_arguments
from harness.machine import device_name, environment
from harness.memory import exact_cpu_memory_accounting, memory_in_child, peak_extra_memory
from harness.model_shapes import resnet18_shapes
from harness.peer_comparisons import write_peer_results
from harness.probes import bandwidth_probes
from harness.results import RESULTS_DIR

IMPLS = ("nvflare", "fedkernels")
INPUTS = ("numpy", "torch")


def aggregator_class(impl: str):
    if impl == "nvflare":
        from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import (
            InTimeAccumulateWeightedAggregator,
        )
    else:
        from fedkernels.integrations.nvflare import InTimeAccumulateWeightedAggregator
    return InTimeAccumulateWeightedAggregator


def build_contributions(k: int, kind: str, seed: int = 0) -> list:
    """K shareables carrying distinct ResNet-18-sized WEIGHT_DIFF DXOs."""
    from nvflare.apis.dxo import DXO, DataKind, MetaKey
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.shareable import Shareable
    from nvflare.app_common.app_constant import AppConstants

    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        data = {f"p{j}": rng.standard_normal(s, dtype=np.float32)
                for j, s in enumerate(resnet18_shapes())}
        if kind == "torch":
            data = {n: torch.from_numpy(a) for n, a in data.items()}
        s = Shareable()
        s.set_peer_props({ReservedKey.IDENTITY_NAME: f"site-{i + 1}"})
        s.add_cookie(AppConstants.CONTRIBUTION_ROUND, 0)
        dxo = DXO(DataKind.WEIGHT_DIFF, data=data, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 10 + i})
        out.append(dxo.update_shareable(s))
    return out


def make_round(impl: str, k: int):
    """A function that runs one full round (K accepts, one aggregate) on a fresh aggregator."""
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.app_constant import AppConstants

    cls = aggregator_class(impl)
    weights = {f"site-{i + 1}": 1.0 + 0.1 * i for i in range(k)}

    def one_round(contributions):
        agg = cls(aggregation_weights=weights)
        agg._initialize(agg.aggregation_weights, agg.exclude_vars, agg.expected_data_kind)
        ctx = FLContext()
        ctx.set_prop(AppConstants.CURRENT_ROUND, 0)
        for s in contributions:
            if not agg.accept(s, ctx):
                raise RuntimeError(f"{impl} rejected a contribution")
        return agg.aggregate(ctx)

    return one_round


def child_memory(k: int, kind: str, impl: str) -> int:
    exact_cpu_memory_accounting()
    contributions = build_contributions(k, kind)
    one_round = make_round(impl, k)
    one_round(contributions)
    if impl == "fedkernels":
        # the pool's idle blocks from the warm-up round are resident already: count the
        # accumulators as a first round does
        import fedkernels
        fedkernels.release_output_pool()
    peak = peak_extra_memory(lambda: one_round(contributions), torch.device("cpu"))
    return -1 if peak is None else int(peak)


def measure_memory(k: int, kind: str, impl: str) -> int:
    return memory_in_child(__file__, k, kind, impl, "--threads", torch.get_num_threads())


def measure_time(k: int, kind: str, repeats: int) -> dict[str, float]:
    contributions = build_contributions(k, kind)
    rounds = {impl: make_round(impl, k) for impl in IMPLS}
    for impl in IMPLS:  # warm-up
        rounds[impl](contributions)
    times = {impl: [] for impl in IMPLS}
    for _ in range(repeats):
        for impl in IMPLS:
            t0 = time.perf_counter()
            rounds[impl](contributions)
            times[impl].append(time.perf_counter() - t0)
    return {impl: statistics.median(ts) for impl, ts in times.items()}


def model_bytes() -> int:
    return 4 * sum(int(np.prod(s)) for s in resnet18_shapes())


def markdown_table(rows: list[dict], env: dict) -> str:
    lines = [
        f"NVFlare InTimeAccumulateWeightedAggregator, one round (K accepts + aggregate), "
        f"ResNet-18-sized float32 model; {env['device']}, {env['threads']} threads, torch "
        f"{env['torch']}, nvflare {env['nvflare']}, {env['date'][:10]}; read probe "
        f"{env['probes']['read_GBps']:.1f} GB/s",
        "",
        "| input | K | NVFlare ms | fedkernels ms | speed-up | NVFlare peak | fedkernels peak "
        "| fedkernels GB/s (% of read probe) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = [f"{r[f'{i}_peak_MB']:.0f} MB" if f"{i}_peak_MB" in r else "-" for i in IMPLS]
        lines.append(
            f"| {r['input']} | {r['K']} | {r['nvflare_ms']:.1f} | {r['fedkernels_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {mem[0]} | {mem[1]} | {r['fedkernels_GBps']:.1f} "
            f"({100 * r['fedkernels_GBps'] / env['probes']['read_GBps']:.0f} %) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="K = 4 only, 3 repeats")
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--threads", type=at_least(1), help="torch threads (default: torch's)")
    parser.add_argument("--out", metavar="FILE", help="results JSON (default "
                        "bench/results/nvflare-<device>.json)")
    parser.add_argument("--child-memory", nargs=3, metavar=("K", "INPUT", "IMPL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_output_arguments(args)  # an --out folder: refused now, not after the run
    logging.disable(logging.CRITICAL)  # NVFlare logs every accept; both sides alike
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_memory:
        k, kind, impl = args.child_memory
        print(child_memory(int(k), kind, impl))
        return
    import nvflare

    cpu = torch.device("cpu")
    env = environment(cpu)
    env["nvflare"] = nvflare.__version__
    env["probes"] = bandwidth_probes(cpu)
    env["load_average_at_start"] = os.getloadavg()
    ks = (4,) if args.quick else (4, 20)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for kind in INPUTS:
        for k in ks:
            t = measure_time(k, kind, repeats)
            row = {"input": kind, "K": k, "repeats": repeats,
                   "nvflare_ms": 1e3 * t["nvflare"], "fedkernels_ms": 1e3 * t["fedkernels"],
                   "speedup": t["nvflare"] / t["fedkernels"],
                   "fedkernels_GBps": (k + 1) * model_bytes() / t["fedkernels"] / 1e9}
            if not args.no_memory:
                for impl in IMPLS:
                    row[f"{impl}_peak_MB"] = measure_memory(k, kind, impl) / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    payload = {"environment": env, "model": "resnet18 (62 tensors, 11.69 M float32 values)",
               "rows": rows}
    path = args.out or os.path.join(RESULTS_DIR, f"nvflare-{device_name(cpu)}.json")
    write_peer_results(path, payload, markdown_table(rows, env))


if __name__ == "__main__":
    main()
