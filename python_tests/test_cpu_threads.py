"""Small inputs run on the calling thread (csrc/cpu/parallel.h): in a fresh process whose
OpenMP team has not been started yet, every CPU op on inputs touching ~0.3-3 MiB (below the
4 MiB threshold, above the old per-op grains; the cases bench/bench_small_calls.py times) leaves
the process's thread count alone; a large input then starts the team, which shows the count does
see it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parent.parent / "bench"

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch

    sys.path.insert(0, sys.argv[1])
    from bench_small_calls import small_op_cases  # the cases bench_small_calls.py times

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(1)  # build the inputs without starting the team
    cases = small_op_cases()
    torch.set_num_threads(2)
    start = threads()
    for name, fn in cases.items():
        fn()
        if threads() != start:
            print("TEAM", name)
            sys.exit(1)
    big = torch.randn(20000, 100)  # 8 MB: above the threshold
    torch.ops.fedkernels.energy_from_logits(big, None)
    print("OK", start, threads(), len(cases))
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_small_inputs_stay_on_the_calling_thread():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(_BENCH)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    word, start, after, count = proc.stdout.split()
    assert word == "OK"
    assert int(after) > int(start), "a large input did not start the thread team"
    assert int(count) == 29
