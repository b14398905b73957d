"""One Flower round of each robust or private rule: Flower's Message-API class, fedkernels'
drop-in (``fedkernels.integrations.flower.robust``, ``.central_dp``) and a PyTorch
``torch.stack`` version of the same rule, on the replies of K clients with the ResNet-18 shape
(62 float32 tensors, 11.69 M values, 46.8 MB).

Rules: FedMedian, FedTrimmedAvg (β = 0.2), Krum, MultiKrum (3 selected) and Bulyan with f = 2
malicious clients (f = 1 at K = 10, where Bulyan's K ≥ 4f + 3 allows no more), and the
server-side DP wrappers around FedAvg (fixed clipping: C = 1, σ = 1; adaptive: σ = 0.5, initial
C = 1, Flower's other defaults). Two of the K clients are far off (the Byzantine ones).

The ``torch.stack`` version is what a user would write with PyTorch: per tensor (or, for the
distances, the whole flattened model) stack the K replies' views into a ``[K, ...]`` tensor and
sort / reduce along dimension 0 (DP: stack the updates, one norm per row, clip, weighted sum,
``torch.randn`` noise). It reads the replies through the same zero-copy views as fedkernels
and returns the same ArrayRecord.

Time: median of interleaved repeats (Flower, fedkernels, stack, Flower, ...), fresh reply
Messages for every call (the rules empty the replies' records, as Flower's do). Peak memory:
each (K, rule, implementation) in a fresh child process, the peak resident set of one call
beyond what was resident before it (replies built; one warm-up call on a small model done
first, so imports and first-use allocations are not counted; harness/memory.py).

    python bench/bench_robust.py                  # K = 10 and 50, writes bench/results/robust-<cpu>.json
    python bench/bench_robust.py --cases 10 --repeats 3 --rules FedMedian,Krum
    python bench/bench_robust.py --cases 10 --out /tmp/robust.json   # the committed file untouched
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

RULES = ("FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan", "DPFixed", "DPAdaptive")
IMPLS = ("flower", "fedkernels", "stack")
BETA = 0.2


SHAPES = resnet18_shapes()


def malicious(k: int) -> int:
    """f for Krum, Multi-Krum and Bulyan: 2, or the most Bulyan allows (K >= 4f + 3)."""
    return min(2, (k - 3) // 4)


def build_replies(k: int, seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES):
    """The global model (ArrayRecord) and a function returning K fresh reply Messages over
    the same serialized bytes (K distinct client models; two of them far off)."""
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
    names = [f"p{i}" for i in range(len(shapes))]
    global_arrays = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    clients = []
    for c in range(k):
        scale = np.float32(1.0 if c < 2 else 0.01)
        clients.append({n: Array(g + scale * rng.standard_normal(g.shape, dtype=np.float32))
                        for n, g in zip(names, global_arrays)})
    global_record = ArrayRecord({n: Array(g) for n, g in zip(names, global_arrays)})
    del global_arrays
    sizes = rng.integers(10, 1000, size=k).astype(float)

    def replies():
        out = []
        for c in range(k):
            metadata = Metadata(run_id=1, message_id="", src_node_id=c + 1, dst_node_id=0,
                                reply_to_message_id="m", group_id="", created_at=time.time(),
                                ttl=3600.0, message_type=MessageType.TRAIN)
            out.append(Message(metadata=metadata, content=RecordDict({
                "arrays": ArrayRecord(dict(clients[c])),
                "metrics": MetricRecord({"num-examples": float(sizes[c])})})))
        return out

    return global_record, replies


# ---------------------------------------------------------------- the torch.stack versions


class StackRule:
    """A rule written with ``torch.stack`` over the replies' zero-copy views."""

    def __init__(self, rule: str, k: int, global_record):
        self.rule, self.k, self.f = rule, k, malicious(k)
        self.global_record = global_record
        self.clip = 1.0

    def __call__(self, server_round, replies):
        from flwr.app import ArrayRecord

        from fedkernels.integrations.flower import array_to_tensor, ndarray_to_array

        records = [m.content["arrays"] for m in replies]
        names = list(records[0].keys())
        weights = torch.tensor([m.content["metrics"]["num-examples"] for m in replies],
                               dtype=torch.float64)
        cols = [[array_to_tensor(r[n]) for r in records] for n in names]
        if self.rule == "FedMedian":
            result = [self._median(torch.stack(c)) for c in cols]
        elif self.rule == "FedTrimmedAvg":
            cut = int(BETA * self.k)
            result = [torch.stack(c).sort(dim=0).values[cut:self.k - cut].mean(dim=0)
                      for c in cols]
        elif self.rule in ("Krum", "MultiKrum", "Bulyan"):
            result = self._krum_family(cols, weights)
        else:
            result = self._private(cols, weights)
        return ArrayRecord({n: ndarray_to_array(t.numpy()) for n, t in zip(names, result)}), None

    @staticmethod
    def _median(stack):
        s = stack.sort(dim=0).values
        k = s.shape[0]
        return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2

    def _krum_family(self, cols, weights):
        k, f = self.k, self.f
        flat = torch.stack([torch.cat([c[j].reshape(-1) for c in cols]) for j in range(k)])
        gram = (flat @ flat.T).double()
        del flat
        sq = gram.diagonal()
        dist = sq[:, None] + sq[None, :] - 2 * gram
        closest = max(1, k - f - 2)
        scores = dist.sort(dim=1).values[:, 1:closest + 1].sum(dim=1)
        m = {"Krum": 1, "MultiKrum": 3, "Bulyan": k - 2 * f}[self.rule]
        chosen = scores.argsort()[:m].tolist()
        if self.rule != "Bulyan":
            w = weights[chosen] / weights[chosen].sum()
            return [sum(float(w[i]) * c[j] for i, j in enumerate(chosen)) for c in cols]
        beta = m - 2 * f
        out = []
        for c in cols:
            stack = torch.stack([c[j] for j in chosen])
            med = self._median(stack)
            nearest = (stack - med).abs().argsort(dim=0)[:beta]
            out.append(stack.gather(0, nearest).mean(dim=0))
        return out

    def _private(self, cols, weights):
        from fedkernels.integrations.flower import array_to_tensor

        base = [array_to_tensor(v) for v in self.global_record.values()]
        updates = [torch.stack(c) - b for c, b in zip(cols, base)]
        norms = torch.stack([u.reshape(self.k, -1).double().pow(2).sum(dim=1)
                             for u in updates]).sum(dim=0).sqrt()
        factors = (self.clip / norms).clamp(max=1.0)
        w = weights / weights.sum() * factors
        std = (1.0 if self.rule == "DPFixed" else 0.5) * self.clip / self.k
        shape = [self.k] + [1] * 8
        return [b + (u * w.to(u.dtype).reshape(shape[:u.dim()])).sum(dim=0)
                + std * torch.randn(b.shape) for u, b in zip(updates, base)]


# ---------------------------------------------------------------- strategies


def make_rule(impl: str, rule: str, k: int, global_record):
    """A callable (server_round, replies) for one implementation of one rule."""
    if impl == "stack":
        return StackRule(rule, k, global_record)
    if impl == "flower":
        from flwr.serverapp import strategy as module
        dp_module, inner = module, module.FedAvg
    else:
        from fedkernels.integrations import flower as fk_flower
        from fedkernels.integrations.flower import central_dp as dp_module
        from fedkernels.integrations.flower import robust as module
        inner = fk_flower.FedAvg
    f = malicious(k)
    if rule == "FedMedian":
        s = module.FedMedian()
    elif rule == "FedTrimmedAvg":
        s = module.FedTrimmedAvg(beta=BETA)
    elif rule == "Krum":
        s = module.Krum(num_malicious_nodes=f)
    elif rule == "MultiKrum":
        s = module.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=3)
    elif rule == "Bulyan":
        s = module.Bulyan(num_malicious_nodes=f)
    elif rule == "DPFixed":
        s = dp_module.DifferentialPrivacyServerSideFixedClipping(inner(), 1.0, 1.0, k)
    else:
        s = dp_module.DifferentialPrivacyServerSideAdaptiveClipping(inner(), 0.5, k,
                                                                    initial_clipping_norm=1.0)
    if rule.startswith("DP"):
        def call(server_round, replies):
            s.current_arrays = global_record
            if rule == "DPAdaptive":
                s.clipping_norm = 1.0  # the same work every call
            return s.aggregate_train(server_round, replies)
        return call
    return s.aggregate_train


def child_memory(k: int, rule: str, impl: str) -> int:
    """Runs in a fresh process: peak extra resident memory of one call."""
    exact_cpu_memory_accounting()
    quiet_flower()
    small_record, small_replies = build_replies(k, shapes=[(8, 8), (8,)])
    make_rule(impl, rule, k, small_record)(1, small_replies())  # warm-up: imports, first use
    del small_record, small_replies
    global_record, replies = build_replies(k)
    fn = make_rule(impl, rule, k, global_record)
    prepared = replies()
    peak = peak_extra_memory(lambda: fn(1, prepared), torch.device("cpu"))
    return -1 if peak is None else int(peak)


def measure_memory(k: int, rule: str, impl: str) -> int:
    return memory_in_child(__file__, k, rule, impl, timeout=3600)


def measure_time(k: int, rule: str, repeats: int, global_record, replies) -> dict[str, float]:
    fns = {impl: make_rule(impl, rule, k, global_record) for impl in IMPLS}
    times: dict[str, list[float]] = {impl: [] for impl in fns}
    for fn in fns.values():  # warm-up
        fn(1, replies())
    for _ in range(repeats):
        for impl, fn in fns.items():  # interleaved
            prepared = replies()
            t0 = time.perf_counter()
            fn(1, prepared)
            times[impl].append(time.perf_counter() - t0)
            del prepared
    return {impl: statistics.median(v) for impl, v in times.items()}


def quiet_flower() -> None:
    """Flower's per-round INFO lines off (set after importing flwr, which sets its level)."""
    import flwr.common.logger  # noqa: F401

    logging.getLogger("flwr").setLevel(logging.WARNING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="10,50", help="values of K")
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure only peak memory and add it to the rows already in the "
                             "results file")
    # without it a run merges into the committed results of this CPU
    parser.add_argument("--out", metavar="FILE",
                        help="results JSON to write, merging the rows of other cases already "
                             "in it (default bench/results/robust-<device>.json, committed)")
    parser.add_argument("--child-memory", nargs=3, metavar=("K", "RULE", "IMPL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        k, rule, impl = args.child_memory
        print(child_memory(int(k), rule, impl))
        return
    quiet_flower()
    import flwr

    rules = [r for r in args.rules.split(",") if r]
    for r in rules:
        if r not in RULES:
            parser.error(f"--rules: unknown rule {r!r}; choose from {RULES}")
    try:
        cases = [int(k) for k in args.cases.split(",") if k]
    except ValueError:
        parser.error(f"--cases: expected values of K, got {args.cases!r}")
    if any(k < 3 for k in cases):
        parser.error("--cases: K must be >= 3 (Bulyan needs 4f + 3 replies)")
    check_output_arguments(args)
    device = torch.device("cpu")
    path = args.out or os.path.join(RESULTS_DIR, f"robust-{device_name(device)}.json")
    if args.memory_only:
        if not os.path.exists(path):
            parser.error(f"--memory-only adds to the rows of {path}, which does not exist")
        add_memory(path, cases, rules)
        return
    probe = bandwidth_probes(device)
    model_mb = 4 * sum(int(np.prod(s)) for s in SHAPES) / 1e6
    env = environment(device)
    env.update({"flwr": flwr.__version__, "numpy": np.__version__,
                "python": platform.python_version(), "cpu_count": os.cpu_count(),
                "repeats": args.repeats, "probe": probe, "model_MB": model_mb,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds")})
    rows: list[dict] = []
    for k in cases:
        global_record, replies = build_replies(k)
        for rule in rules:
            t = measure_time(k, rule, args.repeats, global_record, replies)
            row = {"K": k, "rule": rule, "f": malicious(k), "tensors": len(SHAPES),
                   "params": int(sum(np.prod(s) for s in SHAPES)),
                   **{f"{impl}_s": t[impl] for impl in IMPLS},
                   "speedup_vs_flower": t["flower"] / t["fedkernels"],
                   "speedup_vs_stack": t["stack"] / t["fedkernels"], "environment": env}
            if not args.no_memory:
                for impl in IMPLS:
                    row[f"{impl}_peak_MB"] = measure_memory(k, rule, impl) / 1e6
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "environment"}),
                  flush=True)
            merged = save(path, rows, env)  # after every row: a partial run keeps its rows
        del global_record, replies
    print(f"\nwritten {path}\n")
    print(markdown_table(merged, env))


def save(path: str, rows: list[dict], env: dict) -> list[dict]:
    """Writes ``rows`` into ``path``, keeping the rows of other (K, rule) cases measured by
    an earlier run (each with the environment of its own run); returns all rows."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        done = {(r["K"], r["rule"]) for r in rows}
        kept = [r for r in old.get("rows", []) if (r["K"], r["rule"]) not in done]
    merged = sorted(kept + rows, key=lambda r: (r["K"], RULES.index(r["rule"])))
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": merged}, f, indent=1)
        f.write("\n")
    return merged


def add_memory(path: str, cases: list[int], rules: list[str]) -> None:
    """Peak memory of the (K, rule) rows already timed in ``path``, written back into them."""
    with open(path) as f:
        results = json.load(f)
    for row in results["rows"]:
        if row["K"] in cases and row["rule"] in rules:
            for impl in IMPLS:
                row[f"{impl}_peak_MB"] = measure_memory(row["K"], row["rule"], impl) / 1e6
            print(json.dumps({k: v for k, v in row.items() if k != "environment"}), flush=True)
            with open(path, "w") as f:  # after every row: a partial run keeps what it measured
                json.dump(results, f, indent=1)
                f.write("\n")
    print(markdown_table(results["rows"], results["environment"]))


def markdown_table(rows: list[dict], env: dict) -> str:
    lines = [
        f"{env['device']}, {env['threads']} threads, torch {env['torch']}, flwr {env['flwr']}, "
        f"numpy {env['numpy']}, {env['date'][:10]}; ResNet-18 shape (62 tensors, 11.7 M "
        "float32); times are medians of the row's interleaved repeats",
        "",
        "| K | rule | repeats | Flower | fedkernels | torch.stack | vs Flower | vs stack "
        "| Flower peak | fedkernels peak | stack peak |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem = [f"{r[f'{i}_peak_MB']:.0f} MB" if f"{i}_peak_MB" in r else "-" for i in IMPLS]
        repeats = r.get("environment", env)["repeats"]
        lines.append(
            f"| {r['K']} | {r['rule']} | {repeats} | {r['flower_s']:.2f} s | "
            f"{r['fedkernels_s']:.2f} s | "
            f"{r['stack_s']:.2f} s | {r['speedup_vs_flower']:.2f}x | "
            f"{r['speedup_vs_stack']:.2f}x | {mem[0]} | {mem[1]} | {mem[2]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
