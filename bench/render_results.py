"""Write the benchmark tables of docs/results/ from the committed bench/results/*.json.

A page holds each generated table between two marker comments:

    <!-- generated: aggregate/intel-xeon-avx512 -->
    ... (written by this script; edits here are overwritten) ...
    <!-- end generated -->

The name after ``generated:`` is a key of BLOCKS below. Every block starts with a line that
names the machine, the date and the results file it comes from, so a number on a page can be
traced to one JSON key, and a rerun benchmark changes the page only through this script.

    python bench/render_results.py            # rewrite the blocks in README.md, docs/results/*.md
    python bench/render_results.py --check    # exit 1 if a page differs from its JSON

Exit status: 0 when the pages are up to date (or were rewritten), 1 when ``--check`` finds a
page out of date, 2 for a marker that names no block, a block that no page holds, an unclosed
marker or a missing results file. The script reads JSON only and imports nothing from the
package, so it runs without a build.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"<!-- generated: ([\w./+-]+) -->\n")
END = "<!-- end generated -->"


class RenderError(Exception):
    """A page or a results file is not what the blocks expect."""


# ---------------------------------------------------------------- number formats


def sig(x: float | None, digits: int = 3) -> str:
    """`digits` significant figures; thousands separated; no exponent."""
    if x is None:
        return "—"
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{x:,.{decimals}f}"


def ratio(x: float | None) -> str:
    """A speed-up or a time ratio: two decimals below 10, one above."""
    if x is None:
        return "—"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def pct(fraction: float | None) -> str:
    return "—" if fraction is None else f"{100 * fraction:.0f}"


def size(p: int) -> str:
    """10000 -> 1e4; other numbers as they are."""
    exponent = round(math.log10(p)) if p > 0 else 0
    return f"1e{exponent}" if p == 10**exponent else f"{p:,}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- sources


def load(root: Path, name: str) -> dict:
    path = root / "bench" / "results" / name
    if not path.is_file():
        raise RenderError(f"missing results file bench/results/{name}")
    return json.loads(path.read_text())


def section(root: Path, name: str, key: str | None) -> dict:
    data = load(root, name)
    if key is None:
        return data
    if key not in data:
        raise RenderError(f"bench/results/{name} has no key {key!r}")
    return data[key]


def source_line(name: str, key: str | None, env: dict, probes: dict | None = None) -> str:
    """The machine, clock, date and probes of one run, and where its numbers are."""
    build = env.get("fedkernels_cpu_build")
    threads = env.get("threads")
    parts = [f"`{env.get('device', '?')}`"]
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    if build:
        parts.append(f"{build} CPU build")
    parts.append(f"torch {env.get('torch', '?')}")
    if threads is not None:
        parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    if env.get("cpu_clock") == "process":
        parts.append("process CPU time")
    date = str(env.get("date", ""))[:10]
    if date:
        parts.append(date)
    text = ", ".join(parts)
    if probes:
        text += (f"; read probe {probes['read_GBps']:.1f} GB/s, "
                 f"copy probe {probes['copy_GBps']:.1f} GB/s")
    where = f"`bench/results/{name}`" + (f", key `{key}`" if key else "")
    return f"*{text}. Source: {where}.*"


# ---------------------------------------------------------------- weighted sum


def _methods_by_case(run: dict) -> dict[tuple, dict[str, dict]]:
    """{(model, dtype, K): {method: row}} of a bench_aggregate run."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in run["rows"]:
        by_case.setdefault((row["model"], row["dtype"], row["K"]), {})[row["method"]] = row
    return by_case


def aggregate_block(root: Path, name: str, key: str = "aggregate") -> str:
    """bench_aggregate.py: every model, dtype and K, the fused call against the alternatives."""
    run = section(root, name, key)
    by_case = _methods_by_case(run)
    rows = []
    for (model, dtype, k), methods in by_case.items():
        fused, out = methods["fused"], methods.get("fused out=", {})
        rows.append([
            model, dtype, str(k), sig(fused["median_ms"]), sig(out.get("median_ms")),
            sig(out.get("GBps")), sig(out.get("pct_read_probe"), 2) if out else "—",
            f"{fused['extra_in_outputs']:.2f}",
            *(ratio(methods[m]["time_vs_fused"]) if m in methods else "—"
              for m in ("loop", "foreach", "stack", "flat mv", "reference")),
        ])
    header = ["model", "dtype", "K", "fused ms", "out= ms", "out= GB/s", "out= % read probe",
              "extra memory (outputs)", "loop ×", "foreach ×", "stack ×", "flat mv ×",
              "reference ×"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def allocation_block(root: Path, name: str, key: str = "aggregate") -> str:
    """bench_aggregate.py's allocating calls (the output pool, torch's allocator, huge pages)
    and `_foreach`, each as a multiple of the in-place call's time in the same run."""
    run = section(root, name, key)
    rows = []
    for (model, dtype, k), methods in _methods_by_case(run).items():
        inplace = methods["fused out="]
        cells = []
        for m in ("fused", "no pool", "huge pages", "foreach"):
            t = methods[m]["median_ms"] if m in methods else None
            cells += [sig(t), ratio(None if t is None else t / inplace["median_ms"])]
        faults = [methods[m].get("minor_faults_per_call") if m in methods else None
                  for m in ("fused", "no pool")]
        rows.append([model, dtype, str(k), sig(inplace["median_ms"]), *cells,
                     f"{inplace['pct_read_probe']:.0f}",
                     *("—" if f is None else f"{f:,.0f}" for f in faults)])
    header = ["model", "dtype", "K", "in place (`out=`) ms", "allocating, pool ms", "÷ in place",
              "allocating, no pool ms", "÷ in place", "huge pages ms", "÷ in place",
              "`_foreach` ms", "÷ in place", "in place % read probe", "page faults per call, pool",
              "page faults per call, no pool"]
    env = run["environment"]
    load_average = env.get("load_average")
    text = source_line(name, key, env, run["probes"])
    if load_average:
        text += (f" Load average (1, 5, 15 min) {', '.join(map(str, load_average['start']))} "
                 f"at the start, {', '.join(map(str, load_average['end']))} at the end.")
    return text + "\n\n" + table(header, rows)


def cost_curve_block(root: Path, name: str, key: str = "cost_curve") -> str:
    """bench_cost_curve.py's sweep over K and P: time split into the op and the Python layer."""
    run = section(root, name, key)
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in run["rows"]:
        case = (row["section"], row["dtype"], row["K"], row["P"], row["tensors"])
        by_case.setdefault(case, {})[row["method"]] = row
    rows = []
    for (part, dtype, k, p, tensors), methods in by_case.items():
        fused = methods["fused"]["median_ms"] * 1e3
        op_only = methods["op only"]["median_ms"] * 1e3 if "op only" in methods else None
        # At 1e7 values and more the difference is inside the run-to-run noise of the op.
        layer = (fused - op_only if op_only is not None and op_only < fused and p < 10**7
                 else None)
        out = methods.get("fused out=")
        shape = f"LoRA {tensors} tensors, {size(p)}" if part == "lora" else size(p)
        rows.append([
            dtype, str(k), shape, sig(fused), sig(op_only), sig(layer, 2),
            *(ratio(methods[m]["time_vs_fused"]) if m in methods else "—"
              for m in ("loop", "foreach")),
            f"{out['pct_read_probe']:.0f}" if out else "—",
        ])
    header = ["dtype", "K", "P", "fused µs", "op only µs", "Python layer µs", "loop ×",
              "foreach ×", "out= % read probe"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def stream_block(root: Path, name: str, key: str = "cost_curve") -> str:
    """The streaming Accumulator: time per client and peak memory, whatever K."""
    run = section(root, name, key)
    rows = [[r["dtype"], str(r["K"]), size(r["P"]), sig(r["add_ms_per_client"]),
             f"{r['pct_read_probe']:.0f}", f"{r['peak_in_models']:.2f}",
             f"{r['inputs_at_once_GiB']:.2f} GiB"] for r in run["stream"]]
    header = ["dtype", "K", "P", "ms per client", "add % read probe", "peak extra (models)",
              "all clients at once would need"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def distributed_block(root: Path, name: str, key: str = "cost_curve") -> str:
    """all_reduce_aggregate on gloo processes of one machine against one process."""
    run = section(root, name, key)
    rows = [[str(r["world"]), str(r["K"]), size(r["P"]), sig(r["one process_ms"]),
             sig(r["all_reduce_aggregate_ms"]), sig(r["all_reduce only_ms"]),
             sig(r["local aggregate_ms"])] for r in run["distributed"]]
    header = ["gloo processes", "K", "P", "one process ms", "`all_reduce_aggregate` ms",
              "its all-reduce ms", "its local sum ms"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def vmap_block(root: Path, name: str, key: str = "vmap") -> str:
    run = section(root, name, key)
    rows = [[case, str(r["clients"]), sig(r["sequential_s"] * 1e3), sig(r["vmap_s"] * 1e3),
             ratio(r["speedup"]), f"{r['max_abs_diff']:.1e}"] for case, r in run["rows"].items()]
    header = ["local training", "clients", "sequential ms", "vmap ms", "speed-up",
              "max abs difference"]
    return source_line(name, key, run["environment"]) + "\n\n" + table(header, rows)


def personalized_eval_block(root: Path, name: str, key: str = "personalized_eval") -> str:
    """bench_personalized_eval.py: every client's own model, one at a time against batched."""
    run = section(root, name, key)
    rows = [[model, f"{r['clients']:,}", f"{r['test_rows']:,}", sig(r["sequential_s"] * 1e3),
             sig(r["batched_s"] * 1e3), ratio(r["speedup"]), f"{r['max_abs_diff']:.1e}"]
            for model, r in run["rows"].items()]
    header = ["model", "clients", "test rows", "one at a time ms", "batched ms", "speed-up",
              "max abs difference"]
    return source_line(name, key, run["environment"]) + "\n\n" + table(header, rows)


SIMULATION_METHODS = {"sequential": "fedkernels run", "vmap": "fedkernels run --vmap",
                      "flower": "Flower (Ray)", "pfl": "pfl-research", "plain": "plain PyTorch loop"}


def simulation_block(root: Path, name: str) -> str:
    """bench_simulation.py: the same FL task by fedkernels' simulator and its peers."""
    data = load(root, name)
    env, task = data["environment"], data["task"]
    rows, reasons = [], {}
    for r in data["rows"]:
        base = r["methods"].get("sequential", {})
        for method, label in SIMULATION_METHODS.items():
            m = r["methods"].get(method)
            if m is None:
                continue
            cell = [r["model"], str(r["per_round"]), str(r["epochs"]), label]
            if "round_s" not in m:
                reasons[label] = m.get("skipped") or m.get("error", "?")
                rows.append(cell + ["did not run"] + ["—"] * 8)
                continue
            cpu, base_cpu = m.get("round_cpu_s"), base.get("round_cpu_s")
            rows.append(cell + [
                sig(cpu * 1e3) if cpu else "—",
                ratio(base_cpu / cpu) if cpu and base_cpu else "—",
                sig(m["round_s"] * 1e3), ratio(m.get("speedup_vs_sequential")),
                sig(m["updates_per_s"]), sig(m["peak_rss_MB"]), f"{m['accuracy']:.3f}",
                sig(m["end_to_end_s"]), str(m["repeats"])])
    header = ["model", "K", "epochs", "method", "CPU ms per round", "speed-up (CPU)",
              "wall ms per round", "speed-up (wall)", "updates/s (wall)", "peak MB", "accuracy",
              "end-to-end s", "repeats"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    loads = [env["load_average_before"][0], env["load_average_after"][0]]
    loads += [x for r in data["rows"] for x in r.get("load_average", [])]
    line = (f"*{env['cpu_count']} CPUs (1-minute load average "
            f"{min(loads):.1f} to {max(loads):.1f} at the cells' starts and ends), "
            f"{env['threads']} thread{'s' if env['threads'] != 1 else ''} a run, "
            f"{versions}, {env['date'][:10]}; {task['rounds']} rounds, medians of "
            f"interleaved repeats; speed-ups are over `fedkernels run` in the same cell. "
            f"Source: `bench/results/{name}`.*")
    notes = "".join(f"\n\n{label} did not run: {why}" for label, why in reasons.items())
    return line + "\n\n" + table(header, rows) + notes


# ---------------------------------------------------------------- distillation and FedEvg


def pseudo_labels_block(root: Path, name: str, key: str = "ensemble_pseudo_labels") -> str:
    """bench_distill.py; where the run has them, the entropy weighting's time over FedGO's and
    that of the softmax statistics alone (energy_from_logits over the same rows)."""
    run = section(root, name, key)
    optional = [(k, label) for k, label in (
        ("back_to_back_fraction_of_read_probe", "back to back % read probe"),
        ("entropy_over_fedgo_median_of_ratios", "entropy ÷ FedGO time"),
        ("softmax_stats_over_fedgo_median_of_ratios", "exps alone ÷ FedGO time"),
    ) if any(k in r for r in run["rows"])]
    rows = []
    for r in run["rows"]:
        row = [str(r["K"]), str(r["N"]), str(r["C"]), r["weighting"], sig(r["fused_ms"]),
               sig(r["torch_ms"]), ratio(r["speedup_median_of_ratios"]),
               pct(r["fused_fraction_of_read_probe"])]
        for k, _ in optional:
            value = r.get(k)
            row.append(pct(value) if k.endswith("read_probe") else ratio(value))
        rows.append(row)
    header = ["K", "N", "C", "weighting", "fused ms", "PyTorch ms", "speed-up",
              "fused % read probe"] + [label for _, label in optional]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def distill_kl_block(root: Path, name: str, key: str = "distill_kl") -> str:
    run = section(root, name, key)
    rows = [[str(r["N"]), str(r["C"]), r["mode"], sig(r["fused_us"]), sig(r["torch_us"]),
             ratio(r["speedup_median_of_ratios"]), pct(r["fused_fraction_of_read_probe"])]
            for r in run["rows"]]
    header = ["N", "C", "mode", "fused µs", "PyTorch µs", "speed-up", "fused % read probe"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def energy_block(root: Path, name: str, key: str = "energy_from_logits") -> str:
    run = section(root, name, key)
    rows = [[str(r["N"]), str(r["C"]), sig(r["fused_us"]), sig(r["torch_us"]),
             ratio(r["speedup_median_of_ratios"]), pct(r["fused_fraction_of_read_probe"])]
            for r in run["rows"]]
    header = ["N", "C", "fused µs", "`-logsumexp` µs", "speed-up", "fused % read probe"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def sgld_block(root: Path, name: str, key: str = "sgld_compose_step") -> str:
    """bench_sgld.py; on a CPU also the page faults an out-of-place call takes on its fresh
    output, interleaved with the composition and back to back (they explain the dips)."""
    run = section(root, name, key)
    faults = not run["environment"].get("cuda") and all(
        "fused_faults_per_call" in r for r in run["rows"])
    rows = []
    for r in run["rows"]:
        row = [str(r["K"]), str(r["M"]), str(r["D"]), sig(r["fused_ms"]),
               sig(r["fused_inplace_ms"]), sig(r["fused_back_to_back_ms"]), sig(r["torch_ms"]),
               ratio(r["speedup_median_of_ratios"]), pct(r["fused_fraction_of_read_probe"]),
               pct(r["inplace_fraction_of_read_probe"]),
               pct(r["back_to_back_fraction_of_read_probe"])]
        if faults:
            row.append(f"{r['fused_faults_per_call']:,.0f} / "
                       f"{r.get('back_to_back_faults_per_call', 0):,.0f}")
        rows.append(row)
    header = ["K", "M", "D", "fused ms", "in place ms", "back to back ms", "PyTorch ms",
              "speed-up", "fused % read", "in place % read", "back to back % read"]
    if faults:
        header.append("page faults per call: fused / back to back")
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


# ---------------------------------------------------------------- SuPerFed

SUPERFED_STEPS = [  # (median_ms key, label)
    ("fedavg", "FedAvg step"),
    ("superfed_sgd_step_mm", "MM, `SuPerFedSGD`"),
    ("superfed_sgd_step_lm", "LM, `SuPerFedSGD`"),
    ("superfed_fused_mm", "MM, `superfed_mix` + SGD"),
    ("superfed_fused_lm", "LM, `superfed_mix` + SGD"),
    ("superfed_two_ops_lm", "LM, two ops + SGD"),
    ("superfed_foreach_lm", "LM, `_foreach` + SGD"),
    ("superfed_loops_mm", "MM, per-tensor loops"),
    ("superfed_loops_lm", "LM, per-tensor loops"),
]


def superfed_block(root: Path, name: str, key: str = "superfed") -> str:
    """bench_superfed.py: one local step of each form, and its time over FedAvg's step."""
    run = section(root, name, key)
    rows = []
    for model, m in run["models"].items():
        fedavg = m["median_ms"]["fedavg"]
        for step, label in SUPERFED_STEPS:
            if step in m["median_ms"]:
                ms = m["median_ms"][step]
                rows.append([model, f"{m['parameters']:,}", label, sig(ms), ratio(ms / fedavg)])
    optimizer = f"; FedAvg's SGD: `{run['sgd']}`" if run.get("sgd") else ""
    note = f"ν = {run['nu']}, μ = {run['mu']}{optimizer}."
    header = ["model", "parameters", "local step", "ms", "× FedAvg step"]
    return (source_line(name, key, run["environment"], run["probes"]) + " " + note + "\n\n"
            + table(header, rows))


# ---------------------------------------------------------------- robust and private


def robust_ops_block(root: Path, name: str, key: str = "robust_ops") -> str:
    run = section(root, name, key)
    rows = [[r["case"], str(r["K"]), r["variant"], sig(r["seconds"] * 1e3),
             sig(r["GBps_over_client_reads"]), pct(r["fraction_of_read_probe"]),
             ratio(r["speedup_of_fedkernels"])] for r in run["rows"]]
    header = ["case", "K", "variant", "ms", "GB/s over client reads", "% read probe",
              "time over fedkernels'"]
    model = run.get("model", {})
    shape = (f" Model: {model['name']} shape ({model['tensors']} tensors, "
             f"{model['params']:,} values).") if model else ""
    env = dict(run["environment"], cpu_clock=run.get("clock", run["environment"].get("cpu_clock")))
    return source_line(name, key, env, run["probes"]) + shape + "\n\n" + table(header, rows)


def quantized_block(root: Path, name: str, key: str = "quantized") -> str:
    """bench_quantized.py: each format's round against the fp32 round and the PyTorch round."""
    run = section(root, name, key)
    rows = [[r["format"], r["model"], str(r["K"]), str(r["block_size"] or "tensor"),
             f"{r['bytes_per_value']:.3f}", sig(r["fused_ms"]), sig(r["fp32_fused_ms"]),
             ratio(r["fp32_over_fused"]), sig(r["out_ms"]), sig(r["fp32_out_ms"]),
             ratio(r["fp32_over_out"]), pct(r["out_fraction_of_read_probe"]),
             pct(r["fp32_out_fraction_of_read_probe"]), sig(r["torch_ms"]),
             ratio(r["torch_over_fused"]), sig(r["quantize_us"] / 1e3),
             sig(r["quantize_sr_ef_us"] / 1e3)] for r in run["rows"]]
    header = ["format", "model", "K", "block", "bytes / value", "ms", "fp32 ms", "fp32 / ms",
              "out= ms", "fp32 out= ms", "fp32 / out=", "out= % read", "fp32 out= % read",
              "PyTorch ms", "PyTorch / ms", "quantize ms", "stochastic + EF ms"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def sparse_block(root: Path, name: str, key: str = "sparse") -> str:
    """bench_sparse.py: the fused scatter-add of top-k lists against PyTorch's index_add_ and
    dense materialisation, and the client's selection."""
    run = section(root, name, key)
    rows = [[r["model"], str(r["K"]), f"{100 * r['density']:g} %", sig(r["fused_inplace_ms"]),
             sig(r["fused_out_ms"]), pct(r["fused_fraction_of_read_probe"]),
             sig(r["torch_index_add_ms"]), ratio(r["index_add_over_fused"]),
             sig(r["torch_dense_ms"]), ratio(r["dense_over_fused"]), sig(r["topk_ef_ms"]),
             sig(r["torch_topk_ms"]), sig(r["stable_sort_ms"])] for r in run["rows"]]
    header = ["model", "K", "density", "fused in place ms", "fused out= ms", "in place % read",
              "`index_add_` ms", "`index_add_` / fused", "dense ms", "dense / fused",
              "client top-k + EF ms", "bare `torch.topk` ms", "stable sort ms"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def secagg_block(root: Path, name: str, key: str = "secagg") -> str:
    """bench_secagg.py: the fused ring ops against Flower's NumPy SecAgg+ arithmetic, and the
    mask words each side of ours expands per second (the work that bounds them)."""
    run = section(root, name, key)
    rows = []
    for r in run["rows"]:
        k, p = r["K"], r["params"]
        # client: K - 1 pair masks and the self-mask; server: K - 1 self-masks and the dropped
        # client's K - 1 pair masks
        rows.append([str(k), f"{p / 1e6:.2f} M", sig(r["ours_client_s"] * 1e3),
                     sig(r["flower_client_s"] * 1e3), ratio(r["client_speedup"]),
                     f"{k * p / r['ours_client_s'] / 1e9:.2f}",
                     sig(r["ours_server_s"] * 1e3), sig(r["flower_server_s"] * 1e3),
                     ratio(r["server_speedup"]),
                     f"{2 * (k - 1) * p / r['ours_server_s'] / 1e9:.2f}"])
    header = ["K", "parameters", "client ms", "Flower client ms", "client ×",
              "client G mask words/s", "server ms", "Flower server ms", "server ×",
              "server G mask words/s"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def flower_robust_block(root: Path, name: str) -> str:
    """bench_robust.py: Flower's robust and DP strategies against the drop-ins."""
    data = load(root, name)
    rows = [[str(r["K"]), r["rule"], str(r["f"]), sig(r["flower_s"] * 1e3),
             sig(r["fedkernels_s"] * 1e3), sig(r["stack_s"] * 1e3), ratio(r["speedup_vs_flower"]),
             ratio(r["speedup_vs_stack"]), sig(r["flower_peak_MB"]), sig(r["fedkernels_peak_MB"]),
             sig(r["stack_peak_MB"])] for r in data["rows"]]
    header = ["K", "rule", "f", "Flower ms", "fedkernels ms", "`torch.stack` ms", "Flower ×",
              "stack ×", "Flower peak MB", "fedkernels peak MB", "stack peak MB"]
    env = data["environment"]
    return source_line(name, None, env, env.get("probe")) + "\n\n" + table(header, rows)


# ---------------------------------------------------------------- frameworks


def flower_block(root: Path, name: str) -> str:
    """bench_flower.py: one aggregate_train of Flower's Message-API strategies and ours."""
    data = load(root, name)
    rows = [[r["model"], str(r["K"]), str(r["distinct_clients"]), r["strategy"],
             sig(r["flower_s"] * 1e3), sig(r["fedkernels_s"] * 1e3), ratio(r["speedup"]),
             sig(r["flower_peak_MB"]), sig(r["fedkernels_peak_MB"]),
             f"{r['environment']['probe']['read_GBps']:.1f}",
             f"{100 * r['fedkernels_read_probe_fraction']:.0f} %", r["environment"]["date"][:10]]
            for r in data["rows"]]
    header = ["model", "K", "distinct replies", "strategy", "Flower ms", "fedkernels ms",
              "speed-up", "Flower peak MB", "fedkernels peak MB", "read probe GB/s",
              "fedkernels % of read probe", "date"]
    env = data["environment"]
    return source_line(name, None, env) + "\n\n" + table(header, rows)


def framework_block(root: Path, name: str, theirs: str, label: str) -> str:
    """bench_nvflare.py, bench_fedlab.py, bench_fedml.py: the framework's call against ours."""
    data = load(root, name)
    first = ["input"] if "input" in data["rows"][0] else []
    rows = [[*(r[c] for c in first), str(r["K"]), sig(r[f"{theirs}_ms"]), sig(r["fedkernels_ms"]),
             ratio(r["speedup"]), sig(r[f"{theirs}_peak_MB"]), sig(r["fedkernels_peak_MB"]),
             sig(r["fedkernels_GBps"]),
             f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "—"] for r in data["rows"]]
    header = [*first, "K", f"{label} ms", "fedkernels ms", "speed-up", f"{label} peak MB",
              "fedkernels peak MB", "fedkernels GB/s", "max abs difference"]
    env = data["environment"]
    model = f" Model: {data['model']}." if data.get("model") else ""
    return source_line(name, None, env, env.get("probes")) + model + "\n\n" + table(header, rows)


# ---------------------------------------------------------------- CPU threading and numbers


def serial_threshold_block(root: Path, name: str, key: str = "serial_threshold") -> str:
    run = section(root, name, key)
    rows = [[f"{r['bytes_touched'] // 1024:,} KiB", sig(r["serial_us"]), sig(r["team_us"]),
             ratio(r["serial_over_team"])] for r in run["rows"]]
    header = ["bytes touched", "one thread µs", f"{run['threads']} threads µs",
              "one thread over the team"]
    text = source_line(name, key, run["environment"]) + "\n\n" + table(header, rows)
    if run.get("op_costs"):
        op_rows = [[op, f"{c['bytes_touched'] / 2**20:.1f} MiB", sig(c["one_thread_us"]),
                    ratio(c["cost_per_byte_over_add"]), c["declared"]]
                   for op, c in run["op_costs"].items()]
        text += "\n\n" + table(["op", "bytes touched", "one thread µs",
                                "cost per byte over `torch.add`", "declared pass cost"], op_rows)
    return text


def small_calls_block(root: Path, name: str, key: str = "small_calls") -> str:
    run = section(root, name, key)
    rows = [[r["case"], sig(r["quiet"]["median_us"]), sig(r["quiet"]["p90_us"]),
             sig(r["busy"]["median_us"]), sig(r["busy"]["p90_us"])] for r in run["rows"]]
    header = ["case", "quiet median µs", "quiet p90 µs", "busy median µs", "busy p90 µs"]
    note = f" Busy: {run['busy_processes']} spinning processes beside the benchmark."
    return source_line(name, key, run["environment"]) + note + "\n\n" + table(header, rows)


def subnormals_block(root: Path, name: str, key: str = "subnormals") -> str:
    run = section(root, name, key)
    rows = [[r["op"], r["mode"], f"{100 * r['subnormal_share']:.1f} %",
             f"{sig(r['fused_normal_us'])} → {sig(r['fused_subnormal_us'])} "
             f"({ratio(r['fused_subnormal_over_normal'])}×)",
             f"{sig(r['torch_normal_us'])} → {sig(r['torch_subnormal_us'])} "
             f"({ratio(r['torch_subnormal_over_normal'])}×)"] for r in run["rows"]]
    header = ["op", "caller's mode", "subnormal share", "fused µs: normal → subnormal",
              "PyTorch µs: normal → subnormal"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


# ---------------------------------------------------------------- GPU profiles


def gpu_runs_block(root: Path, name: str, key: str = "runs") -> str:
    """The GPU sessions whose results the file keeps: what ran, what it found, which keys."""
    data = load(root, name)
    if key not in data:
        raise RenderError(f"bench/results/{name} has no key {key!r}")
    rows = [[r["date"], f"`{r['commit']}`", r["what"],
             "; ".join(f"{check}: {result}" for check, result in r["results"].items()),
             ", ".join(f"`{k}`" for k in r.get("kept here", []))] for r in data[key]]
    header = ["date", "commit", "what ran", "results", "keys from this run"]
    return f"*Source: `bench/results/{name}`, key `{key}`.*\n\n" + table(header, rows)


def gpu_call_block(root: Path, name: str, key: str = "aggregate") -> str:
    """The op alone (`weighted_sum` into a preallocated model) at the call level, against
    `_foreach` and against `fedkernels.aggregate`, which adds its layout checks."""
    run = section(root, name, key)
    by_case = _methods_by_case(run)
    rows = []
    for (model, dtype, k), methods in by_case.items():
        op = methods.get("op out=")
        if op is None:
            continue
        ms = op["median_ms"]
        rows.append([model, dtype, str(k), sig(ms), f"{op['pct_copy_probe']:.0f}",
                     ratio(methods["foreach"]["median_ms"] / ms),
                     sig(methods["fused out="]["median_ms"]), sig(methods["fused"]["median_ms"])])
    header = ["model", "dtype", "K", "`weighted_sum` out= ms", "% of copy probe",
              "`_foreach` time ÷ op's", "`aggregate` out= ms", "`aggregate` ms (new result)"]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


ROBUST_BASELINES = [  # (case, the PyTorch variant to compare with, label)
    ("median", "stack+median", "coordinate median (× `torch.stack` + `median`)"),
    ("trimmed", "stack+sort", "trimmed mean (× `torch.stack` + `sort`)"),
    ("distances", "gram fp32", "pairwise distances (× float32 Gram matrix)"),
    ("private", "foreach", "DP sum with noise (× `_foreach`)"),
]


def robust_summary_block(root: Path, name: str, key: str = "robust_ops") -> str:
    """One line per robust op: fedkernels' ms at each K, and how many times slower the
    PyTorch variant a user would write is."""
    run = section(root, name, key)
    found = {(r["case"], r["K"], r["variant"]): r for r in run["rows"]}
    ks = sorted({r["K"] for r in run["rows"]})
    rows = []
    for case, baseline, label in ROBUST_BASELINES:
        cells = []
        for k in ks:
            ours, theirs = found.get((case, k, "fedkernels")), found.get((case, k, baseline))
            cells.append("—" if ours is None else sig(ours["seconds"] * 1e3) + (
                f" ({ratio(theirs['speedup_of_fedkernels'])}×)" if theirs else ""))
        rows.append([label, *cells])
    header = ["op: fedkernels ms (PyTorch's time over it)", *(f"K = {k}" for k in ks)]
    return source_line(name, key, run["environment"], run["probes"]) + "\n\n" + table(header, rows)


def ncu_block(root: Path, name: str, key: str = "ncu") -> str:
    """Nsight Compute: one launch of every kernel (time, DRAM traffic, occupancy)."""
    data = load(root, name)
    if key not in data:
        raise RenderError(f"bench/results/{name} has no key {key!r}")
    rows = [[r["case"], f"`{r['kernel']}`", sig(r["duration"] / 1e3), sig(r["dram_read"] / 1e6),
             sig(r["dram_write"] / 1e6), f"{r['dram_pct_of_peak']:.0f}",
             f"{r['achieved_occupancy_pct']:.0f}", f"{r['registers']:.0f}"] for r in data[key]]
    header = ["case", "kernel", "µs", "DRAM read MB", "DRAM write MB", "DRAM % of peak",
              "occupancy %", "registers"]
    return f"*Source: `bench/results/{name}`, key `{key}`.*\n\n" + table(header, rows)


# ---------------------------------------------------------------- the README's headline table


def _one(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise RenderError(f"expected one row with {match}, found {len(found)}")
    return found[0]


def headline_block(root: Path) -> str:
    """A few figures of the committed runs, each linking to the page that has the whole table."""
    page = "docs/results/"
    agg = section(root, INTEL, "aggregate")["rows"]
    case = {"model": "resnet18", "dtype": "float32", "K": 10}
    fused_out = _one(agg, method="fused out=", **case)
    loop, foreach = _one(agg, method="loop", **case), _one(agg, method="foreach", **case)
    gpu = section(root, H200, "aggregate")["rows"]
    op_out, gpu_foreach = _one(gpu, method="op out=", **case), _one(gpu, method="foreach", **case)
    flower = _one(load(root, "flower-cpu-amd-epyc-avx2.json")["rows"], model="resnet18", K=100,
                  distinct_clients=100, strategy="FedAvg")
    fedlab = _one(load(root, "fedlab-cpu-amd-epyc-avx2.json")["rows"], K=100)
    median = _one(section(root, INTEL, "robust_ops")["rows"], case="median", K=10,
                  variant="stack+median")
    fedgo = _one(section(root, INTEL, "ensemble_pseudo_labels")["rows"], K=40, N=4096, C=1000,
                 weighting="fedgo")
    superfed = section(root, INTEL, "superfed")["models"]["resnet18"]["median_ms"]
    vmap = section(root, INTEL, "vmap")["rows"]["5 epochs, batch 10"]
    sim = _one(load(root, "simulation-cpu-amd-epyc-avx512.json")["rows"], model="mlp",
               per_round=100, epochs=1)["methods"]
    sim_cpu = {m: sim[m]["round_cpu_s"] for m in ("vmap", "flower", "pfl")}
    rows = [
        ["`aggregate`: 10 ResNet-18-sized clients, fp32, into a preallocated model",
         f"{fused_out['pct_read_probe']:.0f} % of the read probe; the per-tensor loop takes "
         f"{ratio(loop['time_vs_fused'])}×, `_foreach_add_` {ratio(foreach['time_vs_fused'])}× "
         "the time of the allocating call", "2-core Xeon",
         f"[aggregate]({page}bench_aggregate.md)"],
        ["`weighted_sum`, the same case on a GPU",
         f"{sig(op_out['median_ms'])} ms, {op_out['pct_copy_probe']:.0f} % of the copy probe; "
         f"`_foreach` takes {ratio(gpu_foreach['median_ms'] / op_out['median_ms'])}×",
         "NVIDIA H200", f"[gpu]({page}gpu.md)"],
        ["Flower `FedAvg` round, 100 ResNet-18-sized replies",
         f"{ratio(flower['speedup'])}× faster than Flower's class; peak extra memory "
         f"{sig(flower['fedkernels_peak_MB'])} MB against {sig(flower['flower_peak_MB'])} MB",
         "2-core EPYC", f"[frameworks]({page}bench_frameworks.md)"],
        ["FedLab `fedavg_aggregate`, K = 100",
         f"{ratio(fedlab['speedup'])}× faster; peak {sig(fedlab['fedkernels_peak_MB'])} MB "
         f"against {sig(fedlab['fedlab_peak_MB'])} MB", "2-core EPYC",
         f"[frameworks]({page}bench_frameworks.md)"],
        ["coordinate median of 10 ResNet-18-sized clients",
         f"{ratio(median['speedup_of_fedkernels'])}× faster than `torch.stack` + `torch.median`",
         "2-core Xeon", f"[robust]({page}bench_robust.md)"],
        ["FedGO pseudo-labels, 40 teachers, 4096 samples, 1000 classes",
         f"{ratio(fedgo['speedup_median_of_ratios'])}× faster than the PyTorch composition",
         "2-core Xeon", f"[distillation]({page}bench_distillation.md)"],
        ["SuPerFed local step (MM, `SuPerFedSGD`), ResNet-18",
         f"{ratio(superfed['superfed_sgd_step_mm'] / superfed['fedavg'])}× the time of a "
         "FedAvg step", "Xeon, one thread", f"[superfed]({page}bench_superfed.md)"],
        ["`--vmap`: one round of 100 clients, 5 local epochs",
         f"{ratio(vmap['speedup'])}× faster than training them one by one", "2-core Xeon",
         f"[simulation]({page}simulation.md)"],
        ["`fedkernels run --vmap`: an FL round of 100 MNIST-1D clients (MLP, 1 epoch)",
         f"{ratio(sim_cpu['flower'] / sim_cpu['vmap'])}× less CPU than Flower's simulation "
         f"engine, {ratio(sim_cpu['pfl'] / sim_cpu['vmap'])}× less than pfl-research",
         "EPYC, one thread", f"[simulation]({page}simulation.md)"],
    ]
    return table(["what", "measured", "machine", "page"], rows)


# ---------------------------------------------------------------- the blocks

INTEL = "cpu-intel-r-xeon-r-processor-avx512.json"
ZEN4 = "cpu-amd-epyc-avx512.json"
ZEN3 = "cpu-amd-epyc-avx2.json"
H200 = "nvidia-h200.json"

BLOCKS: dict[str, Callable[[Path], str]] = {
    "aggregate/intel-xeon-avx512": lambda r: aggregate_block(r, INTEL),
    "aggregate/amd-epyc-avx512": lambda r: aggregate_block(r, ZEN4),
    "aggregate/amd-epyc-avx2": lambda r: aggregate_block(r, ZEN3),
    "aggregate-allocation/amd-epyc-avx512": lambda r: allocation_block(
        r, "alloc-pool-cpu-amd-epyc-avx512.json"),
    "cost-curve/intel-xeon-avx512": lambda r: cost_curve_block(r, INTEL),
    "cost-curve/amd-epyc-avx512": lambda r: cost_curve_block(r, ZEN4),
    "cost-curve/amd-epyc-avx2": lambda r: cost_curve_block(r, ZEN3),
    "cost-curve-full/amd-epyc-avx2": lambda r: cost_curve_block(r, ZEN3, "cost_curve_full"),
    "stream/intel-xeon-avx512": lambda r: stream_block(r, INTEL),
    "stream/amd-epyc-avx2": lambda r: stream_block(r, ZEN3),
    "stream/amd-epyc-avx2-full": lambda r: stream_block(r, ZEN3, "cost_curve_full"),
    "distributed/intel-xeon-avx512": lambda r: distributed_block(r, INTEL),
    "distributed/amd-epyc-avx512": lambda r: distributed_block(r, ZEN4),
    "distributed/amd-epyc-avx2": lambda r: distributed_block(r, ZEN3),
    "vmap/intel-xeon-avx512": lambda r: vmap_block(r, INTEL),
    "personalized-eval/intel-xeon-avx512": lambda r: personalized_eval_block(r, INTEL),
    "simulation/amd-epyc-avx512": lambda r: simulation_block(
        r, "simulation-cpu-amd-epyc-avx512.json"),
    "pseudo-labels/intel-xeon-avx512": lambda r: pseudo_labels_block(r, INTEL),
    "pseudo-labels/amd-epyc-avx512": lambda r: pseudo_labels_block(r, ZEN4),
    "distill-kl/intel-xeon-avx512": lambda r: distill_kl_block(r, INTEL),
    "distill-kl/amd-epyc-avx512": lambda r: distill_kl_block(r, ZEN4),
    "distill-kl/amd-epyc-avx2": lambda r: distill_kl_block(r, ZEN3),
    "energy/intel-xeon-avx512": lambda r: energy_block(r, INTEL),
    "energy/amd-epyc-avx512": lambda r: energy_block(r, ZEN4),
    "sgld/intel-xeon-avx512": lambda r: sgld_block(r, INTEL),
    "sgld/amd-epyc-avx512": lambda r: sgld_block(r, ZEN4),
    "sgld/amd-epyc-avx2": lambda r: sgld_block(r, ZEN3),
    "superfed/intel-xeon-avx512": lambda r: superfed_block(r, INTEL),
    "superfed/intel-xeon-avx512-fused-sgd": lambda r: superfed_block(r, INTEL,
                                                                     "superfed_fused_sgd"),
    "superfed/amd-epyc-avx2": lambda r: superfed_block(r, ZEN3),
    "robust-ops/intel-xeon-avx512": lambda r: robust_ops_block(r, INTEL),
    "robust-ops/amd-epyc-avx512": lambda r: robust_ops_block(r, "robust-ops-cpu-amd-epyc-avx512.json"),
    "robust-ops/amd-epyc-avx512-window": lambda r: robust_ops_block(
        r, "robust-ops-window-cpu-amd-epyc-avx512.json"),
    "robust-ops/amd-epyc-avx2": lambda r: robust_ops_block(r, "robust-ops-cpu-amd-epyc-avx2.json"),
    "quantized/amd-epyc-avx512": lambda r: quantized_block(r, "quantized-cpu-amd-epyc-avx512.json"),
    "quantized/amd-epyc-avx512-1thread": lambda r: quantized_block(
        r, "quantized-1thread-cpu-amd-epyc-avx512.json"),
    "sparse/amd-epyc-avx512": lambda r: sparse_block(r, "sparse-cpu-amd-epyc-avx512.json"),
    "secagg/amd-epyc-avx512": lambda r: secagg_block(r, "secagg-cpu-amd-epyc-avx512.json"),
    "flower-robust/amd-epyc-avx2": lambda r: flower_robust_block(r, "robust-cpu-amd-epyc-avx2.json"),
    "flower-robust/amd-epyc-avx512-krum-ties": lambda r: flower_robust_block(
        r, "robust-krum-ties-cpu-amd-epyc-avx512.json"),
    "flower/amd-epyc-avx2": lambda r: flower_block(r, "flower-cpu-amd-epyc-avx2.json"),
    "flower/intel-xeon-avx512": lambda r: flower_block(
        r, "flower-cpu-intel-r-xeon-r-processor-avx512.json"),
    "nvflare/amd-epyc-avx512": lambda r: framework_block(r, "nvflare-cpu-amd-epyc-avx512.json",
                                                         "nvflare", "NVFlare"),
    "fedlab/amd-epyc-avx2": lambda r: framework_block(r, "fedlab-cpu-amd-epyc-avx2.json",
                                                      "fedlab", "FedLab"),
    "fedml/amd-epyc-avx512": lambda r: framework_block(r, "fedml-cpu-amd-epyc-avx512.json",
                                                       "fedml", "FedML"),
    "serial-threshold/intel-xeon-avx512": lambda r: serial_threshold_block(r, INTEL),
    "serial-threshold/amd-epyc-avx512": lambda r: serial_threshold_block(r, ZEN4),
    "small-calls/intel-xeon-avx512": lambda r: small_calls_block(r, INTEL),
    "small-calls/amd-epyc-avx512": lambda r: small_calls_block(r, ZEN4),
    "subnormals/intel-xeon-avx512": lambda r: subnormals_block(r, INTEL),
    "gpu/aggregate": lambda r: aggregate_block(r, H200),
    "gpu/pseudo-labels": lambda r: pseudo_labels_block(r, H200),
    "gpu/sgld": lambda r: sgld_block(r, H200),
    "gpu/superfed": lambda r: superfed_block(r, H200),
    "gpu/robust-ops": lambda r: robust_ops_block(r, H200),
    "gpu/ncu": lambda r: ncu_block(r, H200),
    "gpu/runs": lambda r: gpu_runs_block(r, H200),
    "gpu/call-level": lambda r: gpu_call_block(r, H200),
    "gpu/robust-summary": lambda r: robust_summary_block(r, H200),
    "readme/headline": headline_block,
}


# ---------------------------------------------------------------- pages


def render_page(text: str, root: Path, page: str, seen: set[str]) -> str:
    """The page with every generated block rewritten from its JSON."""
    out, pos = [], 0
    for match in BEGIN.finditer(text):
        name = match.group(1)
        if match.start() < pos:
            raise RenderError(f"{page}: block {name!r} starts inside another block")
        if name not in BLOCKS:
            raise RenderError(f"{page}: marker names no block: {name!r}")
        end = text.find(END, match.end())
        if end < 0:
            raise RenderError(f"{page}: block {name!r} has no '{END}'")
        seen.add(name)
        out += [text[pos:match.end()], "\n", BLOCKS[name](root), "\n\n"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs" / "results").glob("*.md"))]


def run(root: Path, check: bool) -> tuple[int, list[str]]:
    """(exit status, messages)."""
    seen: set[str] = set()
    stale, messages = [], []
    try:
        for path in pages(root):
            text = path.read_text()
            new = render_page(text, root, str(path.relative_to(root)), seen)
            if new != text:
                stale.append(str(path.relative_to(root)))
                if not check:
                    path.write_text(new)
        missing = sorted(set(BLOCKS) - seen)
        if missing:
            raise RenderError("no page holds the block(s) " + ", ".join(missing))
    except RenderError as error:
        return 2, [f"render_results: {error}"]
    if check and stale:
        messages = [f"render_results: out of date (run python bench/render_results.py): {p}"
                    for p in stale]
        return 1, messages
    messages = [f"render_results: rewrote {p}" for p in stale] if not check else []
    return 0, messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a page differs from its JSON")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="repository root (default: the one holding this script)")
    args = parser.parse_args(argv)
    status, messages = run(args.root, args.check)
    for line in messages:
        print(line, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
