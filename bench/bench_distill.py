"""The fused pseudo-label op against its PyTorch composition (docs/algorithms/distillation.md).

    OMP_NUM_THREADS=2 python bench/bench_distill.py [--device cuda] [--repeats 7]
    python bench/bench_distill.py --check  # exit 1 if a ratio regressed > 20 %

For K in {10, 40} teachers, N in {256, 4096} samples and C in {10, 100, 1000} classes (fp32):

- ``fused``: ``fedkernels.ensemble_pseudo_labels`` (weights, combination and softmax on blocks
  of samples held in cache: the logits are read from memory once);
- ``torch``: the composition a user writes (``fedkernels.ops.reference.ensemble_pseudo_labels_reference``:
  sigmoid/softmax over clients for the weights, broadcast multiply, sum over K, softmax), eager.

Weightings timed: ``fedgo`` (scores from the discriminators: the op reads L once) and
``entropy`` (a per-teacher softmax and entropy first: the composition materialises several
[K, N, C] intermediates). Effective bandwidth counts the minimum traffic (read L and the scores,
write y and w) and is compared with the read-bandwidth probe measured again right before the
case (``read_probe_GBps``; harness.probes.ReadProbe). The machine may be shared: each fused op
is timed interleaved with its composition, and a ratio is the median over rounds of the
per-round ratio; ``entropy_over_fedgo_median_of_ratios`` (the entropy weighting's time over
FedGO's) comes from rounds of the two fused calls alone, with a third call in the same rounds:
``fedkernels.energy_from_logits`` over the same K * N rows, which takes the row maxima and sums
of exps with the entropy weighting's own exp code and nothing else
(``softmax_stats_over_fedgo_median_of_ratios``). Where the logits stay in cache between the
rounds, arithmetic sets all three times, and the entropy weighting does that work plus FedGO's
combination and output softmax: there a ratio above 0.3 means the entropy weighting cannot come
within 1.3x of FedGO's time without faster exps. Where the logits come from memory, the exps can
overlap the reads and the bound does not apply. Each fused op also runs back to back
(``fused_back_to_back_ms``): interleaved with the composition, whose large temporaries can make
the C library hand memory back to the system, the op's outputs may land on fresh pages, and
every 4 KiB of them then costs a page fault inside the call (``fused_faults_per_call``); back to
back, the allocator reuses the previous call's pages. Results: bench/results/<device>.json under
``ensemble_pseudo_labels``.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

import fedkernels
from fedkernels.ops import reference as R

from harness.case_runs import add_case_arguments, finish_case_run, start_case_run
from harness.memory import minor_faults
from harness.timing import timed

KS = (10, 40)
NS = (256, 4096)
CS = (10, 100, 1000)
WEIGHTINGS = ("fedgo", "entropy")


def interleaved(fns: dict, device, repeats: int) -> tuple[dict, dict]:
    """Times of every function over ``repeats`` interleaved rounds, and the page faults of
    each call."""
    for fn in fns.values():  # warm-up
        fn()
        fn()
    times = {k: [] for k in fns}
    faults = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            before = minor_faults()
            times[k].append(timed(fn, device))
            faults[k].append(minor_faults() - before)
    return times, faults


def ratios(payload: dict) -> dict[str, float]:
    """The run's ratios for --check, each higher-is-better: the PyTorch composition's time over
    the fused op's, and the fused op's bandwidth over the read probe."""
    found = {}
    for r in payload.get("rows", []):
        case = f"K={r['K']} N={r['N']} C={r['C']} {r['weighting']}"
        found[f"{case}: torch time / fused time"] = r.get("speedup_median_of_ratios")
        found[f"{case}: fused GB/s / read probe"] = r.get("fused_fraction_of_read_probe")
        if r.get("entropy_over_fedgo_median_of_ratios"):
            found[f"{case}: fedgo time / entropy time"] = 1 / r["entropy_over_fedgo_median_of_ratios"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser, "K=2, N=8, C=5, 1 repeat, small probe: checks the script runs")
    args, device, probes, probe = start_case_run(parser, "ensemble_pseudo_labels")
    ks, ns, cs = ((2,), (8,), (5,)) if args.tiny else (KS, NS, CS)
    rows = []
    g = torch.Generator().manual_seed(0)
    for K in ks:
        for N in ns:
            for C in cs:
                L = (3 * torch.randn(K, N, C, generator=g)).to(device)
                z = torch.randn(K, N, generator=g).to(device)
                n = torch.arange(1, K + 1, dtype=torch.float64) * 10
                fns = {}
                for weighting in WEIGHTINGS:
                    s = z if weighting == "fedgo" else None
                    kw = dict(weighting=weighting, sample_sizes=n if s is not None else None)
                    fns[f"{weighting}_fused"] = partial(fedkernels.ensemble_pseudo_labels, L, s, **kw)
                    fns[f"{weighting}_torch"] = partial(R.ensemble_pseudo_labels_reference, L, s, **kw)
                read = probe.read_gbps()
                big = K * N * C >= 40 * 4096 * 100
                reps = max(3, args.repeats // 2) if big else args.repeats
                # Each fused op interleaved with its composition; then the two fused ops in
                # rounds of their own, for their ratio side by side (with the compositions between
                # them, one op would run after the other's large temporaries, the other not).
                times, faults = {}, {}
                for weighting in WEIGHTINGS:
                    pair = {k: fns[f"{weighting}_{k}"] for k in ("fused", "torch")}
                    t, f = interleaved(pair, device, reps)
                    times.update({f"{weighting}_{k}": v for k, v in t.items()})
                    faults.update({f"{weighting}_{k}": v for k, v in f.items()})
                # The entropy weighting's softmax statistics alone, as energy_from_logits takes
                # them over the same K * N rows (row maxima and sums of exps, the same exps,
                # without the entropy's second sum, the weights, the combination or the output):
                # a floor under the entropy weighting's extra time over FedGO's.
                side_by_side, _ = interleaved(
                    {**{w: fns[f"{w}_fused"] for w in WEIGHTINGS},
                     "stats": partial(fedkernels.energy_from_logits, L.view(K * N, C))},
                    device, max(reps, args.repeats))
                for weighting in WEIGHTINGS:
                    fused_fn = fns[f"{weighting}_fused"]
                    before = minor_faults()
                    back_to_back = [timed(fused_fn, device) for _ in range(reps)]
                    back_to_back_faults = (minor_faults() - before) / reps
                    t_fused, t_torch = times[f"{weighting}_fused"], times[f"{weighting}_torch"]
                    has_scores = weighting == "fedgo"
                    nbytes = 4 * (K * N * C + (K * N if has_scores else 0) + N * C + K * N)
                    fused = statistics.median(t_fused)
                    repeated = statistics.median(back_to_back)
                    ref = statistics.median(t_torch)
                    ratio = statistics.median(t / f for t, f in zip(t_torch, t_fused))
                    row = {
                        "K": K, "N": N, "C": C, "weighting": weighting,
                        "fused_ms": 1e3 * fused, "torch_ms": 1e3 * ref,
                        "speedup_median_of_ratios": ratio,
                        "min_traffic_bytes": nbytes,
                        "fused_GBps": nbytes / fused / 1e9,
                        "read_probe_GBps": read,
                        "fused_fraction_of_read_probe": nbytes / fused / 1e9 / read,
                        "fused_faults_per_call": statistics.median(faults[f"{weighting}_fused"]),
                        "fused_back_to_back_ms": 1e3 * repeated,
                        "back_to_back_fraction_of_read_probe": nbytes / repeated / 1e9 / read,
                        "back_to_back_faults_per_call": back_to_back_faults,
                        "torch_GBps": nbytes / ref / 1e9,
                    }
                    versus = ""
                    if weighting == "entropy":
                        row["entropy_over_fedgo_median_of_ratios"] = statistics.median(
                            e / f for e, f in zip(side_by_side["entropy"], side_by_side["fedgo"]))
                        row["softmax_stats_over_fedgo_median_of_ratios"] = statistics.median(
                            s / f for s, f in zip(side_by_side["stats"], side_by_side["fedgo"]))
                        versus = (f"; {row['entropy_over_fedgo_median_of_ratios']:.2f}x fedgo's "
                                  f"time, its exps alone "
                                  f"{row['softmax_stats_over_fedgo_median_of_ratios']:.2f}x")
                    rows.append(row)
                    print(f"K={K:3d} N={N:5d} C={C:5d} {weighting:8s} fused {1e3*fused:9.3f} ms "
                          f"torch {1e3*ref:9.3f} ms  x{ratio:5.2f}  "
                          f"{row['fused_GBps']:6.1f} GB/s "
                          f"({100*row['fused_fraction_of_read_probe']:.0f}% of read at "
                          f"{read:.1f} GB/s){versus}; back to back "
                          f"{100*row['back_to_back_fraction_of_read_probe']:.0f}%; page faults "
                          f"per call {row['fused_faults_per_call']:.0f} interleaved, "
                          f"{back_to_back_faults:.0f} back to back")
                L = z = fns = None  # free this size before allocating the next
    finish_case_run("ensemble_pseudo_labels", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
