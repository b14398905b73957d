"""The server's fused weighted scatter-add of top-k sparse client updates against what a user
writes in PyTorch (docs/algorithms/sparse.md; the table: docs/results/bench_sparse.md).

    OMP_NUM_THREADS=2 python bench/bench_sparse.py [--device cuda] [--repeats 7]
    python bench/bench_sparse.py --check     # exit 1 if a ratio regressed > 20 %

The ResNet-18 shape (11.7 M fp32 parameters, 62 tensors), each client's update sparsified per
tensor to a density of 1 % or 10 % (int32 indices, fp32 values), K = 10 (and K = 100 at 1 %),
weights 1/K, added to a dense global model. Timed interleaved, one call per timing:

- ``fused_inplace``: ``fedkernels.aggregate_sparse_`` into the model (op
  ``sparse_weighted_sum_``): reads and writes the model once, reads every list once;
- ``fused_out``: ``fedkernels.aggregate_sparse(..., base, out=buffers)`` (op
  ``sparse_weighted_sum.out``), the model unchanged, the result in buffers kept between rounds;
- ``torch_index_add``: per client and tensor ``out_t.view(-1).index_add_(0, i, v, alpha=w_k)``
  into a clone of the model;
- ``torch_dense``: per client and tensor a dense zero tensor, ``d[i] = v``, then
  ``out_t.add_(d, alpha=w_k)``: the client materialised, then the weighted sum.

Ratios are medians over rounds of per-round ratios (``index_add_over_fused``,
``dense_over_fused``: PyTorch's time over the fused in-place time). Bandwidth counts the fused
call's minimum traffic (the model read and written once, each list's indices and values read
once) against the read probe measured right before. The client side is timed too
(``topk_ef_ms``: ``sparsify_topk`` per tensor with error feedback, one client;
``torch_topk_ms``: torch.topk of |x| and a gather, per tensor, the selection without
deterministic ties or error feedback; ``stable_sort_ms``: the deterministic selection by a
stable sort of -|x|, as the reference computes it), for scale and for the choice of torch.topk.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fedkernels
from fedkernels.ops import reference as ref

from harness.case_runs import add_case_arguments, finish_case_run, start_case_run
from harness.model_shapes import resnet18_shapes
from harness.timing import timed


def torch_index_add(base, clients, w):
    out = [b.clone() for b in base]
    for k, c in enumerate(clients):
        for t, o in enumerate(out):
            o.view(-1).index_add_(0, c.indices[t], c.values[t], alpha=w[k])
    return out


def torch_dense(base, clients, w):
    out = [b.clone() for b in base]
    for k, c in enumerate(clients):
        for t, o in enumerate(out):
            d = torch.zeros(o.numel(), dtype=o.dtype, device=o.device)
            d[c.indices[t]] = c.values[t]
            o.add_(d.view(o.shape), alpha=w[k])
    return out


def torch_topk(x, density):
    out = []
    for t in x:
        flat = t.reshape(-1)
        i = torch.topk(flat.abs(), max(1, round(density * flat.numel())), sorted=False).indices
        out.append((i, flat[i]))
    return out


def ratios(payload: dict) -> dict[str, float]:
    """--check's ratios, higher-is-better."""
    found = {}
    for r in payload.get("rows", []):
        case = f"{r['model']} K={r['K']} density={r['density']}"
        found[f"{case}: index_add_ time / fused time"] = r.get("index_add_over_fused")
        found[f"{case}: dense time / fused time"] = r.get("dense_over_fused")
        found[f"{case}: fused GB/s / read probe"] = r.get("fused_fraction_of_read_probe")
    return found


def run_case(args, device, probe, shapes, k, density):
    g = torch.Generator(device="cpu").manual_seed(k)
    clients = []
    for _ in range(k):
        model = [(0.01 * torch.randn(s, generator=g)).to(device) for s in shapes]
        clients.append(fedkernels.sparsify_topk(model, fraction=density))
    base = [torch.randn(s, generator=g).to(device) for s in shapes]
    n = sum(b.numel() for b in base)
    entries = sum(i.numel() for c in clients for i in c.indices)
    w = [1.0 / k] * k
    w_t = torch.tensor(w, dtype=torch.float64)
    model = [b.clone() for b in base]
    out = [torch.empty_like(b) for b in base]
    fns = {
        "fused_inplace": lambda: fedkernels.aggregate_sparse_(model, clients, w_t),
        "fused_out": lambda: fedkernels.aggregate_sparse(clients, w_t, base, out=out),
        "torch_index_add": lambda: torch_index_add(base, clients, w),
        "torch_dense": lambda: torch_dense(base, clients, w),
    }
    # same sums (index_add_ and the dense sum round in their own orders: close, not equal)
    want = fns["fused_out"]()
    for name in ("torch_index_add", "torch_dense"):
        for a, b in zip(fns[name](), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    read = probe.read_gbps()
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    x = [(0.01 * torch.randn(s, generator=g)).to(device) for s in shapes]
    residual = [torch.zeros_like(t) for t in x]
    client_fns = {
        "topk_ef": lambda: fedkernels.sparsify_topk(x, fraction=density, residual=residual),
        "torch_topk": lambda: torch_topk(x, density),
        "stable_sort": lambda: [ref.topk_indices_reference(t.reshape(-1), max(1, round(
            density * t.numel()))) for t in x],
    }
    client_times = {name: [] for name in client_fns}
    for fn in client_fns.values():
        fn()
    for _ in range(max(3, args.repeats // 2)):
        for name, fn in client_fns.items():
            client_times[name].append(timed(fn, device))
    med = {name: statistics.median(v) for name, v in times.items()}
    nbytes = 2 * 4 * n + entries * (4 + 4)
    row = {
        "model": "resnet18" if not args.tiny else "tiny", "K": k, "density": density,
        "parameters": n, "entries": entries,
        **{f"{name}_ms": 1e3 * med[name] for name in fns},
        "index_add_over_fused": statistics.median(
            a / b for a, b in zip(times["torch_index_add"], times["fused_inplace"])),
        "dense_over_fused": statistics.median(
            a / b for a, b in zip(times["torch_dense"], times["fused_inplace"])),
        "min_traffic_bytes": nbytes,
        "fused_GBps": nbytes / med["fused_inplace"] / 1e9,
        "read_probe_GBps": read,
        "fused_fraction_of_read_probe": nbytes / med["fused_inplace"] / 1e9 / read,
        "fused_out_fraction_of_read_probe": nbytes / med["fused_out"] / 1e9 / read,
        "topk_ef_ms": 1e3 * statistics.median(client_times["topk_ef"]),
        "torch_topk_ms": 1e3 * statistics.median(client_times["torch_topk"]),
        "stable_sort_ms": 1e3 * statistics.median(client_times["stable_sort"]),
    }
    print(f"{row['model']} K={k} density={density}: fused in place {row['fused_inplace_ms']:.2f} ms"
          f", out= {row['fused_out_ms']:.2f} ms ({100 * row['fused_fraction_of_read_probe']:.0f}% "
          f"of read); index_add_ {row['torch_index_add_ms']:.2f} ms "
          f"(x{row['index_add_over_fused']:.2f}), dense {row['torch_dense_ms']:.2f} ms "
          f"(x{row['dense_over_fused']:.2f}); client top-k + EF {row['topk_ef_ms']:.1f} ms, "
          f"torch.topk {row['torch_topk_ms']:.1f} ms, stable sort {row['stable_sort_ms']:.1f} ms; "
          f"read probe {read:.1f} GB/s")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-k100", action="store_true", help="leave out K = 100")
    add_case_arguments(parser, "3 small tensors, K=2, 1 repeat, small probe: checks the script runs")
    args, device, probes, probe = start_case_run(parser, "sparse")
    if args.tiny:
        cases, shapes = [(2, 0.1)], [(64, 3, 3, 3), (1000,), (7,)]
    else:
        cases, shapes = [(10, 0.01), (10, 0.1)], resnet18_shapes()
        if not args.no_k100:
            cases.append((100, 0.01))
    rows = [run_case(args, device, probe, shapes, k, density) for k, density in cases]
    finish_case_run("sparse", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
