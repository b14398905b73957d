"""Where a thread team starts to pay off for one memory-bound pass on this machine, and what each
op's pass costs per byte next to it: the measurements behind ``kSerialMaxBytes`` and
``PassCost`` in csrc/cpu/parallel.h.

    python bench/bench_serial_threshold.py [--repeats 15] [--max-mib 64] [--tiny]

For inputs touching 16 KiB to ``--max-mib`` MiB in all (read + written), it times
``torch.add(a, b, out=c)`` (fp32; at::parallel_for, the loop every fedkernels CPU kernel uses)
with one thread (the calling thread) and with all of torch's threads, the two interleaved in
rounds so that load on a shared machine hits both alike. It prints the median time of each and
the median of the per-round ratios, and the smallest size from which the team is faster in
every larger size (the threshold).

Then, on one thread, it times each CPU op on inputs touching 3 MiB (as the kernel counts them)
next to ``torch.add`` touching as many, interleaved, and prints the median of the time ratios:
the op's cost per byte in units of a streaming pass, next to the class its kernel declares
(``streaming`` counts a byte once against the threshold, ``arithmetic`` four times). Results:
bench/results/<device>.json under ``serial_threshold``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from harness.cli import add_output_arguments, at_least, check_output_arguments
from harness.machine import environment
from harness.results import write_results
from harness.timing import cpu_clock


def per_call(fn, threads: int, number: int) -> float:
    torch.set_num_threads(threads)
    t0 = cpu_clock()
    for _ in range(number):
        fn()
    return (cpu_clock() - t0) / number


def op_cost_cases(touched: int) -> dict:
    """name -> (call on one thread, bytes its pass touches as the kernel counts them, the
    kernel's PassCost), fp32 inputs touching about `touched` bytes."""
    import fedkernels
    from fedkernels import privacy, robust

    ops = torch.ops.fedkernels
    g = torch.Generator().manual_seed(0)

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    words = touched // 4
    K, C = 10, 100
    P = words // (K + 1)
    clients = [[rn(P)] for _ in range(K)]
    flat = [c[0] for c in clients]
    wk = torch.full((K,), 1.0 / K, dtype=torch.float64)
    Pm = words // 3
    mix_g, mix_l = [rn(Pm)], [rn(Pm)]
    lam = torch.tensor([0.5], dtype=torch.float64)
    N_e = words // (C + 1)
    energy_logits = rn(N_e, C)
    N_p = words // ((K + 1) * C + K)
    teacher_logits, scores = rn(K, N_p, C), rn(K, N_p)
    N_k = words // (2 * C)
    student, target = rn(N_k, C), torch.softmax(rn(N_k, C), 1)
    D = words // (100 * (K + 2))
    x, grads = rn(100, D), rn(K, 100, D)
    energies, log_w = rn(K, 100), torch.zeros(K)
    P_n = words // (K + 1)
    norm_clients = [[rn(P_n)] for _ in range(K)]
    P_d = words // K
    dist_clients = [[rn(P_d)] for _ in range(K)]
    P_s = words // (K + 2)
    sum_clients = [[rn(P_s)] for _ in range(K)]
    sum_base = [rn(P_s)]
    f = 4  # bytes per fp32 value
    return {
        "weighted_sum": (lambda: ops.weighted_sum(flat, wk, [], 1.0, False),
                         (K + 1) * P * f, "streaming"),
        "mix_endpoints": (lambda: ops.mix_endpoints(mix_g, mix_l, lam), 3 * Pm * f, "streaming"),
        "energy_from_logits": (lambda: ops.energy_from_logits(energy_logits, None),
                               N_e * (C + 1) * f, "arithmetic"),
        "pseudo_labels[fedgo]": (
            lambda: ops.ensemble_pseudo_labels(teacher_logits, scores, None, "fedgo", "logits",
                                               1.0, 1.0, True),
            ((K + 1) * N_p * C + K * N_p) * f, "arithmetic"),
        "pseudo_labels[entropy]": (
            lambda: ops.ensemble_pseudo_labels(teacher_logits, None, None, "entropy", "logits",
                                               1.0, 1.0, True),
            ((K + 1) * N_p * C + K * N_p) * f, "arithmetic"),
        "distill_kl": (lambda: ops.distill_kl(student, target, 1.0, 1.0, False),
                       2 * N_k * C * f, "arithmetic"),
        "sgld_compose_step": (
            lambda: ops.sgld_compose_step(x, grads, energies, log_w, "signed", 0.1, 1.0, 3.0,
                                          0.0, 1.0, None, None),
            100 * D * (K + 2) * f, "arithmetic"),
        "coordinate_median": (lambda: robust.coordinate_median(clients), (K + 1) * P * f,
                              "arithmetic"),
        "trimmed_mean": (lambda: robust.trimmed_mean(clients, 0.2), (K + 1) * P * f,
                         "arithmetic"),
        "pairwise_sq_distances": (lambda: robust.pairwise_sq_distances(dist_clients),
                                  K * P_d * f, "arithmetic"),
        "update_norms": (lambda: privacy.update_norms(norm_clients, [torch.zeros(P_n)]),
                         (K + 1) * P_n * f, "arithmetic"),
        "private_aggregate(noise 0)": (
            lambda: fedkernels.private_aggregate(sum_clients, base=sum_base, clip_norm=1e9,
                                                 noise_std=0.0),
            # its two passes: the norms, then the clipped sum
            ((K + 1) + (K + 2)) * P_s * f, "arithmetic"),
    }


def op_costs(repeats: int, touched: int) -> dict:
    torch.set_num_threads(1)
    rows = {}
    for name, (fn, nbytes, declared) in op_cost_cases(touched).items():
        n = nbytes // 12
        a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)

        def add(a=a, b=b, c=c):
            torch.add(a, b, out=c)

        number = {}
        for label, f in (("op", fn), ("add", add)):
            once = per_call(f, 1, 3)
            number[label] = max(1, min(2000, int(5e-3 / max(once, 1e-7))))
        ratios, op_times = [], []
        for r in range(repeats):
            got = {}
            for label, f in ((("op", fn), ("add", add)) if r % 2 == 0 else
                             (("add", add), ("op", fn))):
                got[label] = per_call(f, 1, number[label])
            ratios.append(got["op"] / got["add"])
            op_times.append(got["op"])
        row = {"bytes_touched": nbytes, "one_thread_us": 1e6 * statistics.median(op_times),
               "cost_per_byte_over_add": statistics.median(ratios), "declared": declared}
        rows[name] = row
        print(f"{name:28s} {nbytes / 2**20:5.2f} MiB  one thread {row['one_thread_us']:8.1f} us"
              f"  cost x{row['cost_per_byte_over_add']:6.2f}  ({declared})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=at_least(1), default=15)
    parser.add_argument("--max-mib", type=at_least(1), default=64)
    parser.add_argument("--tiny", action="store_true",
                        help="up to 1 MiB, 1 repeat: checks the script runs")
    add_output_arguments(parser)
    args = parser.parse_args()
    check_output_arguments(args)
    if args.tiny:
        args.max_mib, args.repeats = 1, 1
    device = torch.device("cpu")
    team = torch.get_num_threads()
    if team < 2:
        sys.exit("bench_serial_threshold: torch has one thread; nothing to compare")
    rows = []
    touched = 16 << 10
    while touched <= args.max_mib << 20:
        n = touched // 12  # two fp32 inputs read, one written
        a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)

        def fn(a=a, b=b, c=c):
            torch.add(a, b, out=c)

        once = per_call(fn, 1, 3)
        number = max(1, min(2000, int(5e-3 / max(once, 1e-7))))
        serial, parallel, ratios = [], [], []
        for r in range(args.repeats):
            order = (1, team) if r % 2 == 0 else (team, 1)
            got = {threads: per_call(fn, threads, number) for threads in order}
            serial.append(got[1])
            parallel.append(got[team])
            ratios.append(got[1] / got[team])
        row = {
            "bytes_touched": touched,
            "serial_us": 1e6 * statistics.median(serial),
            "team_us": 1e6 * statistics.median(parallel),
            "serial_over_team": statistics.median(ratios),
        }
        rows.append(row)
        print(f"{touched / 1024:9.0f} KiB  one thread {row['serial_us']:10.1f} us  "
              f"{team} threads {row['team_us']:10.1f} us  one/team x{row['serial_over_team']:.2f}",
              flush=True)
        touched *= 2
    torch.set_num_threads(team)
    threshold = None
    for i, row in enumerate(rows):
        if all(r["serial_over_team"] > 1.0 for r in rows[i:]):
            threshold = row["bytes_touched"]
            break
    print("team faster from", "never" if threshold is None else f"{threshold / 1024:.0f} KiB")
    print("each op's cost per byte, one thread, in units of torch.add's:")
    costs = op_costs(max(3, args.repeats // 3), (256 << 10) if args.tiny else (3 << 20))
    torch.set_num_threads(team)
    payload = {"environment": environment(device), "threads": team, "rows": rows,
               "team_faster_from_bytes": threshold, "repeats": args.repeats,
               "op_costs": costs}
    print("wrote", write_results("serial_threshold", device, payload, save=args.save,
                                 out=args.out))


if __name__ == "__main__":
    main()
