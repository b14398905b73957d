"""The fused FedEvg server step against its PyTorch composition (docs/algorithms/fedevg.md,
section 5).

    OMP_NUM_THREADS=2 python bench/bench_sgld.py [--device cuda] [--repeats 7] [--max-elements N]
    python bench/bench_sgld.py --check     # exit 1 if a ratio regressed > 20 %

For K in {10, 100} clients, M in {100, 1000} synthetic samples, D = 3*32*32 (fp32, signed
weighting, tau = 3, clamp [0, 1], drawn noise):

- ``fused``: ``fedkernels.sgld_compose_step`` (weights, clipped weighted sum over K, step, noise,
  clamp in one pass over grads);
- ``fused_inplace``: the same with ``inplace=True``, as FedEvg's server loop calls it;
- ``fused_back_to_back``: the out-of-place op again, in a run of calls of its own after the
  interleaved rounds. Interleaved with the PyTorch composition, whose large temporaries make
  the C library hand memory back to the operating system, every out-of-place call writes
  ``x'`` into fresh pages and takes one page fault per 4 KiB inside the timed call
  (``fused_faults_per_call``, counted with getrusage); back to back, the allocator reuses the
  previous call's pages and the faults stop. Both are what users see: the first in a program
  that allocates large temporaries between calls, the second in a loop of calls;
- ``torch``: what a user writes: ``softmax`` over clients, ``clamp`` of G, ``einsum``, ``randn``,
  ``clamp``, eager.

Effective bandwidth counts the op's minimum traffic, (K + 2)*M*D*4 bytes plus the K x M energies
and weights: every client gradient read once, ``x`` read once, ``x'`` written once (the
convention of bench_aggregate.py and bench_distill.py), and is compared with the read-bandwidth
probe measured again right before the case (``read_probe_GBps``; harness.probes.ReadProbe);
``grads_fraction_of_read_probe`` counts ``grads`` alone. The variants are timed interleaved; the
speedup is the median over rounds of the per-round ratio. Results: bench/results/<device>.json
under ``sgld_compose_step``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fedkernels

from harness.case_runs import add_case_arguments, finish_case_run, start_case_run
from harness.cli import at_least
from harness.memory import minor_faults
from harness.timing import timed

KS = (10, 100)
MS = (100, 1000)
D = 3 * 32 * 32


def torch_compose(x, grads, energies, log_w, beta, delta, gen):
    pi = torch.softmax(log_w[:, None] + torch.sign(-energies), dim=0)
    a = torch.einsum("km,kmd->md", pi, grads.clamp(-3.0, 3.0))
    noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
    return (x - beta * a + delta * noise).clamp(0.0, 1.0)


def ratios(payload: dict) -> dict[str, float]:
    """The run's ratios for --check, each higher-is-better: the PyTorch composition's time over
    the fused op's, and the fused op's bandwidth (out of place and in place) over the read
    probe."""
    found = {}
    for r in payload.get("rows", []):
        case = f"K={r['K']} M={r['M']}"
        found[f"{case}: torch time / fused time"] = r.get("speedup_median_of_ratios")
        found[f"{case}: fused GB/s / read probe"] = r.get("fused_fraction_of_read_probe")
        found[f"{case}: in-place GB/s / read probe"] = r.get("inplace_fraction_of_read_probe")
        found[f"{case}: back-to-back GB/s / read probe"] = r.get(
            "back_to_back_fraction_of_read_probe")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser, "K=2, M=3, 1 repeat, small probe: checks the script runs")
    parser.add_argument("--max-elements", type=at_least(1), default=10**9,
                        help="skip sizes whose grads have more elements (memory)")
    args, device, probes, probe = start_case_run(parser, "sgld_compose_step")
    ks, ms = ((2,), (3,)) if args.tiny else (KS, MS)
    rows = []
    for K in ks:
        for M in ms:
            if K * M * D > args.max_elements:
                print(f"K={K} M={M}: skipped (--max-elements)")
                continue
            g = torch.Generator(device=device).manual_seed(0)
            grads = torch.randn(K, M, D, device=device, generator=g)
            x = torch.rand(M, D, device=device, generator=g)
            energies = torch.randn(K, M, device=device, generator=g)
            log_w = torch.log(torch.rand(K, device=device, generator=g) + 0.1)
            x_inplace = x.clone()
            gen = torch.Generator(device=device).manual_seed(1)
            fns = {
                "fused": lambda: fedkernels.sgld_compose_step(
                    x, grads, energies, log_w, mode="signed", step_size=10.0, noise_std=0.01,
                    grad_clip=3.0, clamp=(0.0, 1.0), generator=gen),
                "fused_inplace": lambda: fedkernels.sgld_compose_step(
                    x_inplace, grads, energies, log_w, mode="signed", step_size=10.0,
                    noise_std=0.01, grad_clip=3.0, clamp=(0.0, 1.0), generator=gen, inplace=True),
                "torch": lambda: torch_compose(x, grads, energies, log_w, 10.0, 0.01, gen),
            }
            read = probe.read_gbps()
            for fn in fns.values():
                fn()
            times = {k: [] for k in fns}
            faults = []
            reps = args.repeats if K * M < 100 * 1000 else max(3, args.repeats // 2)
            for _ in range(reps):
                for k, fn in fns.items():
                    before = minor_faults()
                    times[k].append(timed(fn, device))
                    if k == "fused":
                        faults.append(minor_faults() - before)
            fns["fused"]()
            before = minor_faults()
            back_to_back = [timed(fns["fused"], device) for _ in range(reps)]
            back_to_back_faults = (minor_faults() - before) / reps
            grads_bytes = 4 * K * M * D
            nbytes = grads_bytes + 4 * (2 * M * D + 2 * K * M)
            fused = statistics.median(times["fused"])
            inplace = statistics.median(times["fused_inplace"])
            repeated = statistics.median(back_to_back)
            ref = statistics.median(times["torch"])
            ratio = statistics.median(t / f for t, f in zip(times["torch"], times["fused"]))
            row = {
                "K": K, "M": M, "D": D, "fused_ms": 1e3 * fused, "torch_ms": 1e3 * ref,
                "fused_inplace_ms": 1e3 * inplace, "fused_back_to_back_ms": 1e3 * repeated,
                "read_probe_GBps": read,
                "inplace_fraction_of_read_probe": nbytes / inplace / 1e9 / read,
                "back_to_back_fraction_of_read_probe": nbytes / repeated / 1e9 / read,
                "fused_faults_per_call": statistics.median(faults),
                "back_to_back_faults_per_call": back_to_back_faults,
                "speedup_median_of_ratios": ratio, "grads_bytes": grads_bytes,
                "min_traffic_bytes": nbytes, "fused_GBps": nbytes / fused / 1e9,
                "fused_fraction_of_read_probe": nbytes / fused / 1e9 / read,
                "grads_fraction_of_read_probe": grads_bytes / fused / 1e9 / read,
                "torch_GBps": nbytes / ref / 1e9,
            }
            rows.append(row)
            print(f"K={K:3d} M={M:5d} fused {1e3*fused:9.3f} ms torch {1e3*ref:9.3f} ms x{ratio:5.2f} "
                  f"{row['fused_GBps']:6.1f} GB/s ({100*row['fused_fraction_of_read_probe']:.0f}% of read; "
                  f"grads alone {100*row['grads_fraction_of_read_probe']:.0f}%); "
                  f"inplace {1e3*inplace:.3f} ms ({100*row['inplace_fraction_of_read_probe']:.0f}%); "
                  f"back to back {1e3*repeated:.3f} ms "
                  f"({100*row['back_to_back_fraction_of_read_probe']:.0f}%); page faults per call "
                  f"{row['fused_faults_per_call']:.0f} interleaved, {back_to_back_faults:.0f} back to "
                  f"back; read probe {read:.1f} GB/s")
            grads = fns = None  # free this size before allocating the next
    finish_case_run("sgld_compose_step", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
