"""One Nsight Compute profile of every fedkernels CUDA kernel, summarized: duration, DRAM bytes
and throughput (as a fraction of the device's peak), achieved occupancy and registers.

    python bench/gpu_profile.py --out DIR      # runs itself under ncu, writes DIR/ncu.csv,
                                               # DIR/ncu_summary.md and DIR/ncu_summary.json

Each op runs once untimed (module load, allocator warm-up), then once more between
cudaProfilerStart/Stop, on inputs sized like the benchmarks' largest cases, so that ncu sees one
launch of every kernel and nothing of PyTorch's set-up. The clocks are left as they are
(``--clock-control none``). Needs ncu (Nsight Compute) and a CUDA build of fedkernels.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
}


def workload() -> None:
    import torch

    import fedkernels
    from fedkernels import ops

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    from harness.model_shapes import lora_shapes, resnet18_shapes

    resnet = resnet18_shapes()
    lora = list(lora_shapes().values())
    K = 10
    w = torch.rand(K, dtype=torch.float64)

    def clients_of(shapes, dtype=torch.float32, k=K):
        return [randn(*s, dtype=dtype) for _ in range(k) for s in shapes]

    fp32 = clients_of(resnet)
    bf16 = clients_of(resnet, torch.bfloat16)
    lora_clients = clients_of(lora)
    g = fp32[: len(resnet)]
    loc = fp32[len(resnet): 2 * len(resnet)]
    base = [torch.zeros_like(t) for t in g]
    T = len(resnet)
    out = [torch.empty_like(t) for t in g]
    logits40 = randn(40, 4096, 1000)
    scores40 = randn(40, 4096)
    student = randn(4096, 1000)
    target = torch.softmax(randn(4096, 1000), dim=1)
    labels = torch.randint(0, 1000, (4096,), device=dev)
    D = 3 * 32 * 32
    x = torch.rand(1000, D, device=dev)
    grads = randn(100, 1000, D)
    energies, log_w = randn(100, 1000), torch.zeros(100, device=dev)
    coeffs = torch.rand(K, dtype=torch.float64)

    cases = {
        "weighted_sum fp32 resnet18 K=10": lambda: ops.weighted_sum(fp32, w),
        "weighted_sum.out fp32 resnet18 K=10": lambda: ops.weighted_sum_out(fp32, w, (), 1.0, False, out=out),
        "weighted_sum bf16 resnet18 K=10": lambda: ops.weighted_sum(bf16, w),
        "weighted_sum fp32 lora K=10": lambda: ops.weighted_sum(lora_clients, w),
        "mix_endpoints resnet18": lambda: ops.mix_endpoints(g, loc, 0.3),
        "superfed_stats resnet18": lambda: ops.superfed_stats(g, loc, base),
        "mix_endpoints_with_stats resnet18": lambda: ops.mix_endpoints_with_stats(g, loc, 0.3, base),
        "ensemble_pseudo_labels fedgo K=40 N=4096 C=1000":
            lambda: ops.ensemble_pseudo_labels(logits40, scores40, weighting="fedgo"),
        "ensemble_pseudo_labels entropy K=40 N=4096 C=1000":
            lambda: ops.ensemble_pseudo_labels(logits40, weighting="entropy"),
        "distill_kl N=4096 C=1000": lambda: ops.distill_kl(student, target, 2.0),
        "energy_from_logits N=4096 C=1000": lambda: ops.energy_from_logits(student, labels),
        "sgld_step M=1000": lambda: ops.sgld_step(x, grads[0], step_size=0.1, noise_std=0.01,
                                                  generator=gen),
        "sgld_compose_step K=100 M=1000": lambda: ops.sgld_compose_step(
            x, grads, energies, log_w, mode="signed", step_size=0.1, noise_std=0.01,
            clamp=(0.0, 1.0), generator=gen),
        "coordinate_median K=10": lambda: ops.coordinate_median(fp32, K),
        "trimmed_mean K=10": lambda: ops.trimmed_mean(fp32, K, 2),
        "median_window_mean K=10": lambda: ops.median_window_mean(fp32, K, 6),
        "pairwise_sq_distances K=10": lambda: ops.pairwise_sq_distances(fp32, K),
        "update_norms K=10": lambda: ops.update_norms(fp32, K, fp32[:T]),
        "private_sum K=10": lambda: ops.private_sum(fp32, coeffs, fp32[:T], 0.01, gen),
    }
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    for name, fn in cases.items():
        torch.cuda.nvtx.range_push(name)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()
    print(f"profiled {len(cases)} cases; fedkernels {fedkernels.__version__}")


def kernel_name(signature: str) -> str:
    """``void ns::<unnamed>::name<float, ...>(args)`` -> ``name<float, ...>``."""
    head = signature.split("(")[0]
    name, _, targs = head.partition("<unnamed>::")[2].partition("<") if "<unnamed>::" in head \
        else head.partition("<")
    name = name.split()[-1].split("::")[-1]
    full = f"{name}<{targs}" if targs else name
    return full if len(full) <= 60 else full[:57] + "..."


def case_name(row: dict) -> str:
    """The NVTX range the launch ran in (``1429 "<default domain>:CASE:none:..."``)."""
    for key, value in row.items():
        if key and "Push/Pop_Range" in key and value:
            text = value.split('"')[1] if '"' in value else value
            return text.split(":")[1] if text.count(":") >= 1 else text
    return ""


def summarize(csv_text: str) -> list[dict]:
    """One row per kernel launch from ``ncu --csv --page raw`` output (unit-free numbers)."""
    lines = [ln for ln in csv_text.splitlines() if ln.startswith('"')]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    rows = []
    for r in reader:
        if not r.get("Kernel Name") or r.get("ID", "").startswith(("(", "ID")):
            continue
        row = {"kernel": kernel_name(r["Kernel Name"]), "case": case_name(r)}
        for metric, key in METRICS.items():
            try:
                row[key] = float(str(r.get(metric, "")).replace(",", ""))
            except ValueError:
                row[key] = None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| # | case | kernel | µs | DRAM MB | DRAM % of peak | occupancy % (achieved / theoretical) "
           "| regs | grid × block |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        mb = ((r["dram_read"] or 0) + (r["dram_write"] or 0)) / 1e6
        out.append(f"| {i} | {r['case']} | {r['kernel']} | {(r['duration'] or 0) / 1e3:.1f} | {mb:.1f} | "
                   f"{r['dram_pct_of_peak'] or 0:.0f} | {r['achieved_occupancy_pct'] or 0:.0f} / "
                   f"{r['theoretical_occupancy_pct'] or 0:.0f} | {r['registers'] or 0:.0f} | "
                   f"{r['grid'] or 0:.0f} × {r['block'] or 0:.0f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ncu.csv and the summaries")
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        workload()
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        sys.exit("gpu_profile: ncu (Nsight Compute) not found")
    os.makedirs(args.out, exist_ok=True)
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--print-units", "base", "--nvtx", "--metrics", ",".join(METRICS),
           sys.executable, os.path.abspath(__file__), "--workload", "--out", args.out]
    # the profiled child imports the source tree's fedkernels (an in-place build) first
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    with open(os.path.join(args.out, "ncu.csv"), "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        sys.exit(f"gpu_profile: ncu exited with {proc.returncode}")
    rows = summarize(proc.stdout)
    with open(os.path.join(args.out, "ncu_summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    table = markdown(rows)
    with open(os.path.join(args.out, "ncu_summary.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
