"""The comparisons with a framework's own aggregation on K = 10 and 100 ResNet-18-sized clients
(bench_fedlab.py, bench_fedml.py, bench_nvflare.py): their flags, markdown table and results
file.
"""

from __future__ import annotations

import argparse
import json
import os

from .cli import at_least


def write_peer_results(path: str, payload: dict, table: str) -> None:
    """Writes a framework comparison's results JSON (bench_fedlab.py, bench_fedml.py,
    bench_nvflare.py) and prints its markdown table and where it went."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print()
    print(table)
    print(f"\nwritten: {path}")


def add_peer_arguments(parser: argparse.ArgumentParser, results: str) -> None:
    """The arguments of the comparisons with a framework's own aggregation on K = 10 and 100
    ResNet-18-sized clients (bench_fedlab.py, bench_fedml.py); ``results`` names the default
    results file."""
    parser.add_argument("--quick", action="store_true", help="K = 10 only, 3 repeats")
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--threads", type=at_least(1), help="torch threads (default: torch's)")
    parser.add_argument("--out", metavar="FILE", help=f"results JSON (default {results})")
    parser.add_argument("--child-memory", nargs=2, metavar=("K", "IMPL"), help=argparse.SUPPRESS)


def peer_table(title: str, peer: str, rows: list[dict], read_gbps: float) -> str:
    """The markdown table of a framework comparison: ``rows`` hold ``K``, ``<peer>_ms``,
    ``fedkernels_ms``, ``speedup``, ``fedkernels_GBps``, ``max_abs_diff`` and, unless the
    memory children were skipped, ``<peer>_peak_MB`` and ``fedkernels_peak_MB``."""
    name = {"fedlab": "FedLab", "fedml": "FedML"}.get(peer, peer)
    lines = [title, "",
             f"| K | {name} ms | fedkernels ms | speed-up | {name} peak | fedkernels peak "
             "| fedkernels GB/s (% of read probe) | max abs diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = [f"{r[f'{i}_peak_MB']:.0f} MB" if f"{i}_peak_MB" in r else "-"
               for i in (peer, "fedkernels")]
        lines.append(
            f"| {r['K']} | {r[f'{peer}_ms']:.1f} | {r['fedkernels_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {mem[0]} | {mem[1]} | {r['fedkernels_GBps']:.1f} "
            f"({100 * r['fedkernels_GBps'] / read_gbps:.0f} %) | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)
