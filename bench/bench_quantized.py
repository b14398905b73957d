"""The server's fused dequantize + weighted sum of int8 client updates against the fp32 round
and against dequantize-then-aggregate in PyTorch (docs/algorithms/quantized.md; the table:
docs/results/bench_quantized.md).

    OMP_NUM_THREADS=2 python bench/bench_quantized.py [--device cuda] [--repeats 7]
    python bench/bench_quantized.py --check     # exit 1 if a ratio regressed > 20 %

K = 10 clients of the ResNet-18 shape (11.7 M fp32 parameters, 62 tensors), block size 256,
weights 1/K. Timed interleaved, one call per timing:

- ``int8_fused``: ``fedkernels.aggregate_quantized`` (``torch.ops.fedkernels.
  dequantize_weighted_sum``): reads each client's int8 values and float32 scales once,
  accumulates in float32, writes the fp32 model;
- ``fp32_fused``: ``torch.ops.fedkernels.weighted_sum`` over the same clients in fp32 (the
  round without quantization, our fused kernel);
- ``int8_out``, ``fp32_out``: the same two into output buffers allocated once (``out=``), as
  a server that keeps its buffers between rounds calls them: no page faults on fresh memory,
  which on a VM cost as much as the whole int8 sum;
- ``int8_torch``: what a user writes without the op: per client and tensor,
  ``q.float() * s.repeat_interleave(B)[:n]`` then ``acc.add_(deq, alpha=w_k)``.

The ratios are medians over rounds of the per-round ratios: ``fp32_over_int8`` and
``fp32_over_int8_out`` (the goal: >= 2.5) and ``torch_over_int8``. Bandwidth counts
each case's minimum traffic (its inputs read once, the fp32 output written once) against the
read probe measured right before.
The client side is timed too (``quantize_us``: one client, to nearest; ``quantize_sr_ef_us``:
stochastic with error feedback), for scale only.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fedkernels
from fedkernels.ops.quantize import aggregate_quantized

from harness.case_runs import add_case_arguments, finish_case_run, start_case_run
from harness.model_shapes import resnet18_shapes
from harness.timing import timed

K = 10
BLOCK = 256


def torch_dequantize_sum(clients, w, block):
    """Dequantize-then-aggregate as eager PyTorch: one float tensor per client and tensor."""
    out = []
    for t in range(len(clients[0].values)):
        n = clients[0].values[t].numel()
        acc = torch.zeros(clients[0].values[t].shape, device=clients[0].values[t].device)
        for k, c in enumerate(clients):
            deq = c.values[t].reshape(-1).float() * c.scales[t].repeat_interleave(block)[:n]
            acc.add_(deq.view(acc.shape), alpha=w[k])
        out.append(acc)
    return out


def ratios(payload: dict) -> dict[str, float]:
    """--check's ratios, higher-is-better."""
    found = {}
    for r in payload.get("rows", []):
        case = f"{r['model']} K={r['K']}"
        found[f"{case}: fp32 fused time / int8 fused time"] = r.get("fp32_over_int8")
        found[f"{case}: fp32 out= time / int8 out= time"] = r.get("fp32_over_int8_out")
        found[f"{case}: torch int8 time / int8 fused time"] = r.get("torch_over_int8")
        found[f"{case}: int8 GB/s / read probe"] = r.get("int8_fraction_of_read_probe")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser, "3 small tensors, K=2, 1 repeat, small probe: checks the script runs")
    args, device, probes, probe = start_case_run(parser, "quantized")
    shapes, k = ([(64, 3, 3, 3), (1000,), (7,)], 2) if args.tiny else (resnet18_shapes(), K)
    g = torch.Generator(device="cpu").manual_seed(0)
    models = [[(0.01 * torch.randn(s, generator=g)).to(device) for s in shapes] for _ in range(k)]
    flat = [t for m in models for t in m]
    w = [1.0 / k] * k
    w_t = torch.tensor(w, dtype=torch.float64)
    clients = [fedkernels.quantize_int8(m, BLOCK) for m in models]
    n = sum(t.numel() for t in models[0])
    blocks = sum(s.numel() for s in clients[0].scales)
    out_int8 = [torch.empty_like(t) for t in models[0]]
    out_fp32 = [torch.empty_like(t) for t in models[0]]
    fns = {
        "int8_fused": lambda: aggregate_quantized(clients, w_t),
        "fp32_fused": lambda: torch.ops.fedkernels.weighted_sum(flat, w_t, [], 1.0, False),
        "int8_out": lambda: aggregate_quantized(clients, w_t, out=out_int8),
        "fp32_out": lambda: torch.ops.fedkernels.weighted_sum.out(flat, w_t, [], 1.0, False,
                                                                   out=out_fp32),
        "int8_torch": lambda: torch_dequantize_sum(clients, w, BLOCK),
    }
    # same sums: the fused int8 round and the PyTorch one agree
    for a, b in zip(fns["int8_fused"](), fns["int8_torch"]()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    read = probe.read_gbps()
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    residual = [torch.zeros_like(t) for t in models[0]]
    client_fns = {
        "quantize": lambda: fedkernels.quantize_int8(models[0], BLOCK),
        "quantize_sr_ef": lambda: fedkernels.quantize_int8(models[0], BLOCK, stochastic=True,
                                                           seed=1, residual=residual),
    }
    client_times = {name: [] for name in client_fns}
    for fn in client_fns.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in client_fns.items():
            client_times[name].append(timed(fn, device))
    med = {name: statistics.median(v) for name, v in times.items()}
    int8_bytes = k * (n + 4 * blocks) + 4 * n
    fp32_bytes = k * 4 * n + 4 * n
    row = {
        "model": "resnet18" if not args.tiny else "tiny", "K": k, "block_size": BLOCK,
        "parameters": n, "int8_fused_ms": 1e3 * med["int8_fused"],
        "fp32_fused_ms": 1e3 * med["fp32_fused"], "int8_torch_ms": 1e3 * med["int8_torch"],
        "fp32_over_int8": statistics.median(
            f / q for f, q in zip(times["fp32_fused"], times["int8_fused"])),
        "int8_out_ms": 1e3 * med["int8_out"], "fp32_out_ms": 1e3 * med["fp32_out"],
        "fp32_over_int8_out": statistics.median(
            f / q for f, q in zip(times["fp32_out"], times["int8_out"])),
        "torch_over_int8": statistics.median(
            t / q for t, q in zip(times["int8_torch"], times["int8_fused"])),
        "int8_min_traffic_bytes": int8_bytes, "fp32_min_traffic_bytes": fp32_bytes,
        "int8_GBps": int8_bytes / med["int8_fused"] / 1e9,
        "fp32_GBps": fp32_bytes / med["fp32_fused"] / 1e9,
        "read_probe_GBps": read,
        "int8_fraction_of_read_probe": int8_bytes / med["int8_fused"] / 1e9 / read,
        "int8_out_fraction_of_read_probe": int8_bytes / med["int8_out"] / 1e9 / read,
        "fp32_out_fraction_of_read_probe": fp32_bytes / med["fp32_out"] / 1e9 / read,
        "fp32_fraction_of_read_probe": fp32_bytes / med["fp32_fused"] / 1e9 / read,
        "quantize_us": 1e6 * statistics.median(client_times["quantize"]),
        "quantize_sr_ef_us": 1e6 * statistics.median(client_times["quantize_sr_ef"]),
    }
    print(f"{row['model']} K={k}: int8 fused {row['int8_fused_ms']:.2f} ms, fp32 fused "
          f"{row['fp32_fused_ms']:.2f} ms (x{row['fp32_over_int8']:.2f}), int8 torch "
          f"{row['int8_torch_ms']:.2f} ms (x{row['torch_over_int8']:.2f}); out=: int8 "
          f"{row['int8_out_ms']:.2f} ms, fp32 {row['fp32_out_ms']:.2f} ms "
          f"(x{row['fp32_over_int8_out']:.2f}); int8 "
          f"{row['int8_GBps']:.1f} GB/s ({100 * row['int8_fraction_of_read_probe']:.0f}% of read), "
          f"fp32 {row['fp32_GBps']:.1f} GB/s ({100 * row['fp32_fraction_of_read_probe']:.0f}%); "
          f"client quantize {row['quantize_us']:.0f} us, stochastic + EF "
          f"{row['quantize_sr_ef_us']:.0f} us; read probe {read:.1f} GB/s")
    finish_case_run("quantized", device, args, probes, [row], ratios)


if __name__ == "__main__":
    main()
