"""The robust-aggregation and DP ops against what a user writes with PyTorch: stack the K
clients per tensor and call ``torch.median`` / ``torch.sort`` / ``torch.cdist``.

    OMP_NUM_THREADS=2 python bench/bench_robust_ops.py [--device cuda] [--ks 10,50]
    OMP_NUM_THREADS=1 python bench/bench_robust_ops.py --clock process   # on a shared machine

On the ResNet-18 shape (62 float32 tensors, 11.69 M parameters), for each K:

- median: ``fedkernels.ops.robust.coordinate_median`` against ``torch.stack`` +
  ``torch.median(dim=0)`` per tensor (which returns the lower middle value for even K, so it is
  not even the same rule; ``torch.quantile`` is limited to 16 M elements a call) and against
  ``torch.stack`` + ``torch.sort`` + the mean of the two middle rows (the NumPy rule);
- trimmed mean (beta = 0.2): the op against ``torch.stack`` + ``torch.sort`` + a mean of the
  kept rows;
- window (Bulyan's coordinate step, beta = K - 4f with f = (K - 3) // 4): the op against
  ``torch.stack`` + ``torch.sort`` for the median, then ``argsort`` of the distances to it,
  ``gather`` and a mean (the NumPy rule Flower's Bulyan follows, in PyTorch);
- distances: the op (one pass, float64) against ``torch.cdist`` of the flattened clients in
  float64 (one [K, P] concatenation, skipped above --max-fp64-bytes) and the Gram form in
  float32;
- norms + clipped noisy sum: ``update_norms`` then ``private_sum`` against ``torch._foreach``
  norms, a scaled sum and ``randn`` noise per tensor;
- ``median_nan_client`` and ``trimmed_nan_client``: the median and the trimmed mean when client
  0 sends NaN everywhere (the simplest attack on a robust rule), against the same
  ``stack`` + ``sort`` baselines (``torch.sort`` puts NaN last too; its median rows are the
  middle ones, where NumPy's rule, and the op's, give NaN).

Each case is timed interleaved with its baselines (median of ``--repeats`` rounds); the traffic
is one read of the K clients (K * P * 4 bytes) and its bandwidth is given as a fraction of the
read probe measured in the same run. Results: bench/results/runs/ (``--save``: merged into
bench/results/<device>.json under ``robust_ops``).
"""

from __future__ import annotations

import argparse

import torch

from fedkernels.ops import private as private_ops
from fedkernels.ops import robust as robust_ops

from harness.cli import (
    add_clock_argument,
    add_output_arguments,
    at_least,
    check_output_arguments,
    resolve_device,
)
from harness.machine import environment
from harness.model_shapes import resnet18_shapes
from harness.probes import MIN_PROBE_BYTES, bandwidth_probes, print_probes
from harness.results import write_results
from harness.timing import interleaved_medians, use_cpu_clock


def stack_median(clients, K, T):
    return [torch.median(torch.stack([clients[k * T + t] for k in range(K)]), dim=0).values
            for t in range(T)]


def sorted_median(s, K):
    """The NumPy median from values sorted along dim 0."""
    return s[K // 2] if K % 2 else (s[K // 2 - 1] + s[K // 2]) / 2


def stack_sort_median(clients, K, T):
    return [sorted_median(torch.sort(torch.stack([clients[k * T + t] for k in range(K)]),
                                     dim=0).values, K) for t in range(T)]


def stack_sort_trimmed(clients, K, T, cut):
    return [torch.sort(torch.stack([clients[k * T + t] for k in range(K)]), dim=0)
            .values[cut:K - cut].mean(dim=0) for t in range(T)]


def stack_sort_window(clients, K, T, window):
    out = []
    for t in range(T):
        x = torch.stack([clients[k * T + t] for k in range(K)])
        med = sorted_median(torch.sort(x, dim=0).values, K)
        nearest = torch.argsort((x - med).abs(), dim=0)[:window]
        out.append(torch.gather(x, 0, nearest).mean(dim=0))
    return out


def cdist_distances(clients, K, T):
    flat = torch.stack([torch.cat([clients[k * T + t].reshape(-1) for t in range(T)])
                        for k in range(K)]).double()
    return torch.cdist(flat, flat) ** 2


def gram_distances(clients, K, T):
    flat = torch.stack([torch.cat([clients[k * T + t].reshape(-1) for t in range(T)])
                        for k in range(K)])
    sq = (flat * flat).sum(1)
    return sq[:, None] + sq[None, :] - 2 * flat @ flat.T


def foreach_private(clients, K, T, base, clip, std, gen):
    deltas = [[clients[k * T + t] - base[t] for t in range(T)] for k in range(K)]
    norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(d))) for d in deltas]
    acc = [torch.zeros_like(b) for b in base]
    for d, n in zip(deltas, norms):
        torch._foreach_add_(acc, d, alpha=float(min(1.0, clip / max(float(n), 1e-30))) / K)
    out = torch._foreach_add(base, acc)
    for o in out:
        o.add_(torch.randn(o.shape, generator=gen, device=o.device), alpha=std)
    return out


def fused_private(clients, K, base, clip, std, gen):
    norms = private_ops.update_norms(clients, K, base)
    coef = torch.tensor([min(1.0, clip / n) if n > 0 else 1.0 for n in norms.tolist()],
                        dtype=torch.float64) / K
    return private_ops.private_sum(clients, coef, base, std, gen)


CASES = ("median", "trimmed", "window", "distances", "private", "median_nan_client",
         "trimmed_nan_client")


def choice(names: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown case {text!r} (cases: {', '.join(names)})")
        return text
    return parse


def comma_list(item):
    """An argparse type: a comma-separated list whose items ``item`` parses."""
    def parse(text: str) -> list:
        items = [item(part) for part in text.split(",") if part]
        if not items:
            raise argparse.ArgumentTypeError("expected at least one value")
        return items
    return parse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    # below 3 clients the window case (Bulyan's coordinate step) has no valid window
    parser.add_argument("--ks", type=comma_list(at_least(3)), default="10,50",
                        help="client counts K, comma-separated (at least 3 each)")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--probe-bytes", type=at_least(MIN_PROBE_BYTES), default=1 << 28)
    # an unknown case would time nothing, and --save would then replace the committed
    # results with an empty run
    parser.add_argument("--cases", type=comma_list(choice(CASES)), default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--max-fp64-bytes", type=int, default=2 << 30,
                        help="skip the cdist baseline when its [K, P] float64 copy is larger")
    add_output_arguments(parser)
    add_clock_argument(parser)
    args = parser.parse_args()
    check_output_arguments(args)
    use_cpu_clock(args.clock)
    device = resolve_device(args.device)
    probes = bandwidth_probes(device, args.probe_bytes)
    print_probes(device, probes)
    shapes = resnet18_shapes()
    T = len(shapes)
    P = sum(torch.Size(s).numel() for s in shapes)
    cases = set(args.cases)
    rows = []
    for K in args.ks:
        g = torch.Generator(device="cpu").manual_seed(K)
        clients = [torch.randn(s, generator=g).to(device) for _ in range(K) for s in shapes]
        base = [torch.randn(s, generator=g).to(device) for s in shapes]
        nan_client = [torch.full_like(t, float("nan")) for t in clients[:T]] + clients[T:]
        gen = torch.Generator(device=device).manual_seed(0)
        cut = int(0.2 * K)
        window = max(1, K - 4 * ((K - 3) // 4))
        groups = {
            "median": {"fedkernels": lambda: robust_ops.coordinate_median(clients, K),
                       "stack+median": lambda: stack_median(clients, K, T),
                       "stack+sort": lambda: stack_sort_median(clients, K, T)},
            "trimmed": {"fedkernels": lambda: robust_ops.trimmed_mean(clients, K, cut),
                        "stack+sort": lambda: stack_sort_trimmed(clients, K, T, cut)},
            "window": {"fedkernels": lambda: robust_ops.median_window_mean(clients, K, window),
                       "stack+sort+argsort": lambda: stack_sort_window(clients, K, T, window)},
            "distances": {"fedkernels": lambda: robust_ops.pairwise_sq_distances(clients, K),
                          "cdist fp64": lambda: cdist_distances(clients, K, T),
                          "gram fp32": lambda: gram_distances(clients, K, T)},
            "private": {"fedkernels": lambda: fused_private(clients, K, base, 1.0, 0.01, gen),
                        "foreach": lambda: foreach_private(clients, K, T, base, 1.0, 0.01, gen)},
            "median_nan_client": {
                "fedkernels": lambda: robust_ops.coordinate_median(nan_client, K),
                "stack+sort": lambda: stack_sort_median(nan_client, K, T)},
            "trimmed_nan_client": {
                "fedkernels": lambda: robust_ops.trimmed_mean(nan_client, K, cut),
                "stack+sort": lambda: stack_sort_trimmed(nan_client, K, T, cut)},
        }
        if K * P * 8 > args.max_fp64_bytes:  # the [K, P] float64 copy would not fit
            del groups["distances"]["cdist fp64"]
        read_bytes = K * P * 4
        for case, fns in groups.items():
            if case not in cases:
                continue
            times = interleaved_medians(fns, device, repeats=args.repeats)
            for name, seconds in times.items():
                gbps = read_bytes / seconds / 1e9
                row = {"case": case, "K": K, "variant": name, "seconds": seconds,
                       "GBps_over_client_reads": gbps,
                       "fraction_of_read_probe": gbps / probes["read_GBps"],
                       "speedup_of_fedkernels": times[name] / times["fedkernels"]}
                rows.append(row)
                print(f"{case:10s} K={K:3d} {name:13s} {seconds * 1e3:10.1f} ms  "
                      f"{gbps:7.2f} GB/s  ({row['fraction_of_read_probe']:.2f} of read probe)  "
                      f"fedkernels is {row['speedup_of_fedkernels']:.2f}x faster", flush=True)
    payload = {"environment": environment(device), "clock": args.clock, "probes": probes,
               "model": {"name": "resnet18", "tensors": T, "params": P}, "rows": rows}
    print(write_results("robust_ops", device, payload, save=args.save, out=args.out))


if __name__ == "__main__":
    main()
