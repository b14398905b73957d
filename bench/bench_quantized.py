"""The server's fused dequantize + weighted sum of quantized client updates (int8 and packed
4-bit with per-block scales, fp8 e4m3 with a per-tensor scale) against the fp32 round and
against dequantize-then-aggregate in PyTorch (docs/algorithms/quantized.md; the table:
docs/results/bench_quantized.md).

    OMP_NUM_THREADS=2 python bench/bench_quantized.py [--device cuda] [--repeats 7]
    python bench/bench_quantized.py --check     # exit 1 if a ratio regressed > 20 %

K = 10 clients of the ResNet-18 shape (11.7 M fp32 parameters, 62 tensors), block size 256
(int8, int4), weights 1/K. Timed interleaved, one call per timing, for each format F:

- ``F_fused``: ``fedkernels.aggregate_quantized`` (ops ``dequantize_weighted_sum``,
  ``dequantize_int4_weighted_sum``, ``dequantize_fp8_weighted_sum``): reads each client's
  compressed values and float32 scales once, accumulates in float32, writes the fp32 model;
- ``F_out``: the same into output buffers allocated once (``out=``), as a server that keeps
  its buffers between rounds calls it: no page faults on fresh memory;
- ``F_torch``: what a user writes without the op: per client and tensor, the float32
  dequantized tensor (int8: ``q.float() * s.repeat_interleave(B)[:n]``; int4: the nibbles
  unpacked and sign-extended first; fp8: ``q.float() * s``) then ``acc.add_(deq, alpha=w_k)``;

and once per round ``fp32_fused`` / ``fp32_out``: ``torch.ops.fedkernels.weighted_sum`` over
the same clients in fp32 (the round without quantization, our fused kernel).

The ratios are medians over rounds of the per-round ratios: ``fp32_over_fused`` and
``fp32_over_out`` (the target: time proportional to the compressed bytes) and
``torch_over_fused``. Bandwidth counts each case's minimum traffic (its inputs read once, the
fp32 output written once) against the read probe measured right before.
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
FORMATS = ("int8", "int4", "fp8")


def quantize(fmt: str, tensors, **kw):
    if fmt == "fp8":
        return fedkernels.quantize_fp8(tensors, **kw)
    return getattr(fedkernels, f"quantize_{fmt}")(tensors, BLOCK, **kw)


def torch_dequantize(c, t: int) -> torch.Tensor:
    """Client c's tensor t as float32, in eager PyTorch."""
    if c.format == "fp8":
        return c.values[t].float() * c.scales[t]
    q = c.values[t]
    n = q.numel()
    if c.format == "int4":
        n = c.shapes[t].numel()
        b = q.to(torch.int16)
        q = torch.stack([b & 0xF, b >> 4], 1).reshape(-1)[:n]
        q = (q ^ 8) - 8
    return (q.reshape(-1).float() * c.scales[t].repeat_interleave(c.block_size)[:n])


def torch_dequantize_sum(clients, w):
    """Dequantize-then-aggregate as eager PyTorch: one float tensor per client and tensor."""
    out = []
    c0 = clients[0]
    for t in range(len(c0.values)):
        shape = c0.shapes[t] if c0.format == "int4" else c0.values[t].shape
        acc = torch.zeros(shape, device=c0.values[t].device)
        for k, c in enumerate(clients):
            acc.add_(torch_dequantize(c, t).view(shape), alpha=w[k])
        out.append(acc)
    return out


def ratios(payload: dict) -> dict[str, float]:
    """--check's ratios, higher-is-better."""
    found = {}
    for r in payload.get("rows", []):
        case = f"{r['model']} K={r['K']} {r.get('format', 'int8')}"
        found[f"{case}: fp32 fused time / fused time"] = r.get("fp32_over_fused")
        found[f"{case}: fp32 out= time / out= time"] = r.get("fp32_over_out")
        found[f"{case}: torch time / fused time"] = r.get("torch_over_fused")
        found[f"{case}: GB/s / read probe"] = r.get("fraction_of_read_probe")
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
    clients = {f: [quantize(f, m) for m in models] for f in FORMATS}
    n = sum(t.numel() for t in models[0])
    outs = {f: [torch.empty_like(t) for t in models[0]] for f in FORMATS}
    out_fp32 = [torch.empty_like(t) for t in models[0]]
    fns = {
        "fp32_fused": lambda: torch.ops.fedkernels.weighted_sum(flat, w_t, [], 1.0, False),
        "fp32_out": lambda: torch.ops.fedkernels.weighted_sum.out(flat, w_t, [], 1.0, False,
                                                                   out=out_fp32),
    }
    for f in FORMATS:
        fns[f"{f}_fused"] = lambda f=f: aggregate_quantized(clients[f], w_t)
        fns[f"{f}_out"] = lambda f=f: aggregate_quantized(clients[f], w_t, out=outs[f])
        fns[f"{f}_torch"] = lambda f=f: torch_dequantize_sum(clients[f], w)
        # same sums: the fused round and the PyTorch one agree
        for a, b in zip(fns[f"{f}_fused"](), fns[f"{f}_torch"]()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    read = probe.read_gbps()
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    residual = [torch.zeros_like(t) for t in models[0]]
    client_fns = {}
    for f in FORMATS:
        client_fns[f"{f}_quantize"] = lambda f=f: quantize(f, models[0])
        client_fns[f"{f}_quantize_sr_ef"] = lambda f=f: quantize(
            f, models[0], stochastic=True, seed=1, residual=residual)
    client_times = {name: [] for name in client_fns}
    for fn in client_fns.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in client_fns.items():
            client_times[name].append(timed(fn, device))
    med = {name: statistics.median(v) for name, v in times.items()}

    def per_round(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    fp32_bytes = k * 4 * n + 4 * n
    rows = []
    for f in FORMATS:
        sent = clients[f][0].nbytes  # one client's values and scales
        traffic = k * sent + 4 * n
        row = {
            "model": "resnet18" if not args.tiny else "tiny", "K": k, "format": f,
            "block_size": clients[f][0].block_size, "parameters": n,
            "bytes_per_value": sent / n,
            "fused_ms": 1e3 * med[f"{f}_fused"], "out_ms": 1e3 * med[f"{f}_out"],
            "torch_ms": 1e3 * med[f"{f}_torch"],
            "fp32_fused_ms": 1e3 * med["fp32_fused"], "fp32_out_ms": 1e3 * med["fp32_out"],
            "fp32_over_fused": per_round("fp32_fused", f"{f}_fused"),
            "fp32_over_out": per_round("fp32_out", f"{f}_out"),
            "torch_over_fused": per_round(f"{f}_torch", f"{f}_fused"),
            "min_traffic_bytes": traffic, "fp32_min_traffic_bytes": fp32_bytes,
            "GBps": traffic / med[f"{f}_fused"] / 1e9,
            "read_probe_GBps": read,
            "fraction_of_read_probe": traffic / med[f"{f}_fused"] / 1e9 / read,
            "out_fraction_of_read_probe": traffic / med[f"{f}_out"] / 1e9 / read,
            "fp32_fraction_of_read_probe": fp32_bytes / med["fp32_fused"] / 1e9 / read,
            "fp32_out_fraction_of_read_probe": fp32_bytes / med["fp32_out"] / 1e9 / read,
            "quantize_us": 1e6 * statistics.median(client_times[f"{f}_quantize"]),
            "quantize_sr_ef_us": 1e6 * statistics.median(client_times[f"{f}_quantize_sr_ef"]),
        }
        rows.append(row)
        print(f"{row['model']} K={k} {f}: fused {row['fused_ms']:.2f} ms, fp32 fused "
              f"{row['fp32_fused_ms']:.2f} ms (x{row['fp32_over_fused']:.2f}), torch "
              f"{row['torch_ms']:.2f} ms (x{row['torch_over_fused']:.2f}); out=: "
              f"{row['out_ms']:.2f} ms, fp32 {row['fp32_out_ms']:.2f} ms "
              f"(x{row['fp32_over_out']:.2f}); {row['GBps']:.1f} GB/s "
              f"({100 * row['fraction_of_read_probe']:.0f}% of read, out= "
              f"{100 * row['out_fraction_of_read_probe']:.0f}%); client quantize "
              f"{row['quantize_us']:.0f} us, stochastic + EF {row['quantize_sr_ef_us']:.0f} us")
    print(f"read probe {read:.1f} GB/s")
    finish_case_run("quantized", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
