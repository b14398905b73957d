"""One Flower round's ``aggregate_train``: Flower's Message-API strategy against fedkernels'
drop-in of the same name (``fedkernels.integrations.flower``), on the replies of K clients.

Models (float32, as torch clients send them):

- ``resnet18``: the 62 parameter tensors of a ResNet-18 (11.69 M values, 46.8 MB);
- ``lora``: 256 adapter tensors of 64 Ki values each (16.8 M values, 67.1 MB).

K = 10 and 100. ``--distinct D`` (default 10) builds D distinct client models and reply k
carries the serialized bytes of client k mod D, so that K = 100 fits in memory on a small
machine. Repeated replies favour the fused op: it reads one tile of every reply before the
next tile, so a repeat within K is a cache hit, where Flower's reply-by-reply loop re-reads
the whole model. Rows record D; use ``--distinct 100`` (4.7 GB of replies for ResNet-18,
6.7 GB for LoRA) for an unbiased K = 100.

Time: the median of interleaved repeats (Flower, ours, Flower, ours, ...) in this process.
Peak memory: each (model, K, strategy, implementation) in a fresh child process, the peak
resident set of one ``aggregate_train`` call beyond what was resident before it (replies
built, one warm-up call done; glibc set to return freed memory, harness/memory.py). The
result's serialization into an ArrayRecord is part of both. Effective bandwidth: the minimum
traffic of the weighted mean, (K + 1) model sizes, over the time, and its ratio to a read
bandwidth probe (a large ``sum``) measured in the same run.

    python bench/bench_flower.py                 # all cases, writes bench/results/flower-<cpu>.json
    python bench/bench_flower.py --quick         # K = 10 only, 3 repeats
    python bench/bench_flower.py --quick --out /tmp/flower.json   # the committed file untouched
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import time

import numpy as np
import torch

from harness.cli import at_least, check_output_arguments
from harness.machine import device_name, environment
from harness.memory import exact_cpu_memory_accounting, memory_in_child, peak_extra_memory
from harness.model_shapes import resnet18_shapes
from harness.probes import bandwidth_probes
from harness.results import RESULTS_DIR

STRATEGIES = ("FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "QFedAvg")
FEDOPT = ("FedAdam", "FedYogi", "FedAdagrad")


MODELS = {
    "resnet18": resnet18_shapes(),
    "lora": [(16, 4096)] * 256,
}


def build_replies(model: str, k: int, num_distinct: int = 10, seed: int = 0):
    """The global model (ArrayRecord) and a function that returns K fresh reply Messages
    (fresh ArrayRecords over the same serialized bytes: QFedAvg empties the replies'
    records, as Flower's does, but no bytes are copied)."""
    from flwr.app import (
        Array,
        ArrayRecord,
        Message,
        MessageType,
        Metadata,
        MetricRecord,
        RecordDict,
    )

    rng = np.random.default_rng(seed)
    shapes = MODELS[model]
    names = [f"p{i}" for i in range(len(shapes))]
    global_arrays = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    distinct = []
    for _ in range(min(k, num_distinct)):
        distinct.append({n: Array(g + np.float32(0.01) * rng.standard_normal(g.shape,
                                                                          dtype=np.float32))
                         for n, g in zip(names, global_arrays)})
    global_record = ArrayRecord({n: Array(g) for n, g in zip(names, global_arrays)})
    del global_arrays
    sizes = rng.integers(10, 1000, size=k).astype(float)
    losses = rng.uniform(0.2, 2.0, size=k)

    def replies():
        out = []
        for c in range(k):
            metadata = Metadata(run_id=1, message_id="", src_node_id=c + 1, dst_node_id=0,
                                reply_to_message_id="m", group_id="", created_at=time.time(),
                                ttl=3600.0, message_type=MessageType.TRAIN)
            arrays = ArrayRecord(dict(distinct[c % len(distinct)]))
            metrics = MetricRecord({"num-examples": float(sizes[c]),
                                    "train_loss": float(losses[c])})
            out.append(Message(metadata=metadata,
                               content=RecordDict({"arrays": arrays, "metrics": metrics})))
        return out

    return global_record, replies


def make_strategy(impl: str, name: str, global_record):
    """A strategy ready to aggregate (its current arrays set as configure_train would)."""
    if impl == "flower":
        from flwr.serverapp import strategy as module
    else:
        from fedkernels.integrations import flower as module
    if name == "QFedAvg":
        strategy = module.QFedAvg(client_learning_rate=0.1)
    elif name == "FedAvgM":  # with server momentum: the server step runs (else it is FedAvg)
        strategy = module.FedAvgM(server_momentum=0.9)
    else:
        strategy = getattr(module, name)()
    if name in FEDOPT:
        strategy.current_arrays = {k: v.numpy() for k, v in global_record.items()}
    elif name in ("QFedAvg", "FedAvgM"):
        strategy.current_arrays = global_record.copy()
    return strategy


def one_round(strategy, name, global_record, replies):
    if name == "QFedAvg":  # configure_train's copy, which aggregate_train empties
        strategy.current_arrays = global_record.copy()
    return strategy.aggregate_train(1, replies())


def child_memory(model: str, k: int, name: str, impl: str, distinct: int) -> int:
    """Runs in a fresh process: peak extra resident memory of one aggregate_train call."""
    exact_cpu_memory_accounting()
    quiet_flower()
    global_record, replies = build_replies(model, k, distinct)
    strategy = make_strategy(impl, name, global_record)
    one_round(strategy, name, global_record, replies)  # warm-up (imports, first-use allocs)
    prepared = replies()
    peak = peak_extra_memory(lambda: strategy.aggregate_train(1, prepared)
                             if name != "QFedAvg" else
                             _qfedavg_call(strategy, global_record, prepared),
                             torch.device("cpu"))
    return -1 if peak is None else int(peak)


def _qfedavg_call(strategy, global_record, prepared):
    strategy.current_arrays = global_record.copy()
    return strategy.aggregate_train(1, prepared)


def measure_memory(model: str, k: int, name: str, impl: str, distinct: int) -> int:
    return memory_in_child(__file__, model, k, name, impl, distinct, timeout=1800)


def measure_time(model: str, k: int, name: str, repeats: int, distinct: int
                 ) -> dict[str, float]:
    global_record, replies = build_replies(model, k, distinct)
    strategies = {impl: make_strategy(impl, name, global_record)
                  for impl in ("flower", "fedkernels")}
    times = {impl: [] for impl in strategies}
    for s in strategies.values():  # warm-up
        one_round(s, name, global_record, replies)
    for _ in range(repeats):
        for impl, s in strategies.items():  # interleaved
            prepared = replies()
            if name == "QFedAvg":
                s.current_arrays = global_record.copy()
            t0 = time.perf_counter()
            s.aggregate_train(1, prepared)
            times[impl].append(time.perf_counter() - t0)
            del prepared
    return {impl: statistics.median(v) for impl, v in times.items()}


def quiet_flower() -> None:
    """Flower's per-round INFO lines off (set after importing flwr, which sets its level)."""
    import flwr.common.logger  # noqa: F401

    logging.getLogger("flwr").setLevel(logging.WARNING)


def model_bytes(model: str) -> int:
    return 4 * sum(int(np.prod(s)) for s in MODELS[model])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="K = 10 only, 3 repeats")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--cases", default="resnet18:10,lora:10,resnet18:100,lora:100",
                        help="model:K pairs; rows of other cases already in the results "
                             "file are kept")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--distinct", type=int, default=10,
                        help="distinct client models the K replies cycle through")
    parser.add_argument("--no-memory", action="store_true")
    # without it a run merges into the committed results of this CPU
    parser.add_argument("--out", metavar="FILE",
                        help="results JSON to write, merging the rows of other cases already "
                             "in it (default bench/results/flower-<device>.json, committed)")
    parser.add_argument("--child-memory", nargs=5, help=argparse.SUPPRESS,
                        metavar=("MODEL", "K", "STRATEGY", "IMPL", "DISTINCT"))
    args = parser.parse_args()
    if args.child_memory:
        model, k, name, impl, distinct = args.child_memory
        print(child_memory(model, int(k), name, impl, int(distinct)))
        return
    if args.distinct < 1:
        parser.error("--distinct: expected a positive number of client models")
    check_output_arguments(args)
    quiet_flower()
    import flwr

    names = [s for s in args.strategies.split(",") if s]
    for s in names:
        if s not in STRATEGIES:
            parser.error(f"--strategies: unknown strategy {s!r}; choose from {STRATEGIES}")
    repeats = 3 if args.quick else args.repeats
    try:
        cases = [(m, int(k)) for m, k in (c.split(":") for c in args.cases.split(",") if c)]
    except ValueError:
        parser.error(f"--cases: expected model:K pairs, got {args.cases!r}")
    for model, k in cases:
        if model not in MODELS or k < 1:
            parser.error(f"--cases: unknown model {model!r} or K {k} (models: {list(MODELS)})")
    if args.quick:
        cases = [(m, k) for m, k in cases if k <= 10]
    device = torch.device("cpu")
    probe = bandwidth_probes(device)
    load_at_start = os.getloadavg()
    rows = []
    for model, k in cases:
        for name in names:
            distinct = min(k, args.distinct)
            t = measure_time(model, k, name, repeats, distinct)
            row = {"model": model, "tensors": len(MODELS[model]),
                   "params": model_bytes(model) // 4, "K": k,
                   "distinct_clients": distinct, "strategy": name,
                   "flower_s": t["flower"], "fedkernels_s": t["fedkernels"],
                   "speedup": t["flower"] / t["fedkernels"]}
            traffic = (k + 1) * model_bytes(model)
            row["fedkernels_GBps"] = traffic / t["fedkernels"] / 1e9
            row["fedkernels_read_probe_fraction"] = row["fedkernels_GBps"] / probe["read_GBps"]
            if not args.no_memory:
                for impl in ("flower", "fedkernels"):
                    row[f"{impl}_peak_MB"] = measure_memory(model, k, name, impl,
                                                            distinct) / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = environment(device)
    env.update({"flwr": flwr.__version__, "numpy": np.__version__,
                "python": platform.python_version(), "cpu_count": os.cpu_count(),
                "repeats": repeats, "probe": probe,
                "load_average": {"start": [round(x, 2) for x in load_at_start],
                                 "end": [round(x, 2) for x in os.getloadavg()]},
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds")})
    path = args.out or os.path.join(RESULTS_DIR, f"flower-{device_name(device)}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Rows of other (model, K, strategy) cases measured by an earlier run are kept, each
    # with the environment of its own run.
    for row in rows:
        row["environment"] = env
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        def case(r):
            return r["model"], r["K"], r["distinct_clients"], r["strategy"]

        done = {case(r) for r in rows}
        kept = [r for r in old.get("rows", []) if case(r) not in done]
    order = {m: i for i, m in enumerate(MODELS)}
    rows = sorted(kept + rows, key=lambda r: (r["K"], order[r["model"]], r["distinct_clients"],
                                              STRATEGIES.index(r["strategy"])))
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
        f.write("\n")
    print(f"\nwritten {path}\n")
    print(markdown_table(rows, env))


def markdown_table(rows: list[dict], env: dict) -> str:
    lines = [
        f"{env['device']}, {env['threads']} threads, torch {env['torch']}, flwr {env['flwr']}, "
        f"numpy {env['numpy']}, {env['date'][:10]}; read probe "
        f"{env['probe']['read_GBps']:.1f} GB/s; median of {env['repeats']} interleaved "
        "repeats",
        "",
        "| model | K | strategy | Flower | fedkernels | speed-up | Flower peak | fedkernels "
        "peak | fedkernels GB/s (% of read probe) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        model = f"{r['model']} ({r['tensors']} tensors, {r['params'] / 1e6:.1f} M)"
        k = f"{r['K']}" + (f" ({r['distinct_clients']} distinct)"
                           if r["distinct_clients"] < r["K"] else "")
        mem = [f"{r[f'{i}_peak_MB']:.0f} MB" if f"{i}_peak_MB" in r else "-"
               for i in ("flower", "fedkernels")]
        lines.append(
            f"| {model} | {k} | {r['strategy']} | {r['flower_s'] * 1e3:.0f} ms | "
            f"{r['fedkernels_s'] * 1e3:.0f} ms | {r['speedup']:.1f}x | {mem[0]} | {mem[1]} | "
            f"{r['fedkernels_GBps']:.1f} ({100 * r['fedkernels_read_probe_fraction']:.0f}%) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
