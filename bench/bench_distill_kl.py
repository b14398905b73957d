"""The fused distillation loss against the PyTorch expression a user writes
(docs/algorithms/distillation.md, section 4).

    OMP_NUM_THREADS=2 python bench/bench_distill_kl.py [--device cuda] [--repeats 7]
    python bench/bench_distill_kl.py --check  # exit 1 if a ratio regressed > 20 %

For N in {256, 4096, 65536} samples and C in {10, 100, 1000} classes (fp32; the largest case is
left out, 262 MB per tensor), the loss T^2 / N * KL(y || softmax(s / T)) of a student's logits s
against pseudo-labels y at T = 2, in two modes:

- ``forward``: the loss alone (evaluation);
- ``train``: the loss and its gradient to s (``loss.backward()`` on logits that require grad,
  as a distillation step runs it).

``fused`` is ``fedkernels.distill_kl(s, y, T)`` (one read of s and y; in train mode the gradient
is written in the same pass); ``torch`` is
``F.kl_div(F.log_softmax(s / T, 1), y, reduction="batchmean") * T * T``, eager, with
autograd's backward in train mode. Effective bandwidth counts the minimum traffic (read s and
y, and write the gradient in train mode) and is compared with the read-bandwidth probe measured
again right before the case (``read_probe_GBps``; harness.probes.ReadProbe). The two are timed
interleaved and the speedup is the median over rounds of the per-round ratio. Results:
bench/results/<device>.json under ``distill_kl``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

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
MODES = ("forward", "train")
MAX_ELEMENTS = 4096 * 1000 * 4  # leaves out N = 65536, C = 1000
T = 2.0


def torch_loss(s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.kl_div(F.log_softmax(s / T, 1), y, reduction="batchmean") * (T * T)


def fused_loss(s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return fedkernels.distill_kl(s, y, T)


def step(loss_fn, s: torch.Tensor, y: torch.Tensor, mode: str):
    """One call of ``mode``: the loss, or the loss and s.grad (cleared first)."""
    if mode == "forward":
        return lambda: loss_fn(s, y)

    def train():
        s.grad = None
        loss_fn(s, y).backward()
    return train


def ratios(payload: dict) -> dict[str, float]:
    """The run's ratios for --check, each higher-is-better."""
    return fused_versus_torch_ratios(payload, lambda r: f"N={r['N']} C={r['C']} {r['mode']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser, "N=8, C=5, 1 repeat, small probe: checks the script runs")
    args, device, probes, probe = start_case_run(parser, "distill_kl")
    g = torch.Generator().manual_seed(0)
    rows = []
    for N, C, calls in rows_by_classes(args, NS, CS, MAX_ELEMENTS):
        s = (3 * torch.randn(N, C, generator=g)).to(device)
        y = torch.softmax(3 * torch.randn(N, C, generator=g), 1).to(device)
        for mode in MODES:
            x = s.detach().requires_grad_(mode == "train")
            row = {"N": N, "C": C, "mode": mode, **fused_versus_torch(
                step(fused_loss, x, y, mode), step(torch_loss, x, y, mode), device,
                args.repeats, calls=calls, nbytes=4 * N * C * (3 if mode == "train" else 2),
                read_gbps=probe.read_gbps())}
            rows.append(row)
            print(f"N={N:6d} C={C:5d} {mode:8s} {fused_versus_torch_line(row)}")
            x = None
        s = y = None
    finish_case_run("distill_kl", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
