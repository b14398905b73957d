"""What subnormal inputs (below 2^-126 in float32) cost each CPU op and its PyTorch alternative,
with the calling thread in IEEE mode (the default) and in flush mode
(``torch.set_flush_denormal(True)``); csrc/cpu/parallel.h, "How a thread treats subnormal
floats".

    OMP_NUM_THREADS=2 python bench/bench_subnormals.py [--repeats 7] [--tiny]
    python bench/bench_subnormals.py --check  # exit 1 if a ratio regressed > 20 %

Every case runs on two inputs of the same shape: ``subnormal`` (30 % of the values subnormal;
for the KL, the softmax of a sharp teacher, which has them naturally) and ``normal`` (the same
values with the subnormals replaced by 0). A CPU that takes a microcode assist for a subnormal
operand or result (Intel cores without flush mode) spends far longer on the first. Cases:

- ``aggregate`` (FedAvg of K = 10 clients of 2^20 parameters) against K ``add_``;
- ``trimmed_mean`` (K = 10, beta = 0.2) against sort and mean;
- ``cosine_orthogonality`` (5 tensors of 2^18) against its PyTorch expression;
- ``ensemble_pseudo_labels`` (entropy weighting, K = 10, N = 256, C = 1000), ``distill_kl``
  (N = 1024, C = 1000) and ``energy_from_logits`` (2560 x 1000) against their references.

These last three take subnormals as 0 in any mode; the others follow the caller's mode, in every
worker thread. Each case's four calls (fused and PyTorch on both inputs) are timed interleaved
(harness.timing.interleaved_medians); ``fused_subnormal_over_normal`` is the fused op's time on
the subnormal input over its time on the normal one (1 = no cost), ``torch_...`` the same for
PyTorch, and ``speedup_on_subnormal`` PyTorch's time over the fused op's on the subnormal input.
Results: bench/results/<device>.json under ``subnormals``.
"""

from __future__ import annotations

import argparse

import torch

import fedkernels
from fedkernels.ops import reference as R

from harness.case_runs import add_case_arguments, finish_case_run, start_case_run
from harness.timing import interleaved_medians

TINY = torch.finfo(torch.float32).tiny


def with_subnormals(x: torch.Tensor, g: torch.Generator, frac: float = 0.3) -> torch.Tensor:
    pick = torch.rand(x.shape, generator=g) < frac
    return torch.where(pick, TINY * torch.rand(x.shape, generator=g), x)


def flushed(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < TINY, torch.zeros_like(x), x)


def dimensions(tiny: bool) -> tuple[int, int, int, int]:
    """(K, P, N, C) of the cases: clients, parameters per client, rows, classes."""
    K, P = (3, 1 << 10) if tiny else (10, 1 << 20)
    N, C = (8, 50) if tiny else (256, 1000)
    return K, P, N, C


def input_sizes(tiny: bool) -> dict[str, str]:
    """Each case's input size, in its rows and in --check's ratio names: a --tiny run's ratios
    are not those of the full sizes (the fused op's fixed cost dominates small inputs)."""
    K, P, N, C = dimensions(tiny)
    return {"aggregate": f"K={K} P={P}", "trimmed_mean": f"K={K} P={P}",
            "cosine_orthogonality": f"5x{max(P // 4, 16)}",
            "ensemble_pseudo_labels": f"K={K} N={N} C={C}", "distill_kl": f"N={4 * N} C={C}",
            "energy_from_logits": f"N={10 * N} C={C}"}


def cases(tiny: bool) -> dict:
    """name -> (inputs maker, fused op, PyTorch alternative); the maker takes a generator and
    returns the subnormal input (a tuple of arguments); the normal one is derived from it."""
    K, P, N, C = dimensions(tiny)
    weights = torch.rand(K, generator=torch.Generator().manual_seed(1)) + 0.1

    def torch_fedavg(clients):
        out = torch.zeros_like(clients[0][0])
        for w, c in zip(weights.tolist(), clients):
            out.add_(c[0], alpha=w)
        return out

    def torch_trimmed(clients):
        cut = int(0.2 * K)
        s = torch.stack([c[0] for c in clients]).sort(0).values
        return s[cut:K - cut].mean(0)

    def torch_cosine(g, l):  # noqa: E741
        return R.cosine_orthogonality_reference(g, l)

    def clients_maker(gen):
        return ([[with_subnormals(torch.randn(P, generator=gen), gen)] for _ in range(K)],)

    def params_maker(gen):
        n = max(P // 4, 16)
        return ([with_subnormals(torch.randn(n, generator=gen), gen) for _ in range(5)],
                [with_subnormals(torch.randn(n, generator=gen), gen) for _ in range(5)])

    def logits_maker(gen):
        return (with_subnormals(3 * torch.randn(K, N, C, generator=gen), gen),)

    def kl_maker(gen):
        n = 4 * N
        return (3 * torch.randn(n, C, generator=gen),
                torch.softmax(40 * torch.randn(n, C, generator=gen), -1))

    def energy_maker(gen):
        return (with_subnormals(3 * torch.randn(10 * N, C, generator=gen), gen),)

    return {
        "aggregate": (clients_maker, lambda c: fedkernels.aggregate(c, weights), torch_fedavg),
        "trimmed_mean": (clients_maker, lambda c: fedkernels.trimmed_mean(c, 0.2), torch_trimmed),
        "cosine_orthogonality": (params_maker, fedkernels.cosine_orthogonality, torch_cosine),
        "ensemble_pseudo_labels": (
            logits_maker,
            lambda L: fedkernels.ensemble_pseudo_labels(L, weighting="entropy"),
            lambda L: R.ensemble_pseudo_labels_reference(L, weighting="entropy")),
        "distill_kl": (kl_maker, fedkernels.distill_kl, R.distill_kl_reference),
        "energy_from_logits": (energy_maker, fedkernels.energy_from_logits,
                               lambda f: -torch.logsumexp(f, 1)),
    }


def flush_args(args: tuple):
    """The arguments with every subnormal replaced by 0 (nested lists of tensors too)."""
    if isinstance(args, torch.Tensor):
        return flushed(args)
    return type(args)(flush_args(a) for a in args)


def subnormal_share(args) -> float:
    flat = []

    def walk(a):
        if isinstance(a, torch.Tensor):
            flat.append(a)
        else:
            for b in a:
                walk(b)
    walk(args)
    total = sum(t.numel() for t in flat)
    return sum(int(((t != 0) & (t.abs() < TINY)).sum()) for t in flat) / max(total, 1)


def ratios(payload: dict) -> dict[str, float]:
    """--check's ratios, each higher-is-better: the fused op's time on normal input over its
    time on subnormal input, and PyTorch's time over the fused op's on the subnormal input."""
    found = {}
    full = input_sizes(False)  # rows recorded before the sizes were: the full sizes
    for r in payload.get("rows", []):
        case = f"{r['op']} {r.get('inputs', full.get(r['op'], '?'))} ({r['mode']} mode)"
        found[f"{case}: normal time / subnormal time"] = 1 / r["fused_subnormal_over_normal"]
        found[f"{case}: torch time / fused time on subnormals"] = r["speedup_on_subnormal"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # subnormals cost microcode assists on CPUs only; GPUs take them at full speed
    add_case_arguments(parser, "small inputs, 1 repeat, small probe: checks the script runs",
                       cpu_only=True)
    args, device, probes, _ = start_case_run(parser, "subnormals")
    repeats = args.repeats
    if not torch.set_flush_denormal(True):
        print("this CPU has no flush mode: only the IEEE-mode rows are timed")
        modes = ("ieee",)
    else:
        modes = ("ieee", "flush")
    torch.set_flush_denormal(False)
    rows = []
    gen = torch.Generator().manual_seed(0)
    sizes = input_sizes(args.tiny)
    for name, (make, fused, alternative) in cases(args.tiny).items():
        sub = make(gen)
        normal = flush_args(sub)
        share = subnormal_share(sub)
        for mode in modes:
            torch.set_flush_denormal(mode == "flush")
            try:
                t = interleaved_medians({
                    "fused_normal": lambda: fused(*normal),
                    "fused_subnormal": lambda: fused(*sub),
                    "torch_normal": lambda: alternative(*normal),
                    "torch_subnormal": lambda: alternative(*sub),
                }, device, repeats=repeats)
            finally:
                torch.set_flush_denormal(False)
            row = {"op": name, "inputs": sizes[name], "mode": mode, "subnormal_share": share,
                   **{f"{k}_us": 1e6 * v for k, v in t.items()},
                   "fused_subnormal_over_normal": t["fused_subnormal"] / t["fused_normal"],
                   "torch_subnormal_over_normal": t["torch_subnormal"] / t["torch_normal"],
                   "speedup_on_subnormal": t["torch_subnormal"] / t["fused_subnormal"]}
            rows.append(row)
            print(f"{name:24s} {mode:5s} mode ({100 * share:4.1f} % subnormal): fused "
                  f"{row['fused_normal_us']:9.1f} -> {row['fused_subnormal_us']:9.1f} us "
                  f"(x{row['fused_subnormal_over_normal']:5.2f}), torch "
                  f"{row['torch_normal_us']:9.1f} -> {row['torch_subnormal_us']:9.1f} us "
                  f"(x{row['torch_subnormal_over_normal']:5.2f}); torch time / fused time "
                  f"on subnormals {row['speedup_on_subnormal']:5.2f}")
    finish_case_run("subnormals", device, args, probes, rows, ratios)


if __name__ == "__main__":
    main()
