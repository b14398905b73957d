"""The fused energy op against the PyTorch expression a user writes (docs/algorithms/fedevg.md).

    OMP_NUM_THREADS=2 python bench/bench_energy.py [--device cuda] [--repeats 7]
    python bench/bench_energy.py --check  # exit 1 if a ratio regressed > 20 %

For N in {256, 4096, 65536} samples and C in {10, 100, 1000} classes (fp32; the largest case is
left out, 262 MB), the marginal energy E_i = -logsumexp_c f_ic that FedEvg computes for every
SGLD step:

- ``fused``: ``fedkernels.energy_from_logits(f)`` (one read of f: the row maxima, then the exps in
  base 2 from the cached row; docs/algorithms/fedevg.md);
- ``torch``: ``-torch.logsumexp(f, 1)``, eager.

Effective bandwidth counts the minimum traffic (read f, write E) and is compared with the
read-bandwidth probe measured again right before the case (``read_probe_GBps``;
harness.probes.ReadProbe). The two are timed interleaved and the speedup is the median over
rounds of the per-round ratio. Results: bench/results/<device>.json under
``energy_from_logits``.
"""

from __future__ import annotations

import argparse

import torch

import fedkernels

from harness.case_runs import (
    add_case_arguments,
    finish_case_run,
    fused_versus_torch,
    fused_versus_torch_line,
    fused_versus_torch_ratios,
    rows_by_classes,
    start_case_run,
)

NS = (256, 4096, 65536)
CS = (10, 100, 1000)
MAX_ELEMENTS = 4096 * 1000 * 4  # leaves out N = 65536, C = 1000


def ratios(payload: dict) -> dict[str, float]:
    """The run's ratios for --check, each higher-is-better."""
    return fused_versus_torch_ratios(payload, lambda r: f"N={r['N']} C={r['C']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser, "N=8, C=5, 1 repeat, small probe: checks the script runs")
    args, device, probes, probe = start_case_run(parser, "energy_from_logits")
    g = torch.Generator().manual_seed(0)
    rows = []
    for N, C, calls in rows_by_classes(args, NS, CS, MAX_ELEMENTS):
        f = (3 * torch.randn(N, C, generator=g)).to(device)
        row = {"N": N, "C": C, **fused_versus_torch(
            lambda: fedkernels.energy_from_logits(f), lambda: -torch.logsumexp(f, 1),
            device, args.repeats, calls=calls, nbytes=4 * (N * C + N),
            read_gbps=probe.read_gbps())}
        rows.append(row)
        print(f"N={N:6d} C={C:5d} {fused_versus_torch_line(row)}")
        f = None
    finish_case_run("energy_from_logits", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
