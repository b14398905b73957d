"""Per-call time of every CPU op on small inputs (~0.1-1.5 MiB touched), on a quiet machine and
with the cores kept busy: the check that small calls never wait for the thread team
(csrc/cpu/parallel.h).

    python bench/bench_small_calls.py [--repeats 200] [--busy 2] [--tiny]

Each case is timed ``--repeats`` times, one call per sample, cases interleaved in rounds; the
median and the 90th percentile per call are printed in microseconds. With ``--busy N`` the same
cases are timed again while N spinning processes hold the cores (N = number of cores: every
core busy), next to ``torch.add`` on 1 MiB with torch's threads, the kind of call that waits a
scheduler quantum for a busy core. ``python_tests/test_cpu_threads.py`` runs the same cases and
checks that none of them starts the thread team. The differentiable ops are also timed as a
training step uses them (``with grad: ...``): the public wrapper on inputs that require grad
and ``backward()`` of a scalar, interleaved with the same step written in PyTorch ops
(``with grad, PyTorch: ...``, the formulas of fedkernels.ops.reference); at these sizes most of
either step is per-call overhead (the wrappers', the dispatcher's and autograd's), and
``torch_over_fused`` is the median over rounds of the per-round ratio. Results:
bench/results/<device>.json under ``small_calls``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

from harness.cli import add_output_arguments, check_output_arguments, fail
from harness.machine import environment
from harness.results import write_results


def small_op_cases() -> dict:
    """name -> call of one fedkernels CPU op on inputs touching ~0.3-1.5 MiB: under the
    threshold of csrc/cpu/parallel.h, 4 MiB for streaming passes (weighted_sum, the SuPerFed
    mix) and 1 MiB for arithmetic ones (all the others)."""
    import fedkernels  # noqa: F401

    ops = torch.ops.fedkernels
    g = torch.Generator().manual_seed(0)

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    P = [rn(60000), rn(300, 200)]
    Q = [rn(60000), rn(300, 200)]
    R = [rn(60000), rn(300, 200)]
    lam = torch.tensor([0.3, 0.7], dtype=torch.float64)
    H = torch.rand(2, 4, dtype=torch.float64)
    logits = rn(4, 512, 100)
    scores = rn(4, 512)
    student, target = rn(768, 100), torch.softmax(rn(768, 100), 1)
    x, grads = torch.rand(4, 12288), rn(2, 4, 12288)
    energies, log_w = rn(2, 4), torch.zeros(2)
    w2 = torch.tensor([0.25, 0.75], dtype=torch.float64)
    outs, bases = [torch.empty_like(t) for t in P], [t.clone() for t in P]
    clients = [[rn(18000), rn(90, 200)] for _ in range(5)]
    base = [rn(18000), rn(90, 200)]
    w5 = torch.full((5,), 0.2, dtype=torch.float64)
    cases = {
        "weighted_sum": lambda: ops.weighted_sum(P + Q, w2, [], 1.0, False),
        "weighted_sum.out": lambda: ops.weighted_sum.out(P + Q, w2, [], 1.0, False, out=outs),
        "weighted_sum_": lambda: ops.weighted_sum_(bases, Q, w2[:1], 1.0, True),
        "mix_endpoints": lambda: ops.mix_endpoints(P, Q, lam),
        "mix_endpoints_backward": lambda: ops.mix_endpoints_backward(
            R, P, Q, lam, [True, True, True]),
        "superfed_stats": lambda: ops.superfed_stats(P, Q, R),
        "superfed_stats_backward": lambda: ops.superfed_stats_backward(
            H, P, Q, R, [True, True, True]),
        "mix_endpoints_with_stats": lambda: ops.mix_endpoints_with_stats(P, Q, lam, R),
        "mix_endpoints_with_stats_backward": lambda: ops.mix_endpoints_with_stats_backward(
            R, H, P, Q, lam, R, [True, True, True, True]),
        "energy_from_logits": lambda: ops.energy_from_logits(student, None),
        "sgld_step": lambda: ops.sgld_step(x, x, 0.1, 1.0, 3.0, 0.0, 1.0, None, None),
        "sgld_compose_step": lambda: ops.sgld_compose_step(
            x, grads, energies, log_w, "signed", 0.1, 1.0, 3.0, 0.0, 1.0, None, None),
        "distill_kl": lambda: ops.distill_kl(student, target, 2.0, 1.0, True),
    }
    for weighting in ("uniform", "entropy", "fedgo", "variance", "domain"):
        for combine in ("logits", "probs"):
            cases[f"ensemble_pseudo_labels[{weighting},{combine}]"] = (
                lambda w=weighting, c=combine: ops.ensemble_pseudo_labels(
                    logits, scores if w in ("fedgo", "domain") else None, None, w, c, 2.0,
                    1.0, True))
    # The robust and private aggregations, through their public functions.
    from fedkernels import privacy, robust

    cases.update({
        "coordinate_median": lambda: robust.coordinate_median(clients),
        "trimmed_mean": lambda: robust.trimmed_mean(clients, 0.2),
        "nearest_to_median_mean": lambda: robust.nearest_to_median_mean(clients, 3),
        "pairwise_sq_distances": lambda: robust.pairwise_sq_distances(clients),
        "update_norms": lambda: privacy.update_norms(clients, base),
        "private_aggregate": lambda: privacy.private_aggregate(
            clients, w5, base=base, clip_norm=1.0, noise_std=0.1, generator=g),
    })
    return cases


def small_grad_cases() -> dict:
    """name -> (fedkernels step, PyTorch step): one differentiable op as a training step calls
    it on small inputs (a few KiB to 100 KiB), forward on leaves that require grad, then
    ``backward()`` of a scalar, their gradients cleared first; the PyTorch step runs the op's
    reference formula (fedkernels.ops.reference) on the same leaves."""
    import fedkernels
    from fedkernels import ops
    from fedkernels.ops import reference as R

    g = torch.Generator().manual_seed(1)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    def step(loss, leaves):
        def run():
            for t in leaves:
                t.grad = None
            loss().backward()
        return run

    def total(tensors):
        return sum(t.sum() for t in tensors)

    def pair(fused_loss, torch_loss, leaves):
        return step(fused_loss, leaves), step(torch_loss, leaves)

    cases = {}
    for C in (10, 100):
        s, y = leaf(256, C), torch.softmax(torch.randn(256, C, generator=g), 1)
        cases[f"distill_kl[N=256,C={C}]"] = pair(
            lambda s=s, y=y: fedkernels.distill_kl(s, y, 2.0),
            lambda s=s, y=y: R.distill_kl_reference(s, y, 2.0), [s])
    L = leaf(4, 256, 10)
    z = torch.randn(4, 256, generator=g)
    n = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    r = torch.rand(256, 10, generator=g)
    kw = dict(weighting="fedgo", sample_sizes=n)
    cases["ensemble_pseudo_labels[fedgo,K=4,N=256,C=10]"] = pair(
        lambda: (fedkernels.ensemble_pseudo_labels(L, z, **kw) * r).sum(),
        lambda: (R.ensemble_pseudo_labels_reference(L, z, **kw) * r).sum(), [L])
    E = leaf(1024, 10)
    cases["energy_from_logits[N=1024,C=10]"] = pair(
        lambda: fedkernels.energy_from_logits(E).sum(),
        lambda: R.energy_from_logits_reference(E).sum(), [E])
    shapes = [(64, 32), (64,), (10, 64), (10,)]  # a small MLP's parameters
    P, Q = [leaf(*sh) for sh in shapes], [leaf(*sh) for sh in shapes]
    cases["mix_endpoints[MLP, 4 tensors]"] = pair(
        lambda: total(ops.mix_endpoints(P, Q, 0.3)),
        lambda: total(R.mix_endpoints_reference(P, Q, 0.3)), P + Q)
    clients = [[leaf(*sh) for sh in shapes] for _ in range(4)]
    w4 = torch.full((4,), 0.25, dtype=torch.float64)
    flat = [t for c in clients for t in c]
    cases["weighted_sum[MLP, 4 tensors, K=4]"] = pair(
        lambda: total(ops.weighted_sum(flat, w4)),
        lambda: total(R.weighted_sum_reference(clients, w4)), flat)
    return cases


def time_cases(cases: dict, repeats: int) -> dict[str, list[float]]:
    """``repeats`` samples of every case, one call per case per round; every other round runs
    the cases in reverse, so that no case always follows the same one: a case timed right
    after another pays for what that one leaves behind (a woken thread team, evicted caches)."""
    for fn in cases.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases.items())
    for r in range(repeats):
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_us": 1e6 * statistics.median(ordered),
            "p90_us": 1e6 * ordered[int(0.9 * (len(ordered) - 1))]}


def busy_processes(n: int) -> list[subprocess.Popen]:
    # A spinner stops when this process is gone (its parent is no longer this pid): a
    # benchmark killed by SIGTERM or SIGKILL, which skips the finally that kills them, would
    # otherwise leave every core spinning for the hour. The pid is passed in, not read at the
    # spinner's start, which may come after this process has gone.
    spin = ("import os, time\nt = time.time()\n"
            f"while time.time() - t < 3600 and os.getppid() == {os.getpid()}: pass\n")
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def _exit_on_sigterm(signum, frame) -> None:
    # SIGTERM (timeout, kill) as an exit, so that the finally stops the spinners now
    sys.exit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="also time every case while N spinning processes hold the cores")
    parser.add_argument("--tiny", action="store_true", help="5 repeats: checks the script runs")
    add_output_arguments(parser)
    args = parser.parse_args()
    check_output_arguments(args)
    if args.tiny:
        args.repeats = 5
    if args.repeats < 1:
        fail(f"--repeats must be at least 1, got {args.repeats}")
    if args.busy < 0:
        fail(f"--busy must be 0 or more spinning processes, got {args.busy}")
    device = torch.device("cpu")
    cases = small_op_cases()
    n = (1 << 20) // 12  # torch.add on 1 MiB touched, with torch's threads
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    grad_pairs = small_grad_cases()
    for name, (fused, composed) in grad_pairs.items():
        cases[f"with grad: {name}"] = fused
        cases[f"with grad, PyTorch: {name}"] = composed
    cases["torch.add (1 MiB, reference)"] = lambda: torch.add(a, b, out=c)
    print(f"# {environment(device)['device']}  torch threads {torch.get_num_threads()}  "
          f"{len(cases)} cases x {args.repeats} calls", flush=True)
    phases = {"quiet": 0} | ({"busy": args.busy} if args.busy else {})
    if args.busy:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    rows = {name: {} for name in cases}
    for phase, spinners in phases.items():
        procs = busy_processes(spinners)
        try:
            if procs:
                time.sleep(0.5)  # let the spinners start
            samples = time_cases(cases, args.repeats)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        for name, s in samples.items():
            rows[name][phase] = summary(s)
        for name in grad_pairs:
            fused, composed = samples[f"with grad: {name}"], samples[f"with grad, PyTorch: {name}"]
            rows[f"with grad: {name}"][phase]["torch_over_fused"] = statistics.median(
                t / f for t, f in zip(composed, fused))
    header = "".join(f"  {p} median / p90 (us)" for p in phases)
    print(f"{'case':66s}{header}")
    for name, row in rows.items():
        cols = "".join(f"  {row[p]['median_us']:9.1f} / {row[p]['p90_us']:9.1f}   " for p in phases)
        versus = "".join(f"  {p}: PyTorch {row[p]['torch_over_fused']:.2f}x the time"
                         for p in phases if "torch_over_fused" in row[p])
        print(f"{name:66s}{cols}{versus}")
    payload = {"environment": environment(device), "threads": torch.get_num_threads(),
               "busy_processes": args.busy, "repeats": args.repeats,
               "rows": [{"case": name} | row for name, row in rows.items()]}
    print("wrote", write_results("small_calls", device, payload, save=args.save, out=args.out))


if __name__ == "__main__":
    main()
