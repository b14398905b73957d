"""How the benchmarks time a call: CUDA events on a GPU; on the CPU a chosen clock (wall time,
or this process's CPU time on a machine shared with other work); medians over repeats.

The machines these run on are shared, so every case is timed in rounds, each round timing the
case and all its baselines once (:func:`interleaved_medians`): a burst of load hits them all
alike, and their ratios stay meaningful even when absolute times move.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The clock of CPU timings: wall time by default. ``use_cpu_clock("process")`` switches to the
# CPU time of this process, which leaves out the time other processes held the cores: on a
# machine shared with other work, a sample then measures this process's work rather than its
# turn in the queue. It sums over threads, so use it with one torch thread.
_CPU_CLOCK: Callable[[], float] = time.perf_counter
CPU_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def use_cpu_clock(name: str) -> None:
    global _CPU_CLOCK
    _CPU_CLOCK = CPU_CLOCKS[name]


def cpu_clock() -> float:
    """The current reading of the CPU timings' clock (see use_cpu_clock)."""
    return _CPU_CLOCK()


def cpu_clock_name() -> str:
    """The name in CPU_CLOCKS of the clock that CPU timings use now."""
    return next(name for name, clock in CPU_CLOCKS.items() if clock is _CPU_CLOCK)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Time of one ``fn()`` call in seconds (CUDA: measured with events, synchronized; CPU:
    the clock chosen with use_cpu_clock, wall time by default)."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = _CPU_CLOCK()
    result = fn()
    elapsed = _CPU_CLOCK() - t0
    # Freed after the clock: a caller keeps what a call returns, and handing a large result's
    # pages back to the system (munmap) is not part of the call.
    del result
    return elapsed


def median_time(fn: Callable[[], object], device: torch.device, repeats: int = 7,
                warmup: int = 2) -> float:
    """Median of ``repeats`` :func:`timed` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def timed_calls(fn: Callable[[], object], device: torch.device, number: int) -> float:
    """Seconds per call of ``number`` back-to-back ``fn()`` calls (CUDA: events, synchronized)."""
    if number == 1:
        return timed(fn, device)

    def calls():
        for _ in range(number):
            fn()

    return timed(calls, device) / number


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device,
                        repeats: int = 7, warmup: int = 1,
                        sample_s: float = 2e-3) -> dict[str, float]:
    """Median seconds per call of every function, timed in ``repeats`` rounds. Each round
    times each function once, starting from a different one each round, so that noise on a
    shared machine falls on a case and its baselines alike. Fast functions are called several
    times per sample (enough for about ``sample_s``), so a sample is not just timer jitter."""
    number = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        once = timed(fn, device)
        if once < sample_s:  # the fastest of a few calls: one slow call must not decide
            once = min(once, *(timed(fn, device) for _ in range(2)))
        number[name] = max(1, min(10_000, int(sample_s / max(once, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timed_calls(fns[name], device, number[name]))
    return {name: statistics.median(times) for name, times in samples.items()}
