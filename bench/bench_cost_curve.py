"""Cost curve of fedkernels.aggregate: time and peak memory against the number of clients K and
the model size P, and where the time goes at each end.

    python bench/bench_cost_curve.py            # the default sweep: a few minutes
    python bench/bench_cost_curve.py --full     # P up to 1e9, inputs up to 8 GiB: long
    python bench/bench_cost_curve.py --tiny     # seconds: checks the script runs
    python bench/bench_cost_curve.py --save     # also update bench/results/<cpu>.json
    python bench/bench_cost_curve.py --check    # exit 1 if a ratio regressed > 20 %

Sections of one run (results under the key "cost_curve", "cost_curve_full" with --full; see
harness/results.py for where they go):

  sweep        a model of two tensors (a weight and a bias of P/1000 elements), P from 1e4
               to 1e7 (1e9 with --full), K in {2, 10, 100, 1000}, float32 and bfloat16. A
               combination is left out when its K client models, plus 5 models of results
               and temporaries (the loop's), exceed --max-input-gib (1 GiB by default, 8 GiB
               with --full): the streaming section covers those sizes.
  lora         the shape of a LoRA adapter: 256 tensors of 64 Ki elements (16.8 M), K in
               {2, 10} ({2, 10, 100} with --full) within the same limit.
  stream       fedkernels.Accumulator with the clients generated one at a time, for P and K
               whose inputs would not fit at once (P = 1e7, K up to 100; with --full up to
               K = 1000, and P = 1e8 and 1e9): its peak memory stays a few models whatever
               K is.
  distributed  fedkernels.integrations.distributed.all_reduce_aggregate with the K = 8
               clients spread over 2 and 4 gloo processes on this machine, against one
               process aggregating all 8; P = 1e5 and 1e7 (1e5, 1e6, 1e7 with --full).

Methods of a sweep or lora case, timed in interleaved rounds (see harness/timing.py):

  fused        fedkernels.aggregate(clients, w), allocating its result
  fused out=   fedkernels.aggregate(clients, w, out=result), into a preallocated model
  op only      torch.ops.fedkernels.weighted_sum on a ready flat tensor list and weight
               tensor: the native op without the Python layer (its checks, the layout)
  loop         per tensor sum(w_k * x_k), the Python loop of most FL code
  foreach      torch._foreach_mul, then K - 1 torch._foreach_add_(alpha=w_k)

"overhead" is fused minus op only: what the Python layer costs per call. GB/s counts the
minimum traffic (K + 1) P elements; "% read" is that over the read probe of the same run.
"extra" is the peak memory a call allocates beyond its inputs, in units of one model, measured
in a child process set up for exact accounting. The kernel's resident-set counters are
approximate by a few hundred KiB (per-CPU batching), so it is left out for models under 4 MiB
(the JSON keeps the raw bytes). The curve is the CPU kernels' (bench_aggregate.py --device
cuda times the GPU ones).

The distributed section reports wall times (a collective's cost is mostly waiting), the
slowest rank's in each round; the one-process baseline runs on rank 0 in the same rounds.
On a machine shared with other work, ``--threads 1 --clock process`` times the other
sections by this process's CPU time (see harness/timing.py).
The client tensors are filled with constants (the weighted sum costs the same whatever the
values), which keeps generating 8 GiB of clients quick.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch

import fedkernels
from fedkernels.ops import summation

from harness.cli import (
    add_check_arguments,
    add_clock_argument,
    add_output_arguments,
    at_least,
    check_output_arguments,
    fail,
    positive_number,
)
from harness.machine import environment
from harness.memory import exact_cpu_memory_accounting, peak_extra_memory, release_freed_memory
from harness.model_shapes import lora_shapes
from harness.probes import MIN_PROBE_BYTES, bandwidth_probes, print_probes
from harness.regression_check import check_against_committed, require_committed
from harness.results import write_results
from harness.timing import cpu_clock, interleaved_medians, use_cpu_clock

CPU = torch.device("cpu")  # the cost curve of the CPU kernels (the machine of this project)
GIB = 1 << 30
MEMORY_RESOLUTION_BYTES = 4 << 20  # smaller CPU peaks are within the RSS counters' error
METHODS = ("fused", "fused out=", "op only", "loop", "foreach")
BASELINES = ("loop", "foreach")  # --check compares the fused op's speed-up over these
DISTRIBUTED_CLIENTS = 8


# ---------------------------------------------------------------- models and clients


def two_tensor_shapes(numel: int) -> dict[str, tuple[int, ...]]:
    """A weight and a bias (P / 1000 elements, at least 1), P elements in all."""
    bias = max(1, numel // 1000)
    return {"weight": (numel - bias,), "bias": (bias,)}


def numel_of(shapes: dict) -> int:
    return sum(math.prod(s) for s in shapes.values())


def client_value(k: int) -> float:
    return 0.125 * (k % 7 + 1)  # exact in bfloat16


def make_client(shapes: dict, dtype: torch.dtype, k: int) -> dict:
    return {name: torch.full(shape, client_value(k), dtype=dtype)
            for name, shape in shapes.items()}


def client_weights(num_clients: int) -> list[float]:
    return [float(k % 5 + 1) for k in range(num_clients)]


def case_methods(clients: list[dict], weights: list[float]) -> dict:
    names = list(clients[0])
    flat = [c[n] for c in clients for n in names]
    w_tensor = torch.tensor(weights, dtype=torch.float64)
    out = {n: torch.empty_like(t) for n, t in clients[0].items()}

    def loop():
        return {n: sum(w * c[n] for w, c in zip(weights, clients)) for n in names}

    def foreach():
        acc = torch._foreach_mul([clients[0][n] for n in names], weights[0])
        for w, c in zip(weights[1:], clients[1:]):
            torch._foreach_add_(acc, [c[n] for n in names], alpha=w)
        return acc

    return {
        "fused": lambda: fedkernels.aggregate(clients, weights),
        "fused out=": lambda: fedkernels.aggregate(clients, weights, out=out),
        "op only": lambda: summation.weighted_sum(flat, w_tensor),
        "loop": loop,
        "foreach": foreach,
    }


# ---------------------------------------------------------------- the grid


def settings_for(args) -> dict:
    """Sizes of each section: the default run, --full or --tiny, then explicit flags."""
    if args.tiny:
        s = dict(sizes=[1_000, 10_000], clients=[2, 10], dtypes=["float32"], max_input_gib=0.01,
                 lora=dict(pairs=4, rank=4, width=256), lora_clients=[2, 10],
                 stream=[(10_000, [2, 10])], worlds=[2], distributed_sizes=[10_000], repeats=1)
    elif args.full:
        s = dict(sizes=[10 ** e for e in range(4, 10)], clients=[2, 10, 100, 1000],
                 dtypes=["float32", "bfloat16"], max_input_gib=8.0, lora=dict(),
                 lora_clients=[2, 10, 100],
                 stream=[(10 ** 7, [2, 10, 100, 1000]), (10 ** 8, [2, 10, 100]),
                         (10 ** 9, [2, 10])],
                 worlds=[2, 4], distributed_sizes=[10 ** 5, 10 ** 6, 10 ** 7],
                 repeats=5)
    else:
        s = dict(sizes=[10 ** e for e in range(4, 8)], clients=[2, 10, 100, 1000],
                 dtypes=["float32", "bfloat16"], max_input_gib=1.0, lora=dict(),
                 lora_clients=[2, 10], stream=[(10 ** 7, [2, 10, 100])],
                 worlds=[2, 4], distributed_sizes=[10 ** 5, 10 ** 7], repeats=5)
    if args.dtypes:
        s["dtypes"] = args.dtypes
    if args.sizes:
        s["sizes"] = args.sizes
        s["stream"] = [(p, ks) for p, ks in s["stream"] if p in args.sizes]
        s["distributed_sizes"] = [p for p in s["distributed_sizes"] if p in args.sizes]
    if args.clients:
        s["clients"] = args.clients
        s["lora_clients"] = [k for k in s["lora_clients"] if k in args.clients]
        s["stream"] = [(p, [k for k in ks if k in args.clients]) for p, ks in s["stream"]]
    if args.repeats:
        s["repeats"] = args.repeats
    if args.max_input_gib is not None:
        s["max_input_gib"] = args.max_input_gib
    if args.worlds is not None:
        s["worlds"] = args.worlds
    if args.sections:
        for name, key in (("sweep", "sizes"), ("lora", "lora_clients"), ("stream", "stream"),
                          ("distributed", "worlds")):
            if name not in args.sections:
                s[key] = []
    return s


WORKING_MODELS = 5  # results and temporaries of a case's methods, in models (the loop's)


def cases(settings: dict):
    """(section, dtype name, K, shapes) of every sweep and lora case whose clients and working
    memory fit the limit."""
    limit = settings["max_input_gib"] * GIB
    for dtype_name in settings["dtypes"]:
        esize = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
        for numel in settings["sizes"]:
            for k in settings["clients"]:
                if (k + WORKING_MODELS) * numel * esize <= limit:
                    yield "sweep", dtype_name, k, two_tensor_shapes(numel)
        if settings["lora_clients"]:
            shapes = lora_shapes(**settings["lora"])
            for k in settings["lora_clients"]:
                if (k + WORKING_MODELS) * numel_of(shapes) * esize <= limit:
                    yield "lora", dtype_name, k, shapes


def case_key(section: str, dtype_name: str, k: int, numel: int) -> str:
    return f"{section}/{dtype_name}/K={k}/P={numel}"


# ---------------------------------------------------------------- memory and streaming (child)


def stream_case(shapes: dict, num_clients: int, dtype: torch.dtype) -> dict:
    """Accumulator over clients generated one at a time: time of the adds and of the result,
    and the peak memory of the whole pass (the client being added included)."""
    weights = client_weights(num_clients)
    timing = {"add_s": 0.0}

    def one_pass():
        acc = fedkernels.Accumulator()
        for k in range(num_clients):
            client = make_client(shapes, dtype, k)
            t0 = cpu_clock()
            acc.add(client, weights[k])
            timing["add_s"] += cpu_clock() - t0
            del client
        t0 = cpu_clock()
        result = acc.result(normalize=True)
        timing["result_s"] = cpu_clock() - t0
        expected = sum(w * client_value(k) for k, w in enumerate(weights)) / sum(weights)
        got = float(result["bias"].flatten()[0]) if "bias" in result else None
        if got is not None and abs(got - expected) > 1e-2 * abs(expected):
            raise AssertionError(f"streaming result {got} != {expected}")
        return result

    peak = peak_extra_memory(one_pass, CPU)
    numel = numel_of(shapes)
    esize = torch.empty(0, dtype=dtype).element_size()
    resolved = numel * esize >= MEMORY_RESOLUTION_BYTES
    acc_size = 8 if dtype == torch.float64 else 4
    traffic = num_clients * numel * (esize + 2 * acc_size)  # read a client, read+write acc
    return {"K": num_clients, "P": numel, "dtype": str(dtype).replace("torch.", ""),
            "add_ms_per_client": 1e3 * timing["add_s"] / num_clients,
            "result_ms": 1e3 * timing["result_s"],
            "add_GBps": traffic / timing["add_s"] / 1e9,
            "peak_extra_bytes": peak,
            "peak_in_models": None if peak is None or not resolved else peak / (numel * esize),
            "inputs_at_once_GiB": num_clients * numel * esize / GIB}


def measure_in_child(args, settings: dict) -> dict:
    """Peak memory of every case's methods, and the streaming section (time and memory), in
    this process (a child set up for exact accounting)."""
    memory = {}
    for section, dtype_name, k, shapes in cases(settings):
        dtype = getattr(torch, dtype_name)
        clients = [make_client(shapes, dtype, i) for i in range(k)]
        fns = case_methods(clients, client_weights(k))
        for name, fn in fns.items():
            fn()  # the first touch of a preallocated out is not the call's own memory
            memory[f"{case_key(section, dtype_name, k, numel_of(shapes))}/{name}"] = \
                peak_extra_memory(fn, CPU)
        del clients, fns
        release_freed_memory()
    stream = []
    for dtype_name in settings["dtypes"]:
        for numel, ks in settings["stream"]:
            for k in ks:
                stream.append(stream_case(two_tensor_shapes(numel), k, getattr(torch, dtype_name)))
                release_freed_memory()
                row = stream[-1]
                print(f"# stream {dtype_name} K={k} P={numel:.0e}: "
                      f"{row['add_ms_per_client']:.2f} ms/client", file=sys.stderr, flush=True)
    return {"memory": memory, "stream": stream}


def child_measurements(argv: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "memory.json")
        try:
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory-out",
                            path], check=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            fail(f"the memory and streaming measurements took longer than {timeout_s:.0f} s")
        except subprocess.CalledProcessError as err:
            fail(f"the memory and streaming measurements failed (exit status {err.returncode})")
        with open(path) as f:
            return json.load(f)


# ---------------------------------------------------------------- distributed (gloo ranks)


def _rank_main(rank: int, world: int, port: int, sizes: list[int], repeats: int,
               out_path: str) -> None:
    import torch.distributed as dist

    from fedkernels.integrations.distributed import all_reduce_aggregate

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("cost_curve", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    weights = client_weights(DISTRIBUTED_CLIENTS)
    rows = []
    for numel in sizes:
        shapes = two_tensor_shapes(numel)
        mine = list(range(rank, DISTRIBUTED_CLIENTS, world))
        # The baseline, one process summing all K clients, runs on rank 0 in the same rounds
        # (the other ranks wait at the next barrier), so noise hits it and the ranks alike.
        everyone = ([make_client(shapes, torch.float32, k) for k in range(DISTRIBUTED_CLIENTS)]
                    if rank == 0 else None)
        clients = ([everyone[k] for k in mine] if rank == 0
                   else [make_client(shapes, torch.float32, k) for k in mine])
        my_weights = [weights[k] for k in mine]
        buffer = torch.zeros(numel + 1)
        fns = {
            "all_reduce_aggregate": lambda: all_reduce_aggregate(clients, my_weights,
                                                                 normalize=True),
            "all_reduce only": lambda: dist.all_reduce(buffer),
            "local aggregate": lambda: fedkernels.aggregate(clients, my_weights),
            "one process": lambda: (fedkernels.aggregate(everyone, weights, normalize=True)
                                    if rank == 0 else None),
        }
        for fn in fns.values():
            fn()
        samples = {name: [] for name in fns}
        names = list(fns)
        for r in range(repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                dist.barrier()
                t0 = time.perf_counter()  # wall time: a collective's cost is mostly waiting
                fns[name]()
                samples[name].append(time.perf_counter() - t0)
        gathered = [None] * world
        dist.all_gather_object(gathered, samples)
        row = {"world": world, "P": numel, "dtype": "float32", "K": DISTRIBUTED_CLIENTS,
               "threads_per_rank": torch.get_num_threads()}
        for name in names:  # each round's time is the slowest rank's
            per_round = [max(g[name][i] for g in gathered) for i in range(repeats)]
            row[f"{name}_ms"] = 1e3 * sorted(per_round)[len(per_round) // 2]
        rows.append(row)
        clients = everyone = buffer = fns = None  # free this size's clients before the next
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(world: int, sizes: list[int], repeats: int, timeout_s: float) -> list[dict]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # The ranks run this interpreter; its folder on PATH serves tools looked up by name.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.json")
        context = mp.start_processes(_rank_main, args=(world, store.port, sizes, repeats, path),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    fail(f"the {world} gloo ranks did not finish within {timeout_s:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            fail(f"a gloo rank failed: {err}")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        with open(path) as f:
            return json.load(f)


# ---------------------------------------------------------------- the run


def results_name(args) -> str:
    """The key of the run in the results JSON: the default and the --full sweep are kept (and
    checked) apart."""
    return "cost_curve_full" if args.full else "cost_curve"


def ratios(payload: dict) -> dict[str, float]:
    """The run's ratios, each higher-is-better (what --check compares): each baseline's time
    over the fused call's, the fused calls' and the streaming adds' bandwidth over the read
    probe (P >= 1e6 only: below that a call is overhead, not bandwidth), and one process's
    time over all_reduce_aggregate's."""
    found = {}
    read = payload.get("probes", {}).get("read_GBps")
    for r in payload.get("rows", []):
        case = case_key(r["section"], r["dtype"], r["K"], r["P"])
        if r["method"] in BASELINES and r.get("time_vs_fused"):
            found[f"{case}: {r['method']} time / fused time"] = r["time_vs_fused"]
        elif r["method"] in ("fused", "fused out=") and r["P"] >= 10 ** 6 and r.get("pct_read_probe"):
            found[f"{case}: {r['method']} GB/s / read probe"] = r["pct_read_probe"] / 100
    for r in payload.get("stream", []):
        if read and r["P"] >= 10 ** 6 and r.get("add_GBps"):
            found[f"{case_key('stream', r['dtype'], r['K'], r['P'])}: add GB/s / read probe"] = \
                r["add_GBps"] / read
    for r in payload.get("distributed", []):
        if r.get("one process_ms") and r.get("all_reduce_aggregate_ms"):
            found[f"distributed/world={r['world']}/P={r['P']}: one process time / "
                  "all_reduce_aggregate time"] = r["one process_ms"] / r["all_reduce_aggregate_ms"]
    return found


def print_sweep_row(row_by_method: dict) -> None:
    f = row_by_method["fused"]
    o, op = row_by_method["fused out="], row_by_method["op only"]
    mem = "" if f["extra_in_models"] is None else f"{f['extra_in_models']:.2f}"
    print(f"{f['section']:<6}{f['dtype']:<10}{f['K']:>5}{f['P']:>12.0e}"
          f"{f['median_ms'] * 1e3:>11.1f}{op['median_ms'] * 1e3:>10.1f}"
          f"{(f['median_ms'] - op['median_ms']) * 1e3:>10.1f}"
          f"{row_by_method['loop']['time_vs_fused']:>8.2f}"
          f"{row_by_method['foreach']['time_vs_fused']:>9.2f}"
          f"{o['GBps']:>9.1f}{o['pct_read_probe']:>8.0f}{mem:>8}", flush=True)


def markdown(payload: dict) -> str:
    """The README tables: the sweep and lora cases, the streaming pass, the ranks."""
    lines = ["| case | dtype | K | P | fused µs | op only µs | Python layer µs | loop × | "
             "foreach × | out= GB/s | out= % read | extra (models) |",
             "|" + "---|" * 12]
    blocks: dict[tuple, dict] = {}
    for r in payload["rows"]:
        blocks.setdefault((r["section"], r["dtype"], r["K"], r["P"]), {})[r["method"]] = r
    for (section, dtype, k, numel), by in blocks.items():
        f, o, op = by["fused"], by["fused out="], by["op only"]
        mem = "" if f["extra_in_models"] is None else f"{f['extra_in_models']:.2f}"
        lines.append(f"| {section} | {dtype} | {k} | {numel:.0e} | {f['median_ms'] * 1e3:.0f} | "
                     f"{op['median_ms'] * 1e3:.0f} | {(f['median_ms'] - op['median_ms']) * 1e3:.0f}"
                     f" | {by['loop']['time_vs_fused']:.2f} | {by['foreach']['time_vs_fused']:.2f}"
                     f" | {o['GBps']:.1f} | {o['pct_read_probe']:.0f} | {mem} |")
    if payload.get("stream"):
        lines += ["", "| streaming | dtype | K | P | add ms/client | add GB/s | result ms | "
                  "peak extra (models) | inputs at once GiB |", "|" + "---|" * 9]
        for r in payload["stream"]:
            peak = "" if r["peak_in_models"] is None else f"{r['peak_in_models']:.2f}"
            lines.append(f"| Accumulator | {r['dtype']} | {r['K']} | {r['P']:.0e} | "
                         f"{r['add_ms_per_client']:.2f} | {r['add_GBps']:.1f} | "
                         f"{r['result_ms']:.1f} | {peak} | {r['inputs_at_once_GiB']:.2f} |")
    if payload.get("distributed"):
        lines += ["", "| gloo ranks | P | K | one process ms | all_reduce_aggregate ms | "
                  "its all-reduce alone ms | its local sum ms |", "|" + "---|" * 7]
        for r in payload["distributed"]:
            lines.append(f"| {r['world']} | {r['P']:.0e} | {r['K']} | {r['one process_ms']:.2f} | "
                         f"{r['all_reduce_aggregate_ms']:.2f} | {r['all_reduce only_ms']:.2f} | "
                         f"{r['local aggregate_ms']:.2f} |")
    return "\n".join(lines)


def run(args, argv: list[str], settings: dict) -> dict:
    started = time.monotonic()
    probes = bandwidth_probes(CPU, args.probe_bytes)
    print_probes(CPU, probes)
    env = environment(CPU)
    child = child_measurements(argv, args.timeout)
    memory = child["memory"]

    print(f"{'case':<6}{'dtype':<10}{'K':>5}{'P':>12}{'fused µs':>11}{'op µs':>10}"
          f"{'Py µs':>10}{'loop ×':>8}{'foreach ×':>9}{'GB/s':>9}{'% read':>8}{'extra':>8}")
    rows = []
    for section, dtype_name, k, shapes in cases(settings):
        dtype = getattr(torch, dtype_name)
        numel = numel_of(shapes)
        esize = torch.empty(0, dtype=dtype).element_size()
        clients = [make_client(shapes, dtype, i) for i in range(k)]
        fns = case_methods(clients, client_weights(k))
        times = interleaved_medians(fns, CPU, repeats=settings["repeats"], warmup=1)
        by = {}
        for name in METHODS:
            t = times[name]
            gbps = (k + 1) * numel * esize / t / 1e9
            mem = memory.get(f"{case_key(section, dtype_name, k, numel)}/{name}")
            resolved = numel * esize >= MEMORY_RESOLUTION_BYTES
            by[name] = {"section": section, "dtype": dtype_name, "K": k, "P": numel,
                        "tensors": len(shapes), "method": name, "median_ms": t * 1e3,
                        "GBps": gbps, "pct_read_probe": 100 * gbps / probes["read_GBps"],
                        "pct_copy_probe": 100 * gbps / probes["copy_GBps"],
                        "extra_bytes": mem,
                        "extra_in_models": (None if mem is None or not resolved
                                            else mem / (numel * esize)),
                        "time_vs_fused": t / times["fused"]}
        rows += list(by.values())
        print_sweep_row(by)
        del clients, fns
        release_freed_memory()

    for r in child["stream"]:
        r["pct_read_probe"] = 100 * r["add_GBps"] / probes["read_GBps"]
        peak = "" if r["peak_in_models"] is None else f"{r['peak_in_models']:.2f} models"
        print(f"stream {r['dtype']:<10}K={r['K']:<5} P={r['P']:.0e}  "
              f"{r['add_ms_per_client']:.2f} ms/client  {r['add_GBps']:.1f} GB/s "
              f"({r['pct_read_probe']:.0f} % read)  result {r['result_ms']:.1f} ms  peak {peak} "
              f"(inputs at once: {r['inputs_at_once_GiB']:.2f} GiB)", flush=True)

    distributed = []
    if settings["worlds"]:
        release_freed_memory()
        sizes = settings["distributed_sizes"]
        for world in settings["worlds"]:
            for r in run_distributed(world, sizes, settings["repeats"], args.timeout):
                distributed.append(r)
                print(f"gloo {world} ranks P={r['P']:.0e} K={r['K']}: all_reduce_aggregate "
                      f"{r['all_reduce_aggregate_ms']:.2f} ms (all-reduce alone "
                      f"{r['all_reduce only_ms']:.2f}, local sum {r['local aggregate_ms']:.2f}); "
                      f"one process {r['one process_ms']:.2f} ms", flush=True)

    payload = {"environment": env, "probes": probes, "settings": settings, "rows": rows,
               "stream": child["stream"], "distributed": distributed,
               "elapsed_s": time.monotonic() - started,
               "command": "python bench/bench_cost_curve.py " + " ".join(argv)}
    path = write_results(results_name(args), CPU, payload, save=args.save, out=args.out)
    print(f"# {payload['elapsed_s']:.0f} s; wrote {path}\n")
    print(markdown(payload))
    return payload


def model_size(text: str) -> int:
    """--sizes: P as an integer or in exponent form (1e7); a weight and a bias need P >= 2."""
    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a size such as 1e7, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a weight and a bias), got {text}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true",
                        help="P up to 1e9, inputs up to 8 GiB, streaming up to P = 1e9: long")
    parser.add_argument("--tiny", action="store_true", help="small sizes: checks the script runs")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16",
                                                        "float64"])
    parser.add_argument("--sizes", nargs="+", type=model_size,
                        help="model sizes P of the sweep (e.g. 1e8); also filters the stream "
                             "and distributed sizes")
    parser.add_argument("--clients", nargs="+", type=at_least(1),
                        help="client counts K of the sweep; also filters lora and stream")
    parser.add_argument("--repeats", type=at_least(1),
                        help="interleaved rounds per case (default 5)")
    parser.add_argument("--max-input-gib", type=positive_number,
                        help="leave out cases whose K client models plus 5 models of working "
                             "memory exceed this many GiB")
    parser.add_argument("--worlds", nargs="*", type=at_least(1),
                        help="gloo process counts of the distributed section (default 2 4)")
    parser.add_argument("--sections", nargs="+",
                        choices=["sweep", "lora", "stream", "distributed"],
                        help="run only these sections")
    parser.add_argument("--threads", type=int,
                        help="torch threads of this process and of the measuring child (default: "
                             "torch's); on a machine shared with other work, 1 avoids waiting "
                             "for a descheduled second thread at every parallel call")
    parser.add_argument("--probe-bytes", type=at_least(MIN_PROBE_BYTES), default=GIB,
                        help="size of the bandwidth probes' buffers")
    parser.add_argument("--timeout", type=positive_number, default=3600,
                        help="bound in seconds on the child process and on each set of ranks")
    add_clock_argument(parser)
    add_output_arguments(parser)
    add_check_arguments(parser)
    parser.add_argument("--memory-out", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    check_output_arguments(args)
    use_cpu_clock(args.clock)
    if args.full and args.tiny:
        fail("--full and --tiny exclude each other")
    if args.check and not args.memory_out:
        require_committed(results_name(args), CPU)
    if args.tiny:
        args.probe_bytes = min(args.probe_bytes, 1 << 23)
    if args.threads is not None:
        if args.threads < 1:
            fail(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    settings = settings_for(args)
    if args.memory_out:
        exact_cpu_memory_accounting()
        with open(args.memory_out, "w") as f:
            json.dump(measure_in_child(args, settings), f)
        return
    payload = run(args, argv, settings)
    if args.check:
        sys.exit(check_against_committed(results_name(args), CPU, payload, ratios,
                                         args.tolerance, recheck=True))


if __name__ == "__main__":
    main()
