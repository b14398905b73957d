"""Small inputs run on the calling thread (csrc/cpu/parallel.h): in a fresh process whose
OpenMP team has not been started yet, every CPU op on inputs touching ~0.3-1.5 MiB (below its
threshold: 4 MiB for streaming passes, 1 MiB for arithmetic ones; the cases
bench/bench_small_calls.py times) leaves the process's thread count alone, and so does a 3 MiB
weighted sum; a 2 MiB energy pass, arithmetic, then starts the team, which shows both that the
count sees it and that the threshold weighs a pass's cost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parent.parent / "bench"

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch

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
    w2 = torch.tensor([0.5, 0.5], dtype=torch.float64)
    streaming = [torch.randn(1 << 18) for _ in range(2)]  # 3 MiB touched in all
    torch.ops.fedkernels.weighted_sum(streaming, w2, [], 1.0, False)
    if threads() != start:
        print("TEAM weighted_sum of 3 MiB")
        sys.exit(1)
    arithmetic = torch.randn(5000, 100)  # 2 MiB touched: above the 1 MiB of an exp pass
    torch.ops.fedkernels.energy_from_logits(arithmetic, None)
    print("OK", start, threads(), len(cases))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_small_inputs_stay_on_the_calling_thread():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    # run from bench/, which `python -c` puts first on the path, as a bench script has it
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=_BENCH,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    word, start, after, count = proc.stdout.split()
    assert word == "OK"
    assert int(after) > int(start), "a 2 MiB energy pass did not start the thread team"
    assert int(count) == 29


_FORK_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import fedkernels

    def work():
        clients = [{"w": torch.full((1 << 21,), float(k))} for k in range(4)]
        mean = fedkernels.aggregate(clients, [1, 2, 3, 4], normalize=True)["w"]
        labels = fedkernels.ensemble_pseudo_labels(torch.randn(8, 512, 100), weighting="entropy")
        assert torch.allclose(mean, torch.full_like(mean, 2.0)) and labels.isfinite().all()

    torch.set_num_threads(2)
    work()  # starts the parent's OpenMP team
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # the documented step for a forked child
        work()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    raise SystemExit(os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_runs_the_ops_after_setting_one_thread():
    """docs/guide/python_api.md, Guarantees: a child forked after the parent ran a multi-threaded
    op (torch's own ops too) must call torch.set_num_threads(1) before its first op; with it the
    ops run."""
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_calls_from_several_python_threads_give_the_bits_of_one_call():
    import torch

    import fedkernels

    gen = torch.Generator().manual_seed(0)
    clients = [{"w": torch.randn(1 << 20, generator=gen)} for _ in range(5)]
    logits, scores = torch.randn(8, 512, 100, generator=gen), torch.randn(8, 512, generator=gen)

    def work():
        return (fedkernels.aggregate(clients, [1, 2, 3, 4, 5], normalize=True)["w"],
                fedkernels.ensemble_pseudo_labels(logits, scores, weighting="fedgo"),
                fedkernels.ensemble_pseudo_labels(logits, weighting="entropy"))

    expected = work()
    mismatches, errors = [], []

    def loop():
        try:
            for _ in range(5):
                got = work()
                mismatches.extend(i for i, (a, b) in enumerate(zip(got, expected))
                                  if not torch.equal(a, b))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not mismatches


def on_one_and_two_threads(fn):
    """[fn() with torch's thread count at 1, fn() at 2]; the count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("sizes", [(99_900, 100), (2047, 4097, 65_537), (2_000_003,), (3,) * 40])
def test_weighted_sum_bits_do_not_depend_on_the_thread_count(sizes):
    """The weighted sum's chunks shrink for small passes (balanced_chunk, csrc/cpu/chunk_loop.h)
    so that two threads share the work; each value is still the same sum of the clients in
    order, whatever the chunking and the number of threads."""
    import torch

    gen = torch.Generator().manual_seed(1)
    K = 10
    clients = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(K)]
    weights = torch.rand(K, generator=gen, dtype=torch.float64)
    flat = [t for c in clients for t in c]
    results = on_one_and_two_threads(lambda: torch.ops.fedkernels.weighted_sum(flat, weights, [], 1.0, False))
    for one, two in zip(*results):
        assert torch.equal(one, two)
    expected = [sum(float(w) * c[i].double() for w, c in zip(weights, clients))
                for i in range(len(sizes))]
    for got, want in zip(results[1], expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(99_900, 100), (2047, 4097, 65_537), (3,) * 40])
def test_pairwise_distances_do_not_depend_on_the_thread_count(sizes):
    """The distance pass keeps a row of partial sums per chunk, its chunks sized from the model
    alone (balanced_chunk): one and two threads give the same bits, close to float64 sums."""
    import torch

    import fedkernels

    gen = torch.Generator().manual_seed(2)
    clients = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(7)]
    results = on_one_and_two_threads(lambda: fedkernels.pairwise_sq_distances(clients))
    assert torch.equal(results[0], results[1])
    flat = torch.stack([torch.cat([t.double() for t in c]) for c in clients])
    torch.testing.assert_close(results[1].double(), torch.cdist(flat, flat).pow(2),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sizes", [(99_900, 100), (2047, 4097, 65_537)])
def test_update_norms_do_not_depend_on_the_thread_count(sizes):
    """The norms keep a partial sum per chunk and client, their chunks sized from the model
    alone (balanced_chunk): one and two threads give the same bits."""
    import torch

    import fedkernels

    gen = torch.Generator().manual_seed(3)
    clients = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(12)]
    base = [torch.randn(n, generator=gen) for n in sizes]
    results = on_one_and_two_threads(lambda: fedkernels.update_norms(clients, base))
    assert torch.equal(results[0], results[1])
    want = torch.stack([torch.cat([(x - b).double() for x, b in zip(c, base)]).norm()
                        for c in clients])
    torch.testing.assert_close(results[1].double(), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("K,N,C", [(10, 256, 100), (10, 300, 100), (40, 256, 100), (30, 1000, 10),
                                   (12, 97, 333), (4, 70, 1000)])
def test_pseudo_labels_and_energies_do_not_depend_on_the_thread_count(K, N, C):
    """With few blocks of rows, the pseudo-label and energy passes size their blocks for the
    threads that run them (split_for_threads, csrc/cpu/parallel.h): on two threads 256 rows
    of 100 classes are 16 blocks of 16, on one 13 blocks of 20. Every row is computed from its
    own values alone, so one and two threads give the same bits, for each weighting, both
    combinations and float64 and bfloat16 logits too. The KL loss keeps a float64 partial per
    block of rows, sized from N alone: its loss and gradient have the same bits too."""
    import torch

    import fedkernels

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(K, N, C, generator=gen) * 3
    scores = torch.randn(K, N, generator=gen)

    def calls():
        out = []
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            x = logits.to(dtype)
            for weighting in ("entropy", "fedgo", "variance", "uniform"):
                for combine in ("logits", "probs"):
                    out += fedkernels.ensemble_pseudo_labels(
                        x, scores.to(dtype) if weighting == "fedgo" else None,
                        weighting=weighting, combine=combine, return_weights=True)
            out.append(fedkernels.energy_from_logits(x.reshape(K * N, C)))
            student = x.reshape(K * N, C).clone().requires_grad_()
            loss = fedkernels.distill_kl(student, x.reshape(K * N, C).flip(0).float().softmax(-1).to(dtype))
            loss.backward()
            out += [loss.detach(), student.grad]
        return out

    one, two = on_one_and_two_threads(calls)
    for i, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("sizes", [(400_000,), (20_000, 3), (40_000, 7_000, 65)])
def test_chunked_passes_do_not_depend_on_the_thread_count(sizes):
    """The SuPerFed, robust and DP sum passes size their chunks so that two threads share a
    small model evenly (400 K elements had been 7 chunks, 4 on one thread): the SuPerFed pass
    from the model alone (balanced_chunk: its statistics keep a float64 partial per chunk,
    added in chunk order), the order statistics and the noisy sum for the threads that run them
    (split_for_threads: their values are per element). One and two threads give the same bits."""
    import torch

    import fedkernels
    from fedkernels.ops.mixing import mix_endpoints_with_stats

    gen = torch.Generator().manual_seed(5)
    g = [torch.randn(n, generator=gen) for n in sizes]
    loc = [torch.randn(n, generator=gen) for n in sizes]
    anchor = [torch.randn(n, generator=gen) for n in sizes]
    clients = [{f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
               for _ in range(20)]
    base = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}

    def calls():
        theta, stats = mix_endpoints_with_stats(g, loc, 0.3, anchor)
        private, norms = fedkernels.private_aggregate(
            clients, base=base, clip_norm=50.0, noise_std=0.1,
            generator=torch.Generator().manual_seed(6))
        return [*theta, stats, norms,
                *fedkernels.trimmed_mean(clients, 0.1).values(),
                *fedkernels.coordinate_median(clients).values(), *private.values()]

    one, two = on_one_and_two_threads(calls)
    for i, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), i
