"""Small inputs run on the calling thread (csrc/cpu/parallel.h): in a fresh process whose
OpenMP team has not been started yet, every CPU op on inputs touching ~0.3-2 MiB (below the
4 MiB threshold, above the old per-op grains) leaves the process's thread count alone; a large
input then starts the team, which shows the count does see it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import fedkernels  # noqa: F401

    ops = torch.ops.fedkernels

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(1)  # build the inputs without starting the team
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
    student, target = rn(1024, 100), torch.softmax(rn(1024, 100), 1)
    x, grads = torch.rand(4, 16384), rn(2, 4, 16384)
    energies, log_w = rn(2, 4), torch.zeros(2)
    w2 = torch.tensor([0.25, 0.75], dtype=torch.float64)
    outs, bases = [torch.empty_like(t) for t in P], [t.clone() for t in P]
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
    torch.set_num_threads(2)
    start = threads()
    for name, fn in cases.items():
        fn()
        if threads() != start:
            print("TEAM", name)
            sys.exit(1)
    big = rn(20000, 100)  # 8 MB: above the threshold
    ops.energy_from_logits(big, None)
    print("OK", start, threads(), len(cases))
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_small_inputs_stay_on_the_calling_thread():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    word, start, after, count = proc.stdout.split()
    assert word == "OK"
    assert int(after) > int(start), "a large input did not start the thread team"
    assert int(count) == 23
