"""Where a thread team starts to pay off for one memory-bound pass on this machine: the
measurement behind ``kSerialMaxBytes`` in csrc/cpu/parallel.h.

    python bench/bench_serial_threshold.py [--repeats 15] [--max-mib 64] [--tiny]

For inputs touching 16 KiB to ``--max-mib`` MiB in all (read + written), it times
``torch.add(a, b, out=c)`` (fp32; at::parallel_for, the loop every fedkernels CPU kernel uses)
with one thread (the calling thread) and with all of torch's threads, the two interleaved in
rounds so that load on a shared machine hits both alike. It prints the median time of each and
the median of the per-round ratios, and the smallest size from which the team is faster in
every larger size (the threshold). Results: bench/results/<device>.json under
``serial_threshold``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_output_arguments,
    check_output_arguments,
    cpu_clock,
    environment,
    write_results,
)


def per_call(fn, threads: int, number: int) -> float:
    torch.set_num_threads(threads)
    t0 = cpu_clock()
    for _ in range(number):
        fn()
    return (cpu_clock() - t0) / number


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-mib", type=int, default=64)
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
    payload = {"environment": environment(device), "threads": team, "rows": rows,
               "team_faster_from_bytes": threshold, "repeats": args.repeats}
    print("wrote", write_results("serial_threshold", device, payload, save=args.save,
                                 out=args.out))


if __name__ == "__main__":
    main()
